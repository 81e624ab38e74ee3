"""Rehearsal assets: stand-ins for ``Qwen/Qwen3-8B`` and ``z-lab/Qwen3-8B-DFlash-b16``, written by the project.
Owns writing them (``python -m xpress rehearsal-assets``); it sits above the targets and the drafter it writes.

The ``qwen3-tiny`` preset rehearses ``qwen3-8b`` on a CPU in minutes. Its target and its released drafter
are small random models that this module writes ONCE, in the layouts the real ones have on the model hub,
so that every later load goes through the same code as the paper's setting:

- the target folder: the hub layout of a Qwen3 model (``config.json`` of a ``Qwen3ForCausalLM``,
  ``model.safetensors`` in bfloat16, ``generation_config.json`` with two EOS ids, tokenizer files with a
  Qwen3 chat template), loaded by ``target.source: hub`` (:func:`xpress.targets.load_target`);
- the drafter folder: the released dFlash layout (``config.json`` with ``architectures
  ["DFlashDraftModel"]`` and ``dflash_config {mask_token_id, target_layer_ids}``, ``model.safetensors``
  with the 58 tensor names of five layers, bfloat16), loaded by ``drafter.checkpoint``
  (:meth:`xpress.drafter.DFlashDraftModel.from_pretrained`).

Which folders are rehearsal assets: those whose parent folder is named ``rehearsal``
(:func:`xpress.paths.is_rehearsal_path`; the preset uses ``.cache/rehearsal/<name>``, from the repository
root). ``python -m xpress rehearsal-assets --preset qwen3-tiny`` and notebook 00 call
:func:`ensure_rehearsal_assets`; it writes whatever is missing (each folder in one atomic rename) and
refuses a folder written for another shape (the marker file names it). The target loader then reads the
folders as any hub folder; it never writes them.

The target: ``target.random_layers`` Qwen3 layers of width ``target.random_hidden`` (heads, key-value heads,
intermediate size and init scale from the other ``target.random_*`` keys; ``head_dim = hidden / heads``),
RoPE theta 1e6, untied embeddings, ``max_position_embeddings = target.max_context``, as Qwen3-8B. No Qwen3
tokenizer ships offline, so it uses SmolLM2's (49,152 tokens, from the GGUF of ``target.gguf_package``) with
Qwen3's chat template (thinking off = an empty ``<think></think>`` block after the generation prompt; tool
calls left out). Like Qwen3-8B (151,669 tokens, 151,936 rows) the embedding has spare rows past the
tokenizer (:data:`VOCAB_PAD`), so the drafter's MASK input is the first of them (``mask_token_id``) and the
drafter has exactly the released tensors, no ``mask_embedding``. The spare rows of ``lm_head`` are zero.

    >>> folders = ensure_rehearsal_assets(load_config("qwen3-tiny"))   # doctest: +SKIP
    >>> sorted(folders)                                                  # doctest: +SKIP
    ['drafter', 'target']
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import paths
from .config import Config
from .paths import is_rehearsal_path
from .targets import TargetError
from .utils import atomic_dir, atomic_write_json

MARKER = "xpress_rehearsal.json"  # what wrote the folder, and for which shape
VOCAB_PAD = 128  # the embedding has len(tokenizer) rounded up past the next multiple of this (Qwen3-8B: 128)

# Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json) without its tool-calling branches: no default
# system prompt; earlier assistant turns lose their <think> block; enable_thinking=false appends an empty one.
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if ns.searching and message.role == 'user' %}"
    "{%- set ns.searching = false %}"
    "{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


class RehearsalError(TargetError):
    """A rehearsal folder that exists but was written for another shape; the message says how to fix it."""


def target_spec(cfg: Config) -> dict[str, Any]:
    """Everything that decides the written target (its marker holds this)."""
    t = cfg.target
    return {"kind": "target", "architecture": "Qwen3ForCausalLM", "layers": t.random_layers,
            "hidden": t.random_hidden, "heads": t.random_heads, "kv_heads": t.random_kv_heads,
            "intermediate": t.random_intermediate, "init_std": t.random_init_std,
            "max_position_embeddings": t.max_context, "tokenizer": _tokenizer_source(t.gguf_package),
            "vocab_pad": VOCAB_PAD, "seed": cfg.seed}


def drafter_spec(cfg: Config) -> dict[str, Any]:
    """Everything that decides the written drafter (its marker holds this), the target's spec included."""
    d = cfg.drafter
    return {"kind": "drafter", "layers": d.num_layers, "block_size": d.block_size,
            "num_target_features": d.num_target_features, "intermediate": d.intermediate_size,
            "seed": cfg.seed, "target": target_spec(cfg)}


def _tokenizer_source(package: str) -> str:
    import importlib.metadata as md

    try:
        return f"{package}-{md.version(package)}"
    except md.PackageNotFoundError:
        return package  # load_target says how to install it


def _same_spec(written: Any, asked: Any) -> bool:
    """``written == asked``, except that an unversioned tokenizer source (its package is not installed here,
    as on a GPU node that was sent the written folders) matches any version of that package: the folder
    already holds the tokenizer files it was written with."""
    if isinstance(written, dict) and isinstance(asked, dict):
        return written.keys() == asked.keys() and all(
            (k == "tokenizer" and isinstance(asked[k], str) and str(written[k]).startswith(asked[k] + "-"))
            or _same_spec(written[k], asked[k]) for k in asked)
    return written == asked


def _complete(folder: Path, spec: dict[str, Any]) -> bool:
    """True when ``folder`` holds a finished asset of ``spec``; False when it is absent; a folder written
    for another spec is a :class:`RehearsalError`."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    written = json.loads(marker.read_text()).get("spec")
    if not _same_spec(written, spec):
        raise RehearsalError(f"{folder} is a rehearsal {spec['kind']} of another shape ({MARKER} says {written}, the "
                             f"preset asks {spec}); delete the folder {folder} and the next load writes it again")
    return True


def ensure_rehearsal_assets(cfg: Config) -> dict[str, Path]:
    """Write the preset's rehearsal target (``target.model``) and drafter (``drafter.checkpoint``) where they
    are missing; each folder appears in one atomic rename, and a complete one is left alone (idempotent).
    Only a hub ``target.model`` and a ``drafter.checkpoint`` for which :func:`is_rehearsal_path` holds are
    considered. Returns ``{"target": folder, "drafter": folder}`` for those of the preset."""
    out: dict[str, Path] = {}
    model = None
    if cfg.target.source == "hub" and is_rehearsal_path(cfg.target.model):
        out["target"] = folder = paths.resolve(cfg.target.model)
        if not _complete(folder, target_spec(cfg)):
            model = write_target(folder, cfg)
    if cfg.drafter.checkpoint and is_rehearsal_path(cfg.drafter.checkpoint):
        if "target" not in out:
            raise RehearsalError(f"drafter.checkpoint={cfg.drafter.checkpoint!r} is a rehearsal folder but "
                                 f"target.model={cfg.target.model!r} is not; point target.model at a rehearsal "
                                 f"folder too (the drafter is written for that target)")
        out["drafter"] = folder = paths.resolve(cfg.drafter.checkpoint)
        if not _complete(folder, drafter_spec(cfg)):
            write_drafter(folder, cfg, out["target"], model)
    return out


def _tokenizer(cfg: Config):
    """SmolLM2's tokenizer (the cached GGUF conversion) with Qwen3's chat template."""
    from transformers import AutoTokenizer

    from .targets import _ensure_gguf_tokenizer

    tok = AutoTokenizer.from_pretrained(_ensure_gguf_tokenizer(cfg.target.gguf_package))
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def padded_vocab(n_tokens: int) -> int:
    """Embedding rows for ``n_tokens`` tokenizer entries: past the tokenizer, rounded up to :data:`VOCAB_PAD`,
    so that at least one spare row (the drafter's MASK) exists.

    >>> padded_vocab(49152), padded_vocab(151669)
    (49280, 151808)
    """
    return (n_tokens // VOCAB_PAD + 1) * VOCAB_PAD


def build_target(cfg: Config):
    """The rehearsal target in memory: ``(Qwen3ForCausalLM float32, tokenizer)``, seeded by ``cfg.seed``.
    Embedding and lm_head [V, H] with ``V = padded_vocab(len(tokenizer))``; lm_head rows past the tokenizer
    are zero (they are never the argmax of a random target's logits)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t = cfg.target
    if t.random_hidden % t.random_heads or t.random_heads % t.random_kv_heads:
        raise RehearsalError(f"target.random_hidden={t.random_hidden} must be a multiple of target.random_heads="
                             f"{t.random_heads}, itself a multiple of target.random_kv_heads={t.random_kv_heads}")
    tok = _tokenizer(cfg)
    n_tokens = len(tok)
    end, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=padded_vocab(n_tokens), hidden_size=t.random_hidden, intermediate_size=t.random_intermediate,
        num_hidden_layers=t.random_layers, num_attention_heads=t.random_heads,
        num_key_value_heads=t.random_kv_heads, head_dim=t.random_hidden // t.random_heads,
        max_position_embeddings=t.max_context, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=t.random_init_std,
        bos_token_id=end, eos_token_id=im_end, pad_token_id=end)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[n_tokens:] = 0
    # Qwen3-8B's generation_config.json, with this tokenizer's ids
    model.generation_config = GenerationConfig(bos_token_id=end, eos_token_id=[im_end, end], pad_token_id=end,
                                               do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    return model, tok


def write_target(folder: Path, cfg: Config):
    """Write the rehearsal target to ``folder`` in the hub layout (bfloat16 weights, as Qwen3-8B's) in one
    atomic rename; returns the float32 model in memory."""
    model, tok = build_target(cfg)
    with atomic_dir(folder) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / MARKER, {"what": "rehearsal stand-in for Qwen/Qwen3-8B (random weights), written "
                                                 "by xpress.rehearsal", "spec": target_spec(cfg)})
    return model.float()


def write_drafter(folder: Path, cfg: Config, target_folder: Path, model=None) -> Path:
    """Write a random dFlash drafter for the rehearsal target to ``folder`` in the released layout
    (bfloat16, as z-lab/Qwen3-8B-DFlash-b16), through :meth:`DFlashDraftModel.from_target` and
    :meth:`DFlashDraftModel.save_pretrained`, seeded by ``cfg.seed``; one atomic rename."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .drafter import DFlashDraftModel
    from .targets import Target, _eos_ids, target_layer_ids

    tok = AutoTokenizer.from_pretrained(target_folder)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    n_layers = int(model.config.num_hidden_layers)
    target = Target(model=model, tokenizer=tok, cfg=cfg.target, hidden_size=int(model.config.hidden_size),
                    vocab_size=int(model.get_output_embeddings().weight.shape[0]), num_layers=n_layers,
                    layer_ids=target_layer_ids(n_layers, cfg.drafter.num_target_features),
                    eos_token_ids=_eos_ids(model, tok), name=str(target_folder))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        drafter = DFlashDraftModel.from_target(target, cfg)
    with atomic_dir(folder) as tmp:
        drafter.to(torch.bfloat16).save_pretrained(tmp)
        atomic_write_json(tmp / MARKER, {"what": "rehearsal stand-in for z-lab/Qwen3-8B-DFlash-b16 (random "
                                                 "weights), written by xpress.rehearsal", "spec": drafter_spec(cfg)})
    return folder
