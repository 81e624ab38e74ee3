import itertools

import pytest

import torch

from xpress import DraftVocab, XPressRefiner, jacobi_refine, sequential_refine
from xpress.heads import MarkovHead, randomize_
from xpress.jacobi import corrected_logits, distribution, gumbel_noise, jacobi_refine_one, jacobi_step, prev_tokens

V, VD, H, P, R = 40, 10, 16, 7, 8


def setup(b=6, seed=0, vd=VD, p=P, scale=3.0):
    """A random refiner with a strong correction, base logits and anchors (some outside the vocabulary).
    float64, so that rounding differences between code paths cannot flip a near-tie argmax."""
    g = torch.Generator().manual_seed(seed)
    vocab = DraftVocab.from_ids(range(V - vd, V), V)
    ref = randomize_(XPressRefiner(vocab, H, p, R).double(), scale, g)
    h = torch.randn(b, p, H, generator=g, dtype=torch.float64)
    base = torch.randn(b, p, vd, generator=g, dtype=torch.float64)
    anchor = torch.randint(0, V, (b,), generator=g)
    return vocab, corrected_logits(base, ref.fold(h)), base, anchor


def test_greedy_fixed_point_is_the_sequential_decode():
    for seed in range(5):
        vocab, fn, base, anchor = setup(seed=seed)
        seq = sequential_refine(fn, base, anchor, vocab=vocab)
        jac = jacobi_refine(fn, base, anchor, max_iters=P, vocab=vocab)
        assert torch.equal(jac.tokens, seq.tokens)
        assert (jac.iters <= P).all() and (jac.iters >= 1).all()
        assert torch.equal(seq.iters, torch.full((6,), P)) and seq.q is None and jac.q is None
        assert not torch.equal(seq.tokens, base.argmax(-1))  # the correction matters in this setup


def test_theorem1_invariant_from_any_seed():
    """y_k^(j) = y_k* for j >= k along the trajectory, from adversarial and random seeds."""
    vocab, fn, base, anchor = setup(b=8, seed=3)
    star = sequential_refine(fn, base, anchor, vocab=vocab).tokens
    g = torch.Generator().manual_seed(9)
    for init in [(star + 1) % VD, torch.randint(0, VD, star.shape, generator=g), None]:
        res = jacobi_refine(fn, base, anchor, max_iters=P, vocab=vocab, init=init, return_trajectory=True)
        assert torch.equal(res.tokens, star)
        for j, y in enumerate(res.trajectory):
            assert torch.equal(y[:, :j], star[:, :j])
    adversarial = jacobi_refine(fn, base, anchor, P, vocab=vocab, init=(star + 1) % VD)
    assert (adversarial.iters >= 1).all() and (adversarial.iters <= P).all()


def test_unique_fixed_point_exhaustive():
    vd, p = 3, 4
    vocab, fn, base, anchor = setup(b=1, seed=1, vd=vd, p=p)
    blocks = torch.tensor(list(itertools.product(range(vd), repeat=p)))  # all vd^p blocks
    n = blocks.shape[0]
    rows = torch.zeros(n, dtype=torch.int64)
    new, _ = jacobi_step(fn, blocks, anchor.expand(n), rows, vocab=vocab)
    fixed = blocks[(new == blocks).all(-1)]
    assert fixed.shape[0] == 1
    assert torch.equal(fixed, sequential_refine(fn, base, anchor, vocab=vocab).tokens)


def test_sampling_with_shared_noise_equals_sequential_sample():
    vocab, fn, base, anchor = setup(seed=4)
    noise = gumbel_noise(tuple(base.shape), torch.Generator().manual_seed(5))
    for T in (0.5, 1.0):
        seq = sequential_refine(fn, base, anchor, T, noise=noise, vocab=vocab)
        jac = jacobi_refine(fn, base, anchor, P, T, noise=noise, vocab=vocab)
        assert torch.equal(jac.tokens, seq.tokens)
        torch.testing.assert_close(jac.q, seq.q)
        torch.testing.assert_close(jac.q.sum(-1), torch.ones(6, P))
    # the same generator state gives the same noise
    a = jacobi_refine(fn, base, anchor, P, 1.0, torch.Generator().manual_seed(5), vocab=vocab)
    assert torch.equal(a.tokens, jac.tokens)


def test_q_is_the_distribution_each_token_was_drawn_from_when_stopped_early():
    vocab, fn, base, anchor = setup(seed=6)
    noise = gumbel_noise(tuple(base.shape), torch.Generator().manual_seed(2))
    res = jacobi_refine(fn, base, anchor, 2, 1.0, noise=noise, vocab=vocab, return_trajectory=True)
    assert (res.iters <= 2).all()
    # rows that ran 2 passes drew Y^(2) from logits on Y^(1)'s prefix
    prev = prev_tokens(anchor, res.trajectory[1], vocab)
    logits = fn(prev, torch.arange(6))
    two = res.iters == 2
    torch.testing.assert_close(res.q[two], distribution(logits, 1.0)[two])
    assert torch.equal(res.tokens[two], (logits / 1.0 + noise).argmax(-1)[two])


def test_adaptive_iterations_per_sequence_and_frozen_rows():
    vocab, fn, base, anchor = setup(b=3, seed=7)
    star = sequential_refine(fn, base, anchor, vocab=vocab).tokens
    init = torch.stack([star[0], (star[1] + 1) % VD, star[2]])  # rows 0, 2 start at the fixed point
    seen = []

    def spy(prev, rows, k=None, lo=0):
        seen.append(rows.tolist())
        return fn(prev, rows, k, lo)

    res = jacobi_refine(spy, base, anchor, P, vocab=vocab, init=init)
    assert torch.equal(res.tokens, star)
    assert res.iters[0] == 1 and res.iters[2] == 1 and res.iters[1] > 1
    assert seen[0] == [0, 1, 2] and all(r == [1] for r in seen[1:])  # converged rows are not recomputed


def test_max_iters_caps_passes():
    vocab, fn, base, anchor = setup(seed=8)
    res = jacobi_refine(fn, base, anchor, 1, vocab=vocab)
    assert torch.equal(res.iters, torch.ones(6, dtype=torch.int64))
    one, _ = jacobi_step(fn, base.argmax(-1), anchor, torch.arange(6), vocab=vocab)
    assert torch.equal(res.tokens, one)
    assert (jacobi_refine(fn, base, anchor, 100, vocab=vocab).iters <= P).all()


def test_markov_sequential_uses_previous_token():
    vocab = DraftVocab.full(VD)
    head = randomize_(MarkovHead(vocab, R), 5.0, torch.Generator().manual_seed(0))
    base = torch.randn(2, P, VD, generator=torch.Generator().manual_seed(1))
    anchor = torch.tensor([1, 2])
    res = sequential_refine(corrected_logits(base, head.bias), base, anchor, vocab=vocab)
    prev = prev_tokens(anchor, res.tokens, vocab)
    assert torch.equal(res.tokens, (base + head(prev)).argmax(-1))


# ------------------------------------------------------------------ the incremental (fast) path
def test_argmax_last_is_argmax_exactly():
    from xpress.jacobi import argmax_last

    g = torch.Generator().manual_seed(0)
    for v in (5, 1024, 1000 + 37, 151936 // 16, 16384 + 37, 151936):  # the chunked path from 16384
        x = torch.randint(0, 4, (3, 6, v), generator=g).float()  # many ties: the first index must win
        assert torch.equal(argmax_last(x), x.argmax(-1))
        assert torch.equal(argmax_last(x[0].double()), x[0].double().argmax(-1))
        y = torch.randn(2, v, generator=g)
        y[1, -1] = 1e9  # the maximum in the short tail slice
        assert torch.equal(argmax_last(y), y.argmax(-1))
        y[0, v // 3] = float("nan")
        assert torch.equal(argmax_last(y), y.argmax(-1))


def _spy(fn, calls):
    def spy(prev, rows, k=None, lo=0):
        calls.append((rows.numel(), lo))
        return fn(prev, rows, k, lo)
    return spy


def test_incremental_equals_dense_at_t0():
    """Same tokens, iters and trajectory as recomputing every position every pass, for every K, from the
    drafter's seed and from random seeds (blocks that converge at different passes)."""
    seen_iters = set()
    for seed in range(6):
        vocab, fn, base, anchor = setup(b=8, seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        for init in (None, torch.randint(0, VD, (8, P), generator=g)):
            for k in range(1, P + 1):
                calls = []
                fast = jacobi_refine(_spy(fn, calls), base, anchor, k, vocab=vocab, init=init, return_trajectory=True)
                dense = jacobi_refine(fn, base, anchor, k, vocab=vocab, init=init, return_trajectory=True,
                                      incremental=False)
                assert torch.equal(fast.tokens, dense.tokens) and torch.equal(fast.iters, dense.iters)
                assert all(torch.equal(a, b) for a, b in zip(fast.trajectory, dense.trajectory))
                assert len(fast.trajectory) == len(dense.trajectory) and fast.q is None
                # pass t recomputes positions lo.. with lo >= t - 1 (Theorem 1: the first t-1 are final)
                assert all(lo >= t for t, (_, lo) in enumerate(calls))
                seen_iters.update(fast.iters.tolist())
        star = sequential_refine(fn, base, anchor, vocab=vocab).tokens
        assert torch.equal(jacobi_refine(fn, base, anchor, P, vocab=vocab).tokens, star)
    assert len(seen_iters) >= 3  # blocks converged at different passes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_block_passes_equal_the_batched_refinement(temperature):
    """jacobi_refine_one (b = 1, inference's case: no batch bookkeeping) gives jacobi_refine's tokens, iters
    and (T>0, the same noise) q for every K, on blocks that converge after different numbers of passes."""
    seen = set()
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        vocab = DraftVocab.from_ids(range(V - VD, V), V)
        ref = randomize_(XPressRefiner(vocab, H, P, R).double(), 3.0, g)
        h = torch.randn(1, P, H, generator=g, dtype=torch.float64)
        base = torch.randn(1, P, VD, generator=g, dtype=torch.float64)
        anchor = torch.randint(0, V, (1,), generator=g)
        fold = ref.fold(h)
        noise = gumbel_noise((1, P, VD), g).double() if temperature else None
        for k in range(1, P + 1):
            one = jacobi_refine_one(fold, base, anchor, k, temperature, noise, vocab=vocab)
            batched = jacobi_refine(corrected_logits(base, fold), base, anchor, k, temperature, noise=noise,
                                    vocab=vocab)
            assert torch.equal(one.tokens, batched.tokens) and torch.equal(one.iters, batched.iters), (seed, k)
            if temperature:
                torch.testing.assert_close(one.q, batched.q)
            else:
                assert one.q is None and batched.q is None
            seen.add(int(one.iters))
    assert len(seen) >= 3
    with pytest.raises(ValueError, match="at least one pass"):
        jacobi_refine_one(fold, base, anchor, 0, vocab=vocab)


def test_incremental_equals_dense_at_t_positive():
    for seed in range(4):
        vocab, fn, base, anchor = setup(b=8, seed=seed)
        noise = gumbel_noise(tuple(base.shape), torch.Generator().manual_seed(seed)).double()
        for T in (0.3, 1.0):
            for k in (1, 2, 3, P):
                fast = jacobi_refine(fn, base, anchor, k, T, noise=noise, vocab=vocab, return_trajectory=True)
                dense = jacobi_refine(fn, base, anchor, k, T, noise=noise, vocab=vocab, return_trajectory=True,
                                      incremental=False)
                assert torch.equal(fast.tokens, dense.tokens) and torch.equal(fast.iters, dense.iters)
                assert all(torch.equal(a, b) for a, b in zip(fast.trajectory, dense.trajectory))
                torch.testing.assert_close(fast.q, dense.q, atol=1e-6, rtol=1e-6)
            seq = sequential_refine(fn, base, anchor, T, noise=noise, vocab=vocab)
            fix = jacobi_refine(fn, base, anchor, P, T, noise=noise, vocab=vocab)
            assert torch.equal(fix.tokens, seq.tokens)
            torch.testing.assert_close(fix.q, seq.q, atol=1e-6, rtol=1e-6)


def test_incremental_q_when_stopped_early_is_the_drawing_distribution():
    """With K < convergence, q_k is softmax of the logits y_k was drawn from (the previous iterate's prefix),
    also for positions whose logits were kept from an earlier pass."""
    vocab, fn, base, anchor = setup(seed=6)
    noise = gumbel_noise(tuple(base.shape), torch.Generator().manual_seed(2)).double()
    for k in (2, 3):
        res = jacobi_refine(fn, base, anchor, k, 1.0, noise=noise, vocab=vocab, return_trajectory=True)
        full = res.iters == k
        logits = fn(prev_tokens(anchor, res.trajectory[k - 1], vocab), torch.arange(6))
        torch.testing.assert_close(res.q[full], distribution(logits, 1.0)[full], atol=1e-6, rtol=1e-6)
        assert torch.equal(res.tokens[full], (logits / 1.0 + noise).argmax(-1)[full])


def test_incremental_recomputes_fewer_positions():
    vocab, fn, base, anchor = setup(b=1, seed=3)
    g = torch.Generator().manual_seed(0)
    init = torch.randint(0, VD, (1, P), generator=g)
    calls = []
    res = jacobi_refine(_spy(fn, calls), base, anchor, P, vocab=vocab, init=init)
    rows = sum(P - lo for _, lo in calls)
    assert len(calls) <= int(res.iters) and rows < int(res.iters) * P


def test_incremental_in_float32_with_the_packed_readout():
    """float32 (the oneDNN readout on CPU): the same tokens and iters as the dense path, q within 1e-6."""
    g = torch.Generator().manual_seed(1)
    vocab = DraftVocab.from_ids(range(V - VD, V), V)
    ref = randomize_(XPressRefiner(vocab, H, P, R), 3.0, g)
    h, base = torch.randn(5, P, H, generator=g), torch.randn(5, P, VD, generator=g)
    anchor = torch.randint(0, V, (5,), generator=g)
    with torch.no_grad():
        fn = corrected_logits(base, ref.fold(h))
        noise = gumbel_noise(tuple(base.shape), g)
        for T, nz in ((0.0, None), (1.0, noise)):
            fast = jacobi_refine(fn, base, anchor, 4, T, noise=nz, vocab=vocab)
            dense = jacobi_refine(fn, base, anchor, 4, T, noise=nz, vocab=vocab, incremental=False)
            assert torch.equal(fast.tokens, dense.tokens) and torch.equal(fast.iters, dense.iters)
            if T:
                torch.testing.assert_close(fast.q, dense.q, atol=1e-6, rtol=1e-5)
