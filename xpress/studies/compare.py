"""Methods compared by decoding held-out benchmark prompts: tau per benchmark and the wall-clock speedup
over autoregressive decoding, measured in one run on the same prompts.

Acceptance is measured by decoding, never by training accuracy: the trained checkpoints
(``checkpoints/<preset>/<method>/``) draft for the real target, and tau counts the tokens committed per
verification (bonus included). Timing is interleaved: for every prompt, AR and then each method run back
to back, so a slow phase of a shared machine hits every method alike; the load average before and after
is stored, and every speculative output is checked against AR (lossless at T = 0).

    from xpress.studies.compare import compare_methods
    result = compare_methods(cfg, target)        # writes results/<preset>/methods_t0.{json,csv}
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

from .. import paths
from ..config import Config


def benchmark_prompts(cfg: Config, target, per_benchmark: int) -> list[dict]:
    """The first ``per_benchmark`` prompts of each of ``cfg.data.benchmarks`` (first user turn, chat
    template, thinking off): records ``{"bench", "id", "ids"}``."""
    from ..data import load_benchmark
    from ..targets import encode_chat

    out = []
    for name in cfg.data.benchmarks:
        for rec in load_benchmark(name, limit=per_benchmark):
            out.append({"bench": name, "id": rec["id"], "ids": encode_chat(target.tokenizer, rec["turns"][:1])})
    return out


def summarize_rows(rows: Sequence[dict]) -> list[dict]:
    """Per (method, benchmark) and per method over all benchmarks (``bench = "avg"``: the mean of the
    per-benchmark values, as the paper averages): tau, tokens/s and the speedup over AR on the same
    prompts (AR seconds per token / method seconds per token)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    g = df.groupby(["method", "bench"]).agg(tokens=("tokens", "sum"), steps=("steps", "sum"),
                                            seconds=("seconds", "sum"), prompts=("id", "count"),
                                            lossless=("lossless", "all")).reset_index()
    g["tau"] = g["tokens"] / g["steps"]
    g["tokens_per_s"] = g["tokens"] / g["seconds"]
    ar = g[g["method"] == "ar"].set_index("bench")["tokens_per_s"]
    g["speedup"] = g["tokens_per_s"] / g["bench"].map(ar)
    avg = g.groupby("method").agg(tau=("tau", "mean"), speedup=("speedup", "mean"),
                                  tokens_per_s=("tokens_per_s", "mean"), tokens=("tokens", "sum"),
                                  steps=("steps", "sum"), seconds=("seconds", "sum"), prompts=("prompts", "sum"),
                                  lossless=("lossless", "all")).reset_index()
    avg["bench"] = "avg"
    return pd.concat([g, avg], ignore_index=True).to_dict("records")


def compare_methods(cfg: Config, target, methods: Sequence[str] | None = None, per_benchmark: int | None = None,
                    max_new_tokens: int | None = None, progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Decode ``per_benchmark`` prompts of every benchmark with AR and each method (T = 0, batch 1,
    interleaved per prompt) and return ``{"rows": per prompt and method, "summary": summarize_rows,
    ...}``; with ``save``, written to ``results/<preset>/methods_t0.{json,csv}`` with provenance."""
    import pandas as pd
    from tqdm.auto import tqdm

    from ..decoding import generate_ar, generate_speculative
    from ..methods import make_drafter
    from ..utils import atomic_write_json, atomic_write_text, provenance

    methods = list(methods or cfg.eval.methods)
    per_benchmark = per_benchmark or cfg.eval.prompts_per_benchmark
    max_new_tokens = max_new_tokens or cfg.eval.max_new_tokens
    drafters = {m: make_drafter(m, cfg, target, seed=cfg.seed) for m in methods}
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    load_before = os.getloadavg()
    generate_ar(target, prompts[0]["ids"], 4)  # warm-up
    for d in drafters.values():
        generate_speculative(target, d, prompts[0]["ids"], 4)
    rows = []
    bar = tqdm(total=len(prompts) * (1 + len(methods)), desc="compare methods", unit="run", disable=not progress)
    for p in prompts:
        t0 = time.perf_counter()
        ar = generate_ar(target, p["ids"], max_new_tokens)
        rows.append({"bench": p["bench"], "id": p["id"], "method": "ar", "tokens": len(ar.token_ids),
                     "steps": len(ar.token_ids), "seconds": time.perf_counter() - t0, "lossless": True})
        bar.update(1)
        for m, d in drafters.items():
            t0 = time.perf_counter()
            g = generate_speculative(target, d, p["ids"], max_new_tokens)
            seconds = time.perf_counter() - t0
            iters = [i for s in g.stats.get("iters", []) for i in (s if isinstance(s, list) else [s])]
            rows.append({"bench": p["bench"], "id": p["id"], "method": m, "tokens": len(g.token_ids),
                         "steps": g.n_steps, "seconds": seconds, "lossless": g.token_ids == ar.token_ids,
                         "mean_iters": sum(iters) / len(iters) if iters else None,
                         "refine_s": sum(g.step_times.get("refine", [])), "draft_s": sum(g.step_times.get("draft", [])),
                         "verify_s": sum(g.step_times.get("verify", []))})
            bar.update(1)
            bar.set_postfix(bench=p["bench"], method=m, tau=f"{g.tau:.2f}")
    bar.close()
    summary = summarize_rows(rows)
    result = {"what": "tau by decoding held-out benchmark prompts and speedup over AR, T=0, batch 1, interleaved",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "max_iters": cfg.head.max_iters, "benchmarks": list(cfg.data.benchmarks),
              "prompts_per_benchmark": per_benchmark, "max_new_tokens": max_new_tokens, "methods": methods,
              "summary": summary, "rows": rows,
              "provenance": provenance(cfg.preset, load_average_before=load_before,
                                       load_average_after=os.getloadavg())}
    if save:
        out = paths.RESULTS / cfg.preset
        atomic_write_json(out / "methods_t0.json", result)
        atomic_write_text(out / "methods_t0.csv", pd.DataFrame(summary).to_csv(index=False))
    return result
