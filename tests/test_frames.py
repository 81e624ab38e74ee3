"""``target.frame_rows``: the transformers forward (the one a GPU runs) on aligned frames of F positions.

At T = 0 speculative decoding must equal greedy AR token for token. The lean CPU runtime gets there with
row-invariant kernels; the transformers forward picks kernels by shape, so in bf16 a verify and a step
flip greedy tokens at near-ties (measured on the qwen3-tiny stand-in: 8 of 8 prompts on a CPU, 4 of 4 on an
H200). Frames compute every position by the same forward shape on the same inputs, whoever reaches it.
"""
from __future__ import annotations

import pytest
import torch

from xpress.config import ConfigError, load_config
from xpress.data import load_benchmark
from xpress.decoding import generate_ar, generate_speculative
from xpress.methods import make_drafter
from xpress.reference_drafters import OracleDrafter
from xpress.runtime import native_bf16
from xpress.targets import TargetError, encode_chat, load_target, target_forward

DTYPE = "bfloat16" if native_bf16() else "float32"  # float32 MKL kernels change with the row count too
MAX_NEW = 40


def transformers_target(frame_rows: int):
    return load_target(load_config("smoke", ["target.runtime=transformers", f"target.dtype={DTYPE}",
                                             f"target.frame_rows={frame_rows}"]))


@pytest.fixture(scope="module")
def framed():
    return transformers_target(16)


@pytest.fixture(scope="module")
def prompts(framed):
    return [encode_chat(framed.tokenizer, rec["turns"][:1])
            for name in ("gsm8k", "mt-bench") for rec in load_benchmark(name, limit=6)]


def test_frames_reach_every_position_the_same_way(framed):
    """A prefill, one verify and one-token steps give the same logits and features bit for bit, and those
    equal the plain forward's to rounding (a frame's slicing is right)."""
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (1, 53))
    n = 13  # positions 40..52: the verify starts inside the frame [32, 48) and crosses into [48, 64)
    outs = {}
    for how in ("verify", "steps"):
        pre = target_forward(framed, ids[:, :40])
        cache = pre.cache
        chunks = [ids[:, 40:]] if how == "verify" else [ids[:, j:j + 1] for j in range(40, 40 + n)]
        logits, feats = [], []
        for c in chunks:
            pos = torch.arange(cache.get_seq_length(), cache.get_seq_length() + c.shape[1])[None]
            out = target_forward(framed, c, cache, pos)
            cache = out.cache
            logits.append(out.logits)
            feats.append(out.features)
        outs[how] = torch.cat(logits, 1), torch.cat(feats, 1)
        assert cache.get_seq_length() == 53
    assert outs["verify"][0].shape == (1, n, framed.vocab_size)
    assert torch.equal(outs["verify"][0], outs["steps"][0]) and torch.equal(outs["verify"][1], outs["steps"][1])
    plain = target_forward(transformers_target(0), ids)
    assert torch.allclose(plain.logits[:, 40:], outs["verify"][0], atol=0.15 if DTYPE == "bfloat16" else 1e-4)
    kept = target_forward(framed, ids[:, :32], logits_to_keep=3)
    assert torch.equal(kept.logits, target_forward(framed, ids[:, :32]).logits[:, -3:])


@pytest.mark.parametrize("method", ["oracle", "dflash", "xpress"])
def test_speculative_equals_greedy_on_frames(method, framed, prompts):
    cfg = load_config("smoke", ["target.runtime=transformers", f"target.dtype={DTYPE}", "target.frame_rows=16"])
    for p in prompts:
        drafter = OracleDrafter(framed, 8) if method == "oracle" else make_drafter(method, cfg, framed, seed=0,
                                                                                   untrained_ok=True)
        assert generate_speculative(framed, drafter, p, MAX_NEW).token_ids == generate_ar(framed, p, MAX_NEW).token_ids


def test_frame_rows_are_recorded(framed):
    """The setting is part of the runtime record, so every result's provenance says whether frames ran."""
    from xpress.runtime import runtime_choice
    from xpress.utils import provenance

    assert framed.meta["frame_rows"] == 16
    transformers_target(0)
    assert runtime_choice()["frame_rows"] == 0
    transformers_target(16)
    assert provenance("smoke")["target_runtime"]["frame_rows"] == 16


def test_frame_rows_checks():
    with pytest.raises(ConfigError, match="frame_rows=4 is below drafter.block_size=8"):
        load_config("smoke", ["target.frame_rows=4"])
    framed = transformers_target(8)
    out = target_forward(framed, torch.tensor([[5, 6, 7]]))
    with pytest.raises(TargetError, match="right after the cache"):
        target_forward(framed, torch.tensor([[8]]), out.cache, torch.tensor([[7]]))
