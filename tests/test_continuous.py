"""Continuous batching (:mod:`xpress.continuous`, regeneration's engine): every sequence is bit for bit its
batch-1 greedy decode, whatever the batch size and prompt order; the captured states are laid out as
regeneration stores them; stops and lengths follow the AR engine's rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from xpress import continuous
from xpress.decoding import generate_ar
from xpress.targets import target_forward

N_NEW = 12


# head width 32: the bf16 layer's attention runs on the AMX tiles too (the smoke target's 16 keeps float32)
WIDE_HEADS = ["target.random_hidden=128", "target.random_heads=4", "target.random_kv_heads=2"]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-tiles"])
def fused(request):
    """The smoke target on the fused kernels: float32 (any AVX2 CPU) and bf16 (AMX tiles or AVX512-BF16), where
    they run; bf16 with heads of width 32, whose attention products run in bf16 as well (AMX tiles or AVX512-BF16)."""
    from xpress.config import load_config
    from xpress.targets import TargetError, load_target

    dtype = request.param.removesuffix("-tiles")
    over = ["target.kernels=fused", f"target.dtype={dtype}", *(WIDE_HEADS if "tiles" in request.param else [])]
    try:
        target = load_target(load_config("smoke", over))
    except TargetError as e:
        pytest.skip(f"the fused CPU kernels do not run {dtype} here: {e}")
    assert continuous.available(target)
    assert target.runtime.tile_attention == ("tiles" in request.param)
    return target


@pytest.fixture(scope="module")
def prompts(fused):
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 5, 17, 40, 9, 70, 2]  # uneven, so that rows are refilled at different steps
    return [torch.randint(3, fused.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _run(target, prompts, batch, **kw) -> dict[int, continuous.Finished]:
    out = {f.index: f for f in continuous.generate_greedy(target, prompts, N_NEW, batch, **kw)}
    assert sorted(out) == list(range(len(prompts)))
    return out


def test_each_sequence_equals_its_batch1_greedy_decode(fused, prompts):
    ref = [generate_ar(fused, p, N_NEW) for p in prompts]
    for batch in (1, 3, len(prompts)):
        got = _run(fused, prompts, batch)
        for i, g in enumerate(ref):
            assert got[i].token_ids == g.token_ids, (batch, i)
            assert got[i].finish_reason == g.finish_reason


def test_stop_tokens_end_a_sequence_as_the_ar_engine_does(fused, prompts):
    first = _run(fused, prompts, 2)
    stop = first[5].token_ids[3]  # a token sequence 5 writes: it must stop there, kept
    got = _run(fused, prompts, 2, stop_ids=[stop])
    for i, p in enumerate(prompts):
        ref = generate_ar(fused, p, N_NEW, stop_ids=[stop])
        assert got[i].token_ids == ref.token_ids and got[i].finish_reason == ref.finish_reason
    assert got[5].finish_reason == "stop" and got[5].token_ids[-1] == stop and len(got[5].token_ids) <= 4


def test_captured_states_do_not_depend_on_the_batch_or_the_order(fused, prompts):
    layers = list(fused.layer_ids)
    one = _run(fused, prompts, 1, capture_layers=layers)
    order = list(range(len(prompts)))[::-1]
    many = _run(fused, [prompts[i] for i in order], 4, capture_layers=layers)
    for j, i in enumerate(order):
        a, b = one[i], many[j]
        assert a.token_ids == b.token_ids
        for k in ("features", "hidden", "lse"):
            assert np.array_equal(getattr(a, k), getattr(b, k), equal_nan=True), (i, k)


def test_captured_states_are_the_teacher_forced_ones(fused, prompts):
    """Row t of the features / hidden states is position t's; lse is set from the last prompt position to the
    last fed token and NaN elsewhere; the last row is zeros (never fed)."""
    got = _run(fused, prompts, 3, capture_layers=list(fused.layer_ids))
    W = fused.lm_head().weight.float()
    for i in (0, 3, 5):
        f, p = got[i], len(prompts[i])
        ids = torch.tensor(prompts[i] + f.token_ids)
        T = len(ids)
        assert f.features.shape == (T, fused.feature_size) and f.hidden.shape == (T, fused.hidden_size)
        assert f.features.dtype == np.float16 and f.hidden.dtype == np.float16 and f.lse.dtype == np.float32
        assert not f.features[T - 1].any() and not f.hidden[T - 1].any()
        assert np.isnan(f.lse[:p - 1]).all() and np.isfinite(f.lse[p - 1:T - 1]).all() and np.isnan(f.lse[T - 1])
        with torch.no_grad():
            ref = target_forward(fused, ids[None])
        torch.testing.assert_close(torch.from_numpy(f.features[:T - 1]).float(), ref.features[0, :T - 1].float(),
                                   atol=5e-3, rtol=2e-3)
        logp = torch.from_numpy(f.hidden.astype(np.float32)) @ W.T - torch.from_numpy(f.lse)[:, None]
        resp = slice(p - 1, T - 1)
        torch.testing.assert_close(logp[resp], torch.log_softmax(ref.logits[0], -1)[resp], atol=5e-3, rtol=0)


def test_bad_input_says_what_to_fix(fused):
    with pytest.raises(ValueError, match="empty prompt"):
        list(continuous.generate_greedy(fused, [[5], []], 4, 2))
    with pytest.raises(ValueError, match="at least 1"):
        list(continuous.generate_greedy(fused, [[5]], 4, 0))


def test_a_cache_row_cannot_grow(fused):
    cache = fused.runtime.new_cache(2, 64)
    with pytest.raises(ValueError, match="larger cache"):
        fused.runtime.prefill_row(torch.arange(3, 80), cache, 1)
