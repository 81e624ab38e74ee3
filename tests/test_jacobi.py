import itertools

import torch

from xpress import DraftVocab, XPressRefiner, jacobi_refine, sequential_refine
from xpress.heads import MarkovHead, randomize_
from xpress.jacobi import corrected_logits, distribution, gumbel_noise, jacobi_step, prev_tokens

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

    def spy(prev, rows, k=None):
        seen.append(rows.tolist())
        return fn(prev, rows, k)

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
