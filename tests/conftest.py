"""Shared fixtures: the smoke preset and its target (a tiny seeded random Llama), loaded once;
``torchrun``, the launcher of the several-process tests; and ``kill_after_first_shard``, the interruption of
the resume tests."""
import signal
import subprocess
import sys
import time
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


@pytest.fixture(scope="module")
def no_checkpoints(tmp_path_factory):
    """Model drafters start from fresh seeded weights, whatever lies in this machine's checkpoints/ (a module
    takes it with ``pytestmark = pytest.mark.usefixtures("no_checkpoints")``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "CHECKPOINTS", tmp_path_factory.mktemp("checkpoints"))
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine OpenMP's spinning threads
    slow them down many times over (measured: 33 s -> 5 min). Restored afterwards (a module takes it with
    ``pytest.mark.usefixtures("one_thread")``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.fixture(scope="session")
def kill_after_first_shard():
    """``kill_after_first_shard(command, folder, env, timeout)``: run ``command`` from the repository root and
    SIGKILL it as soon as ``folder / "shard-00000"`` exists (a regeneration cut after its first shard); returns
    the ended process. Fails if it ends on its own first or writes no shard within ``timeout`` seconds."""

    def run(command: list[str], folder: Path, env: dict[str, str], timeout: float = 300) -> subprocess.Popen:
        proc = subprocess.Popen(command, cwd=paths.REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not (folder / "shard-00000").is_dir():
                assert proc.poll() is None, "regenerate ended before its first shard appeared"
                assert time.monotonic() < deadline, f"no shard after {timeout} s"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        return proc

    return run
