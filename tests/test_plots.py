"""Figures from result files alone (xpress.plots), on tiny synthetic results."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")

from xpress import paths  # noqa: E402
from xpress.plots import draw_all, plot_latency, plot_tau_vs_k, records  # noqa: E402
from xpress.studies.table1 import table1_from_rows  # noqa: E402

from test_table1 import two_benchmarks  # noqa: E402


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    (tmp_path / "p").mkdir()
    return tmp_path / "p"


def write(folder, name, obj):
    (folder / f"{name}.json").write_text(json.dumps(obj))


def table1_file(folder):
    rows = two_benchmarks() + [dict(r, temperature=1.0, seed=s, repeat=0, lossless=None)
                               for s in (0, 1) for r in two_benchmarks() if r["repeat"] == 0]
    write(folder, "table1", {"methods": ["dflash", "xpress"], "benchmarks": ["a", "b"], "sampling_seeds": [0, 1],
                             "command": "cmd", **table1_from_rows(rows, n_boot=20)})


def target_cost_result():
    """A synthetic target_cost.json: two dtypes of the lean runtime, two contexts, two sizes, and the old path."""
    from xpress.studies.target_cost import COMPONENTS, break_even

    rows = [{"runtime": "lean", "dtype": dt, "context": L, "new_tokens": n, "component": c,
             "median_ms": (1 + COMPONENTS.index(c)) * n ** 0.5 * (2 if dt == "float32" else 1)}
            for dt in ("float32", "bfloat16") for L in (64, 300) for n in (1, 16) for c in COMPONENTS]
    rows += [{"runtime": "lean", "dtype": dt, "context": L, "new_tokens": n, "component": "forward",
              "median_ms": sum(r["median_ms"] for r in rows if (r["dtype"], r["context"], r["new_tokens"]) == (dt, L, n))}
             for dt in ("float32", "bfloat16") for L in (64, 300) for n in (1, 16)]
    rows += [{"runtime": "transformers", "dtype": "float32", "context": L, "new_tokens": n, "component": "forward",
              "median_ms": 40.0 * n ** 0.3} for L in (64, 300) for n in (1, 16)]
    return {"dtypes": ["float32", "bfloat16"], "contexts": [64, 300], "new_tokens": [1, 16],
            "components": list(COMPONENTS), "rows": rows, "break_even": break_even(rows, 16),
            "provenance": {"machine": {"cpu_model": "cpu", "torch_threads": 2}, "git_revision": "abc", "date": "2026"}}


def test_report_shows_the_target_cost_and_ar_against_generate(results):
    from xpress.report import results_markdown

    write(results, "target_cost", target_cost_result())
    text = results_markdown("p", results)
    assert "| transformers | float32 | 300 | 40.0 | 91.9 (B = 16) | 2.30 |" in text       # 40 * 16 ** 0.3 = 91.9
    assert "| lean | bfloat16 | 64 | 15.0 | 60.0 (B = 16) | 4.00 |" in text
    ceiling = {"ar_tokens_per_s": 30.0, "oracle_tokens_per_s": 240.0, "speedup": 8.0, "tau": 16.0, "block_size": 16,
               "n_prompts": 8, "lossless": True, "mismatched_prompts": [], "verify_cost": {"loop_ratio": 1.4},
               "runtime": {"runtime": "lean", "dtype": "bfloat16"}, "provenance": {},
               "compare": {"ar_old": {"tokens_per_s": 15.0}, "generate": {"tokens_per_s": 20.0},
                           "generate_static": {"tokens_per_s": 24.0}, "ar_over_old": 2.0, "ar_over_generate": 1.25}}
    write(results, "oracle_ceiling", ceiling)
    text = results_markdown("p", results)
    assert "the project's AR (lean runtime, bfloat16) 30.0 tokens/s; before the lean runtime" in text
    assert "15.0 (2.00x)" in text and "ours / the faster = 1.25x" in text and "equals greedy AR on every prompt" in text


def test_no_results_no_figures(results):
    drawn, missing = draw_all("p")
    assert drawn == [] and set(missing) == {"training_curves", "training_acceptance", "validation_tau", "table1",
                                          "resolution", "tau_vs_k", "latency", "batched", "target_cost", "data_scaling",
                                          "levers", "cotraining_steps", "refiner_cost", "gain_vs_strength"}


def test_every_figure_from_synthetic_files(results):
    table1_file(results)
    write(results, "batched", {"batch_sizes": [1, 4], "table": [
        {"batch_size": b, "method": m, "tokens_per_s": v, "speedup": v / (10 * b)}
        for b in (1, 4) for m, v in (("ar", 10 * b), ("xpress", 8 * b))]})
    write(results, "tau_vs_k", {"rows": [{"K": k, "bench": "a", "tau": 1 + k / 4} for k in (1, 2, 4)]
                                + [{"method": "markov", "bench": "a", "tau": 1.6}]})
    write(results, "latency", {"table": [{"method": m, "draft_s": 0.01, "refine_s": 0.002, "verify_s": 0.05,
                                          "bookkeeping_s": 0.001} for m in ("dflash", "xpress")]})
    write(results, "train_xpress", {"step": 20, "final_val": {"tau": 1.8, "prompts": 4, "val_tf_tau": 2.1},
                                    "log": [{"step": s, "refined_l1": 1.0 / (s + 1), "tf_tau": 1 + s / 10,
                                             "tf_accept": [0.6, 0.3, 0.1]} for s in (0, 10, 20)]})
    write(results, "resolution", {"rel": 0.05, "prompts_per_benchmark": 3, "table": [
        {"temperature": t, "baseline": b, "bench": n, "tau_ratio": 1.05, "lo": 1.0, "hi": 1.1}
        for t in (0.0, 1.0) for b in ("dflash", "markov") for n in ("a", "avg")]})
    write(results, "target_cost", target_cost_result())
    write(results, "refiner_cost", {"table": [{"setting": st, "method": m, "GFLOP / block": g, "weights read (M elem)": g * 9}
                                              for st in ("paper (V=9)", "cpu (V=4)") for m, g in (("xPress K=1", 1.0), ("Markov", 1.1))]})
    write(results, "levers", {"rows": [{"lever": lv, "steps": 8, "train_response_tokens": n, "val_tf_tau": t, "val_tau": t - 0.2,
                                        "implied_speedup": t / 2, "measured_speedup": t / 2.1}
                                       for lv, n, t in (("base", 900, 1.9), ("train.train_sequences=1", 100, 1.4),
                                                        ("train.train_sequences=3", 300, 1.7), ("drafter.num_layers=1", 900, 2.0))]
                              + [{"lever": "base", "steps": n, "method": m, "init": "warmstart", "train_response_tokens": 900,
                                  "val_tf_tau": 2 + n / 1000, "val_tau": 1.8 + n / 2000} for m in ("dflash", "xpress")
                                 for n in (6, 18)]})
    confs = [{"name": n, "taus": [{"temperature": 0.0, "method": "dflash", "bench": "avg", "tau": t}],
              "positions": [{"temperature": 0.0, "method": m, "bench": "all", "positions": [
                  {"position": j, "rate": 0.5 / j} for j in (1, 2, 3)]} for m in ("dflash", "xpress")],
              "k_sweep": [{"K": k, "ratio_dflash": 1 + k / 50, "lo": 1.0, "hi": 1.1} for k in (1, 2)]}
             for n, t in (("weak", 1.5), ("strong", 2.5))]
    write(results, "gain_vs_strength", {
        "configurations": confs, "benchmarks": ["a"], "prompts_per_benchmark": 4, "draft_tokens": 3,
        "temperatures": [0.0, 1.0], "points": [
            {"configuration": c["name"], "temperature": t, "bench": b, "tau_dflash": c["taus"][0]["tau"] + 0.1 * (b == "a"),
             "ratio_dflash": 1.05, "lo_dflash": 1.0, "hi_dflash": 1.1} for c in confs for t in (0.0, 1.0) for b in ("a", "avg")]})
    drawn, missing = draw_all("p")
    assert missing == [] and [d.name for d in drawn] == ["refiner_cost", "training_curves", "training_acceptance",
                                                         "validation_tau",
                                                         "table1", "resolution", "tau_vs_k",
                                                         "latency", "batched", "target_cost", "data_scaling", "levers",
                                                         "cotraining_steps", "gain_vs_strength"]
    assert all("json" in d.caption for d in drawn)          # every caption names the data it was drawn from
    for d in drawn:
        assert (results / "figures" / f"{d.name}.png").stat().st_size > 0
        assert (results / "figures" / f"{d.name}.pdf").is_file()


def test_table1_figure_draws_every_method_and_benchmark_from_the_file(results):
    from xpress.plots import draw_table1, load_result

    table1_file(results)
    data = load_result("p", "table1")
    drawn = draw_table1("p")
    axes = drawn.fig.axes
    temps = sorted({r["temperature"] for r in data["summary"]})
    assert [ax.get_title() for ax in axes] == [f"{c}, T = {t:g}" for c in ("tau", "speedup over AR") for t in temps]
    for ax, (col, t) in zip(axes, [(c, t) for c in ("tau", "speedup") for t in temps]):
        want = sorted(r[col] for r in data["summary"] if r["temperature"] == t and r["method"] != "ar")
        got = sorted(b.get_height() for b in ax.patches if b.get_width() > 0 and b.get_height() == b.get_height())
        assert got == pytest.approx(want)   # one bar per (method, benchmark incl. avg), at the file's value
    labels = axes[len(temps) - 1].get_legend_handles_labels()[1]
    assert labels == ["dflash", "xpress"] and "table1.json" in drawn.caption


def test_notebook_07_shows_every_figure_once(results, monkeypatch):
    import IPython.display
    import matplotlib.pyplot as plt

    from xpress.plots import SAVED_ONLY, show_all

    plt.close("all")                          # figures earlier tests left open
    table1_file(results)
    (results / "figures").mkdir()
    fig = plt.figure()
    fig.savefig(results / "figures" / "regeneration.png")
    plt.close(fig)
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    out = show_all("p")
    figs = [o for o in shown if hasattr(o, "savefig")]
    assert out["shown"] == ["table1", "regeneration"] and len(figs) == 1 and len(shown) == 4  # figure + caption each
    assert plt.get_fignums() == []            # closed after display: the inline backend cannot show it again
    assert set(SAVED_ONLY) - {"regeneration"} <= set(out["missing"]) and "batched" in out["missing"]


def test_unreadable_shapes_are_skipped_not_guessed(results):
    assert records({"what": "x", "n": 3}) == [] and records([{"a": 1}]) == [{"a": 1}]
    assert records({"meta": [1, 2], "other": [{"k": 1}]}) == [{"k": 1}]
    assert plot_tau_vs_k([{"method": "x", "speed": 2.0}]) is None
    assert plot_latency([{"bench": "a", "other": 1.0}]) is None
    write(results, "latency", {"note": "no table"})
    assert "latency" in draw_all("p", save=False)[1]


def test_tau_vs_k_in_notebook_05s_layout(results):
    summary = ([{"method": "xpress", "variant": f"K={k}", "K": k, "bench": b, "tau": 1 + k / 8}
                for k in (1, 2, 3) for b in ("a", "avg")]
               + [{"method": m, "variant": v, "K": None, "bench": "avg", "tau": t}
                  for m, v, t in (("dflash", "", 1.2), ("markov", "", 1.4), ("xpress", "sequential", 1.5))])
    fig = plot_tau_vs_k(summary)
    assert [ax.get_title() for ax in fig.axes] == ["a", "avg"]  # one panel per benchmark, the average last
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert {"dFlash (no head)", "Markov head (sequential)", "xPress fixed point (sequential)"} <= set(labels)
    assert len(fig.axes[1].lines) == 4 and len(fig.axes[0].lines) == 1  # the curve + three baselines; a: the curve
    fig = plot_tau_vs_k(summary, {"K=3": [1, 2, 3, 3], "K=15": [2, 5]})
    assert len(fig.axes) == 3 and "passes" in fig.axes[2].get_title()  # + the histogram of passes used


def test_report_shows_table1_batched_and_break_even(results):
    from xpress.report import results_markdown

    table1_file(results)
    t1 = json.loads((results / "table1.json").read_text())
    t1.update(preset="p", prompts_per_benchmark=1, max_new_tokens=8, repeats=2, temperatures=[0.0, 1.0],
              weights={"ar": "none", "dflash": "trained", "xpress": "trained"}, warnings=["busy"],
              provenance={"machine": {"cpu_model": "cpu", "torch_threads": 2}, "git_revision": "abc", "date": "2026",
                          "memory_read_gb_per_s": [81.6, 52.4]})
    write(results, "table1", t1)
    write(results, "batched", {"preset": "p", "methods": ["ar", "xpress"], "batch_sizes": [1, 4], "n_prompts": 4,
                               "max_new_tokens": 8, "provenance": {}, "table": [
                                   {"batch_size": b, "method": m, "tokens_per_s": 10.0 * b, "speedup": 1.0, "tau": 1.0}
                                   for b in (1, 4) for m in ("ar", "xpress")]})
    text = results_markdown("p", results)
    assert "**Table 1**" in text and "T = 1:" in text and "(!)" in text          # the flagged xpress cell
    assert "The paper's Table 1 (Qwen3-8B" in text and "8.02" in text and "6.25" in text
    assert "tau(xPress) / tau(dFlash) = 1.62" in text                             # 3.25 / 2.0, by hand
    assert "**Break-even tau on this machine**" in text and "Warning: busy" in text
    assert "2 torch threads, memory read 82 then 52 GB/s; 2026" in text and "git abc" not in text  # the run's memory phase, each end
    assert "| 4 | 40.0 (1.00x, tau 1.00) | 40.0 (1.00x, tau 1.00) |" in text
    assert "The paper's Table 2" in text and "batch 16: gsm8k 3.2x / 4.3x" in text and "batch 32: gsm8k 2.1x / 2.9x" in text
    cell = {"tau_ratio": 1.1, "lo": 1.06, "hi": 1.14, "resolved": True}
    write(results, "resolution", {"preset": "p", "benchmarks": ["a"], "temperatures": [0.0, 1.0], "rel": 0.05,
                                  "prompts_per_benchmark": 24, "max_new_tokens": 8, "provenance": {}, "table": [
                                      {**cell, "temperature": t, "baseline": "dflash", "bench": b}
                                      for t in (0.0, 1.0) for b in ("a", "avg")]})
    text = results_markdown("p", results)
    assert "**tau on more prompts**" in text and "| 1 | dflash | 1.100 [1.060, 1.140] * |" in text
    assert "Table 1's have" not in text  # the study's file does not say its block size: no claim
    res = json.loads((results / "resolution.json").read_text())
    write(results, "table1", {**t1, "block_size": 4})
    for b in (4, 16):  # the study at Table 1's block size, then at another
        write(results, "resolution", {**res, "block_size": b})
        assert ("drafters with block size 16, Table 1's have 4" in results_markdown("p", results)) == (b == 16)


def test_report_says_which_run_wrote_the_files_and_names_every_file_from_another_revision(results):
    """The results section opens with the run that wrote the notebooks' files (run.json): a notebook file from
    another revision or a dirty tree is named, a study file (make studies) is listed with its own revision."""
    from xpress.report import results_markdown

    def prov(rev, dirty=False):
        return {"machine": {"cpu_model": "cpu", "torch_threads": 2}, "git_revision": rev, "git_dirty": dirty,
                "date": "2026-12-02"}

    run = {"notebook_seconds": {"00_environment": 60.0}, "notebooks": [{"seconds": 60.0, "git_revision": "aaaaaaa1"}],
           "total_seconds": 6000.0, "provenance": prov("aaaaaaa1")}
    write(results, "run", run)
    write(results, "decoding_t0", {"provenance": prov("aaaaaaa1")})
    write(results, "levers", {"rows": [], "provenance": prov("ccccccc3")})
    text = results_markdown("p", results)
    assert "One `make reproduce`" in text and "100 min of notebooks" in text and "git aaaaaaa, 2026-12-02" in text
    assert "Every notebook file is from that revision, with a clean tree." in text
    assert "`levers.json` (cpu, 2 torch threads; git ccccccc, 2026-12-02)" in text
    write(results, "refiner_cost", {"provenance": prov("bbbbbbb2")})
    write(results, "probe", {"provenance": prov("aaaaaaa1", dirty=True)})
    text = results_markdown("p", results)
    assert "another revision or a dirty tree: `probe.json` (git aaaaaaa, dirty), `refiner_cost.json` (git bbbbbbb)." in text
    write(results, "run", {**run, "total_seconds": None, "notebooks": [{"seconds": 1.0, "git_revision": "aaaaaaa1"},
                                                                       {"seconds": 2.0, "git_revision": "bbbbbbb2"}]})
    assert "No single `make reproduce` wrote the notebooks' files: their last runs are at git aaaaaaa, bbbbbbb" in \
        results_markdown("p", results)


def test_report_shows_the_gpu_latencies_beside_the_papers_table3_or_says_they_are_missing(results):
    from xpress.report import results_markdown

    assert "**GPU latency (H200)**: not measured yet" in results_markdown("p", results, gpu=True)
    assert "GPU latency" not in results_markdown("p", results)  # by default beside the README's own preset only
    t = {"markov": {"median_ms": 0.6}, "xpress K=4": {"median_ms": 0.3}}
    (results.parent / "h200").mkdir()
    write(results.parent / "h200", "latency", {"shape_sets": {"paper": {"timings": t}}, "provenance": {
        "machine": {"gpu": "NVIDIA H200", "cpu_model": "some cpu"}, "git_revision": "abcdef0", "date": "2026-12-01"}})
    text = results_markdown("p", results, gpu=True)
    assert "NVIDIA H200" in text and "not measured yet" not in text
    assert "| paper | xpress K=4 | xpress K=4 | 0.3 | 0.500 | 379 | 0.631 |" in text
    assert "lossless on the GPU" not in text
    t.update({"target step (1 token)": {"median_ms": 40.0}, "target verify (16 tokens)": {"median_ms": 50.0}})
    prov = {"machine": {"gpu": "NVIDIA H200", "cpu_model": "some cpu"}, "git_revision": "abcdef0", "date": "2026-12-01"}
    write(results.parent / "h200", "latency", {"shape_sets": {"paper": {"timings": t, "shapes": {"block_size": 16}, "paired": {
        "markov_over_xpress_k4": {"median": 0.6, "min": 0.5, "max": 0.7}}}}, "provenance": prov})
    write(results.parent / "h200", "oracle_ceiling", {
        "preset": "qwen3-tiny", "runtime": {"dtype": "bfloat16", "frame_rows": 64}, "n_prompts": 8, "mismatched_prompts": ["a"],
        "tau": 15.5, "verify_cost": {"block_size": 16, "loop_ratio": 1.01}, "ar_tokens_per_s": 100.0,
        "compare": {"generate": {"tokens_per_s": 90.0}, "generate_static": {"tokens_per_s": 600.0}}, "provenance": prov})
    text = results_markdown("p", results, gpu=True)
    assert "Markov / xPress K=4 = 0.60x (range 0.50-0.70 over paired rounds)" in text
    assert "a 1-token step 40.0 ms, a 16-token verify 50.0 ms (1.25x)" in text
    t.update({"target step (1 token, frames of 64)": {"median_ms": 42.0}, "target verify (16 tokens, frames of 64)": {"median_ms": 63.0}})
    write(results.parent / "h200", "latency", {"shape_sets": {"paper": {"timings": t, "shapes": {"block_size": 16}}}, "provenance": prov})
    assert "on frames of 64 positions (`target.frame_rows`): step 42.0 ms, verify 63.0 ms (1.50x)" in results_markdown("p", results, gpu=True)
    assert ("transformers forward on 64-position frames: 7 of 8 prompts equal to greedy AR with the oracle drafter "
            "(tau 15.5); a 16-token verify 1.01x a step; AR 100 tokens/s") in text


def test_cotraining_steps_rows_take_one_runs_base_rows_at_two_or_more_lengths():
    """The co-training-steps curve: ``base`` rows from the warm start of one run's data and recipe (the group
    with the most step counts), by method and steps; other levers, from-scratch rows and single lengths stay out."""
    from xpress.plots import cotraining_steps_rows

    def row(method, steps, tokens=900, lever="base", init="warmstart", date="2026-12-05"):
        return {"lever": lever, "steps": steps, "method": method, "init": init, "train_response_tokens": tokens,
                "val_tf_tau": 2.0, "date": date}

    rows = [row("xpress", 3600), row("dflash", 600), row("xpress", 600), row("xpress", 1800, lever="train.gamma=2"),
            row("dflash", 600, init=None), row("xpress", 1800, tokens=800, date="2026-12-04"),
            row("xpress", 600, tokens=800, date="2026-12-04"), row("markov", 600, tokens=700)]
    assert [(r["method"], r["steps"]) for r in cotraining_steps_rows({"rows": rows})] == [
        ("dflash", 600), ("xpress", 600), ("xpress", 3600)]        # two lengths each: the later run's data
    more = rows + [row("xpress", 3600, tokens=800, date="2026-12-01")]
    assert {r["train_response_tokens"] for r in cotraining_steps_rows({"rows": more})} == {800}  # three lengths win
    assert cotraining_steps_rows({"rows": rows[-1:]}) == [] and cotraining_steps_rows(None) == []  # one length: none


def test_lever_rows_compare_one_machine_class_at_one_length():
    """The lever figure compares rows of one step count and one target dtype, the preset first, then by the
    speedup tau implies; the data-scaling prefixes and undecoded rows stay out."""
    from xpress.plots import lever_rows

    def row(lever, steps, dtype, implied, tau=1.5):
        return {"lever": lever, "steps": steps, "target_dtype": dtype, "val_tau": tau, "implied_speedup": implied}

    rows = [row("base", 2800, "float32", 0.8), row("drafter.block_size=8", 2800, "float32", 0.95),
            row("drafter.num_layers=1", 2800, "float32", 0.9), row("train.train_sequences=300", 2800, "float32", 0.7),
            row("drafter.block_size=8", 2800, "bfloat16", 1.2),             # another machine class: no base beside it
            row("base", 400, "bfloat16", 0.5), row("drafter.num_layers=1", 400, "bfloat16", 0.6),
            {"lever": "train.anchors_per_seq=32", "steps": 2800, "target_dtype": "float32", "val_tf_tau": 1.4}]
    got = lever_rows({"rows": rows})
    assert [(r["lever"], r["target_dtype"]) for r in got] == [
        ("base", "float32"), ("drafter.block_size=8", "float32"), ("drafter.num_layers=1", "float32")]
    assert lever_rows({"rows": rows[3:5]}) == [] and lever_rows(None) == []


def test_report_says_which_decoding_files_decoded_the_drafters_this_run_trained(results):
    """train_<method>.json's fingerprints against each decoding file's: the same, other drafters (named by
    method), or none recorded; no sentence at all when training recorded none."""
    from xpress.report import _drafters_sentence

    def said():
        return " ".join(_drafters_sentence(results))

    prov = {"machine": {"cpu_model": "cpu", "torch_threads": 2}, "git_revision": "aaaaaaa1", "git_dirty": False,
            "date": "2026-12-05"}
    write(results, "tau_vs_k", {"weights": {"xpress": "trained"}, "fingerprints": {"xpress": "f3"}, "provenance": prov})
    assert said() == ""
    for m, fp in (("dflash", "f1"), ("markov", "f2"), ("xpress", "f3")):
        write(results, f"train_{m}", {"method": m, "step": 1, "seconds": 1.0, "log": [], "fingerprint": fp,
                                      "provenance": prov})
    write(results, "resolution", {"fingerprints": {"dflash": "f1", "markov": "old", "xpress": "f3"}, "provenance": prov})
    write(results, "draft_length", {"table": [], "provenance": prov})
    write(results, "batched", {"weights": {"xpress": "untrained"}, "fingerprints": {}, "provenance": prov})
    text = said()
    assert "`tau_vs_k.json` decoded the drafters this run trained" in text
    assert "Other drafters than this run's: `resolution.json` (markov)." in text
    assert "No fingerprint recorded (written before studies named their drafters): `draft_length.json`." in text
    assert "batched" not in text  # it loaded no checkpoint: nothing to say


def test_the_resolution_file_is_a_notebook_file_where_the_preset_runs_it_in_notebook_04():
    """cpu runs the resolution study in make reproduce (eval.resolution_in_run), so its file must come from that
    run's revision; a results folder of no known preset keeps it among the studies'."""
    from xpress.config import load_config
    from xpress.report import STUDY_FILES, _study_files

    assert load_config("cpu").eval.resolution_in_run
    assert "resolution.json" not in _study_files("cpu") and "resolution.json" in _study_files("p")
    assert set(_study_files("cpu")) == set(STUDY_FILES) - {"resolution.json"}


def test_the_readme_glance_states_the_ratios_beside_the_papers_and_the_finding_in_one_sentence(results):
    """README's result at a glance (report.glance_markdown): the resolution study's tau ratios with their
    intervals beside the paper's, Table 1's taus and speedups, batched speed with the share of rows equal to
    batch-1 AR, losslessness; the sentence first, its numbers the table's."""
    from xpress.report import glance_markdown

    assert "No Table 1" in glance_markdown("p", results)
    table1_file(results)
    t1 = json.loads((results / "table1.json").read_text())
    t1.update(preset="p", target="tiny", prompts_per_benchmark=1, max_new_tokens=8, repeats=2, temperatures=[0.0, 1.0],
              draft_tokens=3, lossless_t0=True,
              provenance={"machine": {"cpu_model": "cpu", "torch_threads": 2}, "git_revision": "abc1234", "date": "2026"})
    write(results, "table1", t1)
    write(results, "resolution", {"preset": "p", "benchmarks": ["a", "b"], "prompts_per_benchmark": 24, "table": [
        {"temperature": t, "baseline": b, "bench": "avg", "tau_ratio": r, "lo": r - 0.01, "hi": r + 0.01}
        for t, b, r in ((0.0, "dflash", 1.05), (1.0, "dflash", 1.07), (0.0, "markov", 1.01))]})
    write(results, "batched", {"n_prompts": 4, "batch_sizes": [1, 4], "table": [
        {"batch_size": 4, "method": m, "speedup": s, "same_as_ar_b1": q}
        for m, s, q in (("ar", 1.0, 0.75), ("dflash", 0.7, 0.5), ("xpress", 0.8, 0.625))]})
    text = glance_markdown("p", results)
    first, table = text.split("\n", 1)
    assert first.startswith("**In one sentence:** here xPress accepts 1.05x dFlash's tokens per round [1.04, 1.06] "
                            "at T = 0 and 1.07x at T = 1, against the paper's 1.28x and 1.41x, and 1.01x the Markov")
    assert "| tau xPress / dFlash, T = 1 (24 prompts x 2 benchmarks, 95% interval) | 1.070 [1.060, 1.080] | 1.41 |" in table
    assert "0.70 / 0.80x; outputs equal to batch-1 AR's: AR 75%, dFlash 50%, xPress 62%" in table
    assert "3.0 / 3.6x (Table 2, batch 16" in table and "every T = 0 output equal to AR's: yes" in table
    assert "git abc1234" in table and "tau xPress / Markov, T = 1" not in table  # no such cell: no row


def test_reproduce_time_per_cpu_class_and_the_stages_table_say_what_they_measured(results, monkeypatch):
    """classes_markdown: one row per CPU class from run.json files (this run's first), with the sizes each ran;
    the training table names its held-out blocks and its few decoded prompts."""
    from xpress import report

    def run(features, minutes, on_bf16):
        return {"notebook_seconds": {}, "total_seconds": 60.0 * minutes, "on_bf16": on_bf16, "provenance": {
            "machine": {"cpu_model": "cpu", "torch_threads": 2, "cpu_features": features}}}

    write(results, "run", run({"avx2": True, "avx512_bf16": True}, 62, ["train.steps=1500"]))
    (results.parent / "old").mkdir()
    write(results.parent / "old", "run", run({"avx2": True}, 113, []))
    monkeypatch.setattr(report.paths, "REPO_ROOT", results.parent.parent)
    monkeypatch.setitem(report.CLASS_RUNS, "p", (f"{results.parent.name}/old/run.json",))
    text = report.classes_markdown("p", results)
    assert "| cpu (AVX512-BF16), 2 threads (this run) | bfloat16 | the `on_bf16` sizes: `train.steps=1500` | 62 |" in text
    assert "| cpu (AVX2 only), 2 threads | float32 | the base sizes | 113 |" in text
    val = {"tau": 1.75, "tokens": 256, "prompts": 4, "val_tf_tau": 2.101, "val_blocks": 742}
    write(results, "train_dflash", {"method": "dflash", "step": 1500, "seconds": 325.0, "train_response_tokens": 853251,
                                    "log": [{"loss": 1.888, "tf_tau": 1.476}], "final_val": val})
    text = report.training_markdown("p", results)
    assert "held-out teacher-forced tau (742 blocks) | tau by decoding (4 validation prompts x 64 tokens) |" in text
    assert "| dflash | dflash | 1500 | 325 | 853,251 | 1.888 | 2.101 | 1.75 |" in text and "1.476" not in text
