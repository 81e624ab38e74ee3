import time

import torch

from xpress.utils import Stopwatch, now, synchronize


def test_stopwatch_accumulates_stages_and_charges_outside_times():
    sw = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with sw("a"):
            time.sleep(0.01)
    sw.add("b", 1.5)
    sw.add("b", 0.5)
    totals = sw.pop()
    assert set(totals) == {"a", "b"} and 0.02 <= totals["a"] < 1.0 and totals["b"] == 2.0
    assert sw.pop() == {}


def test_stopwatch_counts_a_stage_that_raises():
    sw = Stopwatch()
    try:
        with sw("x"):
            raise KeyError
    except KeyError:
        pass
    assert "x" in sw.totals


def test_now_and_synchronize_on_cpu():
    synchronize(None)
    synchronize("cpu")
    t0 = now("cpu")
    assert now(torch.device("cpu")) >= t0 and now() >= t0
