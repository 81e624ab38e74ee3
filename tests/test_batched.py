"""The batched throughput table: its arithmetic by hand and one small run on the smoke target."""
import json

import pytest

from xpress import paths
from xpress.decoding import generate_ar
from xpress.studies.batched import round_robin, row_divergences, run_batched, throughput_table
from xpress.targets import per_row_cache


def test_round_robin_mixes_benchmarks():
    ps = [{"bench": b, "id": f"{b}{i}"} for b in "ab" for i in range(3)] + [{"bench": "c", "id": "c0"}]
    assert [p["id"] for p in round_robin(ps)] == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]


def test_throughput_table_by_hand():
    runs = [{"batch_size": 1, "method": "ar", "sequences": 1, "tokens": 10, "steps": 10, "seconds": 1.0, "same_as_ar_b1": 1},
            {"batch_size": 1, "method": "ar", "sequences": 1, "tokens": 10, "steps": 10, "seconds": 1.0, "same_as_ar_b1": 1},
            {"batch_size": 1, "method": "x", "sequences": 1, "tokens": 10, "steps": 4, "seconds": 0.5, "same_as_ar_b1": 1},
            {"batch_size": 1, "method": "x", "sequences": 1, "tokens": 10, "steps": 6, "seconds": 1.5, "same_as_ar_b1": 1},
            {"batch_size": 2, "method": "ar", "sequences": 2, "tokens": 20, "steps": 20, "seconds": 1.0, "same_as_ar_b1": 2},
            {"batch_size": 2, "method": "x", "sequences": 2, "tokens": 20, "steps": 10, "seconds": 2.0, "same_as_ar_b1": 1}]
    t = {(r["batch_size"], r["method"]): r for r in throughput_table(runs)}
    assert t[(1, "ar")]["tokens_per_s"] == pytest.approx(10.0) and t[(2, "ar")]["tokens_per_s"] == pytest.approx(20.0)
    assert t[(1, "x")]["tau"] == pytest.approx(2.0) and t[(1, "x")]["speedup"] == pytest.approx(1.0)
    assert t[(2, "x")]["speedup"] == pytest.approx(0.5) and t[(2, "x")]["same_as_ar_b1"] == pytest.approx(0.5)


def test_batched_on_the_smoke_target(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    result = run_batched(cfg, target, methods=["xpress"], batch_sizes=[2, 1], n_prompts=3, max_new_tokens=6,
                         untrained_ok=True, progress=False)
    t = {(r["batch_size"], r["method"]): r for r in result["table"]}
    assert set(t) == {(1, "ar"), (1, "xpress"), (2, "ar"), (2, "xpress")} and result["batch_sizes"] == [1, 2]
    assert all(r["sequences"] == 3 for r in result["table"])          # the same prompts at every batch size
    assert t[(1, "xpress")]["same_as_ar_b1"] == 1.0 and t[(1, "ar")]["speedup"] == pytest.approx(1.0)
    if per_row_cache(target):  # the fused kernels: every batched row is its batch-1 decode
        assert all(r["same_as_ar_b1"] == 1.0 for r in result["table"])
    assert all(len(r["divergences"]) == r["sequences"] - r["same_as_ar_b1"] for r in result["runs"])
    assert len({p.split("-")[0] for p in result["prompt_ids"]}) == 3    # round-robin over the benchmarks
    saved = json.loads((tmp_path / cfg.preset / "batched.json").read_text())
    assert saved["provenance"]["preset"] == cfg.preset and "load_average_after" in saved["provenance"]
    assert (tmp_path / cfg.preset / "batched.csv").is_file()


def test_row_divergences_name_the_row_position_and_margin(target):
    prompts = [[5, 6, 7], [9, 10]]
    ref = [generate_ar(target, p, 5).token_ids for p in prompts]
    other = [list(ref[0]), ref[1][:2] + [(ref[1][2] + 1) % target.vocab_size] + ref[1][3:]]
    (d,) = row_divergences(target, prompts, other, ref, first_row=4)
    assert d["row"] == 5 and d["position"] == 2 and d["reference_token"] == ref[1][2] and d["top2_margin"] >= 0
    assert row_divergences(target, prompts, ref, ref) == []
