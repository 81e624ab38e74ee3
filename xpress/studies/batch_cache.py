"""Batched AR with one cache row per sequence against the shared left-padded cache: speed and exactness.

    python -m xpress.studies.batch_cache --preset cpu    # writes results/<preset>/batch_cache.{json,csv}

On the lean runtime with the fused CPU kernels a batch gives every sequence its own cache row
(:class:`xpress.decoding.RowKV`, each row bit for bit a batch-1 forward); the shared cache
(:class:`xpress.decoding.RaggedKV`, prompts left-padded, one PyTorch forward over the batch) is what batches
took before, and what the other runtimes still take. Both decode the same ragged prompts (the batched
table's, ``eval.batched_prompts`` round-robin over the benchmarks) greedily at each of ``eval.batch_sizes``
above 1, the two caches back to back per group and in alternating order per repeat, ``eval.repeats`` passes
(at least 3); per (batch size, cache): tokens/s (tokens over the calls' summed wall seconds, the median over
repeats), the per-repeat ratio rows / shared, and the share of rows equal to batch-1 AR token for token with
each differing row's first divergence and the target's top-2 logit margin there.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Sequence

from .. import paths
from ..config import Config
from ..utils import write_result
from .compare import LoadRecord, study_main
from .table1 import _all_warnings, _provenance

CACHES = ("rows", "shared")


def run_batch_cache(cfg: Config, target, batch_sizes: Sequence[int] | None = None, n_prompts: int | None = None,
                    max_new_tokens: int | None = None, repeats: int | None = None, progress: bool = True,
                    save: bool = True) -> dict[str, Any]:
    """The comparison of the module docstring; writes ``results/<preset>/batch_cache.{json,csv}`` with
    provenance when ``save``. Returns the payload."""
    from tqdm.auto import tqdm

    from ..decoding import generate_ar, generate_ar_batch
    from ..targets import per_row_cache
    from .batched import batched_prompts, row_divergences

    if not per_row_cache(target):
        raise ValueError("the per-row cache needs the lean runtime on the fused CPU kernels (target.kernels=fused); "
                         "this target has none, so there is nothing to compare")
    e = cfg.eval
    sizes = sorted({b for b in (batch_sizes or e.batch_sizes) if b > 1})
    if not sizes:
        raise ValueError("give at least one batch size above 1 (eval.batch_sizes)")
    repeats = max(3, repeats or e.repeats)
    n_prompts = n_prompts or max(e.batched_prompts, max(sizes))
    max_new_tokens = max_new_tokens or e.batched_max_new_tokens
    load = LoadRecord.start()
    prompts = [p["ids"] for p in batched_prompts(cfg, target, n_prompts)]
    generate_ar_batch(target, prompts[:2], 4, cache="rows")  # warm-up: kernels, allocator
    generate_ar_batch(target, prompts[:2], 4, cache="shared")
    reference = [generate_ar(target, p, max_new_tokens).token_ids for p in prompts]
    runs = []
    calls = [(b, start) for b in sizes for start in range(0, n_prompts, b)]
    bar = tqdm(total=len(calls) * repeats * len(CACHES), desc="batch cache", unit="call", disable=not progress)
    for r in range(repeats):
        for b, start in calls:
            for cache in (CACHES if r % 2 == 0 else CACHES[::-1]):
                group = prompts[start:start + b]
                t0 = time.perf_counter()
                gens = generate_ar_batch(target, group, max_new_tokens, cache=cache)
                seconds = time.perf_counter() - t0
                outs = [g.token_ids for g in gens]
                runs.append({"repeat": r, "batch_size": b, "start": start, "cache": cache, "sequences": len(gens),
                             "tokens": sum(len(o) for o in outs), "seconds": seconds,
                             "same_as_ar_b1": sum(o == ref for o, ref in zip(outs, reference[start:])),
                             "divergences": [] if r else row_divergences(target, group, outs, reference[start:], start)})
                bar.update(1)
    bar.close()
    table = []
    for b in sizes:
        per = {c: [] for c in CACHES}
        for r in range(repeats):
            for c in CACHES:
                mine = [x for x in runs if x["batch_size"] == b and x["cache"] == c and x["repeat"] == r]
                per[c].append(sum(x["tokens"] for x in mine) / sum(x["seconds"] for x in mine))
        for c in CACHES:
            mine = [x for x in runs if x["batch_size"] == b and x["cache"] == c and x["repeat"] == 0]
            table.append({"batch_size": b, "cache": c, "tokens_per_s": statistics.median(per[c]),
                          "tokens_per_s_min": min(per[c]), "tokens_per_s_max": max(per[c]),
                          "rows_over_shared": statistics.median(a / s for a, s in zip(per["rows"], per["shared"])),
                          "same_as_ar_b1": sum(x["same_as_ar_b1"] for x in mine) / sum(x["sequences"] for x in mine),
                          "divergences": [d for x in mine for d in x["divergences"]]})
    result = {"what": "batched AR, greedy: one cache row per sequence against the shared left-padded cache, same "
                      "prompts, the two back to back per group, order alternating per repeat",
              "preset": cfg.preset, "target": target.name, "batch_sizes": sizes, "n_prompts": n_prompts,
              "max_new_tokens": max_new_tokens, "repeats": repeats, "table": table, "runs": runs,
              "warnings": _all_warnings(load.stop()),
              "command": f"python -m xpress.studies.batch_cache --preset {cfg.preset}",
              "provenance": _provenance(cfg, load, target.device)}
    if save:
        write_result(paths.RESULTS / cfg.preset, "batch_cache", result,
                     [{k: v for k, v in row.items() if k != "divergences"} for row in table])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.batch_cache", __doc__, "eval.batch_sizes=[1,4]", _main)


def _main(cfg: Config, target, args) -> int:
    try:
        result = run_batch_cache(cfg, target, progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in result["table"]:
        print(f"batch {r['batch_size']:>3} {r['cache']:>6}: {r['tokens_per_s']:.1f} tokens/s "
              f"[{r['tokens_per_s_min']:.1f}, {r['tokens_per_s_max']:.1f}], rows / shared {r['rows_over_shared']:.3f}, "
              f"equal to AR at batch 1: {r['same_as_ar_b1']:.0%}")
    print(f"wrote {paths.RESULTS / cfg.preset / 'batch_cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
