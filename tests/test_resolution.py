"""The tau-resolution study: its table by hand on synthetic rows, and a small run on the smoke target."""
import json

import pytest

from xpress import paths
from xpress.studies.resolution import decode_tau, method_taus, resolution_table, run_resolution


def row(method, bench, id_, tokens, steps, temperature=0.0):
    return {"temperature": temperature, "seed": 0, "repeat": 0, "bench": bench, "id": id_, "method": method,
            "tokens": tokens, "steps": steps}


def test_resolution_table_by_hand():
    # xpress commits 10% more tokens per step than dflash on every prompt: the interval is a point
    rows = [row(m, b, f"{b}{i}", 11 * s if m == "xpress" else 10 * s, 10 * s)
            for m in ("dflash", "xpress") for b in ("a", "b") for i, s in enumerate((1, 2, 3))]
    t = {(r["bench"], r["baseline"]): r for r in resolution_table(rows, n_boot=50)}
    assert set(t) == {("a", "dflash"), ("b", "dflash"), ("avg", "dflash")}  # no markov rows: skipped
    for r in t.values():
        assert r["tau_ratio"] == pytest.approx(1.1) and r["half_width"] == pytest.approx(0, abs=1e-12)
        assert r["resolved"] and r["verdict"] == "xpress better"
    assert t[("avg", "dflash")]["prompts"] == 6
    # a prompt-dependent ratio around 1: wide interval, not resolved, not told apart
    rows = [row(m, "a", f"a{i}", (10 + (5 if i % 2 else -5)) * 10 if m == "xpress" else 100, 50)
            for m in ("dflash", "xpress") for i in range(6)]
    r = next(r for r in resolution_table(rows, n_boot=400) if r["bench"] == "a")
    assert r["tau_ratio"] == pytest.approx(1.0) and r["lo"] < 1 < r["hi"]
    assert r["half_width"] == pytest.approx(max(r["hi"] / r["tau_ratio"] - 1, 1 - r["lo"] / r["tau_ratio"]))
    assert not r["resolved"] and r["verdict"] == "not told apart"
    taus = {(r["method"], r["bench"]): r for r in method_taus(rows)}
    assert taus[("dflash", "avg")]["tau"] == pytest.approx(2.0) and taus[("xpress", "a")]["prompts"] == 6


def test_resolution_on_the_smoke_target(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    result = run_resolution(cfg, target, methods=["dflash", "xpress"], per_benchmark=2, max_new_tokens=6,
                            batch_size=3, untrained_ok=True, progress=False)
    n = 2 * len(cfg.data.benchmarks)
    assert len(result["rows"]) == 2 * 2 * n and result["methods"] == ["dflash", "xpress"]  # 2 temperatures, no AR
    assert {(r["temperature"], r["bench"]) for r in result["table"]} == {
        (t, b) for t in (0.0, 1.0) for b in list(cfg.data.benchmarks) + ["avg"]}
    # tau does not depend on the batch: at T=0 every row commits what it commits alone
    from xpress.studies.compare import benchmark_prompts, make_drafters
    drafters = make_drafters(cfg, target, ["xpress"], untrained_ok=True)
    alone = decode_tau(target, {"xpress": drafters["xpress"]}, benchmark_prompts(cfg, target, 2), 6, 1, 0.0, 0, False)
    batched = [r for r in result["rows"] if r["temperature"] == 0 and r["method"] == "xpress"]
    assert [(r["id"], r["tokens"], r["steps"]) for r in alone] == [(r["id"], r["tokens"], r["steps"]) for r in batched]
    saved = json.loads((tmp_path / cfg.preset / "resolution.json").read_text())
    assert saved["provenance"]["preset"] == cfg.preset and saved["prompts_per_benchmark"] == 2 and saved["seconds"] > 0
    assert (tmp_path / cfg.preset / "resolution.csv").read_text().startswith("temperature,bench,baseline")
