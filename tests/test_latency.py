"""The latency study (Table 3 / Figure 4), the GPU latency script on the CPU, and the tau-vs-K replay."""
import json
import subprocess
import sys

import pytest
import torch

from xpress import paths
from xpress.jacobi import corrected_logits, prev_tokens
from xpress.studies.latency import TINY, LatencyConfig, latency_rows, run_latency, time_call
from xpress.studies.refine_block import (build_block, count_work, dense_rollout, pass_tokens, readout_alone,
                                         refine_xpress)
from xpress.studies.table3 import beside_paper_table3, projected_speedup
from xpress.studies.tau_k import acceptance, all_blocks, follow_rounds, prepare_replay, replay_method


def test_time_call_reports_median_and_spread():
    calls = []
    t = time_call(lambda: calls.append(1), repeats=5, warmup=2, device="cpu")
    assert len(calls) == 7 and t["repeats"] == 5
    assert t["q1_ms"] <= t["median_ms"] <= t["q3_ms"] and t["iqr_ms"] == pytest.approx(t["q3_ms"] - t["q1_ms"])


@pytest.mark.parametrize("bad", [dict(repeats=1), dict(ks=(0, 1)), dict(dtype="int8")])
def test_latency_config_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        LatencyConfig(**bad)


def test_worst_case_block_runs_k_passes_and_theorem1_positions():
    lc = LatencyConfig(repeats=2)
    block = build_block(TINY, lc)
    p = TINY.positions
    seed = torch.randint(0, block.vocab.size, (1, p), generator=torch.Generator().manual_seed(1))
    for k in (1, 3, p):
        w = count_work(block, k, seed)
        assert w["passes"] == k or (k == p and w["passes"] >= p - 1)  # every pass changes the block
        assert w["positions"] <= sum(p - t for t in range(k))  # pass t+1 recomputes at most P - t positions
        assert w["positions"] < k * p or k == 1
        dense = count_work(block, k, seed, incremental=False)
        assert dense["positions"] == dense["passes"] * p
    with torch.no_grad():
        assert torch.equal(dense_rollout(block, 3, seed), refine_xpress(block, 3, seed).tokens)
        one, full = readout_alone(block, seed)  # each head's own T=0 readout: a pass's tokens, a step's token
        assert torch.equal(full(), pass_tokens(block, block.refiner.fold(block.h), seed)[0])
        markov = corrected_logits(block.base, block.markov.fold())
        prev = prev_tokens(block.anchor, seed, block.vocab)
        assert torch.equal(one(), markov(prev, torch.zeros(1, dtype=torch.int64), 0).argmax(-1))


def test_run_latency_writes_results_with_provenance(tmp_path):
    lc = LatencyConfig(ks=(1, 2, 4), repeats=3, warmup=1, target=True, frames=16)
    result = run_latency("smoke", ["tiny"], lc, out_dir=tmp_path, progress=False)
    s = result["shape_sets"]["tiny"]
    assert {"markov", "drafter forward", "base readout", "xpress K=4", "xpress adaptive",
            "target step (1 token)", f"target verify ({TINY.block_size} tokens)", "target step (1 token, frames of 16)",
            f"target verify ({TINY.block_size} tokens, frames of 16)"} <= set(s["timings"])
    assert s["ratios"]["markov"] == 1.0 and s["checks"]["incremental equals dense (K=4 tokens)"]
    assert 0 < s["composition"]["xpress K=4"]["draft_share"] < 1
    p = TINY.positions
    one, full = s["timings"]["markov readout (1 row)"]["median_ms"], s["timings"][f"xpress readout ({p} rows)"]["median_ms"]
    assert one > 0 and full > 0
    for key in ("markov_over_xpress_k4", "readout_only_k4"):  # headline ratios: medians of paired rounds
        paired = s["paired"][key]
        assert len(paired["rounds"]) == lc.rounds and s[key] == paired["median"]
        assert paired["min"] <= paired["median"] <= paired["max"]
    assert s["markov_float32_over_xpress_k4"] is None  # the tiny vocabulary reads out in float32
    saved = json.loads((tmp_path / "latency.json").read_text())
    assert "load_average_after" in saved["provenance"] and saved["provenance"]["torch_threads"] >= 1
    assert (tmp_path / "latency.csv").read_text().splitlines()[0].startswith("shapes,component,K,median_ms")
    assert len(latency_rows(saved)) == len(s["timings"])
    with pytest.raises(ValueError, match="shape set"):
        run_latency("smoke", ["nosuch"], lc, save=False)


def test_gpu_script_runs_on_cpu_with_only_torch_and_transformers(tmp_path):
    """The script's code path at tiny shapes, and it imports nothing beyond torch/transformers' world."""
    code = ("import sys; sys.path.insert(0, 'scripts'); import gpu_latency; "
            f"rc = gpu_latency.main(['--device', 'cpu', '--shapes', 'tiny', '--repeats', '2', '--max-k', '2', "
            f"'--out-dir', {str(tmp_path)!r}]); "
            "heavy = {'pandas', 'seaborn', 'matplotlib', 'datasets', 'papermill'} & set(sys.modules); "
            "assert not heavy, heavy; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = json.loads((tmp_path / "latency.json").read_text())
    assert saved["provenance"]["preset"] == "h200" and "xpress K=2" in saved["shape_sets"]["tiny"]["timings"]
    projected = projected_speedup(saved["shape_sets"]["tiny"], {"dflash": 2.0, "xpress": 3.0}, k=2)  # the notebook's use
    assert [r["method"] for r in projected] == ["dflash", "xpress K=2"] and all(r["projected_speedup"] > 0 for r in projected)
    assert [r["component"] for r in beside_paper_table3(saved)] == ["xpress K=1", "xpress K=2", "markov"]


def test_beside_paper_table3_compares_graph_with_graph_and_eager_with_eager():
    t = {"markov": {"median_ms": 10.0}, "xpress K=1": {"median_ms": 2.0}, "xpress K=4": {"median_ms": 5.0},
         "markov graph": {"median_ms": 4.0}, "xpress graph K=4": {"median_ms": 1.0}}
    rows = {r["component"]: r for r in beside_paper_table3({"shape_sets": {"paper": {"timings": t}}})}
    assert list(rows) == ["xpress K=1", "xpress K=4", "markov"]  # the paper's components that were timed
    assert (rows["xpress K=1"]["measured_as"], rows["xpress K=1"]["ratio_to_markov"]) == ("xpress K=1", 0.2)  # no graph
    assert (rows["xpress K=4"]["measured_as"], rows["xpress K=4"]["ratio_to_markov"]) == ("xpress graph K=4", 0.25)
    assert rows["markov"]["measured_as"] == "markov graph" and rows["markov"]["ratio_to_markov"] == 1.0
    assert rows["xpress K=4"]["paper_us"] == 379 and rows["xpress K=4"]["paper_ratio_to_markov"] == 379 / 601


def test_projected_speedup_is_eq1_by_hand():
    t = {"drafter forward": {"median_ms": 1.0}, "base readout": {"median_ms": 0.5}, "markov": {"median_ms": 1.5},
         "xpress K=4": {"median_ms": 0.5}, "target step (1 token)": {"median_ms": 10.0},
         "target verify (16 tokens)": {"median_ms": 12.0}}
    s = {"timings": t, "shapes": {"block_size": 16}}
    rows = {r["method"]: r for r in projected_speedup(s, {"dflash": 3.0, "markov": 4.5, "xpress": 5.4})}
    assert rows["dflash"]["projected_speedup"] == pytest.approx(3.0 * 10 / (1.5 + 12))  # no refinement
    assert rows["markov"]["projected_speedup"] == pytest.approx(4.5 * 10 / (3.0 + 12))
    assert rows["xpress K=4"]["projected_speedup"] == pytest.approx(5.4 * 10 / (2.0 + 12))
    with pytest.raises(ValueError, match="K=3 was not timed"):
        projected_speedup(s, {"xpress": 5.0}, k=3)
    with pytest.raises(ValueError, match="eagle"):
        projected_speedup(s, {"eagle": 5.0})
    del t["target verify (16 tokens)"]
    with pytest.raises(ValueError, match="no target timings"):
        projected_speedup(s, {"dflash": 3.0})


def test_cli_latency_rejects_unknown_shapes():
    from xpress.__main__ import main

    assert main(["latency", "--shapes", "nosuch", "--repeats", "2"]) == 2


# ------------------------------------------------------------------------------------ tau vs K
def test_acceptance_and_rounds_by_hand():
    class R:
        ids = [5, 6, 1, 2, 3, 4]
    starts = torch.tensor([1, 2])
    drafts = torch.tensor([[1, 2, 9], [2, 3, 4]])  # start 1: g = 1 2 3 -> 2 accepted; start 2: all 3
    assert acceptance(drafts, R, starts).tolist() == [2, 3]
    assert follow_rounds([2, 0, 0, 1, 0, 0], 6) == [0, 3, 5]  # commits 3, 2, then 1 (cut at the end)
    assert follow_rounds([0] * 4, 4) == [0, 1, 2, 3]


def test_replayed_tau_equals_decoding(cfg, target):
    """The offline replay gives the tau (and the passes per round) that the decoding engine measures."""
    from xpress.decoding import generate_batch
    from xpress.methods import make_drafter
    from xpress.studies.compare import benchmark_prompts

    prompts = benchmark_prompts(cfg, target, 1)
    for method, ks in (("dflash", [None]), ("markov", [None]), ("xpress", [1, 2, cfg.drafter.block_size - 1])):
        drafter = make_drafter(method, cfg, target, seed=cfg.seed, untrained_ok=True)
        for pr in prompts:
            replay = prepare_replay(target, pr["ids"], 24)
            blocks = all_blocks(drafter, replay)
            for k in ks:
                sim = replay_method(drafter, replay, blocks, k)
                drafter.max_iters = k or cfg.head.max_iters
                gen = generate_batch(target, drafter, [pr["ids"]], 24)[0]
                drafter.max_iters = cfg.head.max_iters
                assert gen.token_ids == replay.ids[replay.prompt_len:]
                assert (sim["steps"], sim["tau"]) == (gen.n_steps, gen.tau), (method, k, pr["id"])
                if method == "xpress":
                    assert sim["passes"] == gen.stats["iters"]


def test_paired_ratio_times_both_sides_each_round_in_alternating_order(monkeypatch):
    """No clock: ``time_call`` is replaced by a recorder returning set medians, so the arithmetic and the
    order are checked exactly."""
    from xpress import timing

    order, medians = [], {"num": iter([4.0, 6.0, 9.0]), "den": iter([2.0, 2.0, 3.0])}

    def fake_time_call(fn, repeats, warmup, device):
        name = fn()
        order.append(name)
        return {"median_ms": next(medians[name])}

    monkeypatch.setattr(timing, "time_call", fake_time_call)
    p = timing.paired_ratio(lambda: "num", lambda: "den", rounds=3, repeats=2, warmup=0, device="cpu", scale=0.5)
    assert order == ["num", "den", "den", "num", "num", "den"]
    assert p["rounds"] == [1.0, 1.5, 1.5] and p["median"] == 1.5 and (p["min"], p["max"]) == (1.0, 1.5)
    with pytest.raises(ValueError, match="rounds"):
        LatencyConfig(rounds=0)


def test_time_calls_sweeps_every_component_once_per_repeat_in_rotated_order(monkeypatch):
    """No clock: ``now`` is replaced by a counter, so each call's recorded time is exact and each
    component's samples show which sweeps it ran in."""
    from xpress import timing

    clock, order = iter(range(1000)), []
    monkeypatch.setattr(timing, "now", lambda device: next(clock) / 1e3)  # each reading 1 ms later
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    t = timing.time_calls(fns, repeats=4, warmup=1, device="cpu")
    sweeps = ["abc", "bca", "cab", "abc"]  # one sweep per repeat, rotated; each timed call after an untimed one
    assert order == list("abc") + [name for sweep in sweeps for name in sweep for _ in range(2)]
    assert list(t) == list("abc") and all(v["repeats"] == 4 for v in t.values())
    assert all(v["median_ms"] == pytest.approx(1.0) and v["iqr_ms"] == pytest.approx(0.0) for v in t.values())


def test_tau_summary_averages_in_first_seen_order():
    """The ``avg`` rows follow the order the methods first appear (not a set's, which changes between
    processes), so ``tau_vs_k.json`` is the same file on every run."""
    from xpress.studies.tau_k import summarize

    rows = [{"method": m, "variant": v, "K": k, "bench": b, "tokens": t, "steps": 2}
            for m, v, k in (("xpress", "K=2", 2), ("dflash", "", None), ("xpress", "K=1", 1), ("markov", "", None))
            for b, t in (("a", 4), ("b", 6))]
    avg = [r for r in summarize(rows) if r["bench"] == "avg"]
    assert [(r["method"], r["variant"]) for r in avg] == [("xpress", "K=2"), ("dflash", ""), ("xpress", "K=1"),
                                                          ("markov", "")]
    assert all(r["tau"] == 2.5 and r["prompts"] == 2 for r in avg)  # the mean of the benchmarks' taus (2, 3)
