"""The lean runtime (xpress.runtime): the same function as the transformers forward, its KV cache, its
row-invariance (a B-token verify equals B one-token steps bit for bit, in float32 and bf16), the runtime and dtype
choice, and the target-cost study."""
import json

import pytest
import torch

from xpress import runtime as rt
from xpress.config import load_config
from xpress.decoding import generate_ar, generate_ar_batch, generate_speculative, generate_speculative_batch
from xpress.reference_drafters import OracleDrafter, RandomDrafter
from xpress.targets import TargetError, encode_chat, load_target, target_forward

BF16 = pytest.mark.skipif(not rt.native_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")


def transformers_twin(target):
    """The same weights through the transformers forward (a fresh load with target.runtime=transformers)."""
    return load_target(load_config("smoke", ["target.runtime=transformers"]))


def test_smoke_target_runs_lean_and_records_the_choice(target):
    assert target.runtime is not None and target.meta["runtime"] == "lean"
    assert target.compute_dtype == torch.float32 and target.meta["dtype_setting"] == "float32"
    from xpress.utils import provenance

    assert provenance("smoke")["target_runtime"]["runtime"] in ("lean", "transformers")
    load_target(load_config("smoke"))  # the last target loaded is what the provenance names, attention included
    recorded = provenance("smoke")["target_runtime"]
    assert recorded["runtime"] == "lean" and recorded["attention"] and recorded["drafter_products"]


def test_lean_float32_is_the_transformers_function(target):
    """Logits and drafter features agree with the transformers forward (fp32 rounding only), for a plain
    prompt, through the cache in pieces, and for a left-padded ragged batch with explicit positions."""
    twin = transformers_twin(target)
    assert twin.runtime is None
    ids = torch.tensor([encode_chat(target.tokenizer, ["Name three prime numbers."])])
    a, b = target_forward(target, ids), target_forward(twin, ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-4)
    head = target_forward(target, ids[:, :-5])
    tail = target_forward(target, ids[:, -5:], cache=head.cache)
    torch.testing.assert_close(tail.logits, a.logits[:, -5:], rtol=1e-4, atol=1e-4)
    assert head.cache.get_seq_length() == ids.shape[1]
    prompts = [encode_chat(target.tokenizer, [q]) for q in ("Hi", "What is the capital of France, and why?")]
    assert generate_ar_batch(target, prompts, 12)[0].token_ids == generate_ar_batch(twin, prompts, 12)[0].token_ids


def test_lean_runs_qwen3_with_its_qk_norms():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=0.2)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial norm weights, so a wrong order would show
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    lean = rt.LeanModel(model, torch.float32)
    ids = torch.randint(300, (1, 40))
    want = model(ids).logits
    got, _ = lean.forward(ids, lean.new_cache(1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_fall_back_or_refuse():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    cfg = load_config("smoke", ["target.runtime=auto", "target.dtype=bfloat16"]).target
    lean, record = rt_choice(cfg, model)
    assert lean is None and "gpt2" in record["why_not_lean"]
    cfg.runtime = "lean"
    with pytest.raises(TargetError, match="target.runtime=transformers"):
        rt_choice(cfg, model)


def rt_choice(cfg, model):
    from xpress.targets import choose_runtime

    return choose_runtime(cfg, model)


def test_static_kv_grows_crops_and_gathers():
    kv = rt.StaticKV(n_layers=2, batch=2, n_kv=1, head_dim=2, dtype=torch.float32, device="cpu", capacity=1)
    assert kv.capacity == rt.CHUNK and kv.get_seq_length() == 0
    for step in range(3):
        kv.reserve(kv.length + 1)
        kv.write(0, torch.full((2, 1, 1, 2), float(step)), torch.full((2, 1, 1, 2), -float(step)))
        kv.advance(1)
    kv.reserve(200)  # grows, keeping what was written
    assert kv.capacity >= 200 and kv.capacity % rt.CHUNK == 0
    assert kv.keys[0][0, 0, :3, 0].tolist() == [0.0, 1.0, 2.0]
    kv.crop(-1)
    assert kv.length == 2
    kv.gather_columns(torch.tensor([[1], [0]]))  # row 0 keeps column 1, row 1 keeps column 0
    assert kv.length == 1 and kv.keys[0][:, 0, 0, 0].tolist() == [1.0, 0.0]


def test_invariant_attention_is_softmax_attention():
    torch.manual_seed(0)
    b, nkv, g, n, hd, L = 2, 2, 3, 5, 8, 70
    Lc = -(-(L + n) // rt.CHUNK) * rt.CHUNK
    q = torch.randn(b, nkv, g * n, hd)
    k, v = torch.randn(b, nkv, Lc, hd), torch.randn(b, nkv, Lc, hd)
    mask = torch.ones(b, L + n, dtype=torch.bool)
    mask[1, :7] = False  # row 1: seven holes
    bias = rt.attention_bias(b, n, L, g, mask, "cpu")
    got = rt.invariant_attention(q, k, v, bias, g)
    want = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5 + bias, dim=-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@BF16
def test_bf16_verify_equals_one_token_steps_bit_for_bit(target):
    """The row-invariance the exactness of speculative decoding rests on, checked on the smoke target at
    several contexts (several chunks, a prefill longer than ROW_CHUNK)."""
    lean = rt.LeanModel(target.model, torch.bfloat16)
    for context in (5, 63, 64, 150):
        check = rt.check_row_invariance(lean, context=context, n=8, seed=context)
        assert check["exact"], check


@BF16
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_packed_bf16_rows_do_not_depend_on_how_many_are_computed(shape):
    """At SmolLM2-135M's shapes (fused q/k/v, down projection, LM head) a row's product is the same bits
    whether 1, 16, 33 or 80 rows are computed together (on AMX CPUs oneDNN switches kernel above 32-64 rows;
    rt.bf16_row_block keeps every row on one kernel)."""
    torch.manual_seed(0)
    lin = rt.Linear(torch.randn(shape).bfloat16(), packed=True, row_block=rt.bf16_row_block())
    x = torch.randn(80, shape[1]).bfloat16()
    one = torch.cat([lin(x[j:j + 1]) for j in range(80)])
    for m in (2, 16, 32, 33, 48, 64, 80):
        assert torch.equal(lin(x[:m]), one[:m]), m


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16)])
def test_speculative_equals_greedy_ar_in_every_dtype(dtype):
    cfg = load_config("smoke", [f"target.dtype={dtype}"])
    target = load_target(cfg)
    assert str(target.compute_dtype) == f"torch.{dtype}"
    prompts = [encode_chat(target.tokenizer, [q]) for q in
               ("Count to ten.", "Write a haiku about rain.", "Explain gravity to a child.", "2+2=?")]
    oracle = OracleDrafter(target, cfg)
    rand = RandomDrafter(target, cfg, seed=1)
    for p in prompts:
        ref = generate_ar(target, p, 40).token_ids
        assert generate_speculative(target, oracle, p, 40).token_ids == ref
        assert generate_speculative(target, rand, p, 40).token_ids == ref
    batch = generate_speculative_batch(target, oracle, prompts, 40)
    refs = [generate_ar(target, p, 40).token_ids for p in prompts]
    # kernels=torch: one PyTorch layer for every row count; fused: one cache row per sequence through the fused
    # layers (xpress.decoding.RowKV). Equal either way.
    assert [g.token_ids for g in batch] == refs


def test_auto_dtype_falls_back_to_float32_when_bf16_is_not_row_invariant(monkeypatch):
    # auto resolves to bf16 as on a CPU with native bf16; the weights stay unpacked here (native_bf16 is left
    # alone: oneDNN refuses to pack bf16 weights on an AVX2-only CPU)
    real = rt.resolve_dtype
    monkeypatch.setattr(rt, "resolve_dtype", lambda name: torch.bfloat16 if name == "auto" else real(name))
    monkeypatch.setattr(rt, "check_row_invariance", lambda lean, **k: {"exact": False, "max_abs_diff": 0.5})
    target = load_target(load_config("smoke", ["target.dtype=auto"]))
    assert target.compute_dtype == torch.float32 and target.meta["dtype_reason"].startswith("bf16 failed")
    assert target.meta["row_invariance"]["exact"] is False


def test_auto_takes_the_lean_runtime_in_float32_on_a_cpu_and_records_its_check():
    target = load_target(load_config("smoke", ["target.runtime=auto", "target.dtype=float32"]))
    assert target.runtime is not None and target.meta["runtime"] == "lean" and target.runtime.packed
    assert target.compute_dtype == torch.float32 and "exact" in target.meta["row_invariance"]
    assert load_target(load_config("smoke", ["target.runtime=transformers"])).runtime is None


def float32_exact_or_skip(check: dict) -> None:
    """Assert the float32 verify equals the steps bit for bit; on a CPU with AVX-512 (where the float32 oneDNN /
    MKL kernels were not probed) a failure is reported as a skip: the runtime records it in provenance."""
    if not check["exact"] and rt.cpu_features()["avx512f"]:
        pytest.skip(f"float32 products are not row-invariant on this AVX-512 CPU "
                    f"(max |diff| {check['max_abs_diff']:.3g})")
    assert check["exact"], check


def test_float32_verify_equals_one_token_steps_bit_for_bit(target):
    """Prepacked oneDNN projections and attention in fixed blocks of rows (rt.row_blocks) make the float32
    lean runtime row-invariant too; checked at several contexts (several chunks, a prefill over ROW_CHUNK)."""
    assert target.runtime.dtype == torch.float32
    for context in (5, 63, 64, 150):
        float32_exact_or_skip(rt.check_row_invariance(target.runtime, context=context, n=8, seed=context))
    float32_exact_or_skip(rt.check_row_invariance(target.runtime, context=40, n=rt.QUERY_BLOCK + 3, seed=1))


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_packed_float32_rows_do_not_depend_on_how_many_are_computed(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    lin = rt.Linear(w, packed=True)
    x = torch.randn(80, shape[1])
    one = torch.cat([lin(x[j:j + 1]) for j in range(80)])
    torch.testing.assert_close(one, x @ w.T, rtol=1e-4, atol=1e-3)
    for m in (2, 16, 33, 80):
        float32_exact_or_skip({"exact": torch.equal(lin(x[:m]), one[:m]),
                               "max_abs_diff": float((lin(x[:m]) - one[:m]).abs().max())})


def test_resolve_dtype():
    assert rt.resolve_dtype("float32") == torch.float32
    assert rt.resolve_dtype("auto") == (torch.bfloat16 if rt.native_bf16() else torch.float32)


def test_target_cost_rows_and_break_even(tmp_path):
    from xpress.studies.target_cost import COMPONENTS, run_target_cost

    result = run_target_cost("smoke", contexts=(8, 70), new_tokens=(1, 4), repeats=2, dtypes=["float32"],
                             out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "target_cost.json").read_text())
    assert saved["break_even"] == result["break_even"] and (tmp_path / "target_cost.csv").is_file()
    lean = [r for r in saved["rows"] if r["runtime"] == "lean"]
    assert {r["component"] for r in lean} == set(COMPONENTS) | {"forward"}
    for L in (8, 70):
        parts = {r["component"]: r["median_ms"] for r in lean if r["context"] == L and r["new_tokens"] == 4}
        assert parts["other"] == pytest.approx(parts["forward"] - sum(parts[c] for c in COMPONENTS[:-1]))
    be = {(b["runtime"], b["context"]): b for b in saved["break_even"]}
    from xpress.kernels import fused_cpu

    fused = [("lean-fused", 8), ("lean-fused", 70)] if fused_cpu() is not None else []  # where the C++ layer builds
    assert set(be) == {("lean", 8), ("lean", 70), ("transformers", 8), ("transformers", 70), *fused}
    b = be[("lean", 70)]
    assert b["block"] == 4 and b["break_even_tau"] == pytest.approx(b["verify_ms"] / b["step_ms"])
    assert saved["provenance"]["git_revision"]


def test_latency_study_times_the_lean_runtime(target):
    from xpress.studies.shapes import preset_shapes
    from xpress.studies.target_cost import time_target

    shapes = preset_shapes(load_config("smoke"), context=20)
    t = time_target(target.runtime, shapes, repeats=2, warmup=0)
    assert len(t) == 2 and all(v["median_ms"] > 0 and v["repeats"] == 2 for v in t.values())


def test_runtime_and_dtype_settings_are_validated():
    from xpress.config import ConfigError

    with pytest.raises(ConfigError, match="target.runtime='fast'"):
        load_config("smoke", ["target.runtime=fast"])
    with pytest.raises(ConfigError, match="auto, float32"):
        load_config("smoke", ["target.dtype=int8"])
    assert load_config("cpu").target.dtype == "auto" and load_config("cpu").target.runtime == "auto"


@BF16
def test_a_bf16_target_keeps_its_own_weights_in_the_float32_model():
    """The drafters' readout (the float32 model's head) is the one the bf16 target computes with, so the
    stored hidden state and logsumexp give the target's log-probs (regeneration's contract)."""
    target = load_target(load_config("smoke", ["target.dtype=bfloat16"]))
    assert target.dtype == torch.float32 and target.compute_dtype == torch.bfloat16
    for p in target.model.parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float())
    ids = torch.tensor([encode_chat(target.tokenizer, ["Tell me a joke."])])
    lean = target.runtime
    lean.capture, lean.capture_layers = [], list(target.layer_ids)
    try:
        logits, _ = lean.forward(ids, lean.new_cache(1), logits_to_keep=0)
    finally:
        (_, hidden, _), lean.capture = lean.capture[0], None
    rebuilt = hidden.float() @ target.lm_head().weight.T  # the target's bf16 readout output, unrounded
    torch.testing.assert_close(rebuilt, logits, rtol=2 ** -8, atol=1e-3)  # half a bf16 step
