"""The fused C++ layer (xpress/csrc/fused_cpu.cpp, xpress.kernels): the same function as the PyTorch lean
path, row-invariant by construction (a verify equals the steps bit for bit), lossless speculative decoding
through it, and the choice of ``target.kernels`` with its fallbacks."""
import pytest
import torch

from xpress import kernels as kn
from xpress import runtime as rt
from xpress.config import ConfigError, load_config
from xpress.cpu import cpu_flags
from xpress.decoding import generate_ar, generate_speculative, generate_speculative_batch
from xpress.heads import randomize_
from xpress.proposer import new_drafter
from xpress.reference_drafters import OracleDrafter, RandomDrafter
from xpress.targets import TargetError, encode_chat, load_target, target_forward


@pytest.fixture(scope="module")
def fused():
    module = kn.fused_cpu()
    if module is None:
        pytest.skip(f"the fused kernels are not available here: {kn.status()['reason']}")
    return module


@pytest.fixture(scope="module")
def twins(fused):
    """The smoke target with fused layers and with PyTorch layers (the same weights)."""
    return (load_target(load_config("smoke", ["target.kernels=fused"])),
            load_target(load_config("smoke", ["target.kernels=torch"])))


def test_the_kernels_split_their_work_over_torchs_threads(fused):
    """Built with OpenMP, one at::parallel_for runs on every torch thread (a build without it ran the fused
    kernels on one thread whatever torch.set_num_threads said); the status says which build this is."""
    st = kn.status()
    assert st["openmp"] or "without OpenMP" in st["reason"]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert fused.parallel_threads(64) == (n if st["openmp"] else 1)
    finally:
        torch.set_num_threads(threads)


def test_the_tile_emulation_is_built_only_where_asked(fused):
    """XPRESS_AMX_EMULATE=1 builds the tiles' intrinsics in software (csrc/amx_emulate.h), so that a CPU with
    AVX-512 but no tiles runs the tiles' code; without it the build never emulates, and the status says which."""
    asked = kn.amx_emulation_requested()
    assert fused.amx_emulated() == asked
    assert kn.status()["amx"] == ("emulated in software" if asked and fused.amx_ready() else
                                  "tiles" if fused.amx_ready() else "none")
    if asked:
        assert fused.amx_ready() == ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags())
        assert kn.bf16_unit(fused) == ("AMX tiles emulated in software" if fused.amx_ready() else "AVX512-BF16")


@pytest.mark.skipif(kn.amx_emulation_requested(), reason="this run is the emulated one")
def test_the_tiles_code_passes_this_files_tests_where_the_cpu_has_no_tiles(fused):
    """The AMX tiles' products and attention run only on an Intel Xeon with AMX. Where this CPU has AVX-512
    (which the code around the tiles needs) and no tiles, this file's tests, regeneration's engine and the
    runtime's run again in a process whose kernels emulate the six tile instructions in software
    (XPRESS_AMX_EMULATE=1): row invariance bit for bit, the float64 references, lossless decoding, on the tiles'
    configurations, strides and layouts. (A mutation of the emulated TILELOADD that loads only the first 4 bytes of
    a tile's sixteenth row fails nine of them.) Where the CPU has the tiles the ordinary run already covers them."""
    import os
    import subprocess
    import sys

    if fused.amx_ready():
        pytest.skip("this CPU runs the tiles themselves: the ordinary tests cover them")
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags():
        pytest.skip("the code around the tiles needs AVX-512 (F, BW, VL, BF16), which this CPU does not offer")
    from xpress.paths import REPO_ROOT

    files = ["tests/test_kernels.py", "tests/test_continuous.py", "tests/test_runtime.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
                         cwd=REPO_ROOT, env={**os.environ, "XPRESS_AMX_EMULATE": "1"}, capture_output=True,
                         text=True, timeout=1800)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0 and " passed" in tail, tail
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not any("bf16" in line.lower() or "amx" in line.lower() for line in skipped), skipped


def test_the_roofline_rates_are_measured_where_the_cpu_has_the_instructions(fused):
    """read_rate reads a buffer and times it; bf16_dot_rate runs VDPBF16PS chains only on a CPU with
    AVX512-BF16 (else 0, never a made-up figure); and a product cannot beat the rates it is built from."""
    from xpress import bench

    assert 1e8 < fused.read_rate(32 << 20, 2) < 1e13
    dot = fused.bf16_dot_rate(200_000)
    has_dot = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()
    assert (dot > 1e8) if has_dot else dot == 0.0
    f32 = bench.product_rate(fused, 16, 576, False, torch.get_num_threads(), repeats=1)
    assert 1e7 < f32 < 1.2 * fused.fma_rate(2_000_000)  # the float32 kernel is built of 8-lane FMAs


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 40)])
def test_linear_is_a_product_whose_rows_do_not_depend_on_how_many_are_computed(fused, shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    packed = fused.pack(w)
    x = torch.randn(100, shape[1])
    one = torch.cat([fused.linear(x[j:j + 1], packed) for j in range(100)])
    torch.testing.assert_close(one, x @ w.T, rtol=1e-4, atol=1e-4)
    # every row-block shape of the kernel, and both orders past 6 rows (panel by panel while x fits in
    # 128 KB, groups of four panels beyond)
    for m in (2, 3, 5, 6, 7, 13, 16, 40, 100):
        assert torch.equal(fused.linear(x[:m], packed), one[:m]), m


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64)])
def test_bf16_products_do_not_depend_on_how_many_rows_are_computed(fused, shape):
    """With a weight packed by pack_bf16, ``linear`` rounds x to bf16 and multiplies on the AMX tiles or, without
    them, with AVX512-BF16 (VDPBF16PS): a bf16 product (float64 reference on the same rounded operands, float32
    accumulation only) whose rows have the same bits whether computed alone, in one tile of up to 16 rows or
    a block of 4 or 8, or in pairs of tiles (16 rows and up to 16 more) past 16."""
    if not fused.bf16_ready():
        pytest.skip("bf16 products need AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
    torch.manual_seed(0)
    w = torch.randn(shape)
    packed = fused.pack_bf16(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (shape[0] // 16, shape[1] // 2, 16, 2)
    x = torch.randn(100, shape[1])
    one = torch.cat([fused.linear(x[j:j + 1], packed) for j in range(100)])
    ref = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    torch.testing.assert_close(one.double(), ref, rtol=1e-5, atol=1e-4)
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 24, 31, 32, 33, 40, 50, 64, 90, 100):
        assert torch.equal(fused.linear(x[:m], packed), one[:m]), m
    with pytest.raises(RuntimeError, match="K % 32 == 0"):
        fused.pack_bf16(torch.randn(16, 48))


def _reference_layer(h, ln1, wqkv, wo, ln2, wgu, wd, rot, keys, values, L, nh, nkv, eps, bf16=False, tiles=None):
    """One Llama layer in float64 with the fused layer's conventions (rotated pairs adjacent, gate rows before
    up rows); keys / values [nkv, L, hd] hold the cached columns. Returns the new residual stream. ``bf16``:
    the weights and every product's input rounded to bf16 first, as the AMX products do, attention's included
    (q, k, the softmax numerators and v; the denominators are sums of the unrounded numerators) unless ``tiles``
    is False (``target.attention=float32``: attention stays float32)."""
    f = lambda t: t.double()
    r = (lambda t: t.to(torch.bfloat16).double()) if bf16 else f  # a product's operands
    ra = r if (bf16 if tiles is None else tiles) else f  # attention's operands
    mm = lambda x, w: r(x) @ r(w).T
    n, hd = h.shape[0], keys.shape[2]
    rms = lambda x, w: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * f(w)
    qkv = mm(rms(f(h), ln1), wqkv)
    heads = qkv.view(n, nh + 2 * nkv, hd // 2, 2)
    c, s = f(rot)[:, None, :, 0], f(rot)[:, None, :, 1]
    a, b = heads[..., 0], heads[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), -1).view(n, nh + 2 * nkv, hd)
    q, k, v = rotated[:, :nh], rotated[:, nh:nh + nkv], heads.reshape(n, nh + 2 * nkv, hd)[:, nh + nkv:]
    K = torch.cat((f(keys), k.transpose(0, 1)), 1)  # [nkv, L + n, hd]
    V = torch.cat((f(values), v.transpose(0, 1)), 1)
    g = nh // nkv
    scores = torch.einsum("nhd,hcd->hnc", ra(q), ra(K).repeat_interleave(g, 0)) / hd ** 0.5
    scores = scores.masked_fill(torch.arange(L + n)[None, None] > L + torch.arange(n)[None, :, None], float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp()  # attention on the tiles: bf16 numerators, float32 sums
    att = torch.einsum("hnc,hcd->nhd", ra(e), ra(V).repeat_interleave(g, 0)) / e.sum(-1).transpose(0, 1)[..., None]
    att = att.reshape(n, nh * hd)
    h = f(h) + mm(att, wo)
    gate, up = mm(rms(h, ln2), wgu).chunk(2, -1)
    return h + mm(torch.nn.functional.silu(gate) * up, wd)


def test_module_linear_packs_once_repacks_after_a_change_and_steps_aside_under_autograd(fused):
    """kernels.linear (the drafter's products): F.linear's function through the packed kernel, the packed copy
    kept per weight tensor until it changes in place, F.linear itself under autograd or off its shapes."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 40), torch.randn(2, 3, 40)
    with torch.no_grad():
        y = kn.linear(x, w)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
        assert y.shape == (2, 3, 48) and (id(w),) in kn._packed
        packed = kn._packed[(id(w),)][2]
        assert kn.linear(x, w) is not y and kn._packed[(id(w),)][2] is packed  # kept
        w.mul_(2)  # in place: the kept copy is stale
        torch.testing.assert_close(kn.linear(x, w), 2 * y, rtol=1e-5, atol=1e-5)
        assert kn._packed[(id(w),)][2] is not packed
        odd = torch.randn(40, 40)  # 40 outputs: not a multiple of the kernel's 16 columns
        torch.testing.assert_close(kn.linear(x, odd), torch.nn.functional.linear(x, odd))
        assert (id(odd),) not in kn._packed
    wg = w.clone().requires_grad_()
    out = kn.linear(x, wg)  # autograd on: F.linear, so a gradient flows
    out.sum().backward()
    assert wg.grad is not None and (id(wg),) not in kn._packed
    key = (id(w),)
    del w
    assert key not in kn._packed  # dropped with its weight


def test_gate_and_up_interleave_by_panels_and_split_back():
    """The MLP's [gate; up] weight alternates blocks of 16 rows (the fused kernels' SiLU epilogue), and
    split_gate_up recovers each product from the interleaved one exactly; a width off the blocks is refused."""
    torch.manual_seed(5)
    gate, up, x = torch.randn(48, 24), torch.randn(48, 24), torch.randn(3, 24)
    gu = rt.interleave_gate_up(gate, up)
    assert gu.shape == (96, 24) and torch.equal(gu[:16], gate[:16]) and torch.equal(gu[16:32], up[:16])
    g, u = rt.split_gate_up(x @ gu.T)
    assert torch.equal(g, (x @ gu.T)[:, [i for b in range(3) for i in range(32 * b, 32 * b + 16)]])
    torch.testing.assert_close(g, x @ gate.T) and torch.testing.assert_close(u, x @ up.T)
    with pytest.raises(rt.RuntimeUnsupported, match="multiple of 16"):
        rt.interleave_gate_up(torch.randn(40, 8), torch.randn(40, 8))


def test_linears_stack_the_weights_into_one_product_with_each_products_bits(fused):
    """kernels.linears (the drafter's q/k/v and gate/up products): one kernel call on the weights stacked,
    equal bit for bit to a kernel call per weight (the kernel computes each output column alone); the stack
    is kept until one weight changes and dropped with any of them; separate F.linear calls under autograd."""
    torch.manual_seed(1)
    ws = (torch.randn(64, 40), torch.randn(32, 40), torch.randn(32, 40))
    x = torch.randn(2, 7, 40)
    with torch.no_grad():
        outs = kn.linears(x, ws)
        assert [tuple(o.shape) for o in outs] == [(2, 7, 64), (2, 7, 32), (2, 7, 32)]
        for o, w in zip(outs, ws):
            assert torch.equal(o, kn.linear(x, w))
        key = tuple(id(w) for w in ws)
        packed = kn._packed[key][2]
        assert packed.shape == (8, 40, 16) and kn.linears(x, ws) and kn._packed[key][2] is packed
        ws[1].add_(1)  # one weight changed in place: the stack is rebuilt
        assert torch.equal(kn.linears(x, ws)[1], kn.linear(x, ws[1])) and kn._packed[key][2] is not packed
    wg = ws[0].clone().requires_grad_()
    kn.linears(x, (wg, ws[1]))[0].sum().backward()  # autograd: F.linear per weight, the gradient flows
    assert wg.grad is not None and (id(wg), id(ws[1])) not in kn._packed
    a, b = ws[0], ws[2]
    with torch.no_grad():
        kn.linears(x, (a, b))
    pair = (id(a), id(b))
    assert pair in kn._packed and key in kn._packed
    del a, ws  # the first weight is gone (b lives on): every stack holding it goes with it
    assert pair not in kn._packed and key not in kn._packed
def test_module_rms_norm_is_the_drafters_norm_and_steps_aside_under_autograd(fused):
    """kernels.rms_norm (the drafter's norms at inference): Qwen3's RMSNorm on any [..., H] view, to float32
    rounding; None (the caller's PyTorch path) under autograd, off float32 or when H is not a multiple of 8."""
    from xpress.drafter import RMSNorm

    torch.manual_seed(2)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(2, 5, 3 * 64)[..., 64:].unflatten(-1, (2, 64))  # a strided view, [2, 5, 2, 64]
        reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        fused_out = kn.rms_norm(x, norm.weight, 1e-6)
        torch.testing.assert_close(fused_out, reference, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(norm(x), reference, rtol=2e-6, atol=2e-6)
        assert kn.rms_norm(x.double(), norm.weight.double(), 1e-6) is None
        assert kn.rms_norm(torch.randn(3, 12), torch.ones(12), 1e-6) is None
    assert kn.rms_norm(x, norm.weight, 1e-6) is None  # autograd on
    out = norm(x.clone().requires_grad_())
    out.sum().backward()
    assert norm.weight.grad is not None


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-amx"])
@pytest.mark.parametrize("L", [0, 61, 130])
def test_layer_at_smollm2_head_shapes_is_row_invariant_and_a_llama_layer(fused, L, bf16):
    """Head width 64 and 3 query heads per key-value head (SmolLM2-135M's; the smoke target has 16 and 2): 16
    rows in one call equal 16 one-row calls bit for bit, output and cache, across the attention's 64-column
    tiles; and the layer is a Llama layer (a float64 reference: float32 rounding only; with bf16 weights on
    AMX, the reference rounds the same operands to bf16 and the rest is float32 rounding and the odd
    activation that rounds to the other bf16 neighbour)."""
    if bf16 and not fused.bf16_ready():
        pytest.skip("bf16 products need AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
    torch.manual_seed(L)
    H, nh, nkv, hd, inter, n, cap, eps = 192, 9, 3, 64, 256, 16, 160, 1e-5
    w = lambda *shape: torch.randn(shape) * shape[-1] ** -0.5
    ln1, ln2 = 1 + 0.1 * torch.randn(H), 1 + 0.1 * torch.randn(H)
    wqkv, wo, wgu, wd = w((nh + 2 * nkv) * hd, H), w(H, nh * hd), w(2 * inter, H), w(H, inter)
    angle = torch.randn(n, hd // 2)
    rot = torch.stack((angle.cos(), angle.sin()), -1).contiguous()
    h = torch.randn(n, H)
    cached = torch.randn(2, nkv, cap, hd)
    gu = rt.interleave_gate_up(*wgu.chunk(2))  # the fused layer's layout of [gate; up]
    packed = [fused.pack_bf16(t) if bf16 else fused.pack(t) for t in (wqkv, wo, gu, wd)]

    def call(rows, at, keys, values):
        return fused.layer(h[rows], ln1, packed[0], packed[1], ln2, packed[2], packed[3], rot[rows].contiguous(),
                           keys, values, at, nh, nkv, eps, bf16, NO_TILES, NO_TILES, 0)  # tiles: bf16 attention
    k_all, v_all = cached[0].clone(), cached[1].clone()
    together = call(slice(0, n), L, k_all, v_all)
    k_one, v_one = cached[0].clone(), cached[1].clone()
    alone = torch.cat([call(slice(i, i + 1), L + i, k_one, v_one) for i in range(n)])
    assert torch.equal(together, alone) and torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    ref = _reference_layer(h, ln1, wqkv, wo, ln2, wgu, wd, rot, cached[0, :, :L], cached[1, :, :L], L, nh, nkv, eps,
                           bf16=bf16, tiles=bf16)
    tol = 3e-3 if bf16 else 1e-4  # float32 attention is ~1e-2 from the bf16 reference: the bf16 attention is checked
    torch.testing.assert_close(together.double(), ref, rtol=tol, atol=tol)


def test_fused_layers_compute_the_torch_path_function(twins):
    """Logits and drafter features agree with the PyTorch lean path (float32 rounding only), in one forward
    and through the cache in pieces."""
    a, b = twins
    assert a.meta["kernels"] == "fused" and b.meta["kernels"] == "torch"
    assert a.runtime.kernels is not None and b.runtime.kernels is None
    ids = torch.tensor([encode_chat(a.tokenizer, ["Name three prime numbers, then explain why they are prime."])])
    fa, fb = target_forward(a, ids), target_forward(b, ids)
    torch.testing.assert_close(fa.logits, fb.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fa.features, fb.features, rtol=1e-4, atol=1e-4)
    head = target_forward(a, ids[:, :-5])
    tail = target_forward(a, ids[:, -5:], cache=head.cache)
    torch.testing.assert_close(tail.logits, fa.logits[:, -5:], rtol=1e-4, atol=1e-4)


def test_batched_forwards_take_the_kernels_products(twins):
    """With the kernels, the lean runtime's PyTorch layer (left-padded batches: regeneration's capture) computes its
    products with the kernel's linear on the weights the fused layer reads (one packed copy, not two), and a
    batch of two rows gives each row the logits of that row alone through the fused layers."""
    a, b = twins
    lean = a.runtime
    for lw in lean.layers:
        assert lw.wqkv.kernels is not None and lw.fused[0] is lw.wqkv.fused and lw.fused[3] is lw.wd.fused
    assert lean.lm_head.kernels is not None and lean.lm_head_fused[0] is lean.lm_head.fused
    assert b.runtime.lm_head.kernels is None and b.runtime.layers[0].fused == ()
    x = torch.randn(5, lean.hidden)
    w = a.model.get_output_embeddings().weight.detach()
    assert torch.equal(lean.lm_head(x), kn.fused_cpu().linear(x, kn.fused_cpu().pack(w.contiguous())))
    torch.testing.assert_close(lean.lm_head(x), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    ids = torch.tensor([encode_chat(a.tokenizer, ["Two plus two?"])[:12], encode_chat(a.tokenizer, ["Hello"])[:12]])
    both = target_forward(a, ids).logits
    for i in range(2):
        torch.testing.assert_close(both[i:i + 1], target_forward(a, ids[i:i + 1]).logits, rtol=1e-4, atol=1e-4)


def test_fused_verify_equals_one_token_steps_bit_for_bit(twins):
    """A prefill (in ROW_CHUNK pieces past 128 tokens), an n-token verify and n steps give the same logits
    and K/V, at contexts on and around the attention's and the kernels' block edges."""
    lean = twins[0].runtime
    for context, n in ((1, 16), (5, 8), (63, 3), (64, 16), (150, 16), (rt.ROW_CHUNK + 7, 7)):
        check = rt.check_row_invariance(lean, context=context, n=n, seed=context)
        assert check["exact"], (context, n, check)


def test_speculative_equals_greedy_ar_through_the_fused_layers(twins):
    target = twins[0]
    cfg = load_config("smoke", ["target.kernels=fused"])
    prompts = [encode_chat(target.tokenizer, [q]) for q in
               ("Count to ten.", "Write a haiku about rain.", "Explain gravity to a child.", "2+2=?")]
    oracle, rand = OracleDrafter(target, cfg), RandomDrafter(target, cfg, seed=1)
    refs = [generate_ar(target, p, 40).token_ids for p in prompts]
    for p, ref in zip(prompts, refs):
        assert generate_speculative(target, oracle, p, 40).token_ids == ref
        assert generate_speculative(target, rand, p, 40).token_ids == ref
    # a batch of several rows keeps one cache row per sequence, each through the fused layers: equal
    batch = generate_speculative_batch(target, oracle, prompts, 40)
    assert [g.token_ids for g in batch] == refs


NO_TILES = torch.empty(0, 0, dtype=torch.int16)  # layer() without a cache's store of the tiles' layouts
WIDE_HEADS = ["target.random_hidden=128", "target.random_heads=4", "target.random_kv_heads=2"]  # head width 32


@pytest.mark.parametrize("heads", ["width16", "width32"])
def test_bf16_fused_layers_on_amx_are_exact_and_lossless(fused, heads):
    """bf16 weights on the AMX tiles (what ``target.dtype: auto`` and ``target.kernels: auto`` take on such a
    CPU): a prefill, a verify and the steps agree bit for bit at contexts around the block edges, the logits
    are the float32 PyTorch path's up to bf16 rounding, and speculative decoding equals greedy AR token for
    token with a perfect and a random drafter. With heads of width 32 the attention's products run on the
    tiles too (the smoke target's width 16 keeps them in float32)."""
    if not fused.bf16_ready():
        pytest.skip("bf16 products need AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
    over = ["target.dtype=bfloat16", "target.kernels=auto", *(WIDE_HEADS if heads == "width32" else [])]
    target = load_target(load_config("smoke", over))
    assert target.meta["kernels"] == "fused" and target.meta["dtype"] == "bfloat16"
    tiles = heads == "width32"  # bf16 attention: on the tiles, or with AVX512-BF16 without them
    assert target.runtime.tile_attention == tiles
    assert target.meta["attention"] == ("float32 (fused kernel)" if not tiles else f"bf16 products on {kn.bf16_unit(fused)}"
                                        if fused.amx_ready() else "bf16 products with AVX512-BF16")
    assert target.meta["row_invariance"]["exact"]
    assert ("AMX tiles" if fused.amx_ready() else "AVX512-BF16") in target.meta["kernels_reason"]
    lean = target.runtime
    assert lean.layers[0].fused[0].dtype == torch.bfloat16 and lean.new_cache(1).keys[0].dtype == torch.float32
    for context, n in ((1, 16), (63, 3), (64, 16), (150, 16), (rt.ROW_CHUNK + 7, 7)):
        check = rt.check_row_invariance(lean, context=context, n=n, seed=context)
        assert check["exact"], (context, n, check)
    # the float32 PyTorch path's logits up to bf16 rounding (the bf16 PyTorch path, whose K/V and activations
    # are bf16 too, is as far from them: ~0.14 at width 32, where the logits reach ~5)
    torch_path = load_target(load_config("smoke", ["target.dtype=float32", "target.kernels=torch", *over[2:]]))
    ids = torch.tensor([encode_chat(target.tokenizer, ["Name three prime numbers, then explain why they are prime."])])
    torch.testing.assert_close(target_forward(target, ids).logits, target_forward(torch_path, ids).logits,
                               rtol=0.05, atol=0.15)
    cfg = load_config("smoke", over)
    prompts = [encode_chat(target.tokenizer, [q]) for q in ("Count to ten.", "Write a haiku about rain.", "2+2=?")]
    oracle, rand = OracleDrafter(target, cfg), RandomDrafter(target, cfg, seed=1)
    for p in prompts:
        ref = generate_ar(target, p, 40).token_ids
        assert generate_speculative(target, oracle, p, 40).token_ids == ref
        assert generate_speculative(target, rand, p, 40).token_ids == ref


def test_bf16_attention_from_the_caches_store_equals_laying_out_the_whole_cache(fused):
    """The fused bf16 attention reads keys and values in the tiles' layouts. A cache keeps them (tile_store), so
    that each forward lays out only its new columns: through a prefill, steps, verifies, rollbacks (crop) with
    the rolled-back columns written again, a forward of the PyTorch layer (which writes the cache in place) and
    a growth of the cache, the logits equal those of a cache without a store (every column laid out in every
    call) bit for bit."""
    if not fused.bf16_ready():
        pytest.skip("bf16 attention needs AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
    target = load_target(load_config("smoke", ["target.dtype=bfloat16", "target.kernels=fused", *WIDE_HEADS]))
    lean = target.runtime
    assert lean.tile_attention
    stored, plain = lean.new_cache(1, 64), lean.new_cache(1, 64)
    plain.tile_store = lambda: []  # this one lays out the whole cache in each call
    gen = torch.Generator().manual_seed(5)
    steps = [("forward", 40), ("forward", 1), ("forward", 1), ("forward", 5), ("crop", 43), ("forward", 6),
             ("torch", 3), ("forward", 1), ("crop", 30), ("forward", 16), ("forward", 30), ("forward", 1)]
    for what, n in steps:
        if what == "crop":
            stored.crop(n)
            plain.crop(n)
            continue
        L = stored.length
        ids = torch.randint(3, target.vocab_size, (1, n), generator=gen)
        pos = torch.arange(L, L + n)[None]
        if what == "torch":  # the PyTorch layer on the same cache (a ragged batch's path), then the fused one again
            outs = [lean._block(ids, c, pos, None, None)[0] for c in (stored, plain)]
        else:
            outs = [target_forward(target, ids, c, pos).logits for c in (stored, plain)]
        assert torch.equal(outs[0], outs[1]), (what, n, L)
        assert stored.length == plain.length == L + n
    assert stored.capacity > 64 and stored.tiles_upto == stored.length  # it grew, and the store followed


def test_kernels_setting_is_validated_and_refusals_name_the_fix(fused, monkeypatch):
    with pytest.raises(ConfigError, match="target.kernels='cuda'"):
        load_config("smoke", ["target.kernels=cuda"])
    with pytest.raises(ConfigError, match="target.attention='bf16': use auto or float32"):
        load_config("smoke", ["target.attention=bf16"])
    if fused.bf16_ready():  # attention=float32 keeps the bf16 layer's attention off the tiles
        t = load_target(load_config("smoke", ["target.dtype=bfloat16", "target.attention=float32", *WIDE_HEADS]))
        assert not t.runtime.tile_attention and t.meta["attention"] == "float32 (fused kernel)"
    with pytest.raises(RuntimeError, match="bf16 attention \\(AMX tiles or AVX512-BF16\\) needs bf16 weights"):
        h, w = torch.zeros(1, 64), fused.pack(torch.zeros(3 * 32, 64))
        keys = torch.zeros(1, 8, 32)
        fused.layer(h, torch.ones(64), w, fused.pack(torch.zeros(64, 32)), torch.ones(64),
                    fused.pack(torch.zeros(64, 64)), fused.pack(torch.zeros(64, 32)), torch.zeros(1, 16, 2),
                    keys, keys.clone(), 0, 1, 1, 1e-5, True, NO_TILES, NO_TILES, 0)
    bf16 = ["target.kernels=fused", "target.runtime=lean", "target.dtype=bfloat16"]
    if fused.bf16_ready():  # bf16 runs on the AMX tiles or with AVX512-BF16; float16 nowhere
        assert load_target(load_config("smoke", bf16)).meta["kernels"] == "fused"
        with pytest.raises(TargetError, match="set target.kernels=auto"):
            load_target(load_config("smoke", ["target.kernels=fused", "target.runtime=lean", "target.dtype=float16"]))
    else:
        with pytest.raises(TargetError, match="set target.kernels=torch"):
            load_target(load_config("smoke", bf16))
    t = load_target(load_config("smoke", ["target.kernels=auto"]))
    expect = "torch" if rt.cpu_features()["avx512f"] else "fused"  # auto, float32: the measured class of CPU only
    assert t.meta["kernels"] == expect and t.meta["kernels_reason"]
    t = load_target(load_config("smoke", ["target.kernels=auto", "target.dtype=bfloat16"]))
    assert t.meta["kernels"] == ("fused" if fused.bf16_ready() else "torch")  # auto, bf16: AMX or AVX512-BF16


def test_without_the_kernels_auto_falls_back_and_fused_refuses(monkeypatch):
    monkeypatch.setattr(kn, "_state", {})
    monkeypatch.setenv("XPRESS_KERNELS", "0")
    assert kn.fused_cpu() is None and kn.status() == {"built": False, "reason": "XPRESS_KERNELS=0", "openmp": False,
                                                "amx": "none", "products": "float32"}
    t = load_target(load_config("smoke", ["target.kernels=auto"]))
    assert t.meta["kernels"] == "torch" and t.runtime.kernels is None
    if not rt.cpu_features()["avx512f"]:
        assert "XPRESS_KERNELS=0" in t.meta["kernels_reason"]
        with pytest.raises(TargetError, match="set target.kernels=torch"):
            load_target(load_config("smoke", ["target.kernels=fused"]))


def test_drafter_products_follow_the_target_onto_amx_tiles(fused):
    """Where the target runs bf16 products on AMX tiles, kernels.linear (a drafter's products) and the heads'
    readout do too (weights and inputs rounded to bf16, float32 sums: a float64 product of the rounded operands
    to float32 rounding, each row alone), the choice is recorded, and speculative decoding with a model drafter
    stays greedy AR token for token; a float32 target puts them back in float32. Refused without AMX tiles."""
    before = kn.bf16_products()
    try:
        if not fused.bf16_ready():
            with pytest.raises(ValueError, match="AMX"):
                kn.use_bf16_products(True)
            pytest.skip("bf16 products need AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
        over = ["target.dtype=bfloat16", "target.kernels=auto"]
        target = load_target(load_config("smoke", over))
        assert kn.bf16_products() and target.meta["drafter_products"] == kn.status()["products"] == "bfloat16"
        torch.manual_seed(3)
        w, x = torch.randn(48, 64), torch.randn(9, 64)
        with torch.no_grad():
            y = kn.linear(x, w)
            ref = (x.bfloat16().double() @ w.bfloat16().double().T).float()
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
            assert (id(w), "bf16") in kn._packed and kn._packed[(id(w), "bf16")][2].dtype == torch.bfloat16
            assert torch.equal(kn.linear(x[4:5], w), y[4:5])  # a row's bits alone
            odd = torch.randn(48, 40)  # 40 input features: not the tiles' depth, so float32
            torch.testing.assert_close(kn.linear(x[:, :40], odd), x[:, :40] @ odd.T, rtol=1e-5, atol=1e-5)
        cfg = load_config("smoke", over)
        drafter = new_drafter("xpress", cfg, target, seed=0)
        randomize_(drafter.head, generator=torch.Generator().manual_seed(0))
        z = torch.randn(3, drafter.head.rank)
        with torch.no_grad():
            torch.testing.assert_close(drafter.head.readout(z), kn.linear(z, drafter.head.w_r.weight))
        prompt = encode_chat(target.tokenizer, ["Write a haiku about rain."])
        assert generate_speculative(target, drafter, prompt, 40).token_ids == generate_ar(target, prompt, 40).token_ids
        back = load_target(load_config("smoke", ["target.dtype=float32", "target.kernels=fused"]))
        assert not kn.bf16_products() and back.meta["drafter_products"] == "float32"
    finally:
        kn.use_bf16_products(before)


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_drafter_is_the_drafters_pytorch_forward(fused, bf16):
    """At inference, one sequence: the drafter's context entries come from one ``draft_context`` call, bit for
    bit what its operations one by one give (the same products, norms and RoPE in the same order), and each
    layer of a block's forward from one ``draft_layer`` call, equal to the layer's operations to float32
    rounding (attention and SiLU summed in the kernel's orders; with bf16 products a rounding of an input
    may move, hence the looser bound)."""
    from torch import nn

    from xpress.drafter import DFlashConfig, DFlashDraftModel

    before = kn.bf16_products()
    if bf16 and not fused.bf16_ready():
        pytest.skip("bf16 products need AMX tiles or AVX512-BF16, which this CPU (or kernel) does not offer")
    try:
        kn.use_bf16_products(bf16)
        torch.manual_seed(0)
        H, V = 128, 80
        c = DFlashConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, num_hidden_layers=2, num_target_layers=6, target_layer_ids=[1, 3, 5],
                         vocab_size=V, block_size=4, mask_token_id=None, rope_theta=10000.0)
        net = DFlashDraftModel(c).eval().attach(nn.Embedding(V, H), nn.Linear(H, V, bias=False))
        randomize_(net, generator=torch.Generator().manual_seed(1))
        feats, pos = torch.randn(1, 37, 3 * H), torch.arange(37)[None]
        anchor, at = torch.tensor([[7]]), torch.tensor([[37]])
        with torch.no_grad():
            ctx = net.encode_context(feats, pos)
            out = net(anchor, at, ctx)
            calls = {"n": 0}
            real = net.layers[0].fused

            def counted(*a):
                calls["n"] += 1
                return real(*a)
            net.layers[0].fused = counted
            net(anchor, at, ctx)
            del net.layers[0].fused
            assert calls["n"] == 1  # the fused path ran
            net._fused_context = lambda *a: None  # the operations one by one (products through the kernel)
            for layer in net.layers:
                layer.fused = lambda *a: None
            ref_ctx = net.encode_context(feats, pos)
            ref = net(anchor, at, ref_ctx)
        for a, b in zip(ctx.keys + ctx.values, ref_ctx.keys + ref_ctx.values):
            assert torch.equal(a, b)
        tol = 3e-2 if bf16 else 1e-5
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        assert out.shape == (1, 1, 4, H)
    finally:
        kn.use_bf16_products(before)


def test_fused_xpress_fold_and_pass_are_the_heads_operations(fused):
    """For one block, XPressRefiner.fold takes one ``refine_fold`` call and FoldedRefiner.choose one
    ``refine_pass`` call a Jacobi pass: the mixed token-independent part equals the PyTorch fold's to float32
    rounding, and each pass's tokens equal the argmax of the PyTorch readout (random weights; logits far
    from ties at float32 resolution), also for a block's first k positions; a batch keeps the PyTorch path."""
    from xpress import DraftVocab, XPressRefiner

    before = kn.bf16_products()
    try:
        kn.use_bf16_products(False)
        g = torch.Generator().manual_seed(3)
        vocab = DraftVocab.from_ids(range(100, 612), 1000)
        ref = randomize_(XPressRefiner(vocab, 64, 7, 32), 2.0, g).eval()
        with torch.no_grad():
            for seed in range(8):
                h = torch.randn(1, 7, 64, generator=g)
                base = torch.randn(1, 7, vocab.size, generator=g)
                prev = torch.randint(0, 1000, (1, 7), generator=g)
                fold = ref.fold(h)
                table, a_h, a_g, m = ref.folded_weights()
                u = h @ a_h.T + h.mean(dim=1, keepdim=True) @ a_g.T
                torch.testing.assert_close(fold.base, torch.einsum("dkj,bjd->bkd", m, u), rtol=1e-5, atol=1e-5)
                for op, b in ((fold, base), (fold.first(3), base[:, :3])):
                    p = prev[:, :b.shape[1]]
                    calls = {"n": 0}
                    real = op._fused_pass

                    def counted(*a):
                        calls["n"] += 1
                        return real(*a)
                    op._fused_pass = counted
                    tokens = op.choose(p, b)
                    assert calls["n"] == 1 and tokens.shape == p.shape
                    logits = b + ref.w_r(op.latent(p))  # latent: after Trans
                    assert torch.equal(tokens, logits.argmax(-1)), seed
            two = ref.fold(torch.randn(2, 7, 64, generator=g))  # a batch of blocks: the PyTorch operations
            two._fused_pass = None  # would raise if called
            assert two.choose(prev.expand(2, -1), base.expand(2, -1, -1)).shape == (2, 7)
    finally:
        kn.use_bf16_products(before)


def test_fused_markov_steps_are_the_sequential_decode(fused):
    """For one block at T=0 the Markov head's k dependent steps take one ``markov_steps`` call: the tokens
    of sequential_refine with the head's own readout (anchors inside and outside the draft vocabulary)."""
    from xpress import DraftVocab
    from xpress.heads import MarkovHead
    from xpress.jacobi import corrected_logits, sequential_refine

    before = kn.bf16_products()
    try:
        kn.use_bf16_products(False)
        g = torch.Generator().manual_seed(4)
        vocab = DraftVocab.from_ids(range(100, 612), 1000)
        head = randomize_(MarkovHead(vocab, 32), 2.0, g).eval()
        with torch.no_grad():
            for anchor in (torch.tensor([150]), torch.tensor([7])):  # in, out of the draft vocabulary
                for k in (1, 3, 7):
                    base = torch.randn(1, k, vocab.size, generator=g)
                    fold = head.fold()
                    tokens = fold.steps(anchor, base)
                    ref = sequential_refine(corrected_logits(base, fold), base, anchor, vocab=vocab).tokens
                    assert tokens is not None and torch.equal(tokens, ref), (anchor, k)
            assert head.fold().steps(torch.tensor([1, 2]), torch.randn(2, 3, vocab.size)) is None  # a batch
    finally:
        kn.use_bf16_products(before)
