"""The compiled harness (decode.compile, xpress.compiled): the config switch, the static cache's rewinds, the
refiner's fixed-pass rollout, the lazy CUDA-event clock, greedy tokens equal to the eager path's for every
method, and the `bench compiled-eager` command.

torch.compile's real backend (inductor) takes minutes per graph on two cores, so the normal suite compiles with
dynamo's ``eager`` backend (the same graph capture, static cache, fixed shapes and rollouts, without code
generation) and the slow suite runs every method with inductor."""
import json

import pytest
import torch

from xpress import decoding
from xpress.compiled import CompiledError
from xpress.config import ConfigError, load_config
from xpress.heads import randomize_
from xpress.jacobi import corrected_logits, jacobi_refine, jacobi_refine_one, jacobi_rollout
from xpress.methods import make_drafter
from xpress.targets import encode_chat, load_target, target_forward
from xpress.utils import EventSpan

TRANSFORMERS = ["target.runtime=transformers"]


def compiled_cfg(backend: str, cache: int = 256):
    return load_config("smoke", [*TRANSFORMERS, "decode.compile=true", f"decode.compile_backend={backend}",
                                 f"decode.static_cache_len={cache}"])


@pytest.fixture(scope="module")
def eager_target():
    return load_target(load_config("smoke", TRANSFORMERS))


@pytest.fixture(scope="module")
def compiled_target():
    return load_target(compiled_cfg("eager"))


# ------------------------------------------------------------------------------------------------ config
def test_compile_switch_defaults_and_validation():
    assert load_config("smoke").compiled_decoding() is False  # the CPU presets keep their lean runtime
    assert load_config("cpu").compiled_decoding() is False
    assert load_config("qwen3-8b").compiled_decoding() is True  # transformers on cuda
    assert load_config("qwen3-8b", ["target.device=cpu"]).compiled_decoding() is False
    assert load_config("smoke", [*TRANSFORMERS, "decode.compile=true"]).compiled_decoding() is True
    with pytest.raises(ConfigError, match="target.runtime=transformers"):
        load_config("smoke", ["decode.compile=true"])  # the lean runtime is not compiled
    with pytest.raises(ConfigError, match="decode.compile="):
        load_config("smoke", ["decode.compile=maybe"])
    with pytest.raises(ConfigError, match="compile_backend"):
        load_config("smoke", ["decode.compile_backend=tvm"])
    with pytest.raises(ConfigError, match="static_cache_len"):
        load_config("smoke", ["decode.static_cache_len=8"])


def test_the_default_cpu_target_is_not_compiled(target):
    assert target.compiled is None and target.meta["compiled"] is False


# ------------------------------------------------------------------------------------------ static cache
def test_static_cache_rewinds_and_equals_the_dynamic_cache(eager_target, compiled_target):
    """Stale columns (an earlier, longer sequence; a rejected tail) are never read: prefill, a compiled verify
    block, a rewind and a compiled step give the eager forward's logits."""
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None]
    with torch.inference_mode():
        target_forward(compiled_target, ids, None, pos)  # fills 40 columns: stale for what follows
        outs = []
        for t in (eager_target, compiled_target):
            a = target_forward(t, ids[:, :12], None, pos[:, :12], logits_to_keep=1)
            b = target_forward(t, ids[:, 12:20], a.cache, pos[:, 12:20])  # 8 rows: compiled
            b.cache.crop(-5)  # reject the last 5
            c = target_forward(t, ids[:, 15:16], b.cache, pos[:, 15:16])  # 1 row: compiled
            outs.append((a.logits, b.logits, b.features, c.logits, c.cache.get_seq_length()))
    for x, y in zip(outs[0], outs[1]):
        if isinstance(x, int):
            assert x == y == 16
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_a_replaced_cache_and_an_overflow_are_refused(compiled_target):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.inference_mode():
        first = target_forward(compiled_target, ids, None).cache
        target_forward(compiled_target, ids, None)  # a new sequence takes the storage
        with pytest.raises(CompiledError, match="newer sequence"):
            target_forward(compiled_target, ids, first)
        with pytest.raises(CompiledError, match="decode.static_cache_len"):
            target_forward(compiled_target, torch.zeros(1, 300, dtype=torch.long), None)


# ---------------------------------------------------------------------------------------------- rollout
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fixed_rollout_equals_the_adaptive_refinement(cfg, target, temperature):
    """K dense passes without an exit give the adaptive refinement's tokens, iters and q (batch and b = 1)."""
    drafter = make_drafter("xpress", cfg, target, untrained_ok=True)
    randomize_(drafter.head, scale=3.0, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    b, P, vd = 3, drafter.block_size - 1, drafter.vocab.size
    h = torch.randn(b, P, drafter.drafter.config.hidden_size, generator=g)
    base = torch.randn(b, P, vd, generator=g) * 2
    anchor = torch.randint(0, 1000, (b,), generator=g)
    noise = None if temperature == 0 else -torch.log(-torch.log(torch.rand(b, P, vd, generator=g)))
    K = drafter.max_iters
    with torch.no_grad():
        fold = drafter.head.fold(h)
        ref = jacobi_refine(corrected_logits(base, fold), base, anchor, K, temperature, noise=noise, vocab=drafter.vocab)
        fixed = jacobi_rollout(lambda prev: fold(prev) + base, base, anchor, min(K, P), temperature, noise,
                               vocab=drafter.vocab)
        one = jacobi_refine_one(drafter.head.fold(h[:1]), base[:1], anchor[:1], K, temperature,
                                None if noise is None else noise[:1], vocab=drafter.vocab)
        via_drafter = drafter.fixed_refine(h, base, anchor, temperature, noise, *drafter.head.folded_weights())
    assert torch.equal(fixed.tokens, ref.tokens) and torch.equal(fixed.iters, ref.iters)
    assert torch.equal(fixed.tokens[:1], one.tokens) and torch.equal(fixed.iters[:1], one.iters)
    assert torch.equal(via_drafter.tokens, ref.tokens) and torch.equal(via_drafter.iters, ref.iters)
    assert ref.iters.max() > 1  # the randomized head moves tokens: the rollout is not the identity
    if temperature > 0:
        torch.testing.assert_close(fixed.q, ref.q)
        torch.testing.assert_close(via_drafter.q, ref.q, rtol=1e-5, atol=1e-6)
    else:
        assert fixed.q is None


def test_event_span_arithmetic_is_lazy():
    class Ev:  # a stand-in for torch.cuda.Event: elapsed_time in ms from a clock value
        def __init__(self, t):
            self.t, self.waited = t, False

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    a, b, c, d = Ev(0.0), Ev(0.5), Ev(1.0), Ev(3.0)
    span = EventSpan([(1, a, b)]) + EventSpan([(1, c, d)]) + 0.25  # 0.5 + 2.0 + 0.25
    assert not d.waited
    assert float(span) == pytest.approx(2.75) and d.waited
    assert float(span - 1.0) == pytest.approx(1.75)
    assert float((EventSpan([(1, a, b)]) - 2.0).nonnegative()) == 0.0
    assert float((EventSpan([(1, a, b)]) - 2.0).nonnegative() + EventSpan([(1, c, d)])) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="floored"):
        EventSpan([(1, c, d)]) - EventSpan([(1, a, b)]).nonnegative()
    assert float(0.0 + EventSpan([(1, a, c)])) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------- greedy equality
def _decode_all(methods, cfg_c, eager, compiled, max_new_tokens=10):
    cfg_e = load_config("smoke", TRANSFORMERS)
    prompt = encode_chat(eager.tokenizer, ["Name three prime numbers and add them."])
    for method in methods:
        if method == "ar":
            pairs = [(None, None)]
        else:
            pairs = [(make_drafter(method, cfg_e, eager, untrained_ok=True),
                      make_drafter(method, cfg_c, compiled, untrained_ok=True))]
            for d in pairs[0]:
                if d.head is not None:  # a fresh head is the identity: give the refiners something to do
                    randomize_(d.head, scale=3.0, generator=torch.Generator().manual_seed(3))
            assert pairs[0][1].compiled_refine is not None and pairs[0][0].compiled_refine is None
            assert pairs[0][1].compiled_draft is not None and pairs[0][0].compiled_draft is None
        de, dc = pairs[0]
        a = decoding.generate_batch(eager, de, [prompt], max_new_tokens)[0]
        b = decoding.generate_batch(compiled, dc, [prompt], max_new_tokens)[0]
        assert a.token_ids == b.token_ids, method
        assert a.accept_lengths == b.accept_lengths and a.stats == b.stats, method
        assert all(isinstance(t, float) for ts in b.step_times.values() for t in ts)


def test_compiled_greedy_tokens_equal_the_eager_path(eager_target, compiled_target):
    """Every method (dynamo's eager backend: the same capture and code path, no code generation)."""
    _decode_all(["ar", "dflash", "markov", "xpress"], compiled_cfg("eager"), eager_target, compiled_target)


@pytest.mark.slow
def test_inductor_compiled_greedy_tokens_equal_the_eager_path(eager_target):
    """Every method through inductor (float32, no CUDA graphs on a CPU): what a GPU runs, less the graphs."""
    cfg_c = compiled_cfg("inductor")
    _decode_all(["ar", "dflash", "markov", "xpress"], cfg_c, eager_target, load_target(cfg_c), max_new_tokens=8)


# ----------------------------------------------------------------------------------------------- bench
def test_bench_compiled_eager_writes_equal_outputs(tmp_path, capsys):
    from xpress.__main__ import main

    # the device check's form: overrides between the options
    rc = main(["bench", "compiled-eager", "--preset", "smoke", *TRANSFORMERS, "decode.compile_backend=eager",
               "--methods", "ar,dflash", "--n-prompts", "1", "--max-new-tokens", "5", "--frame-rows", "0,8",
               "--benchmarks", "gsm8k", "--out-dir", str(tmp_path), "--no-progress", "decode.static_cache_len=512"])
    assert rc == 0
    saved = json.loads((tmp_path / "compiled_eager.json").read_text())
    assert saved["equal"] is True and saved["compiled"]["compiled"] is True
    assert set(saved["by_frame_rows"]) == {"0", "8"}
    for r in saved["by_frame_rows"].values():
        assert r["methods"]["dflash"]["equals_ar_compiled"] is True
        for h in ("eager", "compiled"):
            assert r["methods"]["ar"][h]["tokens"] == 5 and r["methods"]["ar"][h]["ms_per_token"] > 0
    assert saved["weights"]["ar"].startswith("none")  # dflash: trained where a smoke checkpoint exists, else untrained
    assert saved["weights"]["dflash"].split(" ")[0].rstrip(":") in ("trained", "untrained")
    assert set(saved["frames"]) == {"F=8 eager", "F=8 compiled"}
    assert saved["provenance"]["preset"] == "smoke"
    assert (tmp_path / "compiled_eager.csv").read_text().count("\n") == 1 + 2 * 2 * 2 * 1  # F x method x harness
    assert '"equal": true' in capsys.readouterr().out


def test_bench_compiled_eager_refuses_the_lean_runtime(tmp_path):
    from xpress.bench import DecodeInputError, compiled_eager as run  # DecodeInputError: a one-line CLI error

    with pytest.raises(DecodeInputError, match="target.runtime=transformers"):
        run("smoke", ["ar"], 1, 4, tmp_path)


def test_bench_compiled_eager_names_a_static_cache_too_small_in_one_line(tmp_path, capsys):
    from xpress.__main__ import main

    rc = main(["bench", "compiled-eager", "--preset", "smoke", *TRANSFORMERS, "decode.compile_backend=eager",
               "--methods", "ar", "--n-prompts", "1", "--max-new-tokens", "5", "--frame-rows", "0",
               "--benchmarks", "gsm8k", "--out-dir", str(tmp_path), "--no-progress", "decode.static_cache_len=12"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "decode.static_cache_len" in err and "\n" not in err
    assert not (tmp_path / "compiled_eager.json").exists()
