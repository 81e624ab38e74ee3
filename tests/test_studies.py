"""The method comparison study and the pipeline's notebook selection."""
import json

import pytest

from xpress import paths
from xpress.config import ConfigError
from xpress.pipeline import notebooks, select
from xpress.studies.compare import compare_methods, summarize_rows


def test_summarize_rows_by_hand():
    rows = [
        {"bench": "a", "id": "a0", "method": "ar", "tokens": 10, "steps": 10, "seconds": 2.0, "lossless": True},
        {"bench": "a", "id": "a0", "method": "x", "tokens": 10, "steps": 4, "seconds": 1.0, "lossless": True},
        {"bench": "b", "id": "b0", "method": "ar", "tokens": 20, "steps": 20, "seconds": 2.0, "lossless": True},
        {"bench": "b", "id": "b0", "method": "x", "tokens": 20, "steps": 5, "seconds": 4.0, "lossless": False},
    ]
    s = {(r["method"], r["bench"]): r for r in summarize_rows(rows)}
    assert s[("x", "a")]["tau"] == pytest.approx(2.5) and s[("x", "b")]["tau"] == pytest.approx(4.0)
    assert s[("x", "a")]["speedup"] == pytest.approx(2.0)      # 5 tok/s AR vs 10 tok/s
    assert s[("x", "b")]["speedup"] == pytest.approx(0.5)      # 10 tok/s AR vs 5 tok/s
    assert s[("x", "avg")]["tau"] == pytest.approx(3.25)       # the mean over benchmarks, as the paper averages
    assert s[("x", "avg")]["speedup"] == pytest.approx(1.25)
    assert not s[("x", "avg")]["lossless"] and s[("ar", "avg")]["lossless"]


def test_compare_methods_on_reference_drafters(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    result = compare_methods(cfg, target, methods=["oracle", "random"], per_benchmark=1, max_new_tokens=8,
                             progress=False)
    summary = {(r["method"], r["bench"]): r for r in result["summary"]}
    assert all(r["lossless"] for r in result["rows"])
    assert summary[("oracle", "avg")]["tau"] > summary[("random", "avg")]["tau"]
    assert {r["bench"] for r in result["rows"]} == set(cfg.data.benchmarks)
    saved = json.loads((tmp_path / cfg.preset / "methods_t0.json").read_text())
    assert saved["provenance"]["preset"] == cfg.preset and "load_average_after" in saved["provenance"]
    assert (tmp_path / cfg.preset / "methods_t0.csv").is_file()


def test_select_notebooks():
    assert select() == notebooks() and [p.name[:2] for p in notebooks()] == sorted(p.name[:2] for p in notebooks())
    assert [p.name for p in select(["03"])] == ["03_cotraining.ipynb"]
    with pytest.raises(ConfigError, match="no notebook matches 'nosuch'.*00_environment"):
        select(["nosuch"])


def test_readme_results_agree_with_files():
    """README.md's measured numbers are generated from results/<preset>/ (python -m xpress report)."""
    from xpress.report import README, render

    text = README.read_text()
    for preset in ("cpu",):
        assert render(preset, text) == text, (f"README.md disagrees with results/{preset}/: run "
                                              f"`python -m xpress report --preset {preset}`")
