"""Small shared utilities: seeding, atomic writes, timing, provenance, torch threads and machine load."""
from __future__ import annotations

import json
import os
import random
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a CPU generator seeded the same way."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, records: list[dict]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in records))


def write_result(folder: str | os.PathLike, name: str, payload: Any, rows: Sequence[dict]) -> Path:
    """A measured result: ``<folder>/<name>.json`` (the payload, provenance included) and
    ``<folder>/<name>.csv`` (``rows``, columns in first-seen order), each written atomically."""
    import csv
    import io

    folder = Path(folder)
    atomic_write_json(folder / f"{name}.json", payload)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(folder / f"{name}.csv", buf.getvalue())
    return folder / f"{name}.json"


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                            metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` in one rename."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o777 & ~_UMASK)
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old.{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def synchronize(device: torch.device | str | None) -> None:
    """Wait until the work queued on ``device`` is done (CUDA); a no-op on the CPU or for None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (see :func:`synchronize`):
    the clock to read around GPU work, where kernels run asynchronously."""
    synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Accumulates wall time per named stage: ``with sw("verify"): ...``; ``sw.totals`` in seconds.

    With a ``device`` (CUDA), each stage waits for the device before it stops the clock, so a stage is
    charged for the kernels it queued; stages are meant to follow one another, so the start is not synced.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
            synchronize(self.device)
        finally:
            self.add(stage, time.perf_counter() - t0)

    @staticmethod
    def mark() -> float:
        """The clock now, without waiting (the previous stage ended synchronised): start of :meth:`since`."""
        return time.perf_counter()

    def since(self, start: float) -> float:
        """Seconds from ``start`` (:meth:`mark`) until the device finished what was queued since."""
        return now(self.device) - start

    def add(self, stage: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere (e.g. a drafter's own timings) to ``stage``."""
        self.totals[stage] = self.totals.get(stage, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


class EventSpan:
    """Seconds measured by CUDA events and read back later: a sum of ``(sign, start, end)`` event pairs, a
    constant and spans floored at 0 (:meth:`nonnegative`). ``float()`` waits for the events (one host
    synchronisation; the later waits return at once) and reads ``elapsed_time``; ``+`` and ``-`` with numbers
    or other spans stay lazy, so a decoding round can record its stages without waiting for the device
    (:class:`EventStopwatch`)."""

    def __init__(self, terms: Sequence[tuple[int, Any, Any]] = (), const: float = 0.0,
                 floored: Sequence["EventSpan"] = ()):
        self.terms, self.const, self.floored = list(terms), const, list(floored)

    def _combine(self, other: Any, sign: int) -> "EventSpan":
        if not isinstance(other, EventSpan):
            return EventSpan(self.terms, self.const + sign * float(other), self.floored)
        if sign < 0 and other.floored:
            raise ValueError("cannot subtract a floored EventSpan; take float() first")
        return EventSpan(self.terms + [(s * sign, a, b) for s, a, b in other.terms], self.const + sign * other.const,
                         self.floored + other.floored)

    def __add__(self, other: Any) -> "EventSpan":
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other: Any) -> "EventSpan":
        return self._combine(other, -1)

    def nonnegative(self) -> "EventSpan":
        """This span, read back as ``max(0, value)``."""
        return EventSpan(floored=[self])

    def __float__(self) -> float:
        for _, _, end in self.terms:
            end.synchronize()
        value = self.const + sum(s * a.elapsed_time(b) for s, a, b in self.terms) / 1e3  # elapsed_time: ms
        return value + sum(max(0.0, float(f)) for f in self.floored)


class EventStopwatch:
    """:class:`Stopwatch` on CUDA without host synchronisation: each stage records a start and an end event on
    the current stream and charges an :class:`EventSpan`; :meth:`pop` returns the spans unread, so that the
    caller reads them back once (``float()``, at the end of a generation) instead of waiting for the
    device at every stage end. ``mark()`` / ``since(mark)`` measure a span around a call the same way."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.totals: dict[str, Any] = {}

    @staticmethod
    def mark() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def since(self, start: Any) -> EventSpan:
        return EventSpan([(1, start, self.mark())])

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            self.add(stage, self.since(start))

    def add(self, stage: str, seconds: Any) -> None:
        self.totals[stage] = self.totals.get(stage, 0.0) + seconds

    def pop(self) -> dict[str, Any]:
        out, self.totals = self.totals, {}
        return out


def stage_clock(device: torch.device | str | None) -> "Stopwatch | EventStopwatch":
    """The stage timer for work on ``device``: :class:`EventStopwatch` on CUDA (no synchronisation per stage;
    times read back later), :class:`Stopwatch` elsewhere (a CPU has nothing to wait for)."""
    if device is not None and torch.device(device).type == "cuda":
        return EventStopwatch(device)
    return Stopwatch(device)


DIRTY_LISTED = 20  # provenance lists at most this many of the paths git reports changed or untracked


def provenance(preset: str, **extra: Any) -> dict[str, Any]:
    """What to store beside every measured number: machine, preset, git revision, date, versions."""
    import datetime
    import platform
    import subprocess

    from . import paths

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=paths.REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip()  # porcelain lines may start with a space
        except (OSError, subprocess.SubprocessError):
            return ""

    import transformers

    from .runtime import cpu_features, runtime_choice

    cpu_model = ""
    try:
        cpu_model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                          if line.startswith("model name")), "")
    except OSError:
        pass
    machine = {"platform": platform.platform(), "processor": platform.machine(), "cpu_model": cpu_model,
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "cpu_features": cpu_features()}  # one model name covers EPYCs with and without native bf16
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    changed = git("status", "--porcelain", "--", ".", ":!results").splitlines()  # code not committed
    revision = {"git_revision": git("rev-parse", "HEAD") or "unknown", "git_dirty": bool(changed)}
    if changed:  # what made it dirty, so that a reader can tell a changed module from a stray log file
        revision["git_dirty_files"] = changed[:DIRTY_LISTED] + (
            [f"... and {len(changed) - DIRTY_LISTED} more"] if len(changed) > DIRTY_LISTED else [])
    if os.environ.get("XPRESS_GIT_REVISION"):  # a copy of the tree sent without its history (a lent GPU machine)
        revision = {"git_revision": os.environ["XPRESS_GIT_REVISION"],
                    "git_dirty": os.environ.get("XPRESS_GIT_DIRTY", "0") == "1",
                    "git_from": "XPRESS_GIT_REVISION: the sender's revision, the copy has no history of its own"}
    return {
        "preset": preset,
        **revision,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "target_runtime": runtime_choice(),
        **extra,
    }


def cpu_class(prov: dict, dtype: bool = True) -> str:
    """The CPU's widest matrix feature and (``dtype``) the compute dtype of the last target loaded, from a
    provenance block: e.g. ``"AVX2 only, float32"`` ("" where the block predates the record). Machines share
    model names (a 2-core "AMD EPYC" came with and without AVX512-BF16), and the two run the same stages
    2-3x apart."""
    rt = prov.get("target_runtime") or {}
    f = prov.get("machine", {}).get("cpu_features") or rt.get("cpu_features")
    if not f:
        return ""
    isa = ("AMX-BF16" if f.get("amx_bf16") else "AVX512-BF16" if f.get("avx512_bf16") else
           "AVX-512, no bf16" if f.get("avx512f") else "AVX2 only" if f.get("avx2") else "no AVX2")
    isa += " (simulated: XPRESS_CPU_CLASS)" if f.get("simulated_class") else ""
    return isa + (f", {rt['dtype']}" if dtype and rt.get("dtype") else "") + (
        ", fused C++ layers" if dtype and rt.get("kernels") == "fused" else "") + (
        (", attention on AMX tiles" + (" emulated in software" if "emulated" in str(rt.get("attention")) else "")
         if "AMX" in str(rt.get("attention")) else ", bf16 attention")
        if dtype and str(rt.get("attention", "")).startswith("bf16") else "")


class DeferredInterrupt:
    """Ctrl-C (SIGINT) deferred to a safe point: inside ``with DeferredInterrupt() as stop:`` a SIGINT sets
    ``stop.requested`` instead of raising, and the loop checks it between units of work (a training step),
    so nothing is interrupted half-way. Outside the main thread it does nothing (signals cannot be set)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def __enter__(self) -> "DeferredInterrupt":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        import signal

        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# ============================================================================ threads and machine load
_APPLIED_THREADS: int | None = None  # what apply_torch_threads set last in this process


def physical_cores() -> int:
    """Physical CPU cores this process may run on (psutil's count, capped by the CPU affinity mask)."""
    logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    except ImportError:
        physical = logical
    return max(1, min(physical, usable_cpus()))


def usable_cpus() -> int:
    """Logical CPUs this process may run on (the affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def torch_threads_for(configured: int = 0) -> int:
    """The torch thread count for a config value: ``configured`` when positive; for 0, ``$OMP_NUM_THREADS``
    when set (a caller's explicit choice), else the physical cores (a hyper-thread sibling only adds
    contention to the matrix products)."""
    if configured > 0:
        return configured
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores()


def apply_torch_threads(configured: int = 0) -> int:
    """Set torch's intra-op threads from the config (``torch_threads``, see :func:`torch_threads_for`) and
    return the number in effect. The same value is applied once per process: a later call with it leaves
    alone whatever the caller set since (a test's ``torch.set_num_threads(1)``)."""
    global _APPLIED_THREADS
    n = torch_threads_for(configured)
    if n != _APPLIED_THREADS:
        torch.set_num_threads(n)
        _APPLIED_THREADS = n
    return torch.get_num_threads()


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def other_cpu_use(window: float = 0.5) -> float | None:
    """CPUs kept busy by OTHER processes right now: over ``window`` seconds, the machine's busy CPU time
    (``/proc/stat``) minus this process's own (``os.times``), per second of wall time. Unlike the load
    average (a one-minute mean that still holds this process's own recent work), it tells another job
    from our own. None where ``/proc/stat`` is missing."""
    def sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        t = os.times()
        return sum(fields) - idle, t.user + t.system, time.perf_counter()

    a = sample()
    if a is None:
        return None
    time.sleep(window)
    b = sample()
    if b is None:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = (b[0] - a[0]) / ticks - (b[1] - a[1])
    return max(0.0, busy / max(b[2] - a[2], 1e-9))


def load_check(start: float | None, end: float | None, own_load: float = 0.0,
               cpus: int | None = None, others: Sequence[float | None] = ()) -> dict[str, Any]:
    """Was the machine busy around a measurement? ``start`` and ``end``: 1-minute load averages taken
    before and after it (:func:`load_average`); ``own_load``: what the measurement itself adds to ``end``
    (its torch threads, for a run of a minute or more). Busy: the load of other work above half the
    ``cpus`` (default: :func:`usable_cpus`) at either end. ``others``: CPUs used by other processes
    measured at the ends (:func:`other_cpu_use`); where any was measured, it decides (the load average at
    the start still holds this process's own preceding work). Returns the values to store beside the
    numbers (``load_average_before``, ``load_average_after``, ``other_cpus``, ``busy``, ``load_warning``:
    a sentence, or None)."""
    cpus = cpus or usable_cpus()

    def show(x: float | None) -> str:
        return "?" if x is None else f"{x:.2f}"

    measured = [x for x in others if x is not None]
    if measured:
        busy = any(x > cpus / 2 for x in measured)
        seen = f"other processes kept {', then '.join(show(x) for x in others)} of {cpus} CPUs busy"
    else:
        est = [x for x in (start, None if end is None else end - own_load) if x is not None]
        busy = any(x > cpus / 2 for x in est)
        seen = f"1-minute load average {show(start)} before, {show(end)} after, {own_load:g} of it this run's own, on {cpus} CPUs"
    warning = (f"the machine was busy during this measurement ({seen}): the timings are not trustworthy; "
               f"rerun on an idle machine") if busy else None
    return {"load_average_before": start, "load_average_after": end, "other_cpus": list(others),
            "busy": busy, "load_warning": warning}
