"""Several processes for the embarrassingly parallel jobs (regeneration, the studies), under the
launchers training already uses:

    torchrun --nproc_per_node N -m xpress regenerate --preset P
    accelerate launch -m xpress regenerate --preset P
    torchrun --nproc_per_node N -m xpress.studies.resolution --preset P

The launcher sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`setup` joins the ``torch.distributed`` process group they describe (gloo: only small Python
objects travel, so one backend serves CPUs and GPUs; on CUDA each process takes GPU ``LOCAL_RANK``). A
process group that is already up (accelerate's, in training) is reused. Without those variables, or with
``WORLD_SIZE=1``, nothing is initialised and every function here is the identity of one process.

Work is split by :func:`split` (items ``rank, rank + N, ...``: deterministic, balanced) and merged back by
:func:`gather_ordered`, so a result never depends on N. :func:`agree` compares a value (a config hash)
across ranks at the start. Every collective runs under ``XPRESS_DIST_TIMEOUT`` seconds (default
:data:`DEFAULT_TIMEOUT_S`); a rank that died or hung, or any other failure of a collective, becomes a
:class:`DistributedError` with a one-line message.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
TIMEOUT_ENV = "XPRESS_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 7200.0  # a barrier may wait for the slowest rank's last shard or prompt


class DistributedError(RuntimeError):
    """Ranks that disagree, or one that died or hung; the message (one line) names the cause and the fix."""


def world_size() -> int:
    """The number of processes: the process group's, else ``$WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank() -> int:
    """This process's rank (0 for one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def is_main() -> bool:
    """Rank 0: the process that prints, shows progress and writes the merged files."""
    return rank() == 0


def timeout_s() -> float:
    """Seconds a collective may wait for the other ranks (``$XPRESS_DIST_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set e.g. "
                               f"{TIMEOUT_ENV}=600") from None
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} must be positive; set e.g. {TIMEOUT_ENV}=600")
    return value


def setup() -> int:
    """Join the launcher's process group if there is one (idempotent); return the world size."""
    import torch
    import torch.distributed as dist

    n = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if n <= 1 or (dist.is_available() and dist.is_initialized()):
        return world_size()
    if torch.cuda.is_available():
        local_device("cuda")  # "cuda" = this rank's own GPU
    seconds = timeout_s()
    with _one_line(f"joining the {n} processes at {os.environ.get('MASTER_ADDR', '?')}:"
                   f"{os.environ.get('MASTER_PORT', '?')}"):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    return world_size()


def local_device(device: str) -> str:
    """The device this process computes on, as a string: a bare ``cuda`` becomes this rank's own GPU
    ``cuda:<LOCAL_RANK>`` (the launcher's variable; 0 without one), and that GPU is made current
    (``torch.cuda.set_device``) so that any later bare ``cuda`` is it too. Call it before anything is loaded: a
    model loaded first lands on GPU 0 in every process. Other devices (``cpu``, ``cuda:3``) come back unchanged,
    an explicit GPU index made current as well."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    index = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def shutdown(meet: bool = True) -> None:
    """Leave the process group that :func:`setup` joined (no-op for one process). With ``meet`` (a command
    that finished) the ranks first meet at a barrier, so none tears down its gloo connections while another
    is still inside a collective: a rank that left early once made its peer abort at exit ("terminate called
    without an active exception", a CI run of ``test_two_processes_equal_one``). After a failure there is no
    barrier: the peers may sit in another collective, and a closed connection is what ends their wait."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if meet and dist.get_world_size() > 1:
            with _one_line("the ranks' final barrier"):
                dist.barrier()
    finally:
        dist.destroy_process_group()


@contextmanager
def session() -> Iterator[int]:
    """``with session() as n:`` joins the process group for a command and leaves it at the end (after a
    barrier when the command finished, at once when it raised)."""
    n = setup()
    try:
        yield n
    except BaseException:
        if n > 1:
            shutdown(meet=False)
        raise
    if n > 1:
        shutdown()


@contextmanager
def _one_line(what: str) -> Iterator[None]:
    """Turn a failing collective into a :class:`DistributedError` with one line."""
    try:
        yield
    except DistributedError:
        raise
    except Exception as e:  # DistBackendError, DistStoreError, RuntimeError of gloo: closed peer, timeout
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [""])[0])[:160]  # no gloo source path
        raise DistributedError(
            f"rank {rank()}: {what} failed ({e.__class__.__name__}: {first}): another rank died, was killed or "
            f"waited longer than {TIMEOUT_ENV}={timeout_s():g} s; see that rank's own error, fix it and rerun "
            f"(finished work is kept)") from None


def _active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(obj: T, what: str = "gathering results") -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` for one process."""
    if not _active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    with _one_line(what):
        dist.all_gather_object(out, obj)
    return out


def split(items: Sequence[T]) -> list[T]:
    """This rank's share of ``items``: ``items[rank::world]`` (all of them for one process)."""
    return list(items)[rank()::world_size()]


def gather_ordered(local: Sequence[T], key: Callable[[T], Any], what: str = "gathering results") -> list[T]:
    """Every rank's ``local`` items merged into one list, stably sorted by ``key``: items of equal key
    keep their order within their rank (give the items of one key to one rank, as :func:`split` of the
    keys does, and the merge is the one-process order). One process: ``local`` unchanged."""
    if not _active():
        return list(local)
    merged = [x for part in gather(list(local), what) for x in part]
    return sorted(merged, key=key)


def digest(obj: Any) -> str:
    """A short hash of a JSON-able object (a config, a list of prompts)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def agree(name: str, value: Any, fix: str) -> None:
    """Check that every rank holds the same ``value`` (compared by :func:`digest`); otherwise raise, on
    every rank, ``rank r has <name> X, rank 0 has Y: <fix>``."""
    if not _active():
        return
    mine = digest(value)
    hashes = gather(mine, f"comparing the {name} across ranks")
    for r, h in enumerate(hashes):
        if h != hashes[0]:
            raise DistributedError(f"rank {r} has {name} {h}, rank 0 has {hashes[0]}: {fix}")


def on_main(fn: Callable[[], T], what: str = "rank 0's step") -> T:
    """Run ``fn`` on rank 0 alone and hand its result to every rank; an exception raised there is
    raised on every rank (the same one), so all ranks stop with the same line. One process: ``fn()``."""
    if not _active():
        return fn()
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:
            box[0] = ("error", e)
    with _one_line(what):
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def describe(device: Any = None) -> dict[str, Any]:
    """What produced a measurement: ``{"world_size": N, "devices": [one entry per rank]}`` (each entry the
    rank's device, with the GPU's name on CUDA); for provenance blocks. A collective: call on every rank."""
    import torch

    dev = torch.device(device if device is not None else "cpu")
    name = str(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = f"{dev} ({torch.cuda.get_device_name(dev)})"
    return {"world_size": world_size(), "devices": gather(name, "describing the devices")}
