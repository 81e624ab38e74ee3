"""How many drafted tokens a round should verify, measured end to end at T = 0:
``python -m xpress.studies.draft_length --preset cpu`` (k = 1, 2, 3 and the whole block; ``--draft-tokens
1,2,3,4,5,0,auto`` chooses others; ``auto`` picks k each round from the drafter's confidence,
:mod:`xpress.verify_length`).

A speculative round verifies the anchor and ``k`` drafted tokens in one target forward of ``k + 1`` rows
(``decode.draft_tokens``; the default verifies all ``B - 1``). Where that forward is bound by memory (a GPU at
batch 1) the rows are nearly free and ``k = B - 1`` is best. On two CPU cores in float32 it is bound by
arithmetic from a few rows on (each row costs a pass of multiply-adds over every weight), while tau gains
little from the later drafted positions of a weak drafter: most rounds end at the first or second one. So
a shorter verify can be faster end to end, with the same output (the k tokens are the full draft's first k,
and every output is checked against AR's here).

Each method of ``eval.methods`` decodes Table 1's prompts (``eval.prompts_per_benchmark`` per benchmark,
``eval.max_new_tokens``, batch 1) at each ``k`` of :data:`DRAFT_TOKENS`, AR and every (method, k) pass
interleaved per prompt and repeat (:func:`xpress.studies.compare.decode_interleaved`). Per (method, k):
tau, tokens/s, the speedup over AR on the same prompts (AR seconds per token / the method's, pooled over
prompts and repeats, as Table 1), the spread of the per-prompt speedups, and the verify's cost in AR steps
from the stage timings. With ``auto`` among the k, ``auto_vs_best`` compares it per method with the
fastest fixed k of the same run: the geometric mean over prompts of the paired per-prompt speed ratio, with
a bootstrap interval over prompts. Writes ``results/<preset>/draft_length.{json,csv}``.

    from xpress.studies.draft_length import run_draft_length
    result = run_draft_length(cfg, target)
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Sequence

from .. import paths
from ..config import AUTO, Config
from .compare import (AR, LoadRecord, benchmark_prompts, decode_interleaved, fingerprints_of, make_drafters, study_main,
                      warm_up)

DRAFT_TOKENS = (1, 2, 3, 0)  # 0: all B - 1, the paper's setting


def at_lengths(drafters: dict[str, Any], ks: Sequence[int | str], target=None) -> dict[str, Any]:
    """``{"ar": None, "<method> k=<k>": drafter, ...}``: each model drafter at each k (shallow copies that
    share the networks; k = 0 means all ``B - 1``; ``auto``: chosen per round, its costs calibrated on
    ``target``)."""
    from ..proposer import with_verify_costs

    out: dict[str, Any] = {AR: None}
    for m, d in drafters.items():
        if d is None:
            continue
        for k in ks:
            dk = copy.copy(d)
            dk.auto = k == AUTO
            dk.draft_tokens = d.block_size - 1 if dk.auto else (k or d.block_size - 1)
            if dk.auto:
                if target is None:
                    raise ValueError("at_lengths: k=auto calibrates its costs on the target; pass target")
                out[f"{m} k={AUTO}"] = with_verify_costs(dk, target)
            else:
                dk.auto, dk.verify_costs = False, None
                out[f"{m} k={dk.draft_tokens}"] = dk
    return out


def _k(name: str) -> int | str:
    k = name.split(" k=")[1]
    return k if k == AUTO else int(k)


def auto_vs_best(rows: Sequence[dict], table: Sequence[dict], n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> dict[str, dict]:
    """Per method with an ``auto`` row: its speed against the fastest fixed k of the same run (``table``), as
    the geometric mean over prompts of the paired ratio (tokens / s with auto) / (tokens / s at that k), each
    prompt's speed pooled over its repeats, with a ``level`` bootstrap interval over prompts."""
    import numpy as np

    out: dict[str, dict] = {}
    for method in dict.fromkeys(r["method"] for r in table if r["k"] == AUTO):
        fixed = [r for r in table if r["method"] == method and r["k"] != AUTO]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r["speedup"])

        def speed(k: int | str) -> dict:
            acc: dict[Any, list[float]] = {}
            for r in rows:
                if r["method"] == f"{method} k={k}":
                    pooled = acc.setdefault((r["bench"], r["id"]), [0.0, 0.0])  # tokens, seconds
                    pooled[0] += r["tokens"]
                    pooled[1] += r["seconds"]
            return {p: v[0] / v[1] for p, v in acc.items()}

        a, b = speed(AUTO), speed(best["k"])
        logs = np.log(np.array([a[p] / b[p] for p in a if p in b]))
        idx = np.random.default_rng(seed).integers(0, len(logs), size=(n_boot, len(logs)))
        lo, hi = np.exp(np.percentile(logs[idx].mean(1), [(1 - level) / 2 * 100, (1 + level) / 2 * 100]))
        out[method] = {"best_fixed_k": best["k"], "ratio": float(np.exp(logs.mean())), "lo": float(lo),
                       "hi": float(hi), "prompts": int(len(logs))}
    return out


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (method, k): ``tau``, ``tokens_per_s``, ``speedup`` over AR (pooled seconds per token),
    ``speedup_q1`` / ``speedup_q3`` over prompts, ``verify_steps`` (a verify in AR steps: mean verify
    seconds per round / mean AR forward seconds per step), ``draft_ms`` per round, ``lossless``."""
    ar = [r for r in rows if r["method"] == AR]
    ar_tok, ar_s = sum(r["tokens"] for r in ar), sum(r["seconds"] for r in ar)
    ar_step = sum(r["forward_s"] for r in ar) / max(1, sum(r["timed_steps"] for r in ar))
    ar_by = {(r["id"], r["repeat"]): r for r in ar}
    out = [{"method": AR, "k": 0, "tau": 1.0, "tokens_per_s": ar_tok / ar_s, "speedup": 1.0, "speedup_q1": 1.0,
            "speedup_q3": 1.0, "verify_steps": 1.0, "draft_ms": 0.0, "lossless": True}]
    for name in dict.fromkeys(r["method"] for r in rows if r["method"] != AR):
        mine = [r for r in rows if r["method"] == name]
        tok, steps, s = (sum(r[c] for r in mine) for c in ("tokens", "steps", "seconds"))
        timed = max(1, sum(r["timed_steps"] for r in mine))
        per = [(r["tokens"] / r["seconds"]) / (ar_by[(r["id"], r["repeat"])]["tokens"] / ar_by[(r["id"], r["repeat"])]["seconds"])
               for r in mine]
        q = statistics.quantiles(per, n=4) if len(per) > 1 else [per[0]] * 3
        method, k = name.split(" k=")[0], _k(name)
        drafts = [r["mean_draft_k"] for r in mine if r.get("mean_draft_k") is not None]
        out.append({"method": method, "k": k, "tau": tok / steps, "tokens_per_s": tok / s,
                    "speedup": (tok / s) / (ar_tok / ar_s), "speedup_q1": q[0], "speedup_q3": q[2],
                    "verify_steps": sum(r["verify_s"] for r in mine) / timed / ar_step,
                    "draft_ms": 1e3 * sum(r["draft_s"] + r["refine_s"] for r in mine) / timed,
                    "lossless": all(r["lossless"] for r in mine),
                    **({"mean_draft_k": sum(drafts) / len(drafts)} if drafts else {})})
    return out


def run_draft_length(cfg: Config, target, ks: Sequence[int | str] = DRAFT_TOKENS, methods: Sequence[str] | None = None,
                     progress: bool = True, save: bool = True, untrained_ok: bool = False) -> dict[str, Any]:
    """Decode Table 1's prompts with every method at every k (module docstring); writes
    ``results/<preset>/draft_length.{json,csv}`` atomically with provenance; returns the payload."""
    from ..utils import provenance, write_result

    import torch

    e = cfg.eval
    methods = list(methods or e.methods)
    prov = provenance(cfg.preset, torch_threads=torch.get_num_threads())  # the code as it starts, not as it ends
    load = LoadRecord.start()
    t0 = time.perf_counter()
    loaded = make_drafters(cfg, target, methods, untrained_ok)
    drafters = at_lengths(loaded, ks, target)
    prompts = benchmark_prompts(cfg, target, e.prompts_per_benchmark)
    warm_up(target, drafters, prompts[0]["ids"])
    rows = decode_interleaved(target, drafters, prompts, e.max_new_tokens, 0.0, cfg.seed, e.repeats, progress,
                              desc="draft length")
    for r in rows:
        r["k"] = 0 if r["method"] == AR else _k(r["method"])
    table = summarize(rows)
    warnings = load.stop()
    best = max((r for r in table if r["method"] != AR), key=lambda r: r["speedup"])
    result = {"what": "speedup over AR against the drafted tokens a round verifies (decode.draft_tokens), T = 0, "
                      "batch 1, Table 1's prompts, AR and every (method, k) interleaved per prompt",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "max_iters": cfg.head.max_iters, "benchmarks": list(cfg.data.benchmarks), "methods": methods,
              "fingerprints": fingerprints_of(loaded),
              "draft_tokens": [k or cfg.drafter.block_size - 1 for k in ks],
              "verify_costs": {name: d.verify_costs.to_record() for name, d in drafters.items()
                               if d is not None and d.verify_costs is not None},
              "auto_vs_best": auto_vs_best(rows, table),
              "prompts_per_benchmark": e.prompts_per_benchmark, "max_new_tokens": e.max_new_tokens,
              "repeats": e.repeats, "table": table, "best": {"method": best["method"], "k": best["k"],
                                                              "speedup": best["speedup"], "tau": best["tau"]},
              "lossless_t0": all(r["lossless"] for r in table), "warnings": warnings,
              "seconds": time.perf_counter() - t0,
              "command": f"python -m xpress.studies.draft_length --preset {cfg.preset}"
                         + ("" if tuple(ks) == DRAFT_TOKENS else " --draft-tokens " + ",".join(map(str, ks))),
              "rows": rows,
              "provenance": {**prov, **load.provenance()}}
    if save:
        write_result(paths.RESULTS / cfg.preset, "draft_length", result, table)
    return result


def _add_args(parser) -> None:
    def ks(text: str) -> list[int | str]:
        try:
            return [AUTO if k.strip() == AUTO else int(k) for k in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give the k as integers or auto separated by commas, "
                                             f"e.g. 1,2,3,0,auto")
    parser.add_argument("--draft-tokens", type=ks, default=list(DRAFT_TOKENS), metavar="K,K,...",
                        help="the k to measure, comma-separated (0 = all B - 1; auto = chosen per round; "
                             "default: 1,2,3,0)")


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.draft_length", __doc__, "eval.repeats=1", _main, _add_args)


def _main(cfg: Config, target, args) -> int:
    bad = [k for k in args.draft_tokens if k != AUTO and not 0 <= k < cfg.drafter.block_size]
    if bad:
        print(f"error: --draft-tokens {bad[0]} must lie in [0, {cfg.drafter.block_size - 1}] (0 = all; the drafter's "
              f"block size is {cfg.drafter.block_size})", file=sys.stderr)
        return 2
    result = run_draft_length(cfg, target, ks=args.draft_tokens, untrained_ok=cfg.target.source == "random",
                              progress=not args.no_progress)
    for r in result["table"]:
        print(f"{r['method']:>7} k={r['k']}: tau {r['tau']:.3f}  {r['tokens_per_s']:.1f} tokens/s  speedup "
              f"{r['speedup']:.3f} [{r['speedup_q1']:.2f}, {r['speedup_q3']:.2f}]  verify {r['verify_steps']:.2f} steps  "
              f"draft {r['draft_ms']:.1f} ms  lossless {r['lossless']}")
    for m, c in result["auto_vs_best"].items():
        print(f"{m}: auto / best fixed k={c['best_fixed_k']}: {c['ratio']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}] "
              f"over {c['prompts']} prompts")
    print(f"wrote {paths.RESULTS / cfg.preset / 'draft_length.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
