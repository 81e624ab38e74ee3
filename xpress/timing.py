"""Timing on a shared machine: medians over repeats, interleaved sweeps, paired ratios.

Every timed number of the project comes from these functions, so they all follow the same rules: untimed
warm-up calls first, the clock read after the device finished (:func:`xpress.utils.now`), medians with the
quartiles beside them, and components compared in interleaved sweeps or paired rounds so that a slow
spell of the machine falls on every side of a ratio alike.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from .utils import now


def time_call(fn: Callable[[], Any], repeats: int, warmup: int, device: torch.device | str) -> dict[str, float]:
    """Wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, waiting for the device
    (:func:`xpress.utils.now`): median, first and third quartile, IQR and the mean, in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        samples.append((now(device) - t0) * 1e3)
    return summary(samples)


def time_calls(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int, device: torch.device | str
               ) -> dict[str, dict[str, float]]:
    """:func:`time_call` for several components at once, interleaved: after ``warmup`` untimed calls of
    each, every repeat is one sweep that times each component once, the sweep's order rotated by one
    place each repeat. Each timed call comes right after an untimed call of the same component, so it
    starts from that component's own warm caches, as in :func:`time_call` (without it, a call would find
    whatever the previous component left: another head's weights, or a float32 readout twice the size).
    A slow spell of the machine then falls on all the components of a sweep, not on the repeats of one.
    Returns {name: the :func:`time_call` dict}, in the order of ``fns``."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fns[name]()  # untimed: the component's own weights in cache
            t0 = now(device)
            fns[name]()
            samples[name].append((now(device) - t0) * 1e3)
    return {name: summary(samples[name]) for name in names}


def summary(samples: list[float]) -> dict[str, float]:
    """Median, first and third quartile, IQR and mean of ``samples`` (ms), and their number."""
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return {"median_ms": med, "q1_ms": q1, "q3_ms": q3, "iqr_ms": q3 - q1, "mean_ms": statistics.fmean(samples),
            "repeats": len(samples)}


def paired_ratio(num: Callable[[], Any], den: Callable[[], Any], rounds: int, repeats: int, warmup: int,
                 device: torch.device | str, scale: float = 1.0) -> dict[str, Any]:
    """``scale * t(num) / t(den)`` measured ``rounds`` times, each round timing the two back to back
    (:func:`time_call` medians; the order alternates between rounds), so that a slow spell of the machine
    lands on both sides of one value instead of on one component of the ratio. Returns the ``median``
    over the rounds, its ``min`` and ``max``, and every round's value (``rounds``)."""
    values = []
    for i in range(rounds):
        if i % 2 == 0:
            t_num = time_call(num, repeats, warmup, device)["median_ms"]
            t_den = time_call(den, repeats, warmup, device)["median_ms"]
        else:
            t_den = time_call(den, repeats, warmup, device)["median_ms"]
            t_num = time_call(num, repeats, warmup, device)["median_ms"]
        values.append(scale * t_num / t_den)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def cuda_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Capture ``fn()`` (static shapes, no host synchronisation) in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
