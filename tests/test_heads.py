import pytest
import torch
import torch.nn.functional as F

from xpress import DraftVocab, MarkovHead, XPressRefiner
from xpress.heads import count_flops, count_params, dependency_matrices, randomize_

V, VD, H, P, R = 50, 12, 16, 6, 8


def vocab():
    return DraftVocab.from_ids(range(3, 3 + VD), V)  # target ids 0..2 lie outside: OOV anchors


def refiner(seed=0, **kw):
    return randomize_(XPressRefiner(vocab(), H, P, R, **kw), 1.0, torch.Generator().manual_seed(seed))


def inputs(b=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, P, H, generator=g), torch.randint(0, V, (b, P), generator=g)


def test_fresh_heads_are_the_identity_correction():
    h, prev = inputs()
    assert XPressRefiner(vocab(), H, P, R)(h, prev).abs().max() == 0
    assert MarkovHead(vocab(), R)(prev).abs().max() == 0


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_refiner_equals_the_paper_equations(activation):
    """Eq. 5-8 written out position by position, independently of the module's vectorised code."""
    ref = refiner(activation=activation)
    h, prev = inputs()
    sigma = F.silu if activation == "silu" else F.gelu
    idx = vocab().input_index(prev)
    g = h.mean(1)  # [b, H]: mean over the P refined positions
    a = [ref.w_in.weight @ torch.cat([ref.w_h.weight @ h[:, k].T, ref.w_g.weight @ g.T,
                                      ref.w_e.weight[idx[:, k]].T]) for k in range(P)]  # each [r, b]
    out = []
    for k in range(P):
        c = a[k] + sum(ref.mix[:, k, j, None] * a[j] for j in range(k))  # (I + L) a, L strictly lower
        z = c + ref.w_2.weight @ sigma(ref.w_1.weight @ c)
        out.append((ref.w_r.weight @ z).T)
    torch.testing.assert_close(ref(h, prev), torch.stack(out, 1), atol=1e-5, rtol=1e-5)


def test_upper_triangle_of_mixer_never_acts():
    ref = refiner()
    h, prev = inputs()
    before = ref(h, prev)
    with torch.no_grad():
        ref.mix.add_(torch.ones(P, P).triu() * 1e3)  # diagonal and above: masked out
    assert torch.equal(ref(h, prev), before)


def test_refiner_is_causal_in_tokens():
    ref = refiner()
    h, prev = inputs(b=4)
    delta = ref(h, prev)
    folded = ref.fold(h)
    for m in range(P):
        changed = prev.clone()
        changed[:, m:] = torch.randint(0, V, (4, P - m))
        assert torch.equal(ref(h, changed)[:, :m], delta[:, :m])
        assert torch.allclose(folded(changed)[:, :m], delta[:, :m], atol=1e-5)

def test_dependency_matrices():
    """Tokens: strictly causal (row i = x_{i+1} reads x_0..x_i). Hidden states: every h_j through g;
    without the g path, h_j for j <= k through Mix (not only h_k, as Proposition 1 states)."""
    ref = refiner()
    h, prev = inputs(b=1)
    tokens, hidden = dependency_matrices(ref, h[0], prev[0])
    lower = torch.ones(P, P).tril().bool()
    assert torch.equal(tokens > 0, lower)
    assert (hidden > 0).all()
    with torch.no_grad():
        ref.w_g.weight.zero_()
    _, hidden = dependency_matrices(ref, h[0], prev[0])
    assert torch.equal(hidden > 0, lower)


def test_folded_equals_fuse_then_mix():
    ref = refiner()
    h, prev = inputs(b=5)
    folded = ref.fold(h)
    full = ref(h, prev)
    torch.testing.assert_close(folded(prev), full, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([4, 1])
    torch.testing.assert_close(folded(prev[rows], rows), full[rows], atol=1e-5, rtol=1e-5)
    for k in range(P):
        torch.testing.assert_close(folded(prev[rows], rows, k), full[rows, k], atol=1e-5, rtol=1e-5)


def test_token_table_follows_weight_updates():
    ref = refiner()
    h, prev = inputs()
    ref.fold(h)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(h, prev).square().sum().backward()
    opt.step()
    torch.testing.assert_close(ref.fold(h)(prev), ref(h, prev), atol=1e-5, rtol=1e-5)


def test_folded_weights_follow_each_weight_alone():
    """The folded copies (token table, W_in through W_h and W_g, the mixer) are rebuilt when any one of their
    weights changes in place, and the fold then equals the unfolded forward again."""
    ref = refiner()
    h, prev = inputs()
    for name in ("w_e.weight", "w_in.weight", "w_h.weight", "w_g.weight", "mix"):
        ref.fold(h)
        with torch.no_grad():
            ref.get_parameter(name).mul_(1.5)
        torch.testing.assert_close(ref.fold(h)(prev), ref(h, prev), atol=1e-5, rtol=1e-5, msg=name)


def test_markov_head_reads_previous_token_only():
    head = randomize_(MarkovHead(vocab(), R), 1.0, torch.Generator().manual_seed(0))
    _, prev = inputs()
    prev[:, 0] = 1  # anchor outside the draft vocabulary -> the extra row
    bias = head(prev)
    assert bias.shape == (3, P, VD)
    expected = head.w_1.weight[vocab().input_index(prev)] @ head.w_2.weight.T
    torch.testing.assert_close(bias, expected)
    torch.testing.assert_close(head.w_1.weight[VD] @ head.w_2.weight.T, bias[0, 0])
    torch.testing.assert_close(head.bias(prev, None, 2), bias[:, 2])


def test_parameter_and_flop_counts():
    v, h, r, b = 151936, 4096, 256, 16
    p = b - 1
    with torch.device("meta"):
        ref = XPressRefiner(DraftVocab.full(v), h, p, r)
        markov = MarkovHead(DraftVocab.full(v), r)
    assert count_params(ref) == 2 * h * r + (v + 1) * r + 3 * r * r + r * p * p + 4 * r * r + v * r
    assert count_params(markov) == (v + 1) * r + r * v
    x = count_flops("xpress", v, h, r, b, iters=4)
    m = count_flops("markov", v, h, r, b)
    assert m == {"setup": 0, "per_pass": 2 * r * v, "passes": 15, "total": 15 * 2 * r * v,
                 "weights_read": 15 * (r * v + r)}
    assert x["passes"] == 4 and x["total"] == x["setup"] + 4 * x["per_pass"]
    assert x["per_pass"] == 2 * (r * p * p + 4 * p * r * r + p * r * v)
    assert x["weights_read"] < m["weights_read"]  # 4 readout passes vs 15 serial ones
    with pytest.raises(ValueError):
        count_flops("gru", v, h, r, b)


def test_folded_and_markov_positions_from_lo():
    ref = refiner()
    h, prev = inputs(b=4)
    with torch.no_grad():
        folded, full = ref.fold(h), ref.fold(h)(prev)
        for lo in range(P):
            torch.testing.assert_close(folded(prev, None, None, lo=lo), full[:, lo:], atol=1e-5, rtol=1e-5)
    head = randomize_(MarkovHead(vocab(), R), 1.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(head.bias(prev, None, None, lo=2), head(prev)[:, 2:])


def test_folded_first_k_positions_alone_equal_the_whole_blocks():
    """FoldedRefiner.first(k) (drafting k < P tokens) gives the whole block's corrections of the first k
    positions from their own prefix, for every k and from every lo; a later token cannot reach it."""
    ref = refiner()
    h, prev = inputs(b=3)
    with torch.no_grad():
        full = ref.fold(h)(prev)  # [b, P, Vd]
        for k in range(1, P):
            first = ref.fold(h).first(k)
            torch.testing.assert_close(first(prev[:, :k]), full[:, :k], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(first(prev[:, :k], None, k - 1), full[:, k - 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(first(prev[:, :k], None, None, lo=k - 1), full[:, k - 1:k], atol=1e-5, rtol=1e-5)


def test_packed_readout_equals_the_linear_layer_and_follows_updates():
    ref = refiner()
    z = torch.randn(2, P, R, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ref.readout(z), ref.w_r(z), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref.readout(z[:0]), ref.w_r(z[:0]))
        ref.w_r.weight.mul_(2.0)  # an in-place update: the packed copy must be rebuilt
        torch.testing.assert_close(ref.readout(z), ref.w_r(z), atol=1e-5, rtol=1e-5)
    assert ref.readout(z).shape == (2, P, VD)
    z.requires_grad_(True)  # with autograd the plain layer is used, so gradients flow
    ref.readout(z).sum().backward()
    assert z.grad is not None
