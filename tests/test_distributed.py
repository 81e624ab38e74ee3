"""Several processes (:mod:`xpress.distributed`) on the smoke preset, 2 gloo CPU processes under
torchrun: the studies give the one-process results (tau, tokens, steps exactly); ranks that disagree on
the config, or one that dies or hangs, stop every rank with one line and leave nothing written."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from xpress import distributed

PY = sys.executable


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "XPRESS_DATA": str(root / "data"), "XPRESS_CHECKPOINTS": str(root / "checkpoints"),
            "XPRESS_RESULTS": str(root / "results"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


def _rank_stderr(logs: Path) -> dict[int, str]:
    """Each rank's stderr, from torchrun's ``--log-dir logs --redirects 3``."""
    return {int(f.parent.name): f.read_text() for f in logs.glob("*/attempt_0/*/stderr.log")}


def _one_error_line(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in stderr, stderr
    return lines[0]


def _per_rank(torchrun, root: Path, script: str, **env: str):
    """``script`` (bash, ``$RANK`` set) on 2 ranks; returns (completed process, {rank: stderr})."""
    proc = torchrun("--log-dir", str(root / "logs"), "--redirects", "3", "--no-python", "bash", "-c", script,
                    env=_env(root, **env), timeout=300)
    return proc, _rank_stderr(root / "logs")


# ------------------------------------------------------------------------------------- one process
def test_one_process_is_the_identity(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.setup() == 1 and distributed.world_size() == 1 and distributed.is_main()
    assert distributed.split(range(5)) == [0, 1, 2, 3, 4]
    assert distributed.gather_ordered([3, 1, 2], key=lambda x: x) == [3, 1, 2], "one process: no reordering"
    assert distributed.gather({"a": 1}) == [{"a": 1}]
    distributed.agree("config hash", {"x": 1}, "unused")
    assert distributed.on_main(lambda: 7) == 7
    assert distributed.describe() == {"world_size": 1, "devices": ["cpu"]}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed.split(range(8)) == [1, 4, 7] and not distributed.is_main()
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "soon")
    with pytest.raises(distributed.DistributedError, match=distributed.TIMEOUT_ENV):
        distributed.timeout_s()


# ---------------------------------------------------------------------------------- the studies
# Each study with small overrides. The three run in one process (and in one torchrun launch of two), so
# python, torch and the target are loaded once per rank instead of once per study and rank.
STUDIES = {
    "resolution": ["eval.resolution_prompts=2", "eval.resolution_batch_size=2", "eval.max_new_tokens=8"],
    "table1": ["eval.max_new_tokens=8", "eval.sampling_seeds=[0]"],
    "batched": ["eval.batch_sizes=[1,2]", "eval.batched_prompts=4", "eval.batched_max_new_tokens=6"],
}
DRIVER = f"""
import importlib, sys
from xpress import distributed
leave = distributed.shutdown
distributed.shutdown = lambda: None  # one process group for the three studies, left at the end
codes = [importlib.import_module("xpress.studies." + name).main(["--preset", "smoke", "--no-progress", *over])
         for name, over in {STUDIES!r}.items()]
leave()
sys.exit(max(codes))
"""


@pytest.fixture(scope="module")
def studies(tmp_path_factory, torchrun) -> dict[str, tuple[dict, dict]]:
    """{study: (its result from one process, from two processes under torchrun)}."""
    import subprocess

    from xpress import paths

    out: dict[int, dict] = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"nproc{nproc}")
        if nproc == 1:
            proc = subprocess.run([PY, "-c", DRIVER], capture_output=True, text=True, cwd=paths.REPO_ROOT,
                                  env=_env(root), timeout=600)
        else:
            proc = torchrun("--no-python", PY, "-c", DRIVER, env=_env(root), nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        folder = root / "results" / "smoke"
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.{e}" for n in STUDIES for e in ("csv", "json")), \
            "each written once, no temporaries"
        out[nproc] = {n: json.loads((folder / f"{n}.json").read_text()) for n in STUDIES}
    return {n: (out[1][n], out[2][n]) for n in STUDIES}


TIMED = ("seconds", "prefill_s", "forward_s", "draft_s", "refine_s", "verify_s", "bookkeeping_s")


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in rows]


def test_resolution_two_processes_equal_one(studies):
    one, two = studies["resolution"]
    assert len(one["rows"]) >= 8 and len({(r["bench"], r["id"]) for r in one["rows"]}) >= 4  # >= 2 batches
    for k in ("rows", "taus", "table", "prompts_needed", "methods", "batch_size", "temperatures"):
        assert two[k] == one[k], k
    assert one["provenance"]["world_size"] == 1 and one["provenance"]["devices"] == ["cpu"]
    assert two["provenance"]["world_size"] == 2 and two["provenance"]["devices"] == ["cpu", "cpu"]


def test_table1_taus_two_processes_equal_one(studies):
    one, two = studies["table1"]
    assert len({(r["bench"], r["id"]) for r in one["rows"]}) >= 2, "too few prompts to split"
    assert _untimed(two["rows"]) == _untimed(one["rows"])  # accepted lengths: tokens, steps, lossless, per prompt
    cells = lambda res: [{k: r[k] for k in ("temperature", "method", "bench", "tau", "tau_sd", "prompts", "lossless")}
                         for r in res["summary"]]
    assert cells(two) == cells(one)
    assert two["bootstrap_tau_ratio"] == one["bootstrap_tau_ratio"] and two["prompts_needed"] == one["prompts_needed"]
    assert [g["tau_ratio"] for g in two["gains"]] == [g["tau_ratio"] for g in one["gains"]]
    assert two["provenance"]["world_size"] == 2 and two["provenance"]["devices"] == ["cpu", "cpu"]


def test_batched_counts_two_processes_equal_one(studies):
    one, two = studies["batched"]
    assert len(one["runs"]) == (4 + 2) * len(one["methods"])  # calls at batch 1 and 2: split over the ranks
    assert _untimed(two["runs"]) == _untimed(one["runs"])  # tokens, steps and same_as_ar_b1 per call
    counts = lambda res: [{k: r[k] for k in ("batch_size", "method", "sequences", "tokens", "steps", "tau",
                                             "same_as_ar_b1")} for r in res["table"]]
    assert counts(two) == counts(one) and two["prompt_ids"] == one["prompt_ids"]
    assert two["provenance"]["world_size"] == 2 and two["provenance"]["devices"] == ["cpu", "cpu"]


# ----------------------------------------------------------------------------------- misconfiguration
DATA = ["data.n_train_prompts=4", "data.n_val_prompts=2", "data.regen_shard_size=2"]
REGEN = f"-m xpress regenerate --preset smoke --no-progress {' '.join(DATA)}"


def test_ranks_with_other_configs_stop_with_one_line(tmp_path, torchrun):
    proc, err = _per_rank(torchrun, tmp_path, f"exec {PY} {REGEN} data.regen_max_new_tokens=$((8 + RANK))")
    assert proc.returncode != 0 and set(err) == {0, 1}, proc.stderr[-2000:]
    for r in (0, 1):  # both ranks know (one all_gather), both say the same
        line = _one_error_line(err[r])
        assert "rank 1 has config hash" in line and "rank 0 has" in line and "same --preset and overrides" in line
    assert not (tmp_path / "data").exists(), "nothing may be written"


@pytest.mark.parametrize("rank1", ["import xpress.distributed as d; d.setup()",  # joins, then dies
                                   "import time, xpress.distributed as d; d.setup(); time.sleep(120)"])  # hangs
def test_a_dead_or_hung_rank_stops_the_others_with_one_line(tmp_path, torchrun, rank1):
    script = f'if [ "$RANK" = 1 ]; then exec {PY} -c "{rank1}"; fi; exec {PY} {REGEN}'
    proc, err = _per_rank(torchrun, tmp_path, script, XPRESS_DIST_TIMEOUT="4")
    assert proc.returncode != 0, proc.stderr[-2000:]
    line = _one_error_line(err[0])
    assert "another rank died" in line and "XPRESS_DIST_TIMEOUT=4" in line
    assert not (tmp_path / "data").exists(), "nothing may be written"


def test_training_ranks_with_other_configs_stop_with_one_line(tmp_path, torchrun, target, monkeypatch):
    from xpress import paths
    from xpress.config import load_config
    from xpress.train.regenerate import regenerate

    data = [*DATA, "data.regen_max_new_tokens=8"]
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    regenerate(load_config("smoke", data), target, progress=False)
    train = (f"exec {PY} -m xpress train --preset smoke --method xpress --no-progress {' '.join(data)} train.steps=2 "
             f"train.warm_start_steps=0 train.eval_every=0 train.eval_prompts=0 train.lr=$((RANK + 1))e-3")
    proc, err = _per_rank(torchrun, tmp_path, train)
    assert proc.returncode != 0 and set(err) == {0, 1}, proc.stderr[-2000:]
    for r in (0, 1):
        line = _one_error_line(err[r])
        assert "rank 1 has config hash" in line and "--method and overrides" in line
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results").exists(), "nothing may be written"
