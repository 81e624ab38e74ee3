"""The gain-against-strength study (xpress.studies.gain_strength): its arithmetic by hand, the configurations it
finds under checkpoints/, and one smoke run whose T = 0 replay equals decoding."""
import dataclasses
import json
import shutil

import pytest

from xpress import paths
from xpress.studies import gain_strength as gs

pytestmark = pytest.mark.usefixtures("no_checkpoints", "one_thread")


def test_histogram_and_conditional_acceptance_by_hand():
    hist = gs.accepted_histogram([0, 2, 1, 2, 0, 2, 9], drafts=3)  # 9 > 3 drafts: counted at 3
    assert hist == [2, 1, 3, 1]
    pos = gs.conditional_acceptance(hist)
    assert [(p["position"], p["reached"], p["accepted"]) for p in pos] == [(1, 7, 5), (2, 5, 4), (3, 4, 1)]
    assert pos[1]["rate"] == pytest.approx(4 / 5)
    assert gs.conditional_acceptance([3, 0, 0])[1] == {"position": 2, "reached": 0, "accepted": 0, "rate": None}


def test_trend_is_the_rank_correlation_and_slope_of_the_benchmark_points():
    rows = [{"temperature": 0.0, "bench": b, "tau_dflash": x, "ratio_dflash": 1 + 0.1 * x}
            for b, x in (("a", 1.5), ("b", 2.0), ("c", 2.5), ("d", 3.0))]
    rows.append({"temperature": 0.0, "bench": "avg", "tau_dflash": 9.0, "ratio_dflash": 0.1})  # left out
    (t,) = gs.trend(rows)
    assert t["points"] == 4 and t["spearman"] == pytest.approx(1.0) and t["slope_per_tau"] == pytest.approx(0.1)
    flat = [dict(r, ratio_dflash=1.0) for r in rows]
    assert gs.trend(flat)[0]["spearman"] is None  # no spread: no correlation rather than a NaN


def _checkpoint(folder, complete=None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if complete is not None:
        (folder / "train_state.json").write_text(json.dumps({"complete": complete}))


def test_configurations_are_the_snapshots_and_finals_all_three_methods_have(tmp_path, monkeypatch):
    from xpress.config import load_config

    monkeypatch.setattr(paths, "CHECKPOINTS", tmp_path)
    t = load_config("cpu").train
    first, second = t.snapshot_steps
    for m in gs.METHODS:
        _checkpoint(tmp_path / "cpu" / f"{m}-step{first}")
        _checkpoint(tmp_path / "cpu" / m, complete=True)
        if m != "markov":
            _checkpoint(tmp_path / "cpu" / f"{m}-step{second}")  # markov's is missing: not a configuration
    found = gs.configurations(["cpu"])
    assert [c.made["cotrain_steps"] for c in found] == [first, t.steps]
    assert found[0].folders["xpress"] == tmp_path / "cpu" / f"xpress-step{first}"
    assert found[1].made["domain"] == "general" and found[1].made["warm_start_steps"] == t.warm_start_steps
    for m in gs.METHODS:  # a co-training lever all three methods have is one more; one only dflash has is not
        _checkpoint(tmp_path / "cpu" / "levers" / m / "base-3600steps")
    _checkpoint(tmp_path / "cpu" / "levers" / "dflash" / "train.gamma=2-1500steps")
    lever = gs.configurations(["cpu"])[-1]
    assert lever.name == "cpu lever base-3600steps" and lever.made["cotrain_steps"] == 3600
    assert lever.folders["markov"] == tmp_path / "cpu" / "levers" / "markov" / "base-3600steps"
    shutil.rmtree(tmp_path / "cpu" / "levers")
    (tmp_path / "cpu" / "dflash" / "train_state.json").write_text(json.dumps({"complete": False}))
    assert [c.made["cotrain_steps"] for c in gs.configurations(["cpu"])] == [first]  # an unfinished stage is not one
    with pytest.raises(gs.StrengthError, match="python -m xpress train --preset cpu-math"):
        gs.configurations(["cpu-math"])
    assert gs.made_by(load_config("cpu-math"), 10)["domain"] == "math"


def test_smoke_run_replays_t0_as_decoding_does_and_writes_its_file(cfg, target, tmp_path, monkeypatch):
    from xpress.decoding import generate_batch
    from xpress.methods import make_drafter
    from xpress.studies.compare import benchmark_prompts

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, resolution_batch_size=2),
                              data=dataclasses.replace(cfg.data, benchmarks=["gsm8k", "humaneval"]))
    res = gs.run_gain_strength(cfg, target, [cfg.preset], per_benchmark=1, ks=(1, 2), max_new_tokens=12,
                               untrained_ok=True, progress=False)
    (conf,) = res["configurations"]
    assert (tmp_path / "smoke" / "gain_vs_strength.json").is_file() and res["provenance"]["git_revision"]
    assert {(p["temperature"], p["bench"]) for p in res["points"]} == {
        (t, b) for t in (0.0, cfg.eval.sampling_temperature) for b in [*cfg.data.benchmarks, "avg"]}
    assert [k["K"] for k in conf["k_sweep"]] == [1, 2]
    from xpress import findings, plots

    text = findings.gain_strength("smoke")
    assert text.startswith("- 1 trained configuration, each decoded on 1 prompt of each of") and "T = 0:" in text
    assert plots.draw_gain_strength("smoke").name == "gain_vs_strength"
    from xpress.report import _gain_strength_section

    assert any(x.startswith("| smoke (untrained) | general | ") for x in _gain_strength_section(res))
    conf["made"]["cotrain_steps"] = conf["made"]["cotrain_steps_of"]  # as a trained preset's last step: per benchmark
    lines = _gain_strength_section(res)
    assert sum(x.startswith("| smoke (untrained) | 0 | ") for x in lines) == 3  # 2 benchmarks and the average
    B = cfg.drafter.block_size
    for pos in conf["positions"]:
        assert [p["position"] for p in pos["positions"]] == list(range(1, B))
        assert all(p["rate"] is None or 0 <= p["rate"] <= 1 for p in pos["positions"])
        assert pos["positions"][0]["reached"] == pos["rounds"]  # every round reaches its first draft
    # T = 0: the replayed rounds are the rounds decoding with the full block takes
    full = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, draft_tokens=0))
    prompts = benchmark_prompts(cfg, target, 1)
    for m in gs.METHODS:
        d = make_drafter(m, full, target, seed=cfg.seed, untrained_ok=True)
        gens = generate_batch(target, d, [p["ids"] for p in prompts], 12, 0.0)
        replayed = [r for r in conf["rows"] if r["temperature"] == 0.0 and r["method"] == m]
        assert [(r["tokens"], r["steps"]) for r in replayed] == [(len(g.token_ids), g.n_steps) for g in gens]
        assert [r["accepted"] for r in replayed] == [gs.accepted_histogram([a - 1 for a in g.draft_accepts], B - 1)
                                                     for g in gens]


def test_command_line_names_a_bad_budget_and_a_missing_preset(capsys):
    assert gs.main(["--preset", "smoke", "--no-progress", "--ks", "0,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --ks '0,2' must list") and "\n" not in err
    assert gs.main(["--preset", "smoke", "--no-progress", "--configs", "cpu-math"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no trained configuration of preset 'cpu-math'") and "\n" not in err


def _conf(name, domain, first, later_x, later_d, bench_taus):
    """A configuration as the file holds it: T = 0 positions pooled (``all``) and per bench, 100 rounds each."""
    def pos(rate1, later):
        return [{"position": 1, "reached": 100, "accepted": round(100 * rate1), "rate": rate1},
                {"position": 2, "reached": round(100 * rate1), "accepted": round(100 * rate1 * later), "rate": later}]
    positions = [{"temperature": 0.0, "method": m, "bench": b, "rounds": 100,
                  "positions": pos(first, later_x if m == "xpress" else later_d)}
                 for m in ("dflash", "xpress") for b in ["all", *bench_taus]]
    return {"name": name, "made": {"domain": domain, "train_response_tokens": 1000, "cotrain_steps": 10},
            "positions": positions}


def test_findings_say_the_trend_where_the_gain_is_and_the_benchmark_split(tmp_path, monkeypatch):
    from xpress import findings
    from xpress.utils import atomic_write_json

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    pts = []
    for name, shift in (("weak", 0.0), ("strong", 1.0)):
        for bench, tau, ratio in (("gsm8k", 2.0, 1.02), ("math500", 1.8, 1.10), ("avg", 1.9, 1.06)):
            pts.append({"configuration": name, "temperature": 0.0, "bench": bench, "tau_dflash": tau + shift,
                        "ratio_dflash": ratio + 0.1 * shift, "lo_dflash": ratio - 0.01, "hi_dflash": ratio + 0.2,
                        "ratio_markov": 1.0})
    rows = [p for p in pts if p["bench"] != "avg"]
    result = {"prompts_per_benchmark": 16, "benchmarks": ["gsm8k", "math500"], "draft_tokens": 7,
              "temperatures": [0.0], "points": pts, "trend": gs.trend(rows, "dflash"),
              "configurations": [_conf("weak", "general", 0.4, 0.3, 0.25, ["gsm8k", "math500"]),
                                 _conf("strong", "math", 0.6, 0.5, 0.4, ["gsm8k", "math500"])]}
    atomic_write_json(tmp_path / "cpu" / "gain_vs_strength.json", result)
    text = findings.gain_strength("cpu")
    assert "from the weakest configuration (weak, tau(dFlash) 1.90) to the strongest (strong, 2.90)" in text
    assert "moves 1.060 [1.050, 1.260] -> 1.160" in text
    assert "xPress accepts 50% against dFlash's 40%" in text  # the strongest configuration's later positions
    assert "The benchmark with the strongest drafter is not the one with the largest gain (gsm8k: " in text
    assert findings.gain_strength("nothing").startswith("No results/nothing/gain_vs_strength.json")
