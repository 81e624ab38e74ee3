"""The measurement path shared by the studies, the pipeline's notebook selection and order, and the README
section generated from the result files."""
import dataclasses
import json

import pytest

from xpress.config import ConfigError
from xpress.pipeline import ORDER, notebook_record, notebooks, select
from xpress.studies.compare import benchmark_prompts, decode_interleaved, make_drafters


def test_decode_interleaved_order_and_losslessness(cfg, target):
    prompts = benchmark_prompts(cfg, target, 1)[:2]
    drafters = make_drafters(cfg, target, ["random"])
    rows = decode_interleaved(target, drafters, prompts, 6, repeats=2, progress=False)
    # prompt -> repeat -> method: AR and the method alternate on each prompt
    assert [(r["id"], r["repeat"], r["method"]) for r in rows[:4]] == [
        (prompts[0]["id"], 0, "ar"), (prompts[0]["id"], 0, "random"), (prompts[0]["id"], 1, "ar"),
        (prompts[0]["id"], 1, "random")]
    assert all(r["lossless"] for r in rows) and all(r["timed_steps"] >= 1 for r in rows)
    sampled = decode_interleaved(target, drafters, prompts, 6, temperature=1.0, seed=5, repeats=2, progress=False)
    assert all(r["lossless"] is None for r in sampled)
    assert sampled[0]["tokens"] == sampled[2]["tokens"]     # a repeat re-draws the same tokens: same generator state


def test_draft_length_study_rows_and_table(cfg, target, tmp_path, monkeypatch):
    """Every method at every k against AR on the same prompts, lossless, k = 0 read as all B - 1 drafts, and
    no round committing more than k + 1 tokens."""
    import xpress.paths
    from xpress.studies.draft_length import run_draft_length

    monkeypatch.setattr(xpress.paths, "RESULTS", tmp_path)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, prompts_per_benchmark=1, max_new_tokens=8, repeats=1))
    res = run_draft_length(cfg, target, ks=(1, 0, "auto"), methods=["dflash", "xpress"], progress=False,
                           untrained_ok=True)
    B = cfg.drafter.block_size
    assert [(r["method"], r["k"]) for r in res["table"]] == [("ar", 0), ("dflash", 1), ("dflash", B - 1),
                                                              ("dflash", "auto"), ("xpress", 1), ("xpress", B - 1),
                                                              ("xpress", "auto")]
    assert all(1 <= r["mean_draft_k"] <= B - 1 for r in res["table"] if r["k"] == "auto")  # auto: its rounds' lengths
    auto = res["auto_vs_best"]
    assert set(auto) == {"dflash", "xpress"} and set(res["verify_costs"]) == {"dflash k=auto", "xpress k=auto"}
    assert all(c["lo"] <= c["ratio"] <= c["hi"] and c["prompts"] == len(cfg.data.benchmarks) for c in auto.values())
    assert res["lossless_t0"] and all(1.0 <= r["tau"] <= (B - 1 if r["k"] == "auto" else r["k"]) + 1
                                    for r in res["table"] if r["method"] != "ar")
    assert (tmp_path / cfg.preset / "draft_length.json").is_file() and res["provenance"]["git_revision"]
    from xpress.report import _draft_length_section

    best = next(r for r in res["table"] if (r["method"], r["k"]) == (res["best"]["method"], res["best"]["k"]))
    ar = res["table"][0]
    lines = _draft_length_section(res)
    line = next(x for x in lines if x.startswith("Fastest"))
    assert f"({best['tokens_per_s']:.1f} tokens/s against AR's {ar['tokens_per_s']:.1f})" in line  # the method's rate
    assert any(x.startswith("k = auto against") and f"{auto['xpress']['ratio']:.3f}x" in x for x in lines)


def test_draft_length_command_line_takes_the_ks_and_names_a_bad_one(tmp_path, monkeypatch, capsys):
    """``--draft-tokens`` chooses the k (recorded in the file's command); a k the block cannot hold is one line."""
    import xpress.paths
    from xpress.studies import draft_length

    monkeypatch.setattr(xpress.paths, "RESULTS", tmp_path)
    assert draft_length.main(["--preset", "smoke", "--no-progress", "--draft-tokens", "1,99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --draft-tokens 99 must lie in") and "\n" not in err
    args = ["--preset", "smoke", "--no-progress", "--draft-tokens", "2,1", "eval.prompts_per_benchmark=1",
            "eval.max_new_tokens=4", "eval.repeats=1", "eval.methods=[dflash]"]
    assert draft_length.main(args) == 0
    res = json.loads((tmp_path / "smoke" / "draft_length.json").read_text())
    assert [(r["method"], r["k"]) for r in res["table"]] == [("ar", 0), ("dflash", 2), ("dflash", 1)]
    assert res["command"].endswith("--draft-tokens 2,1")


def test_regen_speed_study_times_both_engines_on_the_same_answers(cfg, target, tmp_path, monkeypatch):
    """Every engine and batch size answers the same prompts; the continuous engine equals itself across batch
    sizes and batch-1 AR; the ratio column is against the ragged batches' median."""
    import xpress.paths
    from xpress import continuous
    from xpress.studies.regen_speed import run_regen_speed

    if not continuous.available(target):
        pytest.skip("the fused CPU kernels are not available here")
    monkeypatch.setattr(xpress.paths, "RESULTS", tmp_path)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, regen_max_new_tokens=8))
    res = run_regen_speed(cfg, target, n_prompts=5, repeats=2, batches=(1, 3), check=2, progress=False)
    assert [(r["engine"], r["batch_size"]) for r in res["table"]] == [("batched", cfg.data.regen_batch_size),
                                                                       ("continuous", 1), ("continuous", 3)]
    assert len(res["rows"]) == 2 * 3 and res["continuous_equal_across_batch_sizes"] and res["continuous_equals_batch1_ar"]
    for r in res["table"][1:]:
        assert r["answers_equal_to_continuous"] == 5 and r["answers_equal_to_batch1_ar"] == 2
    batched = sorted(r["tokens_per_s"] for r in res["rows"] if r["engine"] == "batched")
    assert res["table"][0]["ratio_to_batched"] == 1.0 and res["table"][0]["tokens_per_s"] == sum(batched) / 2
    assert (tmp_path / cfg.preset / "regen_speed.json").is_file() and res["provenance"]["git_revision"]


def test_select_notebooks():
    assert select() == notebooks() and [p.name[:2] for p in notebooks()] == sorted(p.name[:2] for p in notebooks())
    assert [p.name for p in select(["03"])] == ["03_cotraining.ipynb"]
    with pytest.raises(ConfigError, match="no notebook matches 'nosuch'.*00_environment"):
        select(["nosuch"])


def test_pipeline_order_and_run_record():
    assert list(ORDER) == sorted(ORDER) and list(ORDER)[4] == "04_speculative_decoding"
    assert list(ORDER)[-1] == "07_figures"
    present = [nb.stem for nb in notebooks()]
    assert set(present) <= set(ORDER), f"a notebook is missing from xpress.pipeline.ORDER: {set(present) - set(ORDER)}"
    rec = notebook_record({"00_environment": {"seconds": 1.5, "git_revision": "abc", "date": "d"}})
    assert [r["notebook"] for r in rec] == list(ORDER)          # run.json lists every notebook, in order
    assert rec[0]["seconds"] == 1.5 and rec[0]["git_revision"] == "abc" and rec[1]["seconds"] is None
    # a partial run keeps the other notebooks' earlier records and replaces the ones it ran
    old = {"00_environment": {"notebook": "00_environment", "seconds": 9.0, "git_revision": "old", "date": "d0"},
           "01_data_regeneration": {"notebook": "01_data_regeneration", "seconds": 7.0, "git_revision": "old", "date": "d0"}}
    rec = notebook_record({"00_environment": {"seconds": 1.5, "git_revision": "new", "date": "d1"}}, old)
    assert (rec[0]["seconds"], rec[0]["git_revision"]) == (1.5, "new")
    assert (rec[1]["seconds"], rec[1]["git_revision"]) == (7.0, "old") and rec[2]["seconds"] is None


def test_partial_run_record_merges(tmp_path, monkeypatch):
    import json

    from xpress import paths
    from xpress.pipeline import write_run_record

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    write_run_record("smoke", [], {"00_environment": {"seconds": 2.0, "git_revision": "a", "date": "d"},
                                   "01_data_regeneration": {"seconds": 3.0, "git_revision": "a", "date": "d"}}, 5.0)
    write_run_record("smoke", [], {"01_data_regeneration": {"seconds": 4.0, "git_revision": "b", "date": "e"}}, None)
    run = json.loads((tmp_path / "smoke" / "run.json").read_text())
    assert run["partial"] and run["notebook_seconds"] == {"00_environment": 2.0, "01_data_regeneration": 4.0}
    write_run_record("smoke", [], {"02_refiner_and_theorems": {"seconds": 1.0, "git_revision": "c", "date": "f"}}, 1.0)
    run = json.loads((tmp_path / "smoke" / "run.json").read_text())  # a whole run starts the record afresh
    assert not run["partial"] and run["notebook_seconds"] == {"02_refiner_and_theorems": 1.0}


def test_a_failed_run_records_the_notebooks_that_finished(tmp_path, monkeypatch):
    import json

    import papermill as pm

    from xpress import paths, pipeline

    monkeypatch.setattr(paths, "RESULTS", tmp_path)

    import nbformat

    def execute(src, out, **kw):  # the first notebook runs (papermill records the paths as given), the second fails
        if "01_" in src:
            raise pm.PapermillExecutionError(3, 3, "source", "ValueError", "bad", [])
        nbformat.write(nbformat.v4.new_notebook(metadata={"papermill": {"input_path": src, "output_path": out}}), out)

    monkeypatch.setattr(pm, "execute_notebook", execute)
    with pytest.raises(pipeline.NotebookFailed, match="01_data_regeneration.ipynb failed in cell 3"):
        pipeline.run_notebooks("smoke", only=["00_", "01_"])
    run = json.loads((tmp_path / "smoke" / "run.json").read_text())
    assert run["partial"] and list(run["notebook_seconds"]) == ["00_environment"]
    record = nbformat.read(tmp_path / "smoke" / "executed" / "00_environment.ipynb", as_version=4).metadata.papermill
    assert (record.input_path, record.output_path) == ("notebooks/00_environment.ipynb",
                                                       "$XPRESS_RESULTS/smoke/executed/00_environment.ipynb")


def widget_notebook() -> dict:
    """A small executed notebook as papermill writes one with tqdm: widget state in the metadata, a
    progress bar's widget view (with its frozen text fallback) beside ordinary outputs."""
    bar = {"output_type": "display_data", "metadata": {},
           "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2,
                                                                  "version_minor": 0},
                    "text/plain": "train xpress:   0%|          | 0/1500"}}
    text = {"output_type": "stream", "name": "stdout", "text": "tau 1.8\n"}
    table = {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": "a b"}}
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "xpress"}, "widgets": {"application/vnd.jupyter.widget-state+json": {}}},
            "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 1, "source": "train()",
                       "outputs": [bar, text, table]},
                      {"cell_type": "markdown", "id": "m1", "metadata": {}, "source": "# findings"}]}


def test_strip_widgets_drops_widget_state_and_frozen_bars():
    import json

    from xpress.pipeline import strip_widgets

    nb = strip_widgets(widget_notebook())
    assert "application/vnd.jupyter.widget" not in json.dumps(nb) and "widgets" not in nb["metadata"]
    assert [o["output_type"] for o in nb["cells"][0]["outputs"]] == ["stream", "execute_result"]
    assert nb["metadata"]["kernelspec"] == {"name": "xpress"} and nb["cells"][1]["source"] == "# findings"


def test_the_pipeline_writes_executed_copies_without_widgets(tmp_path, monkeypatch):
    import nbformat
    import papermill as pm

    from xpress import paths, pipeline

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    monkeypatch.setattr(pm, "execute_notebook",
                        lambda src, out, **kw: nbformat.write(nbformat.from_dict(widget_notebook()), out))
    (out,) = pipeline.run_notebooks("smoke", only=["00_"])
    text = out.read_text()
    assert "application/vnd.jupyter.widget" not in text and "tau 1.8" in text
    assert "widgets" not in nbformat.read(out, as_version=4).metadata


def test_readme_results_agree_with_files():
    """The measured numbers of README.md, results/<preset>/README.md and docs/ are generated from results/<preset>/
    (python -m xpress report); every file the report fills holds its sections."""
    from xpress import report

    for preset in ("cpu",):
        assert report.stale(preset) == [], f"run `python -m xpress report --preset {preset}`"
        for f, kinds in ((report.README, ("glance", "classes")), (report.targets(preset)[1], ("results", "durations")),
                         (report.targets(preset)[2], ("training", "levers")), (report.targets(preset)[3], ("costs",))):
            assert all(report._markers(preset, k)[0] in f.read_text() for k in kinds), f"{f} lost a generated section"


def test_readme_durations_come_from_run_json(tmp_path, monkeypatch):
    """The "Two commands" durations are run.json's: a whole run gives its total and every notebook's
    minutes; a record of partial runs says so and names their revisions; the AMX overrides it ran with."""
    import json

    from xpress import pipeline, report

    monkeypatch.setattr(pipeline.paths, "RESULTS", tmp_path)
    assert "has not been timed" in report.durations_markdown("smoke", tmp_path / "smoke")
    pipeline.write_run_record("smoke", [], {"00_environment": {"seconds": 60.0, "git_revision": "abc1234", "date": "d"},
                                            "03_cotraining": {"seconds": 1500.0, "git_revision": "abc1234", "date": "d"}},
                              1590.0)
    text = report.durations_markdown("smoke", tmp_path / "smoke")
    assert "took **26 min**" in text and "| 03_cotraining | warm start + three methods trained | 25.0 |" in text
    run = json.loads((tmp_path / "smoke" / "run.json").read_text())
    assert run["on_bf16"] == [] and "on_bf16" not in text  # smoke has no on_bf16 section
    (tmp_path / "smoke" / "run.json").write_text(json.dumps({**run, "on_bf16": ["data.n_train_prompts=40"]}))
    text = report.durations_markdown("smoke", tmp_path / "smoke")
    assert "`on_bf16` overrides applied (`data.n_train_prompts=40`)" in text and "configs/smoke.yaml" in text
    older = {k: v for k, v in run.items() if k != "on_bf16"}  # a run.json written before the rename
    (tmp_path / "smoke" / "run.json").write_text(json.dumps({**older, "on_amx": ["data.n_train_prompts=40"]}))
    assert "`on_bf16` overrides applied (`data.n_train_prompts=40`)" in report.durations_markdown("smoke", tmp_path / "smoke")
    pipeline.write_run_record("smoke", [], {"00_environment": {"seconds": 6.0, "git_revision": "def5678", "date": "e"}},
                              None)
    text = report.durations_markdown("smoke", tmp_path / "smoke")
    assert "No single `make reproduce`" in text and "abc1234"[:7] in text and "def5678" in text


def test_an_oracle_block_below_two_is_refused_in_one_line_before_any_target_loads(capsys):
    from xpress.__main__ import main

    assert main(["bench", "oracle-ceiling", "--preset", "smoke", "--block-size", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--block-size 1" in err and "use 2 or more" in err


def test_a_smoke_run_writes_only_under_its_preset(tmp_path):
    """Results and figures are kept per preset: a smoke run (as `make test` makes one) writes under
    <results>/smoke/ and nowhere else, so the committed results/cpu/ cannot be touched by it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XPRESS_RESULTS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = ("import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt;"
            "from xpress.plots import save_fig; save_fig(plt.figure(), 'probe', 'smoke');"
            "from xpress.__main__ import main; raise SystemExit(main(['bench', 'oracle-ceiling', '--preset', 'smoke',"
            "'--n-prompts', '1', '--max-new-tokens', '4', '--repeats', '1', '--block-size', '4', '--no-progress']))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    written = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.parts[0] == "smoke" for p in written), written
    assert {"smoke/oracle_ceiling.json", "smoke/figures/probe.png"} <= {p.as_posix() for p in written}
    ceiling = json.loads((tmp_path / "smoke" / "oracle_ceiling.json").read_text())
    assert (ceiling["block_size"], ceiling["preset_block_size"]) == (4, 8)  # --block-size, not the preset's B


def test_batch_cache_study_compares_the_two_caches(tmp_path, monkeypatch):
    """Both caches decode the same groups; the per-row cache's rows all equal batch-1 AR; the ratio column is
    rows over shared per repeat; a target without the fused kernels is one error naming the setting."""
    import xpress.paths
    from xpress import kernels
    from xpress.config import load_config
    from xpress.studies.batch_cache import run_batch_cache
    from xpress.targets import load_target

    if kernels.fused_cpu() is None:
        pytest.skip(f"the fused CPU kernels are not built here: {kernels.status()['reason']}")
    cfg = load_config("smoke", ["target.kernels=fused"])
    target = load_target(cfg)
    monkeypatch.setattr(xpress.paths, "RESULTS", tmp_path)
    res = run_batch_cache(cfg, target, batch_sizes=[1, 3], n_prompts=3, max_new_tokens=6, repeats=3, progress=False)
    assert [(r["batch_size"], r["cache"]) for r in res["table"]] == [(3, "rows"), (3, "shared")]
    rows = res["table"][0]
    assert rows["same_as_ar_b1"] == 1.0 and rows["divergences"] == []
    assert rows["tokens_per_s_min"] <= rows["tokens_per_s"] <= rows["tokens_per_s_max"]
    assert len(res["runs"]) == 3 * 2 and (tmp_path / cfg.preset / "batch_cache.json").is_file()
    with pytest.raises(ValueError, match="target.kernels=fused"):
        monkeypatch.setattr("xpress.targets.per_row_cache", lambda t: False)
        run_batch_cache(cfg, target, progress=False, save=False)
