import time

import torch

from xpress.utils import Stopwatch, now, synchronize


def test_stopwatch_accumulates_stages_and_charges_outside_times():
    sw = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with sw("a"):
            time.sleep(0.01)
    sw.add("b", 1.5)
    sw.add("b", 0.5)
    totals = sw.pop()
    assert set(totals) == {"a", "b"} and 0.02 <= totals["a"] < 1.0 and totals["b"] == 2.0
    assert sw.pop() == {}


def test_stopwatch_counts_a_stage_that_raises():
    sw = Stopwatch()
    try:
        with sw("x"):
            raise KeyError
    except KeyError:
        pass
    assert "x" in sw.totals


def test_now_and_synchronize_on_cpu():
    synchronize(None)
    synchronize("cpu")
    t0 = now("cpu")
    assert now(torch.device("cpu")) >= t0 and now() >= t0


def test_portable_paths(tmp_path, monkeypatch):
    """Paths in result files and executed notebooks name no folder of this machine: relative to the
    repository, or to the $XPRESS_* root they are under; other strings are kept."""
    from xpress import paths

    assert paths.portable(paths.REPO_ROOT / "notebooks" / "03_cotraining.ipynb") == "notebooks/03_cotraining.ipynb"
    monkeypatch.setattr(paths, "CHECKPOINTS", tmp_path / "ck")
    monkeypatch.setattr(paths, "DATA", paths.REPO_ROOT / "data")  # under the repository: shown relative to it
    assert paths.portable(tmp_path / "ck" / "cpu" / "warmstart") == "$XPRESS_CHECKPOINTS/cpu/warmstart"
    assert paths.portable(str(paths.REPO_ROOT / "data" / "cpu")) == "data/cpu"
    assert paths.portable(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    assert paths.portable("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
