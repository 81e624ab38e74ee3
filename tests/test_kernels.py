"""The fused C++ layer (xpress/csrc/fused_cpu.cpp, xpress.kernels): the same function as the PyTorch lean
path, row-invariant by construction (a verify equals the steps bit for bit), lossless speculative decoding
through it, and the choice of ``target.kernels`` with its fallbacks."""
import pytest
import torch

from xpress import kernels as kn
from xpress import runtime as rt
from xpress.config import ConfigError, load_config
from xpress.decoding import generate_ar, generate_speculative, generate_speculative_batch
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


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 40)])
def test_linear_is_a_product_whose_rows_do_not_depend_on_how_many_are_computed(fused, shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    packed = fused.pack(w)
    x = torch.randn(40, shape[1])
    one = torch.cat([fused.linear(x[j:j + 1], packed) for j in range(40)])
    torch.testing.assert_close(one, x @ w.T, rtol=1e-4, atol=1e-4)
    for m in (2, 3, 5, 6, 7, 13, 16, 40):  # every row-block shape of the kernel
        assert torch.equal(fused.linear(x[:m], packed), one[:m]), m


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
    # a batch of several rows runs the PyTorch path: its greedy tokens are compared, not its bits
    batch = generate_speculative_batch(target, oracle, prompts, 40)
    assert sum(g.token_ids == r for g, r in zip(batch, refs)) >= len(prompts) - 1


def test_kernels_setting_is_validated_and_refusals_name_the_fix(fused, monkeypatch):
    with pytest.raises(ConfigError, match="target.kernels='cuda'"):
        load_config("smoke", ["target.kernels=cuda"])
    with pytest.raises(TargetError, match="set target.kernels=auto"):
        load_target(load_config("smoke", ["target.kernels=fused", "target.runtime=lean", "target.dtype=bfloat16"]))
    t = load_target(load_config("smoke", ["target.kernels=auto"]))
    expect = "torch" if rt.cpu_features()["avx512f"] else "fused"  # auto: the measured class of CPU only
    assert t.meta["kernels"] == expect and t.meta["kernels_reason"]


def test_without_the_kernels_auto_falls_back_and_fused_refuses(monkeypatch):
    monkeypatch.setattr(kn, "_state", {})
    monkeypatch.setenv("XPRESS_KERNELS", "0")
    assert kn.fused_cpu() is None and kn.status() == {"built": False, "reason": "XPRESS_KERNELS=0"}
    t = load_target(load_config("smoke", ["target.kernels=auto"]))
    assert t.meta["kernels"] == "torch" and t.runtime.kernels is None
    if not rt.cpu_features()["avx512f"]:
        assert "XPRESS_KERNELS=0" in t.meta["kernels_reason"]
        with pytest.raises(TargetError, match="set target.kernels=torch"):
            load_target(load_config("smoke", ["target.kernels=fused"]))
