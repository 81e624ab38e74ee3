"""scripts/device_check.sh: its GPU plan fits one 10-minute device run, and its CPU dry run (every step at tiny
shapes) writes every step's status and its files under a folder named after the detected device, a failing
step leaving the others to run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from xpress import paths
from xpress.__main__ import build_parser

SCRIPT = paths.REPO_ROOT / "scripts" / "device_check.sh"
DEVICE_RUN_S = 600  # one command on a lent GPU machine
DEVICE_FILES = 8  # what one device run brings back
STATUS = re.compile(r"^([a-z0-9-]+): (ok|skipped \(.+\)|timed out \(.+\)|failed \(.+\))(?: in (\d+) s)?$")


def plan() -> tuple[dict[str, tuple[int, int]], int, int]:
    """The script's STEP_PLAN {name: (GPU limit, dry-run limit)}, STARTUP_S and TOTAL_S's default."""
    text = SCRIPT.read_text()
    block = re.search(r'^STEP_PLAN="(.*?)"$', text, flags=re.S | re.M)[1]
    steps = {name: (int(gpu), int(dry)) for name, gpu, dry in (line.split() for line in block.splitlines())}
    startup = int(re.search(r"^STARTUP_S=(\d+)", text, flags=re.M)[1])
    total = int(re.search(r"^TOTAL_S=\$\{DEVICE_CHECK_TOTAL:-(\d+)\}", text, flags=re.M)[1])
    return steps, startup, total


def bench_studies() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(next(a for a in sub.choices["bench"]._actions if a.dest == "study").choices)


def device_check(out, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), "OMP_NUM_THREADS": "1",
                               **env})


def statuses(steps_txt) -> dict[str, tuple[str, str]]:
    out = {}
    for line in steps_txt.read_text().splitlines():
        hit = STATUS.match(line)
        if hit:
            out[hit[1]] = (hit[2].split(" (")[0], line)
    return out


def test_the_gpu_plan_fits_one_device_run():
    steps, startup, total = plan()
    assert list(steps) == ["train-memory", "train-2rank", "compiled-eager", "latency"]  # priority order
    assert sum(gpu for gpu, _ in steps.values()) + startup <= DEVICE_RUN_S
    assert total <= DEVICE_RUN_S - 20  # no step starts after the budget, and each one's limit is cut to it
    assert all(0 < dry <= gpu for gpu, dry in steps.values())


def test_cpu_dry_run_runs_every_step(tmp_path):
    proc = device_check(tmp_path, "--cpu-dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu"]  # the detected device names the folder
    folder = tmp_path / "cpu"
    got = statuses(folder / "steps.txt")
    studies = bench_studies()
    for name in plan()[0]:
        assert name in got, f"steps.txt has no status for {name}:\n{(folder / 'steps.txt').read_text()}"
        state, line = got[name]
        if state == "skipped":  # only for what a CPU cannot run, or a study this tree does not have yet
            assert ("needs 2 GPUs" in line) if name == "train-2rank" else (name not in studies and "no " in line), line
        else:
            assert state == "ok", line
    assert got["latency"][0] == "ok"
    latency = json.loads((folder / "latency.json").read_text())
    assert latency["provenance"]["preset"] == "cpu" and latency["config"]["device"] == "cpu"
    for name, result in (("train-memory", "train_memory.json"), ("compiled-eager", "compiled_eager.json")):
        assert (folder / result).is_file() == (got[name][0] == "ok")
    log = (folder / "device_check.log").read_text()
    assert "=== latency" in log and "gpu_latency.py" in log  # one log, every step's commands and output
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= DEVICE_FILES, files


def test_a_failing_step_leaves_the_others(tmp_path):
    proc = device_check(tmp_path, "--cpu-dry-run", STEPS="latency train-2rank", DEVICE_CHECK_LIMITS="latency=1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = (tmp_path / "cpu" / "steps.txt").read_text()
    got = statuses(tmp_path / "cpu" / "steps.txt")
    assert got["latency"][0] == "timed out" and "limit 1 s" in got["latency"][1]
    assert got["train-2rank"][0] == "skipped"  # the step after it still ran and said how it ended
    assert text.index("latency:") < text.index("train-2rank:") < text.index("total:")
    assert "=== latency (limit 1 s)" in (tmp_path / "cpu" / "device_check.log").read_text()


def test_bad_invocations_stop_with_one_line(tmp_path):
    proc = device_check(tmp_path, "--gpu")
    assert proc.returncode == 2 and "unknown argument --gpu" in proc.stderr and "--cpu-dry-run" in proc.stderr
    proc = device_check(tmp_path, CUDA_VISIBLE_DEVICES="")  # not a dry run, and no GPU
    assert proc.returncode == 2 and "torch sees no GPU" in proc.stderr and "--cpu-dry-run" in proc.stderr
    assert not (tmp_path / "cpu").exists()
