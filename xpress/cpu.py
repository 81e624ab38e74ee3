"""What the CPU offers, from ``/proc/cpuinfo``: the one place its flags are read.

Used to choose the target's dtype and kernels (:mod:`xpress.runtime`, :mod:`xpress.kernels`) and the
preset's ``on_bf16`` overrides (:mod:`xpress.config`); every provenance block records the result.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of the first processor in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively: AMX-BF16 tiles or AVX512-BF16 (VDPBF16PS), the two on which
    ``target.kernels: auto`` takes the fused bf16 layer (:func:`xpress.targets.choose_kernels`) and a preset's
    ``on_bf16`` sizes apply (:func:`xpress.config.bf16_applies`)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
