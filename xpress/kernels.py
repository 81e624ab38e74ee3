"""The project's C++ kernels (``xpress/csrc/``), compiled on first use and cached.

:func:`fused_cpu` builds ``xpress/csrc/fused_cpu.cpp`` with ``torch.utils.cpp_extension`` (g++ and ninja;
about a minute once, then loaded from ``<repo>/.cache/kernels/`` or ``$XPRESS_CACHE/kernels/``) and returns
the module, or None with the reason in :func:`status` where it cannot: a CPU without AVX2 and FMA, no
compiler, a failed build, or ``XPRESS_KERNELS=0`` in the environment. Callers fall back to the Python path
(:mod:`xpress.runtime`), which computes the same thing with PyTorch operations.

The kernels split their work over torch's threads with ``at::parallel_for``, which ATen's headers expand to
an OpenMP region: compiled without ``-fopenmp`` that region runs on one thread, whatever
``torch.set_num_threads`` says (on a 2-core EPYC: 51 G float32 multiply-adds/s instead of 103, and a
16-row product at half speed). So the module is built with OpenMP (``-fopenmp``, against the ``libgomp``
torch itself loads) and, where the compiler cannot, without it; :func:`status` says which (``"openmp"``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .cpu import cpu_flags
from .paths import REPO_ROOT, cache_dir

SOURCE = REPO_ROOT / "xpress" / "csrc" / "fused_cpu.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"]  # no contraction the source does not write
OPENMP = ["-fopenmp"]  # at::parallel_for is an OpenMP region in ATen's headers: without it, one thread
EMULATE_AMX = ["-DXP_AMX_EMULATE"]  # csrc/amx_emulate.h: the AMX tiles in software (tests; XPRESS_AMX_EMULATE=1)
_state: dict[str, Any] = {}
_packed: dict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, ...], torch.Tensor]] = {}
# ids of the weights (+ "bf16" for a bf16 copy) -> (the weights, their versions, their packed stack): the copies
# that packed_copy() keeps


def status() -> dict[str, Any]:
    """``{"built": bool, "reason": str, "openmp": bool, "amx": str, "products": str}`` of the last
    :func:`fused_cpu` call (empty before any); ``openmp`` False: built without OpenMP, so the kernels run on one
    thread; ``amx``: ``"tiles"``, ``"none"`` or ``"emulated in software"`` (:func:`amx_emulation_requested`); ``products``:
    ``"bfloat16"`` or ``"float32"``, what :func:`linear` multiplies in (:func:`use_bf16_products`)."""
    if "status" not in _state:
        return {}
    return {**_state["status"], "products": "bfloat16" if bf16_products() else "float32"}


def amx_emulation_requested() -> bool:
    """Whether ``XPRESS_AMX_EMULATE=1``: build the kernels with the AMX tile instructions run in software
    (``xpress/csrc/amx_emulate.h``), so that a CPU with AVX512-BF16 but no tiles runs the tiles' code paths.
    For tests of that code on machines without AMX; slow, and never chosen otherwise. ``status()["amx"]``
    and the target's ``kernels_reason`` say so."""
    return os.environ.get("XPRESS_AMX_EMULATE", "0") == "1"


def bf16_unit(mod) -> str:
    """What the loaded module ``mod`` runs bf16 products on: ``"AMX tiles"``, ``"AMX tiles emulated in
    software"`` or ``"AVX512-BF16"`` (provenance's ``kernels_reason`` and ``attention``)."""
    if not mod.amx_ready():
        return "AVX512-BF16"
    return "AMX tiles emulated in software" if mod.amx_emulated() else "AMX tiles"


def bf16_products() -> bool:
    """Whether :func:`linear` runs bf16 products (AMX tiles or AVX512-BF16; :func:`use_bf16_products`)."""
    return _state.get("bf16_products", False)


def fused_cpu():
    """The compiled fused kernels (``pack``, ``linear``, ``rms_norm``, ``layer``, ``layer_rows``; float32, and
    bf16 products on AMX tiles where ``amx_ready()``, else with AVX512-BF16 where ``bf16_ready()``:
    ``pack_bf16``), or None."""
    if "module" in _state:
        return _state["module"]
    module, reason, openmp = None, "", False
    if os.environ.get("XPRESS_KERNELS", "1") == "0":
        reason = "XPRESS_KERNELS=0"
    elif not _cpu_has_avx2_fma():
        reason = "the CPU lacks AVX2 or FMA"
    elif shutil.which(os.environ.get("CXX", "c++")) is None:
        reason = "no C++ compiler (c++ or $CXX) on PATH"
    else:
        for openmp in (True, False):  # without OpenMP only where the compiler has none
            try:
                module = _build(OPENMP if openmp else [])
                reason = "built" if openmp else f"built without OpenMP (one thread; {reason})"
                break
            except Exception as e:  # a failed build is a fallback, not an error; the reason is recorded
                reason = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        openmp = openmp and module is not None
    _state["module"] = module
    _state["status"] = {"built": module is not None, "reason": reason, "openmp": openmp,
                        "amx": ("none" if module is None or not module.amx_ready() else
                                "emulated in software" if module.amx_emulated() else "tiles")}
    return module


def use_bf16_products(on: bool) -> None:
    """Whether :func:`linear` and :func:`linears` run their products in bf16 (AMX tiles, or AVX512-BF16 on a CPU
    without them) with the weights rounded to bf16 (the inputs are rounded inside, the sums stay float32), for
    weights over a multiple of 32 input features; otherwise float32. The target loader
    (:func:`xpress.targets.load_target`) sets it to whether the target itself runs bf16 products in the fused
    layer, so that a drafter computes at the precision its target does and as bf16 autocast trained it,
    reading half the bytes. ``status()["products"]`` says which. Refused (ValueError) where the module is not
    loaded or the CPU has neither."""
    mod = _state.get("module")
    if on and (mod is None or not mod.bf16_ready()):
        raise ValueError("bf16 products need the fused kernels loaded on a CPU with AMX tiles or AVX512-BF16 "
                         "(fused_cpu().bf16_ready())")
    _state["bf16_products"] = bool(on)


def for_training(setting: str, device: torch.device | str):
    """The compiled kernels for a training computation set to ``setting`` (``train.loss_kernel``,
    ``train.attention_kernel``): ``auto`` on a CPU where they build (:func:`fused_cpu`); None for ``torch`` and
    on other devices (the PyTorch operations)."""
    if setting == "torch" or torch.device(device).type != "cpu":
        return None
    return fused_cpu()


def for_training_name(setting: str, device: torch.device | str) -> str:
    """What :func:`for_training` resolves to here: ``"fused"`` or ``"torch"`` (recorded with a stage)."""
    return "fused" if for_training(setting, device) is not None else "torch"


def memory_read_gb_per_s(nbytes: int = 256 << 20, repeats: int = 3) -> float | None:
    """GB/s this process's threads read from a buffer of ``nbytes`` (the best of ``repeats`` runs of the
    kernel's ``read_rate``: four streams per thread), or None where the kernels are not loaded. A one-token
    step streams the weights, so its time follows this rate; on a VM the rate moves between runs and over
    time, which is why studies record it before and after they time (``xpress.studies.compare.LoadRecord``)."""
    mod = _state.get("module")
    if mod is None:
        return None
    return max(mod.read_rate(nbytes, 1) for _ in range(repeats)) / 1e9


def kernel_for(x: torch.Tensor, *weights: torch.Tensor):
    """The loaded module where :func:`linear` may use it for ``x`` and every one of ``weights``, else None."""
    mod = _state.get("module")
    if mod is None or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        return None
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[0] % 16 for w in weights):
        return None
    return mod


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias; x [..., K], weight [N, K] -> [..., N]) through the fused kernel's
    ``linear`` where this process already loaded it (:func:`fused_cpu`, as the target's fused layers do; this
    never builds it), autograd is off, both are float32 on the CPU and N is a multiple of 16; else F.linear.

    The weight is packed once and the copy kept (weakly, per tensor) until the tensor changes in place. At a
    few rows on two cores the kernel runs a small drafter's products 1.4-3x faster than F.linear: it streams
    each packed panel once, where the library's general kernel is tuned for larger products. The kernel is
    row-invariant (a row's output does not depend on the other rows), F.linear is not. Where the target runs
    bf16 products (:func:`use_bf16_products`), so does this, for weights over a multiple of 32 inputs."""
    mod = kernel_for(x, weight)
    if mod is None:
        return F.linear(x, weight)
    out = mod.linear(x.reshape(-1, x.shape[-1]).contiguous(), packed_copy(mod, (weight,)))  # [M, N]
    return out.view(*x.shape[:-1], weight.shape[0])


def linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, w)`` for each of ``weights`` (all [N_i, K]) -> one [..., N_i] per weight. Where
    :func:`linear` would use the kernel for all of them, this is ONE product on the weights stacked along
    the outputs (packed once, kept until one changes): one call and one parallel region instead of several,
    and the threads share more output panels (a drafter's 192-wide key and value products split 2:1 over
    two threads). The kernel computes each output column alone, so the results equal separate calls' bit
    for bit; they are views into one [..., sum N_i] tensor."""
    mod = kernel_for(x, *weights)
    if mod is None or len(weights) == 1:
        return tuple(linear(x, w) for w in weights)
    out = mod.linear(x.reshape(-1, x.shape[-1]).contiguous(), packed_copy(mod, weights))
    return out.view(*x.shape[:-1], -1).split([w.shape[0] for w in weights], dim=-1)


def packed_copy(mod, weights: tuple[torch.Tensor, ...], combine=None) -> torch.Tensor:
    """The kernel's packed copy of ``weights`` stacked along the outputs (or of ``combine(*weights)``, a
    [N, K] weight: e.g. ``xpress.runtime.interleave_gate_up``), made once and kept (weakly: it goes with any
    of the weights) until one of them changes in place."""
    bf16 = bf16_products() and weights[0].shape[1] % 32 == 0  # the AMX tiles' depth
    key = tuple(id(w) for w in weights) + (("bf16",) if bf16 else ()) + ((id(combine),) if combine else ())
    kept = _packed.get(key)
    versions = tuple(version(w) for w in weights)
    if kept is None or any(r() is not w for r, w in zip(kept[0], weights)) or kept[1] != versions:
        refs = tuple(weakref.ref(w, lambda _, k=key: _packed.pop(k, None)) for w in weights)  # dropped with any
        stacked = (combine(*(w.detach() for w in weights)) if combine else
                   torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach())
        kept = _packed[key] = (refs, versions, (mod.pack_bf16 if bf16 else mod.pack)(stacked.contiguous()))
    return kept[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / rms(x)`` over the last dim (x [..., H], weight [H], H a multiple of 8) in one call of the
    kernel's ``rms_norm`` where :func:`linear` would use the kernel for x; None elsewhere (the caller then
    computes it with PyTorch operations: six of them). The kernel sums the squares in eight lanes, PyTorch
    in its own order: the two agree to float32 rounding, not bit for bit."""
    mod = _state.get("module")
    if (mod is None or torch.is_grad_enabled() or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or x.shape[-1] % 8 or x.numel() == 0):
        return None
    return mod.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps).view(x.shape)


def version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (-1 for an inference tensor, which keeps none): a copy made
    from ``t`` is stale once this changes."""
    return -1 if t.is_inference() else t._version


def _build(extra: list[str]):
    from pathlib import Path

    from torch.utils.cpp_extension import load, verify_ninja_availability

    venv_bin = str(Path(sys.executable).parent)  # pip's ninja sits beside python, maybe not on PATH
    if shutil.which("ninja") is None and venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    verify_ninja_availability()
    flags = FLAGS + extra + (EMULATE_AMX if amx_emulation_requested() else [])
    sources = b"".join(p.read_bytes() for p in sorted(SOURCE.parent.glob("*.[ch]*")))  # the .cpp and its headers
    digest = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()[:12]
    folder = cache_dir() / "kernels" / f"fused_cpu-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print("xpress: compiling the fused CPU kernels (once, about a minute) ...", file=sys.stderr, flush=True)
    return load(name=f"xpress_fused_cpu_{digest}", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=extra,
                build_directory=str(folder), verbose=False)


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()
