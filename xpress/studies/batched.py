"""The batched table (the paper's Table 2 analogue): throughput (tokens/s) of AR, dFlash and xPress at
several batch sizes (``eval.batch_sizes``), greedy, on the same prompts in one run.

The prompts (``eval.batched_prompts``, taken round-robin over ``cfg.data.benchmarks`` so every batch
mixes them) are decoded in consecutive groups of ``b``; for each group AR and every method run back to
back (interleaved, as in Table 1). Throughput = tokens / wall seconds summed over the groups: the rows of
one batched call overlap in time, so they are timed by the call's wall clock, never by summing rows.
On the lean runtime with the fused CPU kernels every batched row keeps its own cache row and computes the bits
it would alone (:class:`xpress.decoding.RowKV`), so each equals AR at batch 1; on the other runtimes rows share a
left-padded cache and decode as they would alone only up to floating-point reduction order. Either way the
share of outputs equal to AR at batch 1 is recorded (``same_as_ar_b1``), not asserted, and each differing row's
first divergence with the target's top-2 logit margin there (``divergences``: a near-tie decided by reduction
order has a tiny margin, a bug a large one).

    python -m xpress.studies.batched --preset cpu     # writes results/<preset>/batched.{json,csv}
    torchrun --nproc_per_node N -m xpress.studies.batched --preset cpu    # the groups split over N processes

Several processes (``torchrun`` / ``accelerate launch``, :mod:`xpress.distributed`): at each batch size,
group ``j`` (the same prompts as in one process) is decoded by rank ``j mod N``; the runs are merged back
into the one-process order and rank 0 writes the same files. Tokens and steps equal a one-process run's;
the seconds are each process's own clock, summed, and the provenance records ``world_size`` and
``devices``.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Sequence

from .. import paths
from ..utils import write_result
from ..config import Config
from .compare import (AR, LoadRecord, agree_on_study, benchmark_prompts, fingerprints_of, make_drafters, study_main,
                      warm_up, weights_of)
from .table1 import _all_warnings, _provenance

# The paper's Table 2 (vLLM with FlashAttention-3, Qwen3-8B on one H200, greedy, 1024 generated tokens; arXiv
# 2608.02438): tau (mean over batch sizes) and speedup over AR at batch 16 and 32, per benchmark.
PAPER_TABLE2 = {
    "tau": {"dflash": {"gsm8k": 6.41, "math500": 7.62, "humaneval": 6.40, "mbpp": 5.75, "mt-bench": 3.20},
            "xpress": {"gsm8k": 10.13, "math500": 9.67, "humaneval": 8.05, "mbpp": 7.18, "mt-bench": 4.31}},
    16: {"dflash": {"gsm8k": 3.2, "math500": 3.7, "humaneval": 3.1, "mbpp": 3.2, "mt-bench": 1.8},
         "xpress": {"gsm8k": 4.3, "math500": 4.3, "humaneval": 3.5, "mbpp": 3.6, "mt-bench": 2.2}},
    32: {"dflash": {"gsm8k": 2.1, "math500": 2.6, "humaneval": 2.2, "mbpp": 2.3, "mt-bench": 1.3},
         "xpress": {"gsm8k": 2.9, "math500": 3.1, "humaneval": 2.5, "mbpp": 2.6, "mt-bench": 1.6}},
}


def round_robin(prompts: Sequence[dict]) -> list[dict]:
    """Prompts grouped by benchmark (as :func:`benchmark_prompts` returns them) -> interleaved: the first
    of each benchmark, then the second of each, ..."""
    by_bench: dict[str, list[dict]] = {}
    for p in prompts:
        by_bench.setdefault(p["bench"], []).append(p)
    out = []
    for i in range(max((len(v) for v in by_bench.values()), default=0)):
        out += [v[i] for v in by_bench.values() if i < len(v)]
    return out


def batched_prompts(cfg: Config, target, n: int) -> list[dict]:
    """``n`` benchmark prompts, round-robin over ``cfg.data.benchmarks``."""
    per = math.ceil(n / len(cfg.data.benchmarks))
    prompts = round_robin(benchmark_prompts(cfg, target, per))[:n]
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} benchmark prompts available, eval.batched_prompts={n}")
    return prompts


def throughput_table(runs: Sequence[dict]) -> list[dict]:
    """``runs``: one entry per (batch_size, method, group) with tokens, steps, seconds (wall clock of the
    call), sequences and ``same_as_ar_b1`` (rows equal to AR at batch 1). Returns one row per (batch_size,
    method): tokens, steps, tau, seconds, tokens_per_s, speedup over AR at the same batch size, and the
    share of outputs equal to AR at batch 1."""
    import pandas as pd

    df = pd.DataFrame(runs)
    g = df.groupby(["batch_size", "method"], as_index=False, sort=False).agg(
        sequences=("sequences", "sum"), tokens=("tokens", "sum"), steps=("steps", "sum"),
        seconds=("seconds", "sum"), same=("same_as_ar_b1", "sum"))
    g["tau"] = g["tokens"] / g["steps"]
    g["tokens_per_s"] = g["tokens"] / g["seconds"]
    ar = g[g["method"] == AR].set_index("batch_size")["tokens_per_s"]
    g["speedup"] = g["tokens_per_s"] / g["batch_size"].map(ar)
    g["same_as_ar_b1"] = g["same"] / g["sequences"]
    return g.drop(columns="same").to_dict("records")


def row_divergences(target, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    reference: Sequence[Sequence[int]], first_row: int = 0) -> list[dict]:
    """For each row whose output differs from ``reference`` (AR at batch 1, same prompts), where they part:
    ``{"row": first_row + i, "position", "reference_token", "other_token", "top2_margin"}``
    (:func:`xpress.bench.divergence`; ``position`` None where one output is a prefix of the other)."""
    from ..bench import divergence

    return [{"row": first_row + i, **(divergence(target, p, ref, out) or {"position": None})}
            for i, (p, out, ref) in enumerate(zip(prompts, outputs, reference)) if out != ref]


def run_batched(cfg: Config, target, methods: Sequence[str] | None = None, batch_sizes: Sequence[int] | None = None,
                n_prompts: int | None = None, max_new_tokens: int | None = None, untrained_ok: bool = False,
                progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Measure the batched table (defaults from ``cfg.eval``); with ``save``, write
    ``results/<preset>/batched.{json,csv}`` atomically with provenance. Returns the JSON payload.
    Under a launcher every rank decodes its share of the groups and returns the merged payload; rank 0
    writes it."""
    from tqdm.auto import tqdm

    from .. import distributed
    from ..decoding import generate_batch

    distributed.setup()
    e = cfg.eval
    batch_sizes = sorted(set(batch_sizes or e.batch_sizes))
    n_prompts = n_prompts or max(e.batched_prompts, max(batch_sizes))
    max_new_tokens = max_new_tokens or e.batched_max_new_tokens
    load = LoadRecord.start()
    drafters = make_drafters(cfg, target, list(methods or e.batched_methods), untrained_ok)
    prompts = batched_prompts(cfg, target, n_prompts)
    agree_on_study(cfg, prompts, study="batched", methods=list(drafters), batch_sizes=batch_sizes,
                   max_new_tokens=max_new_tokens)
    warm_up(target, drafters, prompts[0]["ids"])
    ids = [p["ids"] for p in prompts]
    calls = [(b, start) for b in batch_sizes for start in range(0, n_prompts, b)]
    mine = distributed.split(calls)
    local = []
    bar = tqdm(total=len(mine) * len(drafters), desc="batched", unit="call",
               disable=not (progress and distributed.is_main()))
    for b, start in mine:
        for m, d in drafters.items():
            t0 = time.perf_counter()
            gens = generate_batch(target, d, ids[start:start + b], max_new_tokens)
            seconds = time.perf_counter() - t0
            local.append({"batch_size": b, "method": m, "start": start, "sequences": len(gens),
                          "tokens": sum(len(g.token_ids) for g in gens), "steps": sum(g.n_steps for g in gens),
                          "seconds": seconds, "outputs": [g.token_ids for g in gens]})
            bar.update(1)
            bar.set_postfix(batch=b, method=m)
    bar.close()
    place = {c: i for i, c in enumerate(calls)}
    runs = distributed.gather_ordered(local, lambda r: place[(r["batch_size"], r["start"])], "gathering the runs")
    reference = None
    for b in batch_sizes:
        outputs: dict[str, list] = {m: [] for m in drafters}
        for r in runs:
            if r["batch_size"] == b:
                outputs[r["method"]] += r["outputs"]
        reference = reference or outputs[AR]  # AR at the smallest batch size (batch 1 when measured)
        for r in runs:
            if r["batch_size"] == b:
                out = outputs[r["method"]][r["start"]:r["start"] + r["sequences"]]
                r["same_as_ar_b1"] = sum(o == ref for o, ref in zip(out, reference[r["start"]:]))
                r["divergences"] = row_divergences(target, ids[r["start"]:], out, reference[r["start"]:], r["start"])
    for r in runs:
        del r["outputs"]
    warnings = _all_warnings(load.stop())
    table = throughput_table(runs)
    result = {"what": "throughput at several batch sizes, greedy, same prompts, one run (Table 2 analogue)",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "methods": list(drafters), "weights": weights_of(drafters),
              "fingerprints": fingerprints_of(drafters), "batch_sizes": batch_sizes,
              "n_prompts": n_prompts, "prompt_ids": [p["id"] for p in prompts], "max_new_tokens": max_new_tokens,
              "temperature": 0.0, "reference_batch_size": batch_sizes[0], "table": table, "runs": runs,
              "warnings": warnings, "command": f"python -m xpress.studies.batched --preset {cfg.preset}  (or notebook 06)",
              "provenance": _provenance(cfg, load, target.device)}
    if save and distributed.is_main():
        write_result(paths.RESULTS / cfg.preset, "batched", result, table)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.batched", __doc__, "eval.batch_sizes=[1,4]", _main)


def _main(cfg: Config, target, args) -> int:
    from .. import distributed

    result = run_batched(cfg, target, untrained_ok=cfg.target.source == "random",
                         progress=not args.no_progress)
    if not distributed.is_main():
        return 0
    for r in result["table"]:
        print(f"batch {r['batch_size']:>3} {r['method']:>7}: {r['tokens_per_s']:.1f} tokens/s, "
              f"{r['speedup']:.2f}x AR, tau {r['tau']:.2f}")
    print(f"wrote {paths.RESULTS / cfg.preset / 'batched.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
