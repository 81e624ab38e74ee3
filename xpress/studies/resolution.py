"""How many prompts it takes to resolve a 5% tau difference: tau of every method on many benchmark prompts,
at T = 0 and at T = ``eval.sampling_temperature``, decoded in batches.

Why a separate run. Table 1 times every prompt at batch 1 against AR (a few minutes per prompt and
benchmark on 2 CPU cores), so it can afford only a few prompts; at T = 1 the per-prompt tau is noisy
(the sampled text differs from run to run) and a few prompts leave a 5% difference inside the spread.
tau itself needs no clock: the engine verifies every row of a ragged batch on its own, so a row commits
the tokens it would commit alone and tau does not depend on the batch size (the batched table measures
the same tau at every batch size). This study therefore decodes ``eval.resolution_prompts`` prompts per
benchmark (the first ones, so Table 1's prompts are among them) ``eval.resolution_batch_size`` at a time,
each method on the same prompts, T = 0 once and T > 0 once per prompt with the generator seeded per
batch (the same seed for every method, so the methods see the same prompts and the same random stream
at the start).

What it reports (:func:`resolution_table`): per temperature, benchmark (and the average over benchmarks,
as the paper averages) and baseline, tau(xPress) / tau(baseline) with its paired bootstrap 95% interval
over prompts (:func:`xpress.studies.table1.bootstrap_tau_ratio`) and ``resolved``: the interval's
half-width is at most 5%, so a 5% difference falls outside it; and, from this run's larger sample, the
prompts per benchmark a 5% difference would need (:func:`xpress.studies.table1.prompts_needed`).

    python -m xpress.studies.resolution --preset cpu    # writes results/<preset>/resolution.{json,csv}
    torchrun --nproc_per_node N -m xpress.studies.resolution --preset cpu   # the batches split over N processes

Several processes (``torchrun`` / ``accelerate launch``, :mod:`xpress.distributed`): batch ``i`` (the
same prompts, with the same generator, as in one process) is decoded by rank ``i mod N``, the rows are
merged back into the one-process order and rank 0 writes the same files: every tau, token and step count
equals a one-process run's.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from .. import paths
from ..config import Config
from ..utils import write_result
from .compare import (LoadRecord, agree_on_study, benchmark_prompts, fingerprints_of, make_drafters, prompt_generator,
                      prompt_order, study_main, weights_of)
from .table1 import BASELINES, HEAD, _all_warnings, _provenance, bootstrap_tau_ratio, prompts_needed

REL = 0.05  # the tau difference to resolve


def decode_tau(target, drafters: dict[str, Any], prompts: Sequence[dict], max_new_tokens: int, batch_size: int,
               temperature: float, seed: int, progress: bool = True, batches: Sequence[int] | None = None
               ) -> list[dict]:
    """Decode ``prompts`` with every drafter (no AR), ``batch_size`` at a time; at T > 0 the generator of
    batch ``i`` is :func:`prompt_generator` (seed, i) for every method. One row per (prompt, method):
    ``{"temperature", "seed", "repeat": 0, "bench", "id", "method", "tokens", "steps"}`` (the fields
    :func:`xpress.studies.table1.per_prompt` reads). ``batches``: decode only these batch indices (one
    process's share; default all)."""
    from tqdm.auto import tqdm

    from ..decoding import generate_batch

    rows: list[dict] = []
    groups = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    batches = range(len(groups)) if batches is None else batches
    bar = tqdm(total=len(batches) * len(drafters), desc=f"tau at T={temperature:g}", unit="batch",
               disable=not progress)
    for i in batches:
        group = groups[i]
        for m, d in drafters.items():
            gen = prompt_generator(target.device, seed, i) if temperature > 0 else None
            gens = generate_batch(target, d, [p["ids"] for p in group], max_new_tokens, temperature, gen)
            rows += [{"temperature": temperature, "seed": seed, "repeat": 0, "bench": p["bench"], "id": p["id"],
                      "method": m, "tokens": len(g.token_ids), "steps": g.n_steps} for p, g in zip(group, gens)]
            bar.update(1)
            bar.set_postfix(method=m, tau=f"{sum(len(g.token_ids) for g in gens) / max(1, sum(g.n_steps for g in gens)):.2f}")
    bar.close()
    return rows


def resolution_table(rows: Sequence[dict], n_boot: int = 2000, seed: int = 0, rel: float = REL,
                     head: str = HEAD, baselines: Sequence[str] = BASELINES) -> list[dict]:
    """Per (temperature, bench incl. ``avg``, baseline): ``tau_ratio`` = tau(head) / tau(baseline) (tokens
    over steps pooled over the prompts; the average over benchmarks for ``avg``), its bootstrap interval
    ``lo`` - ``hi``, ``half_width`` = max(hi / ratio - 1, 1 - lo / ratio), ``resolved`` (half_width <=
    rel), ``prompts``, and ``verdict``: ``head better`` / ``baseline better`` when the interval excludes 1,
    else ``not told apart``."""
    methods = {r["method"] for r in rows}
    out = []
    for base in baselines:
        if not {head, base} <= methods:
            continue
        for t, by_bench in bootstrap_tau_ratio(rows, head, base, n_boot, seed).items():
            for bench, v in by_bench.items():
                half = max(v["hi"] / v["ratio"] - 1, 1 - v["lo"] / v["ratio"])
                verdict = (f"{head} better" if v["lo"] > 1 else
                           f"{base} better" if v["hi"] < 1 else "not told apart")
                out.append({"temperature": float(t), "bench": bench, "baseline": base, "tau_ratio": v["ratio"],
                            "lo": v["lo"], "hi": v["hi"], "half_width": half, "resolved": bool(half <= rel),
                            "prompts": v["prompts"], "verdict": verdict})
    return out


def method_taus(rows: Sequence[dict]) -> list[dict]:
    """Per (temperature, method, bench incl. ``avg``): tau = tokens / steps pooled over the prompts (``avg``:
    the mean over benchmarks) and the number of prompts."""
    import pandas as pd

    df = pd.DataFrame(rows)
    g = df.groupby(["temperature", "method", "bench"], as_index=False).agg(
        tokens=("tokens", "sum"), steps=("steps", "sum"), prompts=("id", "count"))
    g["tau"] = g["tokens"] / g["steps"]
    avg = g.groupby(["temperature", "method"], as_index=False).agg(
        tau=("tau", "mean"), tokens=("tokens", "sum"), steps=("steps", "sum"), prompts=("prompts", "sum"))
    avg["bench"] = "avg"
    return pd.concat([g, avg], ignore_index=True).to_dict("records")


def run_resolution(cfg: Config, target, methods: Sequence[str] | None = None, per_benchmark: int | None = None,
                   max_new_tokens: int | None = None, batch_size: int | None = None,
                   temperature: float | None = None, untrained_ok: bool = False, progress: bool = True,
                   save: bool = True) -> dict[str, Any]:
    """Decode and summarise (defaults from ``cfg.eval``: ``resolution_prompts``, ``max_new_tokens`` as
    Table 1, ``resolution_batch_size``, ``sampling_temperature``; the seed is ``cfg.seed``). With ``save``,
    writes ``results/<preset>/resolution.{json,csv}`` atomically with provenance; returns the payload.
    Under a launcher every rank decodes its share of the batches and returns the merged payload; rank 0
    writes it."""
    from .. import distributed

    distributed.setup()
    e = cfg.eval
    methods = list(methods or e.methods)
    per_benchmark = per_benchmark or e.resolution_prompts
    max_new_tokens = max_new_tokens or e.max_new_tokens
    batch_size = batch_size or e.resolution_batch_size
    temperature = temperature or e.sampling_temperature
    load = LoadRecord.start()
    t0 = time.perf_counter()
    drafters = make_drafters(cfg, target, methods, untrained_ok)
    drafters.pop("ar")  # tau of AR is 1 by definition; nothing here is timed
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    agree_on_study(cfg, prompts, study="resolution", methods=methods, per_benchmark=per_benchmark,
                   max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature)
    mine = distributed.split(range(-(-len(prompts) // batch_size)))  # batch indices
    order = prompt_order(prompts)
    rows = []
    for t in (0.0, temperature):
        local = decode_tau(target, drafters, prompts, max_new_tokens, batch_size, t, cfg.seed,
                           progress and distributed.is_main(), batches=mine)
        rows += distributed.gather_ordered(local, lambda r: order[(r["bench"], r["id"])] // batch_size,
                                           f"gathering the rows at T={t:g}")
    table = resolution_table(rows, e.bootstrap, cfg.seed)
    warnings = _all_warnings(load.stop())
    result = {"what": f"tau ratios on {per_benchmark} prompts per benchmark, batched, to resolve a "
                      f"{REL:.0%} tau difference (Table 1's tau on more prompts)",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "max_iters": cfg.head.max_iters, "benchmarks": list(cfg.data.benchmarks), "methods": list(drafters),
              "weights": weights_of(drafters), "fingerprints": fingerprints_of(drafters),
              "prompts_per_benchmark": per_benchmark,
              "max_new_tokens": max_new_tokens, "batch_size": batch_size, "temperatures": [0.0, temperature],
              "seed": cfg.seed, "rel": REL, "bootstrap_resamples": e.bootstrap,
              "taus": method_taus(rows), "table": table, "prompts_needed": prompts_needed(rows, REL),
              "warnings": warnings, "seconds": time.perf_counter() - t0,
              "command": f"python -m xpress.studies.resolution --preset {cfg.preset}  (or notebook 04)",
              "rows": rows, "provenance": _provenance(cfg, load, target.device)}
    if save and distributed.is_main():
        write_result(paths.RESULTS / cfg.preset, "resolution", result, table)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.resolution", __doc__, "eval.resolution_prompts=8", _main)


def _main(cfg: Config, target, args) -> int:
    from .. import distributed

    result = run_resolution(cfg, target, untrained_ok=cfg.target.source == "random", progress=not args.no_progress)
    if not distributed.is_main():
        return 0
    for r in result["table"]:
        if r["bench"] == "avg":
            print(f"T={r['temperature']:g} xpress/{r['baseline']}: {r['tau_ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] "
                  f"on {r['prompts']} prompts, {'resolved' if r['resolved'] else 'not resolved'} at {REL:.0%}")
    print(f"wrote {paths.RESULTS / cfg.preset / 'resolution.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
