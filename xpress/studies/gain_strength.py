"""The refiner's gain against the drafter's strength: tau(xPress) / tau(dFlash) and tau(xPress) / tau(Markov)
against tau(dFlash), one point per trained configuration and benchmark, at T = 0 and T = 1, with the full block.

Why. The paper explains its gain (tau 6.25 -> 8.02 on Qwen3-8B, x1.28 over dFlash) by the refiner
correcting positions 2..B of the block, which count only once the first positions are accepted. A weak
drafter rarely gets that far, so the explanation predicts a gain that grows with the drafter's strength.
This study puts every configuration the repository trained on one axis:

- the co-training-steps curve: each preset keeps its drafters and heads at ``train.snapshot_steps`` on
  the way to ``train.steps`` (``checkpoints/<preset>/<method>-step<N>/``), one point per step;
- the domain and the data: the general preset (``cpu``: math, chat and code answers) and the math preset
  (``cpu-math``: math answers only), each with its own data;
- each point also per benchmark, where the same drafter is stronger or weaker.

Every configuration is decoded on the same prompts (the study preset's benchmarks, the first
``--prompts`` of each), with the full block (``decode.draft_tokens = 0``: all B - 1 drafts verified):

- T = 0 by replay (:mod:`xpress.studies.tau_k`): the target's greedy continuation does not depend on the
  drafter, so it is computed once per prompt and every configuration's rounds are followed on it (equal to
  decoding up to floating-point reduction order, tested there). The Jacobi budget K is swept there too.
- T = 1 by decoding (:func:`xpress.decoding.generate_batch`, ``eval.resolution_batch_size`` rows at a
  time), the generator seeded per batch, the same for every method.

Per point: tau of each method, the two ratios with paired bootstrap 95% intervals over prompts
(:func:`xpress.studies.resolution.resolution_table`), and the acceptance at each draft position 1..B-1
conditional on the previous position accepted (how many rounds reached the position, and the share that
accepted it), so a reader sees at which positions the refiner gains.

    python -m xpress.studies.gain_strength --preset cpu --configs cpu,cpu-math   # results/cpu/gain_vs_strength.{json,csv}
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .. import paths
from ..config import Config

METHODS = ("dflash", "markov", "xpress")
NAME = "gain_vs_strength"


class StrengthError(ValueError):
    """A configuration that cannot be evaluated here (one line: what and how to make it)."""


@dataclass
class Configuration:
    """One trained configuration: ``folders`` {method: checkpoint folder} of one preset, and how its drafters
    were made (``made``: domain, training sources and answer tokens, warm-start and co-training steps)."""

    name: str
    preset: str
    folders: dict[str, Path]
    made: dict[str, Any] = field(default_factory=dict)


def configurations(presets: Sequence[str]) -> list[Configuration]:
    """The trained configurations of ``presets``: per preset, each step of ``train.snapshot_steps`` whose
    snapshots of all three methods exist, the preset's final checkpoints when all three stages are complete,
    and its co-training levers (:func:`lever_configurations`). A preset with no complete configuration is a :class:`StrengthError` naming the command that
    trains it."""
    from ..config import load_config
    from ..train.loop import checkpoint_dir, read_state, snapshot_dir

    out = []
    for preset in presets:
        cfg = load_config(preset)
        found = []
        for step in [*(n for n in cfg.train.snapshot_steps if n < cfg.train.steps), cfg.train.steps]:
            final = step == cfg.train.steps
            folders = {m: checkpoint_dir(cfg, m) if final else snapshot_dir(cfg, m, step) for m in METHODS}
            if final and not all((read_state(f) or {}).get("complete") for f in folders.values()):
                continue
            if not all((f / "config.json").is_file() for f in folders.values()):
                continue
            found.append(Configuration(f"{preset} @ {step} steps", preset, folders, made_by(cfg, step)))
        found += lever_configurations(cfg)
        if not found:
            raise StrengthError(f"no trained configuration of preset {preset!r} under {paths.CHECKPOINTS / preset}: "
                                f"train it with `for m in {' '.join(METHODS)}; do python -m xpress train --preset "
                                f"{preset} --method $m; done`")
        out += found
    return out


def lever_configurations(cfg: Config) -> list[Configuration]:
    """The co-training levers that ``make studies`` trained for all three methods from the preset's warm start
    (``checkpoints/<preset>/levers/<method>/<lever>-<N>steps/``, :mod:`xpress.studies.levers`), one configuration
    each, named by the lever."""
    import re

    root = paths.CHECKPOINTS / cfg.preset / "levers"
    names = [{p.name for p in (root / m).iterdir() if (p / "config.json").is_file()} if (root / m).is_dir() else set()
             for m in METHODS]
    out = []
    for name in sorted(set.intersection(*names)):
        hit = re.fullmatch(r"(.+)-(\d+)steps", name)
        steps = int(hit[2]) if hit else None
        made = {**made_by(cfg, steps), "cotrain_steps_of": steps, "lever": hit[1] if hit else name}
        out.append(Configuration(f"{cfg.preset} lever {name}", cfg.preset, {m: root / m / name for m in METHODS}, made))
    return out


def made_by(cfg: Config, step: int | None) -> dict[str, Any]:
    """How a configuration's drafters were made: the domain and sources of its training prompts, the answer
    tokens regenerated for them (``results/<preset>/regen_manifest.json``, None without it), the shared
    warm start's steps and the co-training steps (of ``train.steps``) each method had."""
    from ..plots import load_result

    manifest = load_result(cfg.preset, "regen_manifest") or {}
    sources = list(cfg.data.train_sources)
    return {"domain": "math" if set(sources) <= {"gsm8k-train", "math-train"} else "general",
            "train_sources": sources, "train_prompts": cfg.data.n_train_prompts,
            "train_response_tokens": (manifest.get("response_tokens") or {}).get("train"),
            "warm_start_steps": cfg.train.warm_start_steps, "cotrain_steps": step,
            "cotrain_steps_of": cfg.train.steps}


# ============================================================================================ measuring
def accepted_histogram(accepted: Sequence[int], drafts: int) -> list[int]:
    """Counts of rounds by accepted drafts 0..``drafts``."""
    hist = [0] * (drafts + 1)
    for a in accepted:
        hist[min(int(a), drafts)] += 1
    return hist


def conditional_acceptance(hist: Sequence[int]) -> list[dict[str, Any]]:
    """Per draft position j = 1..len(hist)-1: ``reached`` (rounds whose drafts 1..j-1 were all accepted),
    ``accepted`` (of those, the rounds that accepted j too) and ``rate`` = accepted / reached (None where no
    round reached j). ``hist[a]``: rounds that accepted exactly ``a`` drafts."""
    out = []
    for j in range(1, len(hist)):
        reached, accepted = sum(hist[j - 1:]), sum(hist[j:])
        out.append({"position": j, "reached": reached, "accepted": accepted,
                    "rate": accepted / reached if reached else None})
    return out


def _t0_rows(drafters: dict[str, Any], replays: Sequence, prompts: Sequence[dict], ks: Sequence[int],
             max_iters: int) -> tuple[list[dict], list[dict]]:
    """T = 0 by replay: (rows, k_rows). rows: one per (prompt, method) at the preset's K, with ``accepted``
    (the histogram of accepted drafts over its rounds); k_rows: xpress's tokens and steps per prompt at each
    K of ``ks``."""
    import torch

    from .tau_k import acceptance, all_blocks, follow_rounds

    rows, k_rows = [], []
    for p, rp in zip(prompts, replays):
        for m, d in drafters.items():
            h, base, anchors, starts = all_blocks(d, rp)
            budgets = sorted(set(ks) | {max_iters}) if m == "xpress" else [max_iters]
            for k in budgets:
                saved = d.max_iters
                d.max_iters = k
                try:
                    with torch.inference_mode():
                        res = d.refine_block(h, base, anchors, 0.0)
                finally:
                    d.max_iters = saved
                acc = acceptance(d.vocab.to_target(res.tokens), rp, starts).tolist()
                rounds = follow_rounds(acc, rp.n_gen)
                row = {"temperature": 0.0, "seed": 0, "repeat": 0, "bench": p["bench"], "id": p["id"], "method": m,
                       "tokens": rp.n_gen, "steps": len(rounds)}
                if k == max_iters:
                    rows.append({**row, "accepted": accepted_histogram([acc[i] for i in rounds], base.shape[1])})
                if m == "xpress" and k in ks:
                    k_rows.append({**row, "K": k})
    return rows, k_rows


def _sampled_rows(target, drafters: dict[str, Any], prompts: Sequence[dict], max_new_tokens: int, batch_size: int,
                  temperature: float, seed: int) -> list[dict]:
    """T > 0 by decoding, ``batch_size`` rows at a time, batch ``i`` seeded with (seed, i) for every method:
    one row per (prompt, method) with ``accepted`` (accepted drafts per round, before truncation)."""
    from ..decoding import generate_batch
    from .compare import prompt_generator

    rows = []
    for i in range(0, len(prompts), batch_size):
        group = prompts[i:i + batch_size]
        for m, d in drafters.items():
            gens = generate_batch(target, d, [p["ids"] for p in group], max_new_tokens, temperature,
                                  prompt_generator(target.device, seed, i // batch_size))
            drafts = d.block_size - 1
            rows += [{"temperature": temperature, "seed": seed, "repeat": 0, "bench": p["bench"], "id": p["id"],
                      "method": m, "tokens": len(g.token_ids), "steps": g.n_steps,
                      "accepted": accepted_histogram([a - 1 for a in g.draft_accepts], drafts)}
                     for p, g in zip(group, gens)]
    return rows


def summarize_configuration(rows: Sequence[dict], k_rows: Sequence[dict], n_boot: int, seed: int) -> dict[str, Any]:
    """One configuration's numbers: ``taus`` (per temperature, method, bench incl. ``avg``), ``ratios``
    (xpress against dflash and markov, with intervals), ``positions`` (per temperature, method and bench, or
    ``all`` benchmarks' rounds pooled: :func:`conditional_acceptance`) and ``k_sweep`` (T = 0: xpress's tau at each K and its
    ratio to dflash, on average over benchmarks)."""
    from .resolution import method_taus, resolution_table

    taus = [{k: r[k] for k in ("temperature", "method", "bench", "tau", "prompts")} for r in method_taus(rows)]
    positions = []
    benches = list(dict.fromkeys(r["bench"] for r in rows))
    for t in sorted({r["temperature"] for r in rows}):
        for m in METHODS:
            for bench in ["all", *benches]:
                hists = [r["accepted"] for r in rows if r["temperature"] == t and r["method"] == m
                         and bench in ("all", r["bench"])]
                if hists:
                    total = [sum(col) for col in zip(*hists)]
                    positions.append({"temperature": t, "method": m, "bench": bench, "rounds": sum(total),
                                      "positions": conditional_acceptance(total)})
    sweep = []
    if k_rows:
        dflash = [r for r in rows if r["temperature"] == 0.0 and r["method"] == "dflash"]
        for k in sorted({r["K"] for r in k_rows}):
            both = [{**r, "method": "xpress"} for r in k_rows if r["K"] == k] + dflash
            ratio = resolution_table(both, n_boot, seed, baselines=("dflash",))
            avg = next(r for r in ratio if r["bench"] == "avg")
            tau = next(r["tau"] for r in method_taus(both) if r["method"] == "xpress" and r["bench"] == "avg")
            sweep.append({"K": k, "tau_xpress": tau, "ratio_dflash": avg["tau_ratio"], "lo": avg["lo"], "hi": avg["hi"]})
    return {"taus": taus, "ratios": resolution_table(rows, n_boot, seed), "positions": positions, "k_sweep": sweep}


def points(configs: Sequence[dict]) -> list[dict]:
    """The figure's and the CSV's rows: per (configuration, temperature, bench incl. ``avg``), tau of each
    method and the two ratios with their intervals."""
    out = []
    for c in configs:
        tau = {(r["temperature"], r["bench"], r["method"]): r["tau"] for r in c["taus"]}
        for r in c["ratios"]:
            key = (r["temperature"], r["bench"])
            row = next((o for o in out if (o["configuration"], o["temperature"], o["bench"]) == (c["name"], *key)), None)
            if row is None:
                row = {"configuration": c["name"], "preset": c["preset"], "domain": c["made"]["domain"],
                       "cotrain_steps": c["made"]["cotrain_steps"], "temperature": key[0], "bench": key[1],
                       "prompts": r["prompts"], **{f"tau_{m}": tau.get((*key, m)) for m in METHODS}}
                out.append(row)
            b = r["baseline"]
            row.update({f"ratio_{b}": r["tau_ratio"], f"lo_{b}": r["lo"], f"hi_{b}": r["hi"]})
    return out


def trend(rows: Sequence[dict], baseline: str = "dflash") -> list[dict]:
    """Per temperature, over the per-benchmark points (``avg`` left out): Spearman's rank correlation of
    tau(baseline) with tau(xpress) / tau(baseline), its p-value, and the least-squares slope of the ratio
    per unit of tau(baseline)."""
    import numpy as np
    from scipy.stats import spearmanr

    out = []
    for t in sorted({r["temperature"] for r in rows}):
        pts = [(r[f"tau_{baseline}"], r[f"ratio_{baseline}"]) for r in rows
               if r["temperature"] == t and r["bench"] != "avg" and r.get(f"ratio_{baseline}") is not None]
        if len(pts) < 3:
            continue
        x, y = np.array(pts, dtype=float).T
        if np.ptp(x) == 0 or np.ptp(y) == 0:  # no spread: neither a rank correlation nor a slope
            out.append({"temperature": t, "baseline": baseline, "points": len(pts), "spearman": None,
                        "p_value": None, "slope_per_tau": None})
            continue
        rho, p = spearmanr(x, y)
        out.append({"temperature": t, "baseline": baseline, "points": len(pts), "spearman": float(rho),
                    "p_value": float(p), "slope_per_tau": float(np.polyfit(x, y, 1)[0])})
    return out


def run_gain_strength(cfg: Config, target, presets: Sequence[str], per_benchmark: int = 16,
                      ks: Sequence[int] = (1, 2, 3), max_new_tokens: int | None = None, untrained_ok: bool = False,
                      progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Evaluate every configuration of ``presets`` (:func:`configurations`) on ``cfg``'s benchmarks at T = 0
    (replay, K swept over ``ks``) and T = ``cfg.eval.sampling_temperature`` (decoding), full block. With
    ``untrained_ok`` (tests) the study's own preset with no checkpoint is one configuration of fresh weights. Writes
    ``results/<cfg.preset>/gain_vs_strength.{json,csv}`` with provenance when ``save``."""
    import dataclasses

    from tqdm.auto import tqdm

    from ..drafter import CheckpointNotFoundError, DrafterMismatchError
    from ..methods import make_drafter
    from ..utils import write_result
    from .compare import LoadRecord, benchmark_prompts
    from .table1 import _provenance
    from .tau_k import prepare_replay

    e = cfg.eval
    max_new_tokens = max_new_tokens or e.max_new_tokens
    full = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, draft_tokens=0))
    try:
        found = configurations(presets)
    except StrengthError:
        if not (untrained_ok and list(presets) == [cfg.preset]):
            raise
        found = [Configuration(f"{cfg.preset} (untrained)", cfg.preset, {m: None for m in METHODS},
                               made_by(cfg, 0))]
    _check_targets(cfg, found)
    load = LoadRecord.start()
    t0 = time.perf_counter()
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    replays = [prepare_replay(target, p["ids"], max_new_tokens)
               for p in tqdm(prompts, desc="greedy continuations", unit="prompt", disable=not progress)]
    results, skipped = [], []
    for c in tqdm(found, desc="configurations", unit="config", disable=not progress):
        try:
            drafters = {m: make_drafter(m, full, target, seed=cfg.seed, checkpoint=c.folders[m],
                                        untrained_ok=untrained_ok) for m in METHODS}
        except (DrafterMismatchError, CheckpointNotFoundError) as e:  # e.g. a lever of another block size
            skipped.append({"name": c.name, "why": str(e)})
            continue
        rows, k_rows = _t0_rows(drafters, replays, prompts, ks, cfg.head.max_iters)
        rows += _sampled_rows(target, drafters, prompts, max_new_tokens, e.resolution_batch_size,
                              e.sampling_temperature, cfg.seed)
        results.append({"name": c.name, "preset": c.preset, "made": c.made,
                        "checkpoints": {m: paths.portable(f) if f else None for m, f in c.folders.items()},
                        "fingerprints": {m: getattr(d, "fingerprint", None) for m, d in drafters.items()},
                        **summarize_configuration(rows, k_rows, e.bootstrap, cfg.seed), "rows": rows})
    table = points(results)
    result = {"what": "tau(xPress) / tau(dFlash) and / tau(Markov) against tau(dFlash), one point per trained "
                      "configuration and benchmark, full block, T = 0 (replayed greedy) and T = "
                      f"{e.sampling_temperature:g} (decoded)",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "draft_tokens": cfg.drafter.block_size - 1, "max_iters": cfg.head.max_iters, "ks": list(ks),
              "benchmarks": list(cfg.data.benchmarks), "prompts_per_benchmark": per_benchmark,
              "max_new_tokens": max_new_tokens, "temperatures": [0.0, e.sampling_temperature], "seed": cfg.seed,
              "bootstrap_resamples": e.bootstrap, "configurations": results, "skipped": skipped, "points": table,
              "trend": trend(table, "dflash") + trend(table, "markov"), "warnings": load.stop(),
              "seconds": time.perf_counter() - t0,
              "command": f"python -m xpress.studies.gain_strength --preset {cfg.preset} --configs {','.join(presets)} "
                         f"--prompts {per_benchmark}",
              "provenance": _provenance(cfg, load, target.device)}
    if save:
        write_result(paths.RESULTS / cfg.preset, NAME, result, table)
    return result


def _check_targets(cfg: Config, found: Sequence[Configuration]) -> None:
    """Every configuration's preset drafts for the study's target, at its block size."""
    from ..config import load_config

    for preset in {c.preset for c in found} - {cfg.preset}:
        other = load_config(preset)
        if (other.target.model, other.drafter.block_size) != (cfg.target.model, cfg.drafter.block_size):
            raise StrengthError(f"preset {preset!r} drafts for {other.target.model} at block size "
                                f"{other.drafter.block_size}, the study's preset {cfg.preset!r} for {cfg.target.model} "
                                f"at {cfg.drafter.block_size}: pass --configs presets of the same target and block")


def main(argv: Sequence[str] | None = None) -> int:
    from .compare import study_main

    def add_args(p):
        p.add_argument("--configs", default=None,
                       help="presets whose trained configurations to evaluate, comma-separated (default: --preset)")
        p.add_argument("--prompts", type=int, default=16, help="prompts per benchmark (default 16)")
        p.add_argument("--ks", default="1,2,3", help="Jacobi budgets K swept at T = 0 (default 1,2,3)")

    return study_main(argv, "python -m xpress.studies.gain_strength", __doc__, "eval.sampling_temperature=1.0", _main,
                      add_args)


def _main(cfg: Config, target, args) -> int:
    presets = [p for p in (args.configs or cfg.preset).split(",") if p]
    try:
        ks = [int(k) for k in args.ks.split(",") if k]
        if not ks or min(ks) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --ks {args.ks!r} must list Jacobi budgets of at least 1, e.g. 1,2,3", file=sys.stderr)
        return 2
    try:
        result = run_gain_strength(cfg, target, presets, args.prompts, ks,
                                   untrained_ok=cfg.target.source == "random", progress=not args.no_progress)
    except StrengthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in result["points"]:
        if r["bench"] == "avg":
            print(f"{r['configuration']}, T={r['temperature']:g}: tau(dflash) {r['tau_dflash']:.2f}, xpress/dflash "
                  f"{r['ratio_dflash']:.3f} [{r['lo_dflash']:.3f}, {r['hi_dflash']:.3f}]")
    print(f"wrote {paths.RESULTS / cfg.preset / (NAME + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
