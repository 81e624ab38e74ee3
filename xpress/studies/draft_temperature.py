"""At T > 0, what temperature should a drafter draw at? ``python -m xpress.studies.draft_temperature --preset cpu``.

Lossless speculative sampling accepts a drafted token d with probability min(1, p(d) / q(d)), where p is the
target's distribution at the decoding temperature T and q the distribution d was drawn from (:func:`xpress.decoding.
rejection_accept`). Any q keeps the output distribution the target's, so a drafter may draw at a temperature
t_d of its own (q its softmax at t_d), or greedily (t_d = 0: q one-hot on its argmax, d accepted with probability
p(d)). At one position the chance of acceptance is sum_x min(p(x), q(x)), largest where q = p: a drafter whose q
matches the target's distribution at T gains nothing by sharpening it (t_d < T) or flattening it (t_d > T); one
whose mass is spread too wide or too narrow does. The paper's drafters draw at T.

The study decodes ``--prompts`` prompts per benchmark (the first ones, as the resolution study) at the target's
``eval.sampling_temperature`` with every method's drafter drawing at each t_d of ``--draft-temperatures`` (T among
them: the baseline), ``eval.resolution_batch_size`` at a time, the same prompts and the same generator per batch
for every drafter (:func:`xpress.studies.resolution.decode_tau`; batching leaves each row's tau its own). It
reports, per method and t_d, tau and tau(t_d) / tau(T) with its paired bootstrap 95% interval over prompts
(:func:`xpress.studies.table1.bootstrap_tau_ratio`). No clock: t_d changes what is drafted, not what a round costs
(a greedy draft skips the draw, a few microseconds).

Writes ``results/<preset>/draft_temperature.{json,csv}``.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

import torch

from .. import paths
from ..config import Config
from ..utils import write_result
from .compare import LoadRecord, benchmark_prompts, fingerprints_of, make_drafters, study_main, weights_of
from .resolution import decode_tau
from .table1 import _all_warnings, _provenance, bootstrap_tau_ratio

DRAFT_TEMPERATURES = (0.0, 0.8, 1.0, 1.25)  # 1.0: the cpu preset's eval.sampling_temperature, the baseline


class DraftAt:
    """``inner`` drawing its drafts at temperature ``t`` in every round decoded at T > 0 (at T = 0 it drafts
    greedily, as any drafter does). At ``t = 0`` the drafts are its greedy ones and ``q`` [b, n, V] is one-hot
    on them over the target vocabulary of ``vocab_size`` tokens: the exact distribution they were drawn from,
    which rejection sampling needs to stay lossless."""

    def __init__(self, inner: Any, t: float, vocab_size: int) -> None:
        if t < 0:
            raise ValueError(f"a draft temperature of {t}: use 0 (greedy drafts) or a positive temperature")
        self.inner, self.t, self.vocab_size = inner, float(t), int(vocab_size)
        self.block_size = inner.block_size

    def reset(self, prompt_ids: list[list[int]]) -> None:
        self.inner.reset(prompt_ids)

    def extend(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self.inner.extend(tokens, features, positions, valid)

    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None):
        draft = self.inner.propose(anchor, anchor_pos, self.t if temperature > 0 else 0.0, generator)
        if temperature > 0 and self.t == 0:
            q = torch.zeros(*draft.tokens.shape, self.vocab_size, device=draft.tokens.device)  # [b, n, V]
            draft = dataclasses.replace(draft, q=q.scatter_(-1, draft.tokens[..., None], 1.0))
        return draft


def name(method: str, t: float) -> str:
    """The row name of ``method`` drawing at ``t``: ``"xpress@0.8"``."""
    return f"{method}@{t:g}"


def draft_temperature_table(rows: Sequence[dict], methods: Sequence[str], temps: Sequence[float], base: float,
                            n_boot: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Per method and draft temperature: tau over all prompts and, against drawing at ``base`` (the decoding
    temperature), ``ratio`` with its paired bootstrap interval ``lo`` - ``hi`` (the benchmarks' average, as the
    paper averages)."""
    out = []
    for m in methods:
        for t in temps:
            mine = [r for r in rows if r["method"] == name(m, t)]
            tau = sum(r["tokens"] for r in mine) / max(1, sum(r["steps"] for r in mine))
            avg = next(iter(bootstrap_tau_ratio(rows, name(m, t), name(m, base), n_boot, seed).values()))["avg"]
            out.append({"method": m, "draft_temperature": t, "tau": tau, "ratio": avg["ratio"], "lo": avg["lo"],
                        "hi": avg["hi"], "prompts": len(mine)})
    return out


def run_draft_temperature(cfg: Config, target, temps: Sequence[float] = DRAFT_TEMPERATURES,
                          per_benchmark: int = 24, methods: Sequence[str] | None = None, untrained_ok: bool = False,
                          progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Decode and summarise (the decoding temperature is ``cfg.eval.sampling_temperature``, added to ``temps``
    if missing; tokens per prompt as Table 1's). With ``save``, writes ``results/<preset>/draft_temperature.{json,
    csv}`` atomically with provenance; returns the payload."""
    e = cfg.eval
    T = e.sampling_temperature
    temps = sorted({float(t) for t in temps} | {T})
    methods = [m for m in (methods or e.methods) if m != "ar"]
    load = LoadRecord.start()
    t0 = time.perf_counter()
    drafters = make_drafters(cfg, target, methods, untrained_ok)
    drafters.pop("ar")
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    tempered = {name(m, t): DraftAt(d, t, target.vocab_size) for m, d in drafters.items() for t in temps}
    rows = decode_tau(target, tempered, prompts, e.max_new_tokens, e.resolution_batch_size, T, cfg.seed, progress)
    table = draft_temperature_table(rows, list(drafters), temps, T, e.bootstrap, cfg.seed)
    result = {"what": f"tau at T = {T:g} with the drafters drawing at other temperatures (q the distribution drawn "
                      f"from, so every row is lossless); ratio: tau / tau drawing at T, paired bootstrap 95% interval",
              "preset": cfg.preset, "target": target.name, "temperature": T, "draft_temperatures": temps,
              "block_size": cfg.drafter.block_size, "draft_tokens": cfg.decode.draft_tokens,
              "benchmarks": list(cfg.data.benchmarks), "methods": list(drafters), "weights": weights_of(drafters),
              "fingerprints": fingerprints_of(drafters), "prompts_per_benchmark": per_benchmark,
              "max_new_tokens": e.max_new_tokens, "batch_size": e.resolution_batch_size, "seed": cfg.seed,
              "bootstrap_resamples": e.bootstrap, "table": table, "seconds": time.perf_counter() - t0,
              "warnings": _all_warnings(load.stop()),
              "command": f"python -m xpress.studies.draft_temperature --preset {cfg.preset}",
              "rows": rows, "provenance": _provenance(cfg, load, target.device)}
    if save:
        write_result(paths.RESULTS / cfg.preset, "draft_temperature", result, table)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.draft_temperature", __doc__, "eval.sampling_temperature=0.7",
                      _main, _arguments)


def _arguments(parser) -> None:
    parser.add_argument("--draft-temperatures", default=",".join(f"{t:g}" for t in DRAFT_TEMPERATURES),
                        help="comma-separated temperatures the drafters draw at (0: greedy drafts); the decoding "
                             "temperature is added if missing")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per benchmark (default 24)")


def _main(cfg: Config, target, args) -> int:
    try:
        temps = [float(t) for t in args.draft_temperatures.split(",") if t.strip()]
    except ValueError:
        print(f"error: --draft-temperatures {args.draft_temperatures!r}: give numbers separated by commas, e.g. "
              f"0,0.8,1", file=sys.stderr)
        return 2
    if any(t < 0 for t in temps):
        print(f"error: --draft-temperatures {args.draft_temperatures!r}: a negative temperature; use 0 (greedy "
              f"drafts) or positive ones", file=sys.stderr)
        return 2
    if args.prompts < 1:
        print(f"error: --prompts {args.prompts}: give at least 1 prompt per benchmark", file=sys.stderr)
        return 2
    result = run_draft_temperature(cfg, target, temps, args.prompts, untrained_ok=cfg.target.source == "random",
                                   progress=not args.no_progress)
    for r in result["table"]:
        print(f"{r['method']:8s} t_d={r['draft_temperature']:<5g} tau {r['tau']:.3f}  x{r['ratio']:.3f} "
              f"[{r['lo']:.3f}, {r['hi']:.3f}]")
    print(f"wrote {paths.RESULTS / cfg.preset / 'draft_temperature.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
