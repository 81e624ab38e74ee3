"""Shared fixtures: the smoke preset and its target (a tiny seeded random Llama), loaded once; and
``torchrun``, the launcher of the several-process tests."""
import subprocess
import sys
from pathlib import Path

import pytest

from xpress import paths
from xpress.config import load_config
from xpress.targets import load_target


@pytest.fixture(scope="session")
def cfg():
    return load_config("smoke")


@pytest.fixture(scope="session")
def target(cfg):
    """Never modify it in a test: every test file shares it."""
    return load_target(cfg)


@pytest.fixture(scope="session")
def smoke(target):
    return target


@pytest.fixture(scope="session")
def torchrun():
    """``torchrun(*args, env=..., nproc=2)``: ``torchrun --standalone --nproc_per_node nproc *args`` from
    the repository root (gloo on the CPU), output captured. Skips when torchrun is not beside python."""
    exe = Path(sys.executable).with_name("torchrun")
    if not exe.is_file():
        pytest.skip("torchrun is not installed beside this python")

    def run(*args: str, env: dict[str, str], nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), "--standalone", "--nproc_per_node", str(nproc), *args], capture_output=True,
                              text=True, cwd=paths.REPO_ROOT, env=env, timeout=timeout)

    return run
