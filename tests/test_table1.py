"""Table 1: its statistics by hand on synthetic rows, and one small measured run on the smoke target."""
import json
import math

import pytest

from xpress import paths
from xpress.utils import usable_cpus
from xpress.studies.compare import LoadRecord, decode_interleaved
from xpress.studies.table1 import (SPEEDUP_ABOVE_TAU, bootstrap_tau_ratio, gains, prompts_needed, run_table1,
                                   stage_costs, summarize, table1_from_rows)


def row(method, bench, tokens, steps, seconds, repeat=0, id_=None, temperature=0.0, seed=0, lossless=True, **stages):
    return {"temperature": temperature, "seed": seed, "repeat": repeat, "bench": bench, "id": id_ or f"{bench}0",
            "method": method, "lossless": lossless if temperature == 0 else None, "tokens": tokens, "steps": steps,
            "seconds": seconds, "prefill_s": 0.0, "timed_steps": steps,
            **{f"{k}_s": stages.get(k, 0.0) for k in ("forward", "draft", "refine", "verify", "bookkeeping")}}


def two_benchmarks():
    """a: AR 5 tok/s; xpress tau 2.5 at 10 then 20 tok/s (speedup 2 then 4); dflash tau 2 at 10 tok/s.
    b: AR 10 tok/s; xpress tau 4 at 5 tok/s (0.5); dflash tau 2 at 10 tok/s (1.0)."""
    rows = []
    for r, xs in ((0, 1.0), (1, 0.5)):
        rows += [row("ar", "a", 10, 10, 2.0, r), row("xpress", "a", 10, 4, xs, r), row("dflash", "a", 10, 5, 1.0, r),
                 row("ar", "b", 20, 20, 2.0, r), row("xpress", "b", 20, 5, 4.0, r), row("dflash", "b", 20, 10, 2.0, r)]
    return rows


def test_summary_by_hand():
    s = {(r["method"], r["bench"]): r for r in summarize(two_benchmarks())}
    x = s[("xpress", "a")]
    assert x["tau"] == pytest.approx(2.5) and x["speedup"] == pytest.approx(3.0)     # median of 2 and 4
    assert (x["speedup_lo"], x["speedup_hi"]) == pytest.approx((2.0, 4.0)) and x["repeats"] == 2
    assert x["flag"] == SPEEDUP_ABOVE_TAU                                            # 3.0 > 2.5: impossible
    assert s[("xpress", "b")]["speedup"] == pytest.approx(0.5) and s[("xpress", "b")]["flag"] == ""
    avg = s[("xpress", "avg")]
    assert avg["tau"] == pytest.approx(3.25)                     # the mean over benchmarks, as the paper averages
    assert avg["speedup"] == pytest.approx(1.75)                 # per pass (1.25, 2.25), then the median
    assert s[("ar", "avg")]["speedup"] == pytest.approx(1.0) and s[("ar", "avg")]["flag"] == ""
    assert all(r["lossless"] for r in s.values())
    g = {(r["baseline"], r["bench"]): r for r in gains(list(s.values()))}
    assert g[("dflash", "avg")]["tau_ratio"] == pytest.approx(3.25 / 2.0)
    assert g[("dflash", "b")]["speedup_ratio"] == pytest.approx(0.5)
    assert ("markov", "avg") not in g                             # absent baselines are skipped


def test_sampled_rows_mean_and_sd_over_seeds_and_no_lossless_claim():
    rows = []
    for seed, steps in ((0, 5), (1, 4)):  # tau 2.0 and 2.5
        rows += [row("ar", "a", 10, 10, 2.0, temperature=1.0, seed=seed),
                 row("xpress", "a", 10, steps, 4.0, temperature=1.0, seed=seed)]
    s = {(r["method"], r["bench"]): r for r in summarize(rows)}
    assert s[("xpress", "a")]["tau"] == pytest.approx(2.25)
    assert s[("xpress", "a")]["tau_sd"] == pytest.approx(math.sqrt(0.125))
    assert s[("xpress", "a")]["seeds"] == 2 and s[("xpress", "a")]["lossless"] is None


def test_a_mismatch_at_t0_is_recorded():
    rows = two_benchmarks()
    rows[1]["lossless"] = False
    t = table1_from_rows(rows, n_boot=50)
    s = {(r["method"], r["bench"]): r for r in t["summary"]}
    assert not t["lossless_t0"] and not s[("xpress", "a")]["lossless"] and not s[("xpress", "avg")]["lossless"]
    assert s[("dflash", "avg")]["lossless"]
    assert t["flags"] and t["flags"][0]["method"] == "xpress"


def test_speedup_above_the_verify_cost_ceiling_is_flagged():
    # tau 4, a verify costs 2 AR steps: at most 2x with free drafting; 3x is flagged, 1.5x is not
    def rows(x_seconds):
        return [row("ar", "a", 12, 12, 3.0, forward=1.2), row("xpress", "a", 12, 3, x_seconds, verify=0.6)]
    def flag(x_seconds):
        return [r for r in summarize(rows(x_seconds)) if r["method"] == "xpress" and r["bench"] == "a"][0]["flag"]
    assert flag(2.0) == ""                                                 # 1.5x <= 2x
    assert "exceeds tau / verify-cost ratio" in flag(1.0)                  # 3x > 2x, below tau 4
    assert flag(0.5) == SPEEDUP_ABOVE_TAU                                  # 6x > tau 4


def test_stage_costs_by_hand():
    rows = [row("ar", "a", 11, 11, 2.0, forward=0.9, bookkeeping=0.1),  # 10 timed steps: 0.1 s a step
            row("xpress", "a", 12, 4, 1.0, draft=0.04, refine=0.02, verify=0.6, bookkeeping=0.02)]
    rows[0]["timed_steps"] = 10
    (c,) = stage_costs(rows)
    assert c["ar_step_s"] == pytest.approx(0.1) and c["verify_ratio"] == pytest.approx(1.5)
    assert c["break_even_tau"] == pytest.approx(1.7) and c["tau"] == pytest.approx(3.0)


def prompts(method_taus):
    """rows for one benchmark: per method a list of per-prompt (tokens, steps)."""
    out = [row("ar", "a", 8, 8, 1.0, id_=f"p{i}") for i in range(len(next(iter(method_taus.values()))))]
    for m, pairs in method_taus.items():
        out += [row(m, "a", t, s, 1.0, id_=f"p{i}") for i, (t, s) in enumerate(pairs)]
    return out


def test_bootstrap_of_the_tau_ratio():
    noisy = prompts({"dflash": [(8, 8), (8, 4), (9, 3), (8, 8)], "xpress": [(8, 2), (8, 4), (9, 9), (8, 4)]})
    r = bootstrap_tau_ratio(noisy, "xpress", "dflash", n_boot=500)["0.0"]["avg"]
    assert r["ratio"] == pytest.approx((33 / 19) / (33 / 23)) and r["prompts"] == 4
    assert r["lo"] < r["ratio"] < r["hi"]


def test_bootstrap_collapses_when_every_resample_has_the_same_ratio():
    # same tokens, half the steps on every prompt: tau(xpress) / tau(dflash) = 2 for any resample
    same = prompts({"dflash": [(8, 8), (8, 4), (12, 6)], "xpress": [(8, 4), (8, 2), (12, 3)]})
    r = bootstrap_tau_ratio(same, "xpress", "dflash", n_boot=100)["0.0"]["avg"]
    assert (r["lo"], r["ratio"], r["hi"]) == pytest.approx((2.0, 2.0, 2.0))


def test_prompts_needed_from_the_per_prompt_spread():
    rows = prompts({"dflash": [(2, 2), (6, 2)], "xpress": [(4, 2), (6, 2)]})  # dflash taus 1, 3: mean 2, sd sqrt 2
    got = {(r["kind"], r["method"]): r for r in prompts_needed(rows)}
    d = got[("unpaired", "dflash")]
    assert d["mean"] == pytest.approx(2.0) and d["sd"] == pytest.approx(math.sqrt(2))
    assert d["needed"] == math.ceil((2 * 1.96 * math.sqrt(2) / (0.05 * 2.0)) ** 2)
    p = got[("paired", "xpress/dflash")]   # log ratios log 2 and log 1
    assert p["sd"] == pytest.approx(math.log(2) / math.sqrt(2))
    assert p["needed"] == math.ceil((1.96 * p["sd"] / math.log(1.05)) ** 2)
    one = prompts({"dflash": [(2, 2)], "xpress": [(4, 2)]})
    assert all(r["needed"] is None for r in prompts_needed(one))      # one prompt: no spread to speak of


def test_load_record_warns_only_when_others_load_the_machine(monkeypatch):
    import xpress.utils

    monkeypatch.setattr(xpress.utils, "other_cpu_use", lambda window=0.5: None)  # no /proc/stat: load average
    quiet = LoadRecord(before=0.2, own_load=2.0)
    assert quiet.stop(after=2.3) == [] and quiet.provenance()["busy"] is False
    busy = LoadRecord(before=0.2, own_load=2.0)
    (w,) = busy.stop(after=2.0 + 0.6 * usable_cpus())
    assert "busy" in w and busy.provenance()["busy"] is True
    # measured use by other processes decides: a high load average of our own is not "busy", another job is
    monkeypatch.setattr(xpress.utils, "other_cpu_use", lambda window=0.5: 0.0)
    ours = LoadRecord.start()
    assert ours.stop(after=2.0 + 0.6 * usable_cpus()) == [] and ours.provenance()["other_cpus"] == [0.0, 0.0]
    monkeypatch.setattr(xpress.utils, "other_cpu_use", lambda window=0.5: 0.6 * usable_cpus())
    other = LoadRecord.start()
    (w,) = other.stop(after=0.1)
    assert "other processes kept" in w and other.provenance()["busy"] is True


def test_load_record_keeps_the_memory_read_rate_at_each_end(monkeypatch):
    """The memory phase beside every study's timings: the read rate before and after (None without kernels)."""
    import xpress.kernels

    rates = iter([80.0, 50.0])
    monkeypatch.setattr(xpress.kernels, "memory_read_gb_per_s", lambda *a, **k: next(rates))
    record = LoadRecord.start()
    record.stop()
    assert record.provenance()["memory_read_gb_per_s"] == [80.0, 50.0]
    mod = xpress.kernels.fused_cpu()
    monkeypatch.undo()
    got = xpress.kernels.memory_read_gb_per_s(1 << 20, 1)
    assert (got is None) == (mod is None) and (got is None or got > 0)


def test_decode_interleaved_needs_ar_first(target):
    with pytest.raises(ValueError, match="must start with 'ar'"):
        decode_interleaved(target, {"x": None}, [], 4)


def test_table1_on_the_smoke_target(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    result = run_table1(cfg, target, methods=["random", "dflash", "xpress"], per_benchmark=1, max_new_tokens=8,
                        repeats=2, seeds=[3], untrained_ok=True, progress=False)
    n_bench = len(cfg.data.benchmarks)
    assert len(result["rows"]) == n_bench * (2 + 1) * 4     # (2 repeats at T=0 + 1 seed) x (AR + 3 methods)
    assert result["lossless_t0"] and all(r["lossless"] for r in result["rows"] if r["temperature"] == 0)
    assert all(r["lossless"] is None for r in result["rows"] if r["temperature"] > 0)
    # the repeats of a prompt decode the same tokens; only the clock differs
    t0 = [r for r in result["rows"] if r["temperature"] == 0 and r["method"] == "xpress"]
    assert [r["tokens"] for r in t0[0::2]] == [r["tokens"] for r in t0[1::2]]
    summary = {(r["temperature"], r["method"], r["bench"]) for r in result["summary"]}
    assert (1.0, "xpress", "avg") in summary and (0.0, "ar", "avg") in summary
    assert {g["baseline"] for g in result["gains"]} == {"dflash"} and "dflash" in result["bootstrap_tau_ratio"]
    saved = json.loads((tmp_path / cfg.preset / "table1.json").read_text())
    prov = saved["provenance"]
    assert prov["preset"] == cfg.preset and "load_average_before" in prov and "torch_threads" in prov["machine"]
    assert saved["weights"]["random"] == "reference" and saved["temperatures"] == [0.0, 1.0]
    assert (tmp_path / cfg.preset / "table1.csv").read_text().startswith("temperature,method,bench,tau")
