"""Numbers a reader can trust: torch threads from the config, the busy-machine check, the oracle ceiling
(interleaved runs, medians with spread, a speedup that contradicts its tau flagged), progress callbacks
and quiet loading."""
from __future__ import annotations

import json
import time

import pytest
import torch

import xpress.bench as bench
import xpress.decoding as decoding
import xpress.utils as utils
from xpress.config import ConfigError, load_config
from xpress.reference_drafters import OracleDrafter
from xpress.targets import encode_chat


# ----------------------------------------------------------------------------------- torch threads
def test_torch_threads_from_the_config(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert utils.torch_threads_for(3) == 3
    assert utils.torch_threads_for(0) == utils.physical_cores() <= utils.usable_cpus()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert utils.torch_threads_for(0) == 1 and utils.torch_threads_for(2) == 2
    assert load_config("smoke").torch_threads == 0
    assert load_config("smoke", ["torch_threads=2"]).torch_threads == 2
    with pytest.raises(ConfigError, match="torch_threads"):
        load_config("smoke", ["torch_threads=-1"])


def test_threads_are_applied_once(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.setattr(utils, "_APPLIED_THREADS", None)
    try:
        assert utils.apply_torch_threads(2) == 2
        torch.set_num_threads(1)  # what a caller (a test fixture) sets afterwards is left alone ...
        assert utils.apply_torch_threads(2) == 1
        assert utils.apply_torch_threads(3) == 3  # ... unless the config asks for another number
    finally:
        torch.set_num_threads(n)


def test_provenance_records_threads_and_load():
    prov = utils.provenance("smoke", **utils.load_check(0.1, 0.2))
    assert prov["torch_threads"] == torch.get_num_threads() == prov["machine"]["torch_threads"]
    assert prov["busy"] is False and prov["load_warning"] is None and prov["load_average_after"] == 0.2


def test_load_check_by_hand():
    idle = utils.load_check(0.5, 2.4, own_load=2, cpus=2)  # the measurement's own 2 threads are not "busy"
    assert not idle["busy"] and idle["load_warning"] is None
    before = utils.load_check(1.5, 0.2, cpus=2)
    after = utils.load_check(0.2, 3.5, own_load=2, cpus=2)
    assert before["busy"] and after["busy"] and "busy" in after["load_warning"] and "3.50" in after["load_warning"]
    assert not utils.load_check(None, None)["busy"]  # no load average on this platform: no claim
    # measured use by other processes decides where it exists: the load average at the start may be our own
    own_work = utils.load_check(1.9, 2.0, own_load=2, cpus=2, others=(0.05, 0.1))
    assert not own_work["busy"] and own_work["other_cpus"] == [0.05, 0.1]
    shared = utils.load_check(0.3, 2.1, own_load=2, cpus=2, others=(0.1, 1.6))
    assert shared["busy"] and "1.60 of 2 CPUs" in shared["load_warning"]


def test_other_cpu_use_sees_another_process():
    import subprocess
    import sys

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        time.sleep(0.3)
        assert utils.other_cpu_use(0.5) > 0.5  # a spinning process holds about one CPU
    finally:
        spin.kill()
        spin.wait()


# ------------------------------------------------------------------------------------ oracle ceiling
def test_speedup_flag_by_hand():
    assert bench.speedup_flag(7.9, tau=16.0, verify_ratio=1.8) is None  # below 16 / 1.8 = 8.9
    assert "exceeds tau / verify-cost ratio" in bench.speedup_flag(11.0, tau=16.0, verify_ratio=1.8)
    assert "exceeds tau 2.00" in bench.speedup_flag(3.0, tau=2.0, verify_ratio=0.5)
    assert bench.speedup_flag(1.1, tau=1.0, verify_ratio=1.0) is None  # within the tolerance


def test_spread_by_hand():
    s = bench.spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert s["q1"] == pytest.approx(1.75) and s["q3"] == pytest.approx(4.75)
    assert bench.spread([5.0]) == {"median": 5.0, "q1": 5.0, "q3": 5.0, "min": 5.0, "max": 5.0, "n": 1}


def small_ceiling(tmp_path, **kw):
    return bench.oracle_ceiling("smoke", n_prompts=2, max_new_tokens=8, repeats=2, out_dir=tmp_path,
                                verify_repeats=2, **kw)


def test_oracle_ceiling_without_the_comparison_runs_ar_and_the_oracle_only(tmp_path):
    result = small_ceiling(tmp_path, compare=False)
    assert "compare" not in result
    assert set(result["spread"]) == {"ar_tokens_per_s", "oracle_tokens_per_s", "speedup"}


def test_oracle_ceiling_interleaves_and_stores_spread(tmp_path, monkeypatch):
    order = []
    real = decoding.generate_batch

    def recorded(target, drafter, prompts, *a, **k):
        kind = "oracle" if drafter is not None else ("ar" if target.runtime is not None else "ar_old")
        order.append((kind, tuple(prompts[0])))
        return real(target, drafter, prompts, *a, **k)

    monkeypatch.setattr(decoding, "generate_batch", recorded)
    result = small_ceiling(tmp_path)
    methods = [m for m, _ in order]
    # one untimed warm-up of each, then 2 repeats x 2 prompts, each prompt through every runner in turn
    # (the two generate() runners do not go through the engine)
    assert methods == ["ar", "ar_old", "oracle"] * 5
    assert [p for _, p in order[0::3]] == [p for _, p in order[1::3]] == [p for _, p in order[2::3]]
    saved = json.loads((tmp_path / "oracle_ceiling.json").read_text())
    assert saved["lossless"] and saved["tau"] > 1 and saved["repeats"] == 2
    for key in ("ar_tokens_per_s", "oracle_tokens_per_s", "speedup"):
        s = saved["spread"][key]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"]
    assert saved["speedup_measured"] == saved["spread"]["speedup"]["median"]
    assert saved["speedup"] in (None, saved["speedup_measured"]) and (saved["speedup"] is None) == bool(saved["flag"])
    assert saved["oracle_prepare_s"] > 0 and saved["oracle_stage_seconds_last_repeat"]["draft_s"] < saved["oracle_prepare_s"]
    prov = saved["provenance"]
    assert prov["torch_threads"] >= 1 and {"load_average_before", "busy", "load_warning"} <= set(prov)
    assert (tmp_path / "oracle_ceiling.csv").read_text().count("\n") == 1 + 2 * 5  # 2 repeats x 5 runners
    assert result["flag"] == saved["flag"]
    cmp = saved["compare"]
    assert cmp["ar_over_old"] == saved["spread"]["ar_over_old"]["median"] > 0
    assert cmp["ar_over_generate"] > 0 and cmp["verify_cost_old"]["loop_ratio"] > 0
    assert saved["verify_cost_long"]["context_tokens"] == bench.LONG_CONTEXT > saved["verify_cost"]["context_tokens"]
    assert saved["verify_cost_long"]["loop_ratio"] > 0 and saved["verify_cost_long"]["block_size"] == saved["block_size"]
    assert saved["runtime"]["runtime"] == "lean" and saved["mismatch_fraction"] == 0 and saved["divergences"] == []
    roof = saved["roofline"]
    if roof is not None:  # the fused kernels built here: the arithmetic floor of the verify beside the step
        from xpress.targets import load_target

        model = load_target(load_config("smoke")).model
        assert roof["macs_per_token"] == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert roof["fma_per_s"] > 1e8 and roof["fma_per_s_one_thread"] > 1e8 and roof["rows"] == saved["block_size"]
        per_value = {"bfloat16": 2, "float32": 4}[roof["product_dtype"]]
        assert roof["weight_bytes"] == per_value * roof["macs_per_token"] and roof["read_gb_per_s"] > 0.1
        assert roof["memory_floor_s"] == pytest.approx(roof["weight_bytes"] / roof["read_gb_per_s"] / 1e9)
        assert roof["compute_floor_s"] == pytest.approx(roof["rows"] * roof["macs_per_token"] / roof["product_macs_per_s"])
        assert roof["verify_floor_s"] == max(roof["memory_floor_s"], roof["compute_floor_s"])
        assert roof["floor_ratio"] == pytest.approx(roof["verify_floor_s"] / saved["verify_cost"]["step_1_s"])
        # the kernel on cached weights cannot outrun its instruction's peak on chains in registers (10% slack for timing)
        assert roof["peak_macs_per_s"] is None or roof["product_macs_per_s"] < 1.1 * roof["peak_macs_per_s"]
    assert saved["provenance"]["target_runtime"]["runtime"] == "lean"


def test_divergence_reports_the_position_and_the_top2_margin(smoke):
    from xpress.targets import encode_chat, lm_logits

    prompt = encode_chat(smoke.tokenizer, ["Say something."])
    ref = decoding.generate_ar(smoke, prompt, 6).token_ids
    other = ref[:3] + [(ref[3] + 1) % smoke.vocab_size] + ref[4:]
    d = bench.divergence(smoke, prompt, ref, other)
    assert (d["position"], d["reference_token"], d["other_token"]) == (3, ref[3], other[3])
    ids = torch.tensor([prompt + ref[:3]])
    logits, _ = lm_logits(smoke, ids, None, torch.arange(ids.shape[1])[None], None)
    top = logits[0, -1].topk(2).values
    assert d["top2_margin"] == pytest.approx(float(top[0] - top[1])) and d["top2_margin"] >= 0
    assert bench.divergence(smoke, prompt, ref, ref[:4]) is None


def test_a_speedup_above_its_ceiling_is_flagged_not_reported(tmp_path, monkeypatch):
    """With a (faked) verify that costs 100 one-token steps, tau / ratio is far below any measured speedup."""
    real = bench.verify_cost_ratio
    monkeypatch.setattr(bench, "verify_cost_ratio", lambda *a, **k: {**real(*a, **k), "loop_ratio": 100.0})
    result = small_ceiling(tmp_path)
    assert result["speedup"] is None and result["speedup_measured"] > 0
    assert "exceeds tau / verify-cost ratio" in result["flag"]
    assert json.loads((tmp_path / "oracle_ceiling.json").read_text())["flag"] == result["flag"]


def test_bench_cli_prints_the_flag(tmp_path, monkeypatch, capsys):
    from xpress.__main__ import main

    monkeypatch.setattr(bench, "speedup_flag", lambda *a, **k: "speedup 9x exceeds tau 8x")
    assert main(["bench", "oracle-ceiling", "--preset", "smoke", "--n-prompts", "1", "--max-new-tokens", "4",
                 "--repeats", "1", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["speedup"] is None and printed["flag"] == "speedup 9x exceeds tau 8x"
    assert "warning: speedup 9x exceeds tau 8x" in err


# ------------------------------------------------------------------------------ progress, quiet load
@pytest.mark.parametrize("method", ["ar", "oracle"])
def test_on_round_counts_every_token_and_step(method, cfg, target):
    prompts = [encode_chat(target.tokenizer, [q]) for q in ("Name a colour.", "What is 2 + 3?", "Hi")]
    drafter = None if method == "ar" else OracleDrafter(target, cfg)
    rounds = []
    gens = decoding.generate_batch(target, drafter, prompts, 11, on_round=lambda t, s: rounds.append((t, s)))
    assert sum(t for t, _ in rounds) == sum(len(g.token_ids) for g in gens)
    assert sum(s for _, s in rounds) == sum(g.n_steps for g in gens)
    assert len(rounds) == max(g.n_steps for g in gens)  # one call per target step


def test_decode_progress_postfix(capsys):
    bar = bench.DecodeProgress(total=2, interval=0.0)
    bar.round(9, 2)
    bar.round(3, 2)
    assert bar.postfix().startswith("12 tok, ") and bar.postfix().endswith("tau 3.00")
    bar.prompt_done()
    assert bar.bar.n == 1
    bar.close()
    assert "tau 3.00" in capsys.readouterr().err


def test_loading_is_quiet_and_settings_come_back(caplog):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from xpress.targets import quiet_loading

    level, gguf_bar = hf_logging.get_verbosity(), gguf_utils.tqdm
    log = hf_logging.get_logger("transformers.modeling_utils")
    with quiet_loading():
        log.warning("loading chatter")
        assert not hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is not gguf_bar
    assert hf_logging.get_verbosity() == level and hf_logging.is_progress_bar_enabled()
    assert gguf_utils.tqdm is gguf_bar
    with quiet_loading(verbose=True):
        log.warning("wanted")
    messages = [r.getMessage() for r in caplog.records]
    assert "wanted" in messages and "loading chatter" not in messages


def test_unreadable_cached_target_is_a_clear_error(tmp_path):
    from xpress.targets import TargetError, _load_cached_gguf

    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(TargetError, match=f"delete the folder {tmp_path}"):
        _load_cached_gguf(tmp_path, torch.float32)


def test_provenance_names_the_cpu_class():
    """One model name ("AMD EPYC") came with and without native bf16: provenance records the CPU's matrix
    features, and every "where" line of the README names the class and, for one target, its dtype."""
    from xpress import report
    from xpress.runtime import cpu_features

    prov = utils.provenance("smoke")
    assert prov["machine"]["cpu_features"] == cpu_features()
    feats = {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False, "onednn_bf16": True}
    bf16 = {"machine": {"cpu_model": "AMD EPYC", "torch_threads": 2, "cpu_features": feats},
            "target_runtime": {"dtype": "bfloat16"}, "git_revision": "abcdef0123", "date": "2026-12-02"}
    assert report._where(bf16).startswith("AMD EPYC (AVX512-BF16, bfloat16), 2 torch threads")
    assert report._where(bf16, dtype=False).startswith("AMD EPYC (AVX512-BF16), 2")
    avx2 = {**bf16, "machine": {**bf16["machine"], "cpu_features": {**feats, "avx512f": False, "avx512_bf16": False}},
            "target_runtime": {"dtype": "float32"}}
    assert utils.cpu_class(avx2) == "AVX2 only, float32"
    fused = {**avx2, "target_runtime": {"dtype": "float32", "kernels": "fused"}}
    assert utils.cpu_class(fused) == "AVX2 only, float32, fused C++ layers"
    amx = {**bf16, "machine": {**bf16["machine"], "cpu_features": {**feats, "amx_bf16": True}},
           "target_runtime": {"dtype": "bfloat16", "kernels": "fused", "attention": "bf16 products on AMX tiles"}}
    assert utils.cpu_class(amx) == "AMX-BF16, bfloat16, fused C++ layers, attention on AMX tiles"
    dot = {**bf16, "target_runtime": {"dtype": "bfloat16", "kernels": "fused", "attention": "bf16 products with AVX512-BF16"}}
    assert utils.cpu_class(dot) == "AVX512-BF16, bfloat16, fused C++ layers, bf16 attention"
    emu = {**bf16, "target_runtime": {"dtype": "bfloat16", "kernels": "fused",
                                      "attention": "bf16 products on AMX tiles emulated in software"}}
    assert utils.cpu_class(emu) == "AVX512-BF16, bfloat16, fused C++ layers, attention on AMX tiles emulated in software"
    assert utils.cpu_class({"machine": {"cpu_model": "x"}}) == ""  # an older block: no claim
    old = {**bf16, "machine": {"cpu_model": "AMD EPYC", "torch_threads": 2}, "target_runtime": {}}
    assert report._where(old).startswith("AMD EPYC, 2 torch threads")


def test_the_float32_floor_is_not_claimed_for_a_bf16_target():
    """The README's roofline line is a float32 bound; for a target that computes in another dtype (bf16 on
    AMX tiles, whose verify can cost less than that floor) it says that the bound does not apply."""
    from xpress import report

    roof = {"threads": 2, "fma_per_s": 1.2e11, "fma_per_s_one_thread": 6e10, "rows": 16, "macs_per_token": 134e6,
            "verify_floor_s": 0.017, "floor_ratio": 1.5, "step_1_s": 0.011, "step_weight_gb_per_s": 48.0}
    ceiling = {"block_size": 16, "verify_cost": {"loop_ratio": 1.36}, "roofline": roof}
    f32 = "\n".join(report._break_even_section(None, None, {**ceiling, "runtime": {"dtype": "float32"}}))
    bf16 = "\n".join(report._break_even_section(None, None, {**ceiling, "runtime": {"dtype": "bfloat16"}}))
    assert "for a float32 kernel of 8-lane FMAs." in f32 and "does not bind" not in f32
    assert "computes in bfloat16, so that floor does not bind it" in bf16


def test_the_floor_line_states_the_memory_and_the_arithmetic_floor():
    """An oracle_ceiling.json with the memory floor: the README line gives both floors and the larger one's ratio."""
    from xpress import report

    roof = {"threads": 2, "rows": 16, "macs_per_token": 134e6, "product_dtype": "bfloat16", "weight_bytes": 268e6,
            "read_gb_per_s": 50.0, "memory_floor_s": 268e6 / 50e9, "product_macs_per_s": 3.5e11,
            "peak_macs_per_s": 5.4e11, "compute_floor_s": 16 * 134e6 / 3.5e11, "step_1_s": 0.006}
    roof["verify_floor_s"] = max(roof["memory_floor_s"], roof["compute_floor_s"])
    roof["floor_ratio"] = roof["verify_floor_s"] / roof["step_1_s"]
    roof["step_over_memory_floor"] = roof["step_1_s"] / roof["memory_floor_s"]
    text = "\n".join(report._break_even_section(None, None, {"block_size": 16, "verify_cost": {"loop_ratio": 1.6},
                                                                "roofline": roof}))
    assert "268 MB of bfloat16 weights" in text and "50.0 GB/s" in text and "under 5.36 ms" in text
    assert "350 G/s at 16 rows" in text and "peak 540 G/s" in text and "at least 6.13 ms" in text
    assert "Floor of the verify: 1.02 one-token steps (6.00 ms, itself 1.12x its memory floor)" in text


def test_provenance_names_what_made_the_tree_dirty(tmp_path, monkeypatch):
    """git_dirty counts changed and untracked files outside results/ (a stray file could be code), and
    git_dirty_files says which (git status --porcelain lines, at most DIRTY_LISTED), so that a reader can tell a
    changed module from a log file; a clean tree has no list."""
    import subprocess

    from xpress import paths

    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    run("add", "code.py")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(paths, "REPO_ROOT", repo)
    monkeypatch.delenv("XPRESS_GIT_REVISION", raising=False)
    clean = utils.provenance("smoke")
    assert clean["git_dirty"] is False and "git_dirty_files" not in clean
    (repo / "results" / "r.json").write_text("{}")  # results never make a tree dirty
    assert utils.provenance("smoke")["git_dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    (repo / "run.log").write_text("log\n")
    dirty = utils.provenance("smoke")
    assert dirty["git_dirty"] is True and dirty["git_dirty_files"] == [" M code.py", "?? run.log"]
    for i in range(utils.DIRTY_LISTED + 3):
        (repo / f"f{i:02d}.txt").write_text("")
    many = utils.provenance("smoke")["git_dirty_files"]
    assert len(many) == utils.DIRTY_LISTED + 1 and many[-1] == "... and 5 more"  # code.py, run.log and 23 files


def test_provenance_takes_a_sent_revision(monkeypatch):
    """A GPU machine gets a copy of the tree whose .git may be stale: the sender names the revision."""
    assert "git_from" not in utils.provenance("smoke") and utils.provenance("smoke")["git_revision"] != "f" * 40
    monkeypatch.setenv("XPRESS_GIT_REVISION", "f" * 40)
    p = utils.provenance("smoke")
    assert p["git_revision"] == "f" * 40 and p["git_dirty"] is False and "XPRESS_GIT_REVISION" in p["git_from"]
    monkeypatch.setenv("XPRESS_GIT_DIRTY", "1")
    assert utils.provenance("smoke")["git_dirty"] is True
