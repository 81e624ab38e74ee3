"""Latency per block at batch 1 (the paper's Table 3 and Figure 4): the refiner at K = 1..8 and adaptive,
the Markov head's B-1 serial steps, the drafter forward, the base readout and, when a target is given,
the target's 1-token decoding step and B-token verification, measured in one process as ratios.

Two shape sets (:class:`Shapes`): the preset's (the drafter, heads and draft vocabulary of
``configs/<preset>.yaml`` on the preset's target architecture) and the paper's (Qwen3-8B: hidden 4096, 36
layers, the full 151936-token readout; the 5-layer dFlash drafter; r = 256, B = 16). Every module has
random weights: latency does not depend on their values, except through how many Jacobi passes a block
takes, which is reported beside each time (``passes``, ``positions``: readout rows computed).

Refiner timings. The random refiner is made the slowest case for Jacobi refinement (:func:`.refine_block.worst_case_`:
each pass fixes exactly one more position and changes all later ones). ``xpress K=k`` runs
:func:`xpress.jacobi.jacobi_refine` with ``max_iters = k`` from a random seed block, so k passes are run
and pass t recomputes P - t + 1 positions: the worst-case cost of K (a trained refiner converges sooner,
and the incremental passes then recompute fewer positions); ``xpress adaptive`` starts from the drafter's
own argmax, as decoding does, with ``max_iters = P`` (here ~P passes: a bound, not a typical block;
notebook 05 weighs the K timings by the passes a trained refiner actually used); ``xpress dense K=4`` recomputes every position of
every pass (the algorithm as written, before the incremental passes). All include folding the refiner
for the block. ``markov`` is :func:`xpress.jacobi.sequential_refine` with the Markov head: P dependent
steps. On CUDA, ``graph`` variants replay a captured CUDA graph of a fixed-K dense rollout and of the
Markov decode (no host synchronisation inside), with the pass optionally compiled by ``torch.compile``.

Readout. Both heads read out through :class:`xpress.readout.Readout`: at T=0 and a vocabulary of at
least ``FAST_MIN_VOCAB`` on a CPU with a bfloat16 GEMM (the paper's shapes here), the certified argmax
(a bfloat16 readout, the few tokens that could win recomputed in float32; the same tokens). Then
``markov (float32 readout)`` and ``xpress K=4 (float32 readout)`` are also timed, the tokens compared
(``checks``), and ``markov_float32_over_xpress_k4`` is the Markov decode with its float32 readout over
xPress with the certified one; ``markov_over_xpress_k4`` compares the two with the same readout.
``markov readout (1 row)`` and ``xpress readout (P rows)`` time each head's readout alone
(:func:`.refine_block.readout_alone`): ``readout_only_k4 = P t(1) / (4 t(P))`` is the ratio four passes would reach
against P serial steps if nothing but the readouts cost time, what remains of the ratio once the work
around them (gathers, Trans, bookkeeping) is trimmed away.

Timing. The refinement decodes (the Markov head, xPress at every K, adaptive and dense, the
float32-readout variants) are timed interleaved (:func:`time_calls`): each repeat is one sweep over all
of them in a rotated order, each timed call right after an untimed one of the same decode, so a slow
spell of a shared machine falls on every decode of a sweep instead of on the repeats of one. The
drafter forward, the base readout, the fold and the readouts alone are timed on their own
(:func:`time_call`, repeats back to back): a readout alone is one call of a few milliseconds, and timed
after other work it also measures what that work left in the cache (inside a decode, every step or
pass but the first finds its weights in cache). Headline ratios: :func:`headline_ratios` measures each
of the three as ``lc.rounds`` paired rounds, the two sides timed one after the other in alternating
order, and reports the median over the rounds with its range (``paired``).

    from xpress.studies.latency import run_latency
    result = run_latency("cpu", shape_sets=("preset", "paper"))   # results/cpu/latency.{json,csv}

A result read against the paper (Table 3, its Eq. 1 projection, the Figure 4 analogue) is
:mod:`xpress.studies.table3`.

Nothing here imports pandas, seaborn or the data packages at module level: ``scripts/gpu_latency.py``
runs it on a machine with only torch and transformers.
"""
from __future__ import annotations

import csv
import io
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import paths
from ..timing import cuda_graph, paired_ratio, summary, time_call, time_calls  # noqa: F401  (importable from here too)
from ..utils import atomic_write_json, atomic_write_text, provenance
from .refine_block import (Block, build_block, count_work, dense_rollout, on_float32, pass_tokens, readout_alone,
                           refine_markov, refine_xpress)
from .shapes import PAPER, TINY, Shapes, preset_shapes
from .target_cost import random_target, time_target

SHAPE_SETS = ("preset", "paper", "tiny")


@dataclass
class LatencyConfig:
    """How to measure: ``ks`` Jacobi budgets, ``repeats`` timed calls per component (after ``warmup``),
    random weights of ``scale`` for the refiner (N(0, scale^2 / fan_in)), ``seed``, ``device``, ``dtype``
    of every module (the heads' logits are float32 whatever it is), ``target``: also time a random target
    of these shapes (``True``) or not; ``cuda_graphs`` and ``compile``: the captured variants on CUDA;
    ``rounds``: how many times each headline ratio is measured (:func:`paired_ratio`); ``frames``: also time
    the target's step and verify on frames of this many positions (``target.frame_rows``, the GPU presets'
    exact T = 0; 0: not)."""

    ks: Sequence[int] = tuple(range(1, 9))
    repeats: int = 15
    warmup: int = 2
    scale: float = 3.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    target: bool = False
    cuda_graphs: bool = True
    compile: bool = False
    rounds: int = 5
    frames: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 2 or self.warmup < 0:
            raise ValueError(f"repeats={self.repeats} must be >= 2 (for a spread) and warmup={self.warmup} >= 0")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds}: the headline ratios need at least one round")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks={list(self.ks)}: give Jacobi budgets >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: use float32, bfloat16 or float16")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# ============================================================================================= study
def measure_shapes(shapes: Shapes, lc: LatencyConfig, target_model=None, progress: Callable[[str], None] | None = None
                   ) -> dict[str, Any]:
    """Every component at ``shapes``: ``timings`` {name: :func:`time_call` dict}, ``work`` {name: passes,
    positions}, ``ratios`` (median / the Markov head's), ``composition`` (draft side per method and
    its share of a decoding round when the target was timed) and ``checks``."""
    say = progress or (lambda m: None)
    dev = torch.device(lc.device)
    say(f"{shapes.name}: building random modules")
    block = build_block(shapes, lc)
    p = shapes.positions
    g = torch.Generator().manual_seed(lc.seed + 1)
    seed_block = torch.randint(0, block.vocab.size, (1, p), generator=g).to(dev)  # a hard start for K passes
    t: dict[str, dict[str, float]] = {}
    work: dict[str, dict[str, float]] = {}
    rep, warm = lc.repeats, lc.warmup
    with torch.no_grad():
        say(f"{shapes.name}: drafter forward, readout")
        t["drafter forward"] = time_call(block.forward, rep, warm, dev)
        t["base readout"] = time_call(block.readout, rep, warm, dev)
        t["fold"] = time_call(lambda: block.refiner.fold(block.h), rep, warm, dev)
        fast = block.refiner.read.use_fast(block.refiner.w_r.weight, torch.zeros(1, shapes.rank, device=dev))
        one, full = readout_alone(block, seed_block)
        heads = {"markov": lambda: refine_markov(block)}
        for k in lc.ks:
            heads[f"xpress K={k}"] = lambda k=k: refine_xpress(block, k, seed_block)
            work[f"xpress K={k}"] = count_work(block, k, seed_block)
        heads["xpress adaptive"] = lambda: refine_xpress(block, p)
        work["xpress adaptive"] = count_work(block, p, None)
        heads["xpress dense K=4"] = lambda: refine_xpress(block, 4, seed_block, False)
        work["xpress dense K=4"] = count_work(block, 4, seed_block, incremental=False)
        checks = {"incremental equals dense (K=4 tokens)": bool(torch.equal(
            refine_xpress(block, 4, seed_block).tokens, refine_xpress(block, 4, seed_block, False).tokens))}
        if fast:  # the same two with the float32 readout, and the tokens compared
            reads = (block.markov.read, block.refiner.read)
            for r in reads:
                r.rows_certified = r.candidates = 0
            tokens = {"markov": refine_markov(block).tokens, "xpress": refine_xpress(block, 4, seed_block).tokens}
            checks["float32 candidates per row (Markov, xpress K=4)"] = [
                round(r.candidates / max(r.rows_certified, 1), 1) for r in reads]
            heads["markov (float32 readout)"] = on_float32(lambda: refine_markov(block), block.markov.read)
            heads["xpress K=4 (float32 readout)"] = on_float32(lambda: refine_xpress(block, 4, seed_block),
                                                               block.refiner.read)
            checks["certified readout equals float32 (Markov, K=4 tokens)"] = bool(
                torch.equal(tokens["markov"], heads["markov (float32 readout)"]().tokens)
                and torch.equal(tokens["xpress"], heads["xpress K=4 (float32 readout)"]().tokens))
        say(f"{shapes.name}: Markov head ({p} serial steps), xPress at K = {', '.join(map(str, lc.ks))}, "
            f"adaptive and dense: {len(heads)} components, {rep} interleaved sweeps")
        t.update(time_calls(heads, rep, warm, dev))
        say(f"{shapes.name}: the readouts alone, Markov 1 row and xPress {p} rows")
        t["markov readout (1 row)"] = time_call(one, rep, warm, dev)  # back to back: warm, as all steps but a
        t[f"xpress readout ({p} rows)"] = time_call(full, rep, warm, dev)  # decode's first (see time_calls)
        say(f"{shapes.name}: the headline ratios, {lc.rounds} paired rounds")
        paired = headline_ratios(block, lc, seed_block, fast, one, full)
        if dev.type == "cuda" and lc.cuda_graphs:
            t.update(_graph_timings(block, lc, seed_block, checks, say))
    if target_model is not None:
        say(f"{shapes.name}: target step and verify")
        t.update(time_target(target_model, shapes, lc.repeats, lc.warmup, lc.seed, frames=lc.frames))
    markov = t["markov"]["median_ms"]
    ratios = {name: v["median_ms"] / markov for name, v in t.items()}
    headline = {key: paired[key]["median"] if key in paired else None for key in HEADLINE}
    return {"shapes": asdict(shapes), "timings": t, "work": work, "ratios": ratios,
            "readout": "certified bfloat16 argmax (xpress.readout)" if fast else "float32",
            **headline, "paired": paired, "composition": composition(t, shapes), "checks": checks}


HEADLINE = ("markov_over_xpress_k4", "markov_float32_over_xpress_k4", "readout_only_k4")


def headline_ratios(block: Block, lc: LatencyConfig, seed_block: torch.Tensor, fast: bool,
                    one: Callable[[], Any], full: Callable[[], Any]) -> dict[str, dict[str, Any]]:
    """The ratios the study is read for, each over ``lc.rounds`` paired rounds (:func:`paired_ratio`):
    ``markov_over_xpress_k4`` (the Markov decode over xPress at K=4, both on the same readout; only when
    K=4 is among ``lc.ks``), ``markov_float32_over_xpress_k4`` (the Markov decode on its float32 readout;
    only when the certified readout applies) and ``readout_only_k4`` (``P t(1 row) / (4 t(P rows))``, the
    readouts alone: ``one`` and ``full`` of :func:`readout_alone`)."""
    dev, p = torch.device(lc.device), block.shapes.positions

    def pair(num: Callable[[], Any], den: Callable[[], Any], scale: float = 1.0) -> dict[str, Any]:
        return paired_ratio(num, den, lc.rounds, lc.repeats, lc.warmup, dev, scale)

    def markov() -> Any:
        return refine_markov(block)

    def k4() -> Any:
        return refine_xpress(block, 4, seed_block)

    out = {}
    if 4 in lc.ks:
        out["markov_over_xpress_k4"] = pair(markov, k4)
        if fast:
            out["markov_float32_over_xpress_k4"] = pair(on_float32(markov, block.markov.read), k4)
    out["readout_only_k4"] = pair(one, full, p / 4)
    return out


def _graph_timings(block: Block, lc: LatencyConfig, seed_block: torch.Tensor, checks: dict, say) -> dict:
    """CUDA-graph replays of the dense K-pass rollout (the pass compiled if ``lc.compile`` and it works)
    and of the Markov decode; each variant falls back (and is left out) if capture fails."""
    dev, out = torch.device(lc.device), {}
    step = None
    if lc.compile:
        try:
            say("compiling the Jacobi pass (torch.compile)")
            compiled = torch.compile(lambda f, y: pass_tokens(block, f, y), dynamic=False, fullgraph=False)
            dense_rollout(block, 1, seed_block, compiled)
            step = compiled
            checks["compiled"] = True
        except Exception as e:  # no compiler toolchain, an unsupported op: eager passes
            checks["compiled"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    for k in lc.ks:
        try:
            replay = cuda_graph(lambda k=k: dense_rollout(block, k, seed_block, step))
            out[f"xpress graph K={k}"] = time_call(replay, lc.repeats, lc.warmup, dev)
        except Exception as e:
            checks[f"graph K={k}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            break
    try:
        out["markov graph"] = time_call(cuda_graph(lambda: refine_markov(block)), lc.repeats, lc.warmup, dev)
    except Exception as e:
        checks["markov graph"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    checks["dense rollout equals jacobi_refine (K=4 tokens)"] = bool(torch.equal(
        dense_rollout(block, 4, seed_block, step), refine_xpress(block, 4, seed_block).tokens))
    return out


def composition(t: dict[str, dict[str, float]], shapes: Shapes) -> dict[str, dict[str, float]]:
    """Draft side per method (drafter forward + base readout + refinement, ms) and, when the target's
    verification was timed, its share of one decoding round (draft side + verification)."""
    verify = t.get(f"target verify ({shapes.block_size} tokens)")
    drafting = t["drafter forward"]["median_ms"] + t["base readout"]["median_ms"]
    methods = {"dflash": 0.0, "markov": t["markov"]["median_ms"]}
    methods.update({name: v["median_ms"] for name, v in t.items()
                    if (name.startswith("xpress K=") and "(" not in name) or name == "xpress adaptive"})
    out = {}
    for name, refine in methods.items():
        draft = drafting + refine
        row = {"drafter_ms": drafting, "refine_ms": refine, "draft_side_ms": draft}
        if verify is not None:
            round_ms = draft + verify["median_ms"]
            row.update(verify_ms=verify["median_ms"], round_ms=round_ms, draft_share=draft / round_ms,
                       refine_share=refine / round_ms)
        out[name] = row
    return out


def run_latency(preset: str = "cpu", shape_sets: Sequence[str] = SHAPE_SETS, lc: LatencyConfig | None = None,
                overrides: Sequence[str] = (), target=None, out_dir: str | Path | None = None,
                results_name: str | None = None, progress: bool = True, save: bool = True) -> dict[str, Any]:
    """The latency study for ``shape_sets`` (``preset``: ``configs/<preset>.yaml``'s shapes; ``paper``:
    :data:`PAPER`; ``tiny``: :data:`TINY`). ``target``: a loaded :class:`~xpress.targets.Target` to time at the preset's shapes
    (its real weights); with ``lc.target`` a random Qwen3 target is built for the paper's shapes (a GPU
    job: 8B parameters). Writes ``results/<results_name or preset>/latency.{json,csv}`` with provenance
    (load average before and after) and returns the JSON payload."""
    lc = lc or LatencyConfig()
    for s in shape_sets:
        if s not in SHAPE_SETS:
            raise ValueError(f"shape set {s!r}: use {' or '.join(SHAPE_SETS)}")
    say = (lambda m: print(f"[latency] {m}", flush=True)) if progress else None
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    sets: dict[str, Any] = {}
    for name in shape_sets:
        if name == "preset":
            from ..config import load_config

            cfg = load_config(preset, list(overrides))
            shapes = preset_shapes(cfg)
            model = (target.runtime or target.model) if target is not None else (random_target(shapes, lc.torch_dtype, lc.device, lc.seed) if lc.target else None)
            if target is not None:
                shapes = replace(shapes, name=f"{cfg.preset} preset: {target.name}")
        else:
            shapes = PAPER if name == "paper" else TINY
            model = random_target(shapes, lc.torch_dtype, lc.device, lc.seed) if lc.target else None
        sets[name] = measure_shapes(shapes, lc, model, say)
        del model
    result = {"what": "latency per block at batch 1 (Table 3 / Figure 4): refiner at K, Markov head, drafter, "
                      "readout, target step and verify; medians over repeats with the IQR",
              "preset": preset, "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(lc).items()},
              "shape_sets": sets, "seconds": time.perf_counter() - t0,
              "provenance": provenance(results_name or preset, torch_threads=torch.get_num_threads(),
                                       load_average_before=load_before, load_average_after=os.getloadavg())}
    if save:
        folder = Path(out_dir) if out_dir else paths.RESULTS / (results_name or preset)
        atomic_write_json(folder / "latency.json", result)
        atomic_write_text(folder / "latency.csv", latency_csv(result))
    return result


def latency_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (shape set, component): K (None where not a Jacobi budget), median, quartiles, IQR,
    the ratio to the Markov head, passes and readout rows."""
    rows = []
    for set_name, s in result["shape_sets"].items():
        for name, v in s["timings"].items():
            k = int(name.split("K=")[1].split()[0]) if "K=" in name else None
            w = s["work"].get(name, {})
            rows.append({"shapes": set_name, "component": name, "K": k, "median_ms": v["median_ms"],
                         "q1_ms": v["q1_ms"], "q3_ms": v["q3_ms"], "iqr_ms": v["iqr_ms"],
                         "ratio_to_markov": s["ratios"][name], "passes": w.get("passes"),
                         "positions": w.get("positions")})
    return rows


def latency_csv(result: dict[str, Any]) -> str:
    rows = latency_rows(result)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
