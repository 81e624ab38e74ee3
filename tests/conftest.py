"""Shared fixtures: the smoke preset and its target (a tiny seeded random Llama), loaded once; and
``torchrun``, the launcher of the several-process tests."""
import subprocess
import sys
from pathlib import Path

import pytest

from xpress import kernels, paths
from xpress.config import load_config
from xpress.targets import load_target


@pytest.fixture(autouse=True)
def _float32_drafter_products():
    """Each test starts with the drafters' products in float32: ``kernels.use_bf16_products`` is process state
    that loading a bf16 target on an AMX CPU turns on (xpress.targets), and a test must not inherit it from
    whichever test loaded a target before it. A test that loads such a target gets bf16 products from then on."""
    kernels.use_bf16_products(False)
    yield


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
