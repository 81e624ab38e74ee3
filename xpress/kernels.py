"""The project's C++ kernels (``xpress/csrc/``), compiled on first use and cached.

:func:`fused_cpu` builds ``xpress/csrc/fused_cpu.cpp`` with ``torch.utils.cpp_extension`` (g++ and ninja;
about a minute once, then loaded from ``<repo>/.cache/kernels/`` or ``$XPRESS_CACHE/kernels/``) and returns
the module, or None with the reason in :func:`status` where it cannot: a CPU without AVX2 and FMA, no
compiler, a failed build, or ``XPRESS_KERNELS=0`` in the environment. Callers fall back to the Python path
(:mod:`xpress.runtime`), which computes the same thing with PyTorch operations.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from typing import Any

from .paths import REPO_ROOT, cache_dir

SOURCE = REPO_ROOT / "xpress" / "csrc" / "fused_cpu.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"]  # no contraction the source does not write
_state: dict[str, Any] = {}


def status() -> dict[str, Any]:
    """``{"built": bool, "reason": str}`` of the last :func:`fused_cpu` call (empty before any)."""
    return dict(_state.get("status", {}))


def fused_cpu():
    """The compiled fused float32 kernels (``pack``, ``linear``, ``rms_norm``, ``layer``), or None."""
    if "module" in _state:
        return _state["module"]
    module, reason = None, ""
    if os.environ.get("XPRESS_KERNELS", "1") == "0":
        reason = "XPRESS_KERNELS=0"
    elif not _cpu_has_avx2_fma():
        reason = "the CPU lacks AVX2 or FMA"
    elif shutil.which(os.environ.get("CXX", "c++")) is None:
        reason = "no C++ compiler (c++ or $CXX) on PATH"
    else:
        try:
            module = _build()
            reason = "built"
        except Exception as e:  # a failed build is a fallback, not an error; the reason is recorded
            reason = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    _state["module"] = module
    _state["status"] = {"built": module is not None, "reason": reason}
    return module


def _build():
    from pathlib import Path

    from torch.utils.cpp_extension import load, verify_ninja_availability

    venv_bin = str(Path(sys.executable).parent)  # pip's ninja sits beside python, maybe not on PATH
    if shutil.which("ninja") is None and venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    verify_ninja_availability()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    folder = cache_dir() / "kernels" / f"fused_cpu-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print("xpress: compiling the fused CPU kernels (once, about a minute) ...", file=sys.stderr, flush=True)
    return load(name=f"xpress_fused_cpu_{digest}", sources=[str(SOURCE)], extra_cflags=FLAGS,
                build_directory=str(folder), verbose=False)


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags
