"""The inference readout (xpress/readout.py): the certified bfloat16 argmax returns the float32 argmax,
its error bound holds, and refinement at T=0 gives the same tokens with it as without it."""
import pytest
import torch
import torch.nn.functional as F

from xpress.heads import MarkovHead, XPressRefiner, randomize_
from xpress.jacobi import corrected_logits, jacobi_refine, sequential_refine
from xpress.readout import ADD_SLACK, FAST_MIN_VOCAB, SLACK, Readout, argmax_last
from xpress.vocab import DraftVocab


def forced(fast: bool = True) -> Readout:
    r = Readout()
    r.fast = fast
    return r


def needs_bf16(r: Readout, w: torch.Tensor, z: torch.Tensor) -> None:
    if not r.use_fast(w, z):
        pytest.skip("no oneDNN bfloat16 GEMM on this machine")


@pytest.mark.parametrize("v,r,rows,base_scale", [(3000, 64, 15, 1.0), (1000, 16, 1, 0.0), (4097, 256, 7, 5.0),
                                                 (777, 32, 15, 1e-3)])
@torch.no_grad()
def test_certified_argmax_equals_the_float32_argmax(v, r, rows, base_scale):
    g = torch.Generator().manual_seed(v)
    w = torch.randn(v, r, generator=g) / r ** 0.5
    rd = forced()
    for trial in range(5):
        z = torch.randn(rows, r, generator=g) * (0.1 + trial)
        base = torch.randn(rows, v, generator=g) * base_scale
        needs_bf16(rd, w, z)
        ref = argmax_last(F.linear(z, w) + base)
        assert torch.equal(rd.argmax(w, z, base), ref)
    z3 = torch.randn(2, 3, r, generator=g)  # leading dimensions are kept
    base3 = torch.randn(2, 3, v, generator=g)
    assert torch.equal(rd.argmax(w, z3, base3), argmax_last(F.linear(z3, w) + base3))


@torch.no_grad()
def test_certified_argmax_resolves_near_ties_and_exact_ties_like_argmax():
    """Logits packed closer than bfloat16 can tell apart: the candidates decide in float32, and exact ties
    go to the first index."""
    g = torch.Generator().manual_seed(0)
    v, r = 2048, 32
    w = torch.randn(v, r, generator=g) * 1e-3  # corrections far below bfloat16's resolution of the base
    z = torch.randn(4, r, generator=g)
    base = torch.full((4, v), 7.0)
    base[:, 100:200] += torch.randn(4, 100, generator=g) * 1e-4
    rd = forced()
    needs_bf16(rd, w, z)
    assert torch.equal(rd.argmax(w, z, base), argmax_last(F.linear(z, w) + base))
    w_tie = w.clone()
    w_tie[900] = w_tie[300] = w[5] * 0 + 1.0  # two identical rows far above the rest
    rd_tie = forced()
    got = rd_tie.argmax(w_tie, z.abs(), torch.zeros(4, v))
    assert torch.equal(got, torch.full((4,), 300))


@torch.no_grad()
def test_certified_argmax_falls_back_on_non_finite_values():
    v, r = 1500, 16
    w = torch.randn(v, r)
    z = torch.randn(3, r)
    base = torch.randn(3, v)
    base[1, 40] = float("nan")
    base[2, 7] = float("inf")
    rd = forced()
    needs_bf16(rd, w, z)
    assert torch.equal(rd.argmax(w, z, base), argmax_last(F.linear(z, w) + base))


@torch.no_grad()
def test_the_bound_covers_the_bfloat16_error():
    """|a_v - l_v| <= e for every token, with a the bfloat16 logits and l the float32 ones (module docstring,
    step 2); measured, the bound is loose by a wide margin but not absurdly so."""
    g = torch.Generator().manual_seed(1)
    v, r = 5000, 256
    w = torch.randn(v, r, generator=g) * torch.rand(v, 1, generator=g)  # rows of different norms
    z = torch.randn(15, r, generator=g) * 4
    base = torch.randn(15, v, generator=g) * 3
    rd = forced()
    needs_bf16(rd, w, z)
    rd.argmax(w, z, base)
    assert rd.rows_certified == 15 and 15 <= rd.candidates < 15 * v // 10  # each row keeps its winner, few others
    approx = F.linear(z.bfloat16(), w.bfloat16()).float() + base
    exact = F.linear(z.double(), w.double()) + base.double()
    top = approx.amax(-1)
    bound = SLACK * w.norm(dim=1).max() * z.norm(dim=-1) + ADD_SLACK * top.abs()
    err = (approx.double() - exact).abs().amax(-1)
    assert (err <= bound.double()).all()
    assert (err > bound.double() / 1000).all()  # the bound is not vacuous: within three orders of magnitude


def test_auto_uses_the_fast_path_only_at_large_vocabularies_and_without_autograd():
    rd = Readout()
    z = torch.randn(2, 8)
    assert not rd.use_fast(torch.randn(FAST_MIN_VOCAB - 1, 8), z)
    big = torch.randn(FAST_MIN_VOCAB, 8)
    if forced().use_fast(big, z):
        assert rd.use_fast(big, z)
    assert not rd.use_fast(big, z.requires_grad_())
    assert not forced(False).use_fast(big, z.detach())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_refinement_gives_the_same_tokens_with_the_certified_readout(temperature):
    """Jacobi (every K) and the sequential decode, xPress and the Markov head: the same tokens, iters and q
    whether the certified argmax is forced or disabled (it acts at T=0 only)."""
    vd, h, p, rank, b = 3000, 32, 7, 16, 3
    vocab = DraftVocab.from_ids(range(vd), vd + 10)
    g = torch.Generator().manual_seed(3)
    refiner = randomize_(XPressRefiner(vocab, h, p, rank), 3.0, g).eval()
    markov = randomize_(MarkovHead(vocab, rank), 3.0, g).eval()
    hs = torch.randn(b, p, h, generator=g)
    base = torch.randn(b, p, vd, generator=g)
    anchor = torch.tensor([vd + 3, 5, 17])  # one anchor outside the draft vocabulary
    noise = torch.empty(b, p, vd).exponential_(generator=g).log().neg()
    needs_bf16(forced(), refiner.w_r.weight, torch.zeros(1, rank))
    outs = {}
    for fast in (True, False):
        refiner.read.fast = markov.read.fast = fast
        fn = corrected_logits(base, refiner.fold(hs))
        runs = [jacobi_refine(fn, base, anchor, k, temperature, noise=noise, vocab=vocab) for k in (1, 3, p)]
        runs.append(sequential_refine(corrected_logits(base, markov.fold()), base, anchor, temperature, noise=noise,
                                      vocab=vocab))
        runs.append(sequential_refine(fn, base, anchor, temperature, noise=noise, vocab=vocab))
        outs[fast] = runs
    for a, c in zip(outs[True], outs[False]):
        assert torch.equal(a.tokens, c.tokens) and torch.equal(a.iters, c.iters)
        assert (a.q is None) == (c.q is None) == (temperature == 0)
        if a.q is not None:
            torch.testing.assert_close(a.q, c.q)
    assert torch.equal(outs[True][2].tokens, outs[True][4].tokens)  # Theorem 1 holds on the fast path too
