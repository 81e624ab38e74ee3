"""The compiled harness against the eager one: the same prompts, the same weights, every method, T = 0.

    python -m xpress bench compiled-eager --preset qwen3-8b --methods ar,dflash,markov,xpress \
        --n-prompts 8 --max-new-tokens 256 --out-dir results/h200 --frame-rows 0,64
    python -m xpress bench compiled-eager --preset smoke target.runtime=transformers --n-prompts 1 \
        --max-new-tokens 8 --out-dir /tmp/x          # the same code path on a CPU, float32, no CUDA graphs

The target is loaded once; the eager harness runs its transformers forward on a growing ``DynamicCache``
(``decode.compile=false``), the compiled one the same model through :class:`xpress.compiled.CompiledForward`
(a static cache, ``torch.compile``, CUDA graphs on CUDA) with the drafters' refinement compiled too
(:meth:`xpress.proposer.ModelDrafter.compile`). Each method is built twice from the same weights: the preset's
trained checkpoints where they exist, else fresh seeded ones (the file says which: ``weights``). Per frame
setting (``--frame-rows``, ``target.frame_rows``; default the preset's), per method: one untimed decode of the
first prompt on each harness (the compiler's graphs are made there), then every prompt on the eager harness and
on the compiled one, one after the other. Recorded per method: whether the two harnesses' greedy tokens are
equal and, where not, the first divergence with the target's top-2 logit margin there
(:func:`xpress.bench.divergence`); whether each equals AR on its own harness (T = 0 exactness); tokens, target
steps, tau, seconds per token and per round (CUDA events on CUDA, ``perf_counter`` on a CPU: the decoding
engine's own stage clocks) and the compiled-over-eager speed ratio. With frame settings 0 and F > 0, AR's
seconds per token on each harness give what frames cost (``frames``): docs/gpu.md keeps frames on the GPU
path only where they cost under 5% of AR's speed. Writes ``compiled_eager.json`` and ``.csv`` with provenance.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Sequence

from . import paths

HARNESSES = ("eager", "compiled")
FRAMES_BUDGET = 0.05  # frames are kept on the GPU path where they cost AR under 5% of its speed (docs/gpu.md)


def _per_generation(g: Any) -> dict[str, Any]:
    """One decode's counts and times: tokens, steps, seconds (total, prefill included) and per stage."""
    stages = {k: float(sum(v)) for k, v in g.step_times.items()}
    return {"tokens": len(g.token_ids), "steps": g.n_steps, "seconds": g.total_s, "prefill_s": g.prefill_s,
            "round_s": sum(stages.values()), **{f"{k}_s": v for k, v in stages.items()}}


def _summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Totals over a method's prompts on one harness: tau, seconds per token (prefill included) and per round
    (the rounds' stages, prefill excluded)."""
    tokens, steps = sum(r["tokens"] for r in rows), sum(r["steps"] for r in rows)
    seconds, rounds = sum(r["seconds"] for r in rows), sum(r["round_s"] for r in rows)
    return {"tokens": tokens, "steps": steps, "tau": tokens / max(1, steps), "seconds": seconds,
            "ms_per_token": 1e3 * seconds / max(1, tokens), "ms_per_round": 1e3 * rounds / max(1, steps),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def frames_cost(methods_by_frames: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """What frames cost AR, per harness: AR's seconds per token with ``frame_rows`` F over without (0), minus 1,
    for each F > 0 measured beside 0; ``keep`` says whether that is under :data:`FRAMES_BUDGET`. None without
    both a run at 0 and one at F > 0, or without AR."""
    if 0 not in methods_by_frames or "ar" not in methods_by_frames[0]["methods"]:
        return None
    out = {}
    for F, res in methods_by_frames.items():
        if F == 0 or "ar" not in res["methods"]:
            continue
        for h in HARNESSES:
            base = methods_by_frames[0]["methods"]["ar"][h]["ms_per_token"]
            cost = res["methods"]["ar"][h]["ms_per_token"] / base - 1 if base > 0 else None
            out[f"F={F} {h}"] = {"frame_rows": F, "harness": h, "ar_ms_per_token_frames": res["methods"]["ar"][h]["ms_per_token"],
                                 "ar_ms_per_token_no_frames": base, "cost": cost,
                                 "keep": cost is not None and cost < FRAMES_BUDGET}
    return out or None


def compiled_eager(preset: str, methods: Sequence[str] = ("ar", "dflash", "markov", "xpress"), n_prompts: int = 4,
                   max_new_tokens: int = 64, out_dir: str | Path | None = None, overrides: Sequence[str] = (),
                   frame_rows: Sequence[int] | None = None, benchmarks: Sequence[str] = ("gsm8k", "mt-bench"),
                   progress: bool = False) -> dict[str, Any]:
    """Run the comparison (module docstring); returns the JSON payload written to ``compiled_eager.json``."""
    from tqdm.auto import tqdm

    from . import decoding
    from .bench import DecodeInputError, _benchmark_prompts, divergence
    from .config import ConfigError, load_config
    from .methods import METHODS, drafter_weights, make_drafter
    from .targets import compiled_forward, load_target
    from .utils import load_average, load_check, other_cpu_use, provenance, seed_everything, write_result

    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise DecodeInputError(f"--methods {','.join(methods)}: use some of {', '.join(METHODS)}")
    if n_prompts < 1 or max_new_tokens < 1:
        raise DecodeInputError("--n-prompts and --max-new-tokens must be at least 1")
    load_start, others_start = load_average(), other_cpu_use()
    try:
        cfg_e = load_config(preset, [*overrides, "decode.compile=false"])
        cfg_c = load_config(preset, [*overrides, "decode.compile=true"])
    except ConfigError as e:
        raise DecodeInputError(f"{e}; the compiled harness runs the transformers runtime: add "
                               "target.runtime=transformers for a CPU preset") from None
    frames = [cfg_e.target.frame_rows] if frame_rows is None else list(dict.fromkeys(frame_rows))
    bad = [F for F in frames if F < 0 or 0 < F < cfg_e.drafter.block_size]
    if bad:
        raise DecodeInputError(f"--frame-rows {bad}: use 0 (no frames) or at least drafter.block_size "
                               f"({cfg_e.drafter.block_size})")
    seed_everything(cfg_e.seed)
    eager = load_target(cfg_e)
    compiled = dataclasses.replace(eager, compiled=compiled_forward(cfg_c, eager.model))  # the same model
    compiled.compiled.rows.update(F for F in frames if F)
    prompts = _benchmark_prompts(eager, benchmarks, n_prompts)
    drafters = {m: (make_drafter(m, cfg_e, eager, seed=cfg_e.seed, untrained_ok=True),
                    make_drafter(m, cfg_c, compiled, seed=cfg_e.seed, untrained_ok=True)) for m in methods}
    weights = {m: ("none (autoregressive)" if m == "ar" else
                   "trained (the preset's checkpoint)" if drafter_weights(d[0]) == "trained" else
                   "untrained: no checkpoint of this preset was found, so a fresh seeded drafter and head "
                   "(untrained heads are the identity correction); tau and speed are not the trained method's")
               for m, d in drafters.items()}

    rows: list[dict] = []
    by_frames: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(frames) * len(methods) * (len(prompts) + 1) * 2, desc="compiled vs eager", unit="decode",
               disable=not progress, file=sys.stderr)
    for F in frames:
        for t in (eager, compiled):
            t.cfg = dataclasses.replace(t.cfg, frame_rows=F)
        outputs: dict[str, dict[str, list]] = {}
        per_method: dict[str, Any] = {}
        for m in methods:
            targets = dict(zip(HARNESSES, (eager, compiled)))
            run = {h: (lambda p, h=h: decoding.generate_batch(targets[h], drafters[m][HARNESSES.index(h)], [list(p)],
                                                               max_new_tokens)[0]) for h in HARNESSES}
            for h in HARNESSES:  # untimed: allocations, and the compiler's graphs
                run[h](prompts[0][1])
                bar.update(1)
            gens: dict[str, list] = {h: [] for h in HARNESSES}
            for pid, p in prompts:
                for h in HARNESSES:
                    gens[h].append(run[h](p))
                    bar.update(1)
            outputs[m] = {h: [g.token_ids for g in gens[h]] for h in HARNESSES}
            diverged = []
            for (pid, p), a, b in zip(prompts, gens["eager"], gens["compiled"]):
                d = divergence(eager, p, a.token_ids, b.token_ids)
                if d is not None:
                    diverged.append({"prompt": pid, **d})
            per_method[m] = {"equal": not diverged, "divergences": diverged, "weights": weights[m]}
            for h in HARNESSES:
                recs = [_per_generation(g) for g in gens[h]]
                per_method[m][h] = _summary(recs)
                for (pid, _), r, a, b in zip(prompts, recs, gens["eager"], gens["compiled"]):
                    rows.append({"frame_rows": F, "method": m, "harness": h, "prompt": pid, **r,
                                 "harnesses_equal": a.token_ids == b.token_ids})
            e, c = per_method[m]["eager"], per_method[m]["compiled"]
            per_method[m]["compiled_speedup"] = e["ms_per_token"] / c["ms_per_token"] if c["ms_per_token"] > 0 else None
        if "ar" in outputs:  # T = 0 exactness on each harness: every method's tokens against AR's
            for m in methods:
                if m == "ar":
                    continue
                for h in HARNESSES:
                    off = [{"prompt": pid, **d} for (pid, p), ref, out in
                           zip(prompts, outputs["ar"][h], outputs[m][h])
                           if (d := divergence(eager if h == "eager" else compiled, p, ref, out)) is not None]
                    per_method[m][f"equals_ar_{h}"] = not off
                    per_method[m][f"divergences_from_ar_{h}"] = off
                    if per_method["ar"][h]["ms_per_token"] and per_method[m][h]["ms_per_token"]:
                        per_method[m][h]["speedup_over_ar"] = (per_method["ar"][h]["ms_per_token"]
                                                              / per_method[m][h]["ms_per_token"])
        by_frames[F] = {"frame_rows": F, "methods": per_method}
    bar.close()
    load = load_check(load_start, load_average(), others=(others_start, other_cpu_use()))
    result = {
        "what": "the compiled Table 1 harness (static KV cache, torch.compile, CUDA graphs on CUDA) against the "
                "eager one (transformers forward, DynamicCache): equal greedy outputs per method, seconds per token "
                "and per round, and what frames cost AR",
        "preset": preset, "target": eager.name, "methods": list(methods), "n_prompts": len(prompts),
        "prompt_ids": [pid for pid, _ in prompts], "max_new_tokens": max_new_tokens, "temperature": 0.0,
        "device": str(eager.device), "dtype": str(eager.compute_dtype).removeprefix("torch."),
        "timing": "CUDA events, read back once per generation" if eager.device.type == "cuda" else "perf_counter",
        "compiled": compiled.compiled.describe(), "weights": weights,
        "equal": all(r["methods"][m]["equal"] for r in by_frames.values() for m in methods),
        "frames": frames_cost(by_frames), "frames_budget": FRAMES_BUDGET,
        "by_frame_rows": {str(F): r for F, r in by_frames.items()},
        "load_warning": load["load_warning"],
        "provenance": provenance(preset, **load, overrides=list(overrides)),
    }
    write_result(Path(out_dir) if out_dir else paths.RESULTS / preset, "compiled_eager", result, rows)
    return result
