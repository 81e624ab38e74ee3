"""Table 1 of the paper, measured here: AR, dFlash, the Markov head and xPress on every benchmark of the
preset, batch 1, at T = 0 and at T = ``eval.sampling_temperature`` (several seeds): tau, the wall-clock
speedup over AR per benchmark and on average, and xPress's gain over dFlash and over Markov.

Measurement (:func:`xpress.studies.compare.decode_interleaved`): per prompt AR, dflash, markov, xpress
back to back, ``eval.repeats`` times at T = 0 (medians over repeats, with their min-max spread) and once per
seed at T > 0 (mean and sd over seeds). Every T = 0 output must equal AR's token for token (``lossless``);
at T > 0 losslessness is distributional (notebook 04 tests it) and only tau and speed are recorded. A
speedup above its own tau is impossible (a verify costs at least a 1-token step) and is flagged, never
silently reported. The load average before and after is stored, with a warning when the machine was busy.

Several processes (``torchrun`` / ``accelerate launch``, :mod:`xpress.distributed`): prompt ``i`` is
decoded by rank ``i mod N`` (with its own generator, as in one process), the rows are merged back into
the one-process order and rank 0 writes the same files, so tau, tokens and steps equal a one-process
run's; the timings are each process's own clock, and the provenance records ``world_size`` and
``devices`` (processes sharing a CPU slow each other down).

Statistics over prompts: a bootstrap (prompts resampled within each benchmark, the same prompts for both
methods) gives the 95% interval of tau(xPress) / tau(baseline); :func:`prompts_needed` says how many
prompts per benchmark would put a 5% tau difference outside the spread.

    python -m xpress.studies.table1 --preset cpu      # writes results/<preset>/table1.{json,csv}
    torchrun --nproc_per_node N -m xpress.studies.table1 --preset cpu     # the prompts split over N processes
    from xpress.studies.table1 import run_table1
    result = run_table1(cfg, target)
"""
from __future__ import annotations

import math
import sys
from typing import Any, Sequence

from .. import paths
from ..utils import write_result
from ..config import Config
from .compare import (AR, LoadRecord, agree_on_study, benchmark_prompts, decode_interleaved, fingerprints_of,
                      make_drafters, prompt_order, study_main, warm_up, weights_of)

HEAD = "xpress"
BASELINES = ("dflash", "markov")
STAGES = ("draft", "refine", "verify", "bookkeeping")
# The paper's Table 1 (Qwen3-8B, dFlash block-16 drafter, batch 1, at most 2048 tokens), the average
# over its seven benchmarks: tau and speedup over AR (arXiv 2608.02438, Table 1).
PAPER_AVG = {
    0.0: {"dflash": {"tau": 6.25, "speedup": 4.9}, "markov": {"tau": 7.64, "speedup": 6.1},
          "xpress": {"tau": 8.02, "speedup": 6.2}},
    1.0: {"dflash": {"tau": 4.94, "speedup": 3.6}, "markov": {"tau": 6.62, "speedup": 4.7},
          "xpress": {"tau": 6.97, "speedup": 5.3}},
}
SPEEDUP_ABOVE_TAU = "speedup > tau (impossible: timing noise or a busy machine)"


# ========================================================================================= summaries
def pass_table(rows: Sequence[dict]):
    """One row per timed pass and benchmark: (temperature, seed, repeat, method, bench) -> tokens, steps,
    seconds (summed over the benchmark's prompts), tau = tokens / steps, tokens/s and the speedup over
    AR's pass on the same prompts (method tokens/s / AR tokens/s = AR s per token / method s per token).
    ``bench == "avg"`` rows hold the mean over benchmarks of tau, speedup and tokens/s (as the paper
    averages)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    run = ["temperature", "seed", "repeat"]
    g = df.groupby(run + ["method", "bench"], as_index=False).agg(
        tokens=("tokens", "sum"), steps=("steps", "sum"), seconds=("seconds", "sum"), prompts=("id", "count"))
    g["tau"] = g["tokens"] / g["steps"]
    g["tokens_per_s"] = g["tokens"] / g["seconds"]
    ar = g[g["method"] == AR][run + ["bench", "tokens_per_s"]].rename(columns={"tokens_per_s": "ar_tokens_per_s"})
    if ar.empty:
        raise ValueError(f"no {AR!r} rows: the speedup needs AR measured in the same run")
    g = g.merge(ar, on=run + ["bench"], how="left")
    g["speedup"] = g["tokens_per_s"] / g["ar_tokens_per_s"]
    avg = g.groupby(run + ["method"], as_index=False).agg(
        tau=("tau", "mean"), speedup=("speedup", "mean"), tokens_per_s=("tokens_per_s", "mean"),
        tokens=("tokens", "sum"), steps=("steps", "sum"), seconds=("seconds", "sum"), prompts=("prompts", "sum"))
    avg["bench"] = "avg"
    return pd.concat([g.drop(columns="ar_tokens_per_s"), avg], ignore_index=True)


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Table 1's cells: per (temperature, method, bench incl. ``avg``) -- ``tau`` and ``speedup`` (per seed
    the median over repeats; then the mean over seeds), ``tau_sd`` / ``speedup_sd`` (over seeds; 0 with
    one seed), ``speedup_lo`` / ``speedup_hi`` (min and max over every pass: the spread), ``tokens_per_s``,
    ``lossless`` (T = 0: every output equal to AR's; None at T > 0), ``flag`` (:func:`speedup_flag`: ""
    or why the speedup contradicts its tau)."""
    import pandas as pd

    p = pass_table(rows)
    keys = ["temperature", "method", "bench"]
    per_seed = p.groupby(keys + ["seed"], as_index=False).agg(
        tau=("tau", "median"), speedup=("speedup", "median"), tokens_per_s=("tokens_per_s", "median"),
        prompts=("prompts", "first"), repeats=("repeat", "nunique"))
    s = per_seed.groupby(keys, as_index=False).agg(
        tau=("tau", "mean"), tau_sd=("tau", "std"), speedup=("speedup", "mean"), speedup_sd=("speedup", "std"),
        tokens_per_s=("tokens_per_s", "mean"), prompts=("prompts", "first"), repeats=("repeats", "max"),
        seeds=("seed", "nunique"))
    spread = p.groupby(keys, as_index=False).agg(speedup_lo=("speedup", "min"), speedup_hi=("speedup", "max"))
    s = s.merge(spread, on=keys)
    s[["tau_sd", "speedup_sd"]] = s[["tau_sd", "speedup_sd"]].fillna(0.0)
    df = pd.DataFrame(rows)
    ok = df.groupby(["temperature", "method", "bench"])["lossless"].agg(lambda v: bool(all(v)))
    ok_avg = df.groupby(["temperature", "method"])["lossless"].agg(lambda v: bool(all(v)))
    s["lossless"] = [None if t > 0 else bool(ok_avg[(t, m)] if b == "avg" else ok[(t, m, b)])
                     for t, m, b in zip(s["temperature"], s["method"], s["bench"])]
    ratio = {(c["temperature"], c["method"]): c["verify_ratio"] for c in stage_costs(rows)}
    s["flag"] = [speedup_flag(sp, tau, ratio.get((t, m))) for t, m, sp, tau in
                 zip(s["temperature"], s["method"], s["speedup"], s["tau"])]
    return s.to_dict("records")


def speedup_flag(speedup: float, tau: float, verify_ratio: float | None) -> str:
    """Why a speedup contradicts its own tau, or "": above tau (impossible: a verify costs at least a
    1-token step), or, where the run's own verify cost ratio makes the ceiling ``tau / verify_ratio`` at
    least 1, above that ceiling by more than the tolerance of :func:`xpress.bench.speedup_flag` (below 1
    the prefill, the same for both, may legitimately pull a speedup above it)."""
    from ..bench import speedup_flag as bound_flag

    if speedup > tau * (1 + 1e-9):
        return SPEEDUP_ABOVE_TAU
    if verify_ratio and tau / verify_ratio >= 1:
        return bound_flag(speedup, tau, verify_ratio) or ""
    return ""


def gains(summary: Sequence[dict], head: str = HEAD, baselines: Sequence[str] = BASELINES) -> list[dict]:
    """xPress over each baseline per (temperature, bench): ``tau_ratio`` = tau(head) / tau(baseline) and
    ``speedup_ratio`` = speedup(head) / speedup(baseline) (the paper's "x Gain": throughput over the
    baseline's). Baselines absent from ``summary`` are skipped."""
    cell = {(r["temperature"], r["method"], r["bench"]): r for r in summary}
    out = []
    for (t, m, b), r in cell.items():
        if m != head:
            continue
        for base in baselines:
            o = cell.get((t, base, b))
            if o:
                out.append({"temperature": t, "bench": b, "method": head, "baseline": base,
                            "tau_ratio": r["tau"] / o["tau"], "speedup_ratio": r["speedup"] / o["speedup"]})
    return out


def per_prompt(rows: Sequence[dict]):
    """Per (temperature, method, bench, id): tokens and steps summed over seeds (the first repeat: repeats
    decode the same tokens) and the prompt's tau."""
    import pandas as pd

    df = pd.DataFrame(rows)
    df = df[df["repeat"] == 0]
    g = df.groupby(["temperature", "method", "bench", "id"], as_index=False).agg(
        tokens=("tokens", "sum"), steps=("steps", "sum"))
    g["tau"] = g["tokens"] / g["steps"]
    return g


def bootstrap_tau_ratio(rows: Sequence[dict], num: str, den: str, n_boot: int = 2000, seed: int = 0,
                        level: float = 0.95) -> dict[str, dict]:
    """The ``level`` interval of tau(num) / tau(den) by resampling prompts with replacement within each
    benchmark (paired: one resample of prompt ids for both methods). Returns, per temperature (as a
    string key), ``{bench or "avg": {"ratio", "lo", "hi", "prompts"}}``; ``avg`` resamples every benchmark
    and averages the per-benchmark taus, as the table does."""
    import numpy as np

    pp = per_prompt(rows)
    rng = np.random.default_rng(seed)
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    out: dict[str, dict] = {}
    for t, d in pp.groupby("temperature"):
        if not {num, den} <= set(d["method"]):
            continue
        res: dict[str, dict] = {}
        boot_num, boot_den, point_num, point_den = [], [], [], []
        for b, db in d.groupby("bench", sort=False):
            a = db[db["method"] == num].set_index("id").sort_index()
            c = db[db["method"] == den].set_index("id").loc[a.index]
            n = len(a)
            idx = rng.integers(0, n, size=(n_boot, n))
            tn = a["tokens"].to_numpy()[idx].sum(1) / a["steps"].to_numpy()[idx].sum(1)
            td = c["tokens"].to_numpy()[idx].sum(1) / c["steps"].to_numpy()[idx].sum(1)
            pn, pd_ = a["tokens"].sum() / a["steps"].sum(), c["tokens"].sum() / c["steps"].sum()
            lo, hi = np.percentile(tn / td, q)
            res[b] = {"ratio": float(pn / pd_), "lo": float(lo), "hi": float(hi), "prompts": n}
            boot_num.append(tn), boot_den.append(td), point_num.append(pn), point_den.append(pd_)
        lo, hi = np.percentile(np.mean(boot_num, 0) / np.mean(boot_den, 0), q)
        res["avg"] = {"ratio": float(np.mean(point_num) / np.mean(point_den)), "lo": float(lo), "hi": float(hi),
                      "prompts": int(sum(r["prompts"] for r in res.values()))}
        out[str(float(t))] = res
    return out


def _needed(sd: float, width: float, z: float) -> int | None:
    """Smallest n with ``z * sd / sqrt(n) <= width``; None when sd is unknown (one prompt)."""
    if sd is None or math.isnan(sd):
        return None
    return max(1, math.ceil((z * sd / width) ** 2)) if width > 0 else None


def prompts_needed(rows: Sequence[dict], rel: float = 0.05, z: float = 1.96, head: str = HEAD,
                   baselines: Sequence[str] = BASELINES) -> list[dict]:
    """How many prompts per benchmark would put a ``rel`` (5%) tau difference outside the spread, from the
    per-prompt variance of tau:

    - ``unpaired`` (per method): two independent 95% intervals of width ``2 z sd / sqrt(n)`` must fit in
      ``rel * mean``, so ``n = (2 z sd / (rel mean))^2``;
    - ``paired`` (head vs a baseline on the same prompts): the 95% interval of the mean per-prompt
      ``log(tau_head / tau_base)`` must exclude ``log(1 + rel)`` from 0, so ``n = (z sd_log / log(1 + rel))^2``.

    Returns rows ``{"temperature", "bench", "kind", "method", "prompts", "mean", "sd", "needed"}``."""
    import numpy as np

    pp = per_prompt(rows)
    out = []
    for (t, m, b), d in pp.groupby(["temperature", "method", "bench"]):
        if m == AR:
            continue
        mean, sd = float(d["tau"].mean()), float(d["tau"].std()) if len(d) > 1 else float("nan")
        out.append({"temperature": t, "bench": b, "kind": "unpaired", "method": m, "prompts": len(d),
                    "mean": mean, "sd": None if math.isnan(sd) else sd, "needed": _needed(2 * sd, rel * mean, z)})
    for (t, b), d in pp.groupby(["temperature", "bench"]):
        taus = d.pivot(index="id", columns="method", values="tau")
        for base in baselines:
            if head in taus and base in taus:
                lr = np.log(taus[head] / taus[base])
                sd = float(lr.std()) if len(lr) > 1 else float("nan")
                out.append({"temperature": t, "bench": b, "kind": "paired", "method": f"{head}/{base}",
                            "prompts": len(lr), "mean": float(lr.mean()), "sd": None if math.isnan(sd) else sd,
                            "needed": _needed(sd, math.log(1 + rel), z)})
    return out


def stage_costs(rows: Sequence[dict]) -> list[dict]:
    """Per (temperature, method), from the run's own stage timings: ``ar_step_s`` (AR forward +
    bookkeeping per step), ``verify_step_s`` and ``round_s`` (draft + refine + verify + bookkeeping per
    speculative round), ``verify_ratio`` = verify_step_s / ar_step_s (the break-even tau of a free
    drafter) and ``break_even_tau`` = round_s / ar_step_s (the tau at which the method matches AR, prefill
    aside), with the run's ``tau`` (tokens / steps over every prompt) beside them."""
    import pandas as pd

    df = pd.DataFrame(rows)
    out = []
    for t, d in df.groupby("temperature"):
        ar = d[d["method"] == AR]
        ar_step = (ar["forward_s"].sum() + ar["bookkeeping_s"].sum()) / max(1, ar["timed_steps"].sum())
        for m, dm in d[d["method"] != AR].groupby("method", sort=False):
            n = max(1, dm["timed_steps"].sum())
            verify = dm["verify_s"].sum() / n
            round_s = sum(dm[f"{k}_s"].sum() for k in STAGES) / n
            out.append({"temperature": t, "method": m, "ar_step_s": ar_step, "verify_step_s": verify,
                        "round_s": round_s, "verify_ratio": verify / ar_step if ar_step else None,
                        "break_even_tau": round_s / ar_step if ar_step else None,
                        "tau": dm["tokens"].sum() / max(1, dm["steps"].sum()),
                        **{f"{k}_share": dm[f"{k}_s"].sum() / n / round_s if round_s else None for k in STAGES}})
    return out


def table1_from_rows(rows: Sequence[dict], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Everything Table 1 reports, from the decoding rows alone: summary, gains, bootstrap intervals of
    the tau ratios, prompts needed, stage costs, and the flagged cells."""
    summary = summarize(rows)
    methods = {r["method"] for r in rows}
    boot = {base: bootstrap_tau_ratio(rows, HEAD, base, n_boot, seed) for base in BASELINES
            if {HEAD, base} <= methods}
    return {"summary": summary, "gains": gains(summary), "bootstrap_tau_ratio": boot,
            "prompts_needed": prompts_needed(rows), "stage_costs": stage_costs(rows),
            "flags": [{k: r[k] for k in ("temperature", "method", "bench", "tau", "speedup", "flag")}
                      for r in summary if r["flag"]],
            "lossless_t0": all(r["lossless"] for r in rows if r["temperature"] == 0)}


# ========================================================================================= the run
def run_table1(cfg: Config, target, methods: Sequence[str] | None = None, per_benchmark: int | None = None,
               max_new_tokens: int | None = None, repeats: int | None = None, seeds: Sequence[int] | None = None,
               temperature: float | None = None, untrained_ok: bool = False, progress: bool = True,
               save: bool = True) -> dict[str, Any]:
    """Measure Table 1 (defaults from ``cfg.eval``) and, with ``save``, write
    ``results/<preset>/table1.{json,csv}`` atomically with provenance. Returns the JSON payload:
    :func:`table1_from_rows` plus the settings, the drafters' weights, the per-decode ``rows``, the load
    warnings and the provenance. Model drafters need trained checkpoints unless ``untrained_ok``.
    Under a launcher every rank decodes its share of the prompts and returns the merged payload; rank 0
    writes it."""
    from .. import distributed

    distributed.setup()
    e = cfg.eval
    methods = list(methods or e.methods)
    per_benchmark = per_benchmark or e.prompts_per_benchmark
    max_new_tokens = max_new_tokens or e.max_new_tokens
    repeats = repeats or e.repeats
    seeds = list(e.sampling_seeds if seeds is None else seeds)
    temperature = temperature or e.sampling_temperature
    load = LoadRecord.start()
    drafters = make_drafters(cfg, target, methods, untrained_ok)
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    agree_on_study(cfg, prompts, study="table1", methods=methods, per_benchmark=per_benchmark,
                   max_new_tokens=max_new_tokens, repeats=repeats, seeds=seeds, temperature=temperature)
    main = distributed.is_main()
    mine, order = distributed.split(range(len(prompts))), prompt_order(prompts)
    warm_up(target, drafters, prompts[0]["ids"])
    if seeds:
        warm_up(target, drafters, prompts[0]["ids"], temperature)  # the sampling path too

    def decode(t: float, seed: int, reps: int, desc: str) -> list[dict]:
        local = decode_interleaved(target, drafters, [prompts[i] for i in mine], max_new_tokens, t, seed, reps,
                                   progress and main, desc=desc, indices=mine)
        return distributed.gather_ordered(local, lambda r: order[(r["bench"], r["id"])], f"gathering {desc}")

    rows = decode(0.0, cfg.seed, repeats, "Table 1, T=0")
    for s in seeds:
        rows += decode(temperature, s, 1, f"Table 1, T={temperature:g} seed {s}")
    warnings = _all_warnings(load.stop())
    result = {"what": "Table 1: tau by decoding held-out benchmark prompts and speedup over AR, batch 1, "
                      "interleaved per prompt",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "max_iters": cfg.head.max_iters,
              "draft_tokens": cfg.decode.draft_tokens or cfg.drafter.block_size - 1,  # k verified per round, or "auto"
              "benchmarks": list(cfg.data.benchmarks), "methods": methods,
              "weights": weights_of(drafters), "fingerprints": fingerprints_of(drafters),
              "prompts_per_benchmark": per_benchmark,
              "max_new_tokens": max_new_tokens, "repeats": repeats, "temperatures": [0.0] + ([temperature] if seeds else []),
              "sampling_seeds": seeds, "bootstrap_resamples": e.bootstrap,
              **table1_from_rows(rows, e.bootstrap, cfg.seed),
              "warnings": warnings, "paper_avg": {str(t): v for t, v in PAPER_AVG.items()},
              "command": f"python -m xpress.studies.table1 --preset {cfg.preset}  (or notebook 04)",
              "rows": rows,
              "provenance": _provenance(cfg, load, target.device)}
    for f in result["flags"] if main else []:
        print(f"FLAG: T={f['temperature']:g} {f['method']} {f['bench']}: speedup {f['speedup']:.2f} > tau {f['tau']:.2f}")
    if save and main:
        write_result(paths.RESULTS / cfg.preset, "table1", result, result["summary"])
    return result


def _provenance(cfg: Config, load: LoadRecord, device=None) -> dict[str, Any]:
    """Provenance of a study's timings: the machine, its load (rank 0's), and ``world_size`` and
    ``devices`` (one per process, :func:`xpress.distributed.describe`). A collective: call on every rank."""
    import torch

    from .. import distributed
    from ..utils import provenance

    return provenance(cfg.preset, torch_threads=torch.get_num_threads(), **load.provenance(),
                      **distributed.describe(device))


def _all_warnings(warnings: list[str]) -> list[str]:
    """The load warnings of every rank (each once), for the merged result."""
    from .. import distributed

    return list(dict.fromkeys(w for part in distributed.gather(warnings, "gathering the load warnings") for w in part))


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.table1", __doc__, "eval.repeats=3", _main)


def _main(cfg: Config, target, args) -> int:
    from .. import distributed

    result = run_table1(cfg, target, untrained_ok=cfg.target.source == "random", progress=not args.no_progress)
    if not distributed.is_main():
        return 0 if result["lossless_t0"] else 1
    avg = [r for r in result["summary"] if r["bench"] == "avg"]
    for r in avg:
        print(f"T={r['temperature']:g} {r['method']:>7}: tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x {r['flag']}")
    print(f"lossless at T=0: {result['lossless_t0']}; wrote {paths.RESULTS / cfg.preset / 'table1.json'}")
    return 0 if result["lossless_t0"] else 1


if __name__ == "__main__":
    sys.exit(main())
