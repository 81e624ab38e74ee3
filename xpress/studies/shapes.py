"""The shapes that set the cost of one block (:class:`Shapes`): the paper's (Qwen3-8B with the released
5-layer dFlash drafter), a tiny set for tests, and a preset's (:func:`preset_shapes`: the drafter and heads
of ``configs/<preset>.yaml`` on its target's architecture). Used by :mod:`xpress.studies.latency`; nothing
beyond the standard library is imported at module level (``scripts/gpu_latency.py`` needs only torch and
transformers).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shapes:
    """What sets the cost of one block: the heads' readout vocabulary ``vocab`` (the draft vocabulary, or
    the full target vocabulary), the drafter (``hidden``, ``drafter_layers``, attention and MLP sizes,
    ``target_features`` target layers read), the heads (``rank``, ``markov_rank``), ``block_size`` B,
    ``context`` tokens before the block, and the target (``target_layers``, ``target_vocab``,
    ``target_intermediate``)."""

    name: str
    vocab: int
    hidden: int
    block_size: int
    rank: int
    markov_rank: int
    drafter_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_layers: int
    target_features: int
    target_vocab: int
    target_intermediate: int
    context: int = 512

    @property
    def positions(self) -> int:
        return self.block_size - 1


# Qwen3-8B (config.json of Qwen/Qwen3-8B) with z-lab/Qwen3-8B-DFlash-b16 (5 layers, 5 target layers)
PAPER = Shapes(name="paper: Qwen3-8B", vocab=151936, hidden=4096, block_size=16, rank=256, markov_rank=256,
               drafter_layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=12288, target_layers=36,
               target_features=5, target_vocab=151936, target_intermediate=12288, context=512)
# seconds on a CPU: for tests and for checking the GPU script's code path without a GPU
TINY = Shapes(name="tiny (test)", vocab=512, hidden=64, block_size=8, rank=16, markov_rank=16, drafter_layers=1,
              heads=4, kv_heads=2, head_dim=16, intermediate=128, target_layers=4, target_features=2,
              target_vocab=1024, target_intermediate=128, context=32)
# SmolLM2-135M-Instruct, the cpu preset's target (its config.json)
SMOLLM2_135M = {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "layers": 30,
                "vocab": 49152}


def hub_architecture(cfg) -> dict[str, int]:
    """A hub target's sizes, read from its ``config.json`` where :func:`xpress.targets.hub_location` finds it."""
    from transformers import AutoConfig

    from ..targets import hub_location

    t = cfg.target
    try:
        c = AutoConfig.from_pretrained(hub_location(cfg))
    except OSError as e:
        raise ValueError(f"cannot read the architecture of target.model={t.model!r} ({str(e).splitlines()[0]}): "
                         f"download it first, or give a local folder in the Hugging Face layout") from None
    return {"hidden": c.hidden_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "intermediate": c.intermediate_size, "layers": c.num_hidden_layers, "vocab": c.vocab_size}


def preset_shapes(cfg, context: int = 256) -> Shapes:
    """The preset's shapes: B, drafter layers and target features, r, the draft vocabulary (0 = the full
    one) from ``cfg``; the target's architecture from ``cfg.target`` for a random target, from the model's
    ``config.json`` for a hub target (:func:`hub_architecture`), else SmolLM2-135M's (the embedded target)."""
    t = cfg.target
    if t.source == "random":
        arch = {"hidden": t.random_hidden, "heads": t.random_heads, "kv_heads": t.random_kv_heads,
                "head_dim": t.random_hidden // t.random_heads, "intermediate": t.random_intermediate,
                "layers": t.random_layers, "vocab": SMOLLM2_135M["vocab"]}
    elif t.source == "hub":
        arch = hub_architecture(cfg)
    else:
        arch = SMOLLM2_135M
    d = cfg.drafter
    return Shapes(name=f"{cfg.preset} preset: {t.model}", vocab=d.draft_vocab_size or arch["vocab"],
                  hidden=arch["hidden"], block_size=d.block_size, rank=cfg.head.rank,
                  markov_rank=cfg.head.markov_rank, drafter_layers=d.num_layers, heads=arch["heads"],
                  kv_heads=arch["kv_heads"], head_dim=arch["head_dim"],
                  intermediate=d.intermediate_size or arch["intermediate"], target_layers=arch["layers"],
                  target_features=d.num_target_features, target_vocab=arch["vocab"],
                  target_intermediate=arch["intermediate"], context=context)
