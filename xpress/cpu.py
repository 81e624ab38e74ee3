"""What the CPU offers, from ``/proc/cpuinfo``: the one place its flags are read (and where oneDNN's bf16
support is asked).

Used to choose the target's dtype and kernels (:mod:`xpress.runtime`, :mod:`xpress.kernels`) and the
preset's ``on_bf16`` overrides (:mod:`xpress.config`); every provenance block records the result.

``XPRESS_CPU_CLASS=avx2`` in the environment makes the project choose as on a CPU with AVX2 and neither
AVX-512 nor AMX (the flags lose every ``avx512*`` and ``amx*`` entry and oneDNN's bf16 is reported absent),
so the AVX2-only class's runtime, dtype and kernel choices can be run on a newer CPU; ``amx`` (on a CPU with
AVX512-BF16) adds the AMX-BF16 flags, so the choices of that class are run (row blocks of bf16 products;
``XPRESS_AMX_EMULATE=1`` runs the fused kernels' tile code in software, :mod:`xpress.kernels`). It changes the
project's choices only, not the instructions the libraries use (``ONEDNN_MAX_CPU_ISA=AVX2`` and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` bound oneDNN's and MKL's); provenance records it
(``cpu_features["simulated_class"]``, :func:`simulated_class`).
"""
from __future__ import annotations

import functools
import os

CPU_CLASS_ENV = "XPRESS_CPU_CLASS"
CLASSES = ("native", "avx2", "amx")
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})


def simulated_class() -> str:
    """``native`` or the class that ``$XPRESS_CPU_CLASS`` simulates; a value not in :data:`CLASSES` is a
    one-line ``ValueError`` naming them."""
    name = os.environ.get(CPU_CLASS_ENV, "").strip() or "native"
    if name not in CLASSES:
        raise ValueError(f"{CPU_CLASS_ENV}={name!r}: use one of {', '.join(CLASSES)} (or leave it unset)")
    return name


@functools.lru_cache(maxsize=None)
def _proc_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of the first processor in ``/proc/cpuinfo`` (empty where there is none), less
    what the simulated class (:func:`simulated_class`) lacks."""
    flags, simulated = _proc_flags(), simulated_class()
    if simulated == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    if simulated == "amx":
        if "avx512_bf16" not in flags:
            raise ValueError(f"{CPU_CLASS_ENV}=amx needs a CPU with AVX512-BF16 (oneDNN's bf16 kernels); this one "
                             f"has none: leave {CPU_CLASS_ENV} unset")
        return flags | AMX_FLAGS
    return flags


def bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively: AMX-BF16 tiles or AVX512-BF16 (VDPBF16PS), the two on which
    ``target.kernels: auto`` takes the fused bf16 layer (:func:`xpress.targets.choose_kernels`) and a preset's
    ``on_bf16`` sizes apply (:func:`xpress.config.bf16_applies`)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def onednn_bf16() -> bool:
    """Whether oneDNN (in this torch) has bf16 kernels for this CPU (AVX512-BF16 or AMX-BF16); False under a
    simulated class without them."""
    import torch

    if simulated_class() == "avx2":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
