"""Tau against the Jacobi budget K at T = 0 (the paper's Figure 3), simulated from one target forward per
prompt instead of decoding once per K.

At T = 0 speculative decoding outputs exactly the target's greedy continuation, whatever the drafter, so
every round can be replayed offline: with the prompt plus its greedy continuation ``g`` and the target's
features of every position (one teacher-forced forward), a round that starts at position ``p`` has the
anchor ``g_p``, a drafter context of the features before ``p``, and accepts the longest prefix of its draft
that equals ``g_{p+1} ..``; it commits that prefix plus the bonus token (cut at the end of the
continuation, as the engine cuts at EOS or max_new_tokens) and the next round starts at ``p + acc + 1``.
The drafter is run once for every possible start (its attention mask hides the context at and after
``p``), each method/K refines those blocks in one batch, and the chain of rounds is then followed. The
result equals decoding with :func:`xpress.decoding.generate_batch` (a test checks it on the smoke preset),
up to floating-point reduction order.

    from xpress.studies.tau_k import tau_vs_k
    result = tau_vs_k(cfg, target)          # writes results/<preset>/tau_vs_k.{json,csv}
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import paths


@dataclass
class Replay:
    """One prompt prepared for replay: ``ids`` prompt + greedy continuation (target ids), ``prompt_len``,
    ``n_gen`` generated tokens, ``features`` [1, L, F] the target's features of ``ids``."""

    ids: list[int]
    prompt_len: int
    n_gen: int
    features: torch.Tensor


@torch.inference_mode()
def prepare_replay(target, prompt_ids: Sequence[int], max_new_tokens: int) -> Replay:
    """The greedy continuation of ``prompt_ids`` (autoregressive decoding, stopping at EOS as the engine
    does) and the target's features over prompt + continuation."""
    from ..decoding import generate_ar
    from ..targets import target_forward

    gen = generate_ar(target, prompt_ids, max_new_tokens).token_ids
    ids = list(prompt_ids) + list(gen)
    features = target_forward(target, torch.tensor([ids], device=target.device), logits_to_keep=1).features
    return Replay(ids, len(prompt_ids), len(gen), features)


@torch.inference_mode()
def all_blocks(drafter, replay: Replay) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's block at every possible round start ``p = prompt_len - 1 .. prompt_len + n_gen - 2``:
    h [n, P, H], base logits [n, P, Vd] float32, anchors [n] and their positions [n] (target ids, int64)."""
    net, dev = drafter.drafter, drafter.device
    L = len(replay.ids)
    starts = torch.arange(replay.prompt_len - 1, replay.prompt_len - 1 + replay.n_gen, device=dev)  # [n]
    ids = torch.tensor(replay.ids, device=dev)
    context = net.encode_context(replay.features[:, :L - 1], torch.arange(L - 1, device=dev)[None])
    h = net(ids[starts][None], starts[None], context)[0, :, 1:]  # [n, P, H]
    return h, net.base_logits(h, drafter.vocab), ids[starts], starts


def acceptance(drafts: torch.Tensor, replay: Replay, starts: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per round start: the longest prefix of drafts [n, P] (target ids) equal to the
    greedy tokens after each start [n]: [n] int64."""
    n, p = drafts.shape
    ids = torch.tensor(replay.ids + [-1] * (p + 1), device=drafts.device)  # past the end: never equal
    truth = ids[starts[:, None] + 1 + torch.arange(p, device=drafts.device)]  # [n, P]
    return (drafts == truth).long().cumprod(dim=1).sum(dim=1)


def follow_rounds(acc: list[int], n_gen: int) -> list[int]:
    """The round starts (indices into ``acc``, 0 = the first anchor) that decoding visits: each round
    commits ``acc + 1`` tokens, the last one cut at ``n_gen``."""
    i, done, rounds = 0, 0, []
    while done < n_gen:
        rounds.append(i)
        done += min(acc[i] + 1, n_gen - done)
        i += acc[i] + 1
    return rounds


def replay_method(drafter, replay: Replay, blocks, k: int | None = None, sequential: bool = False) -> dict[str, Any]:
    """Tau of ``drafter`` on one prepared prompt (at Jacobi budget ``k`` for xpress, or its sequential
    decode): tokens, steps, tau, and the Jacobi passes of every round decoding would run."""
    h, base, anchors, starts = blocks
    saved = drafter.max_iters, drafter.refine
    try:
        if k is not None:
            drafter.max_iters = k
        drafter.refine = "sequential" if sequential else "jacobi"
        with torch.inference_mode():
            res = drafter.refine_block(h, base, anchors, 0.0)
    finally:
        drafter.max_iters, drafter.refine = saved
    acc = acceptance(drafter.vocab.to_target(res.tokens), replay, starts).tolist()
    rounds = follow_rounds(acc, replay.n_gen)
    iters = res.iters.tolist()
    return {"tokens": replay.n_gen, "steps": len(rounds), "tau": replay.n_gen / max(1, len(rounds)),
            "passes": [iters[i] for i in rounds]}


def tau_vs_k(cfg, target, methods: Sequence[str] = ("dflash", "markov", "xpress"), ks: Sequence[int] | None = None,
             per_benchmark: int | None = None, max_new_tokens: int | None = None, save: bool = True,
             progress: bool = True) -> dict[str, Any]:
    """Tau at T = 0 per benchmark for ``methods`` (trained checkpoints where present, else fresh weights)
    and, for xpress, every K in ``ks`` (default 1 .. B-1) plus its sequential decode (the exact fixed
    point); passes per round at the preset's K and at K = B-1. Writes ``results/<preset>/tau_vs_k.{json,csv}``
    with provenance when ``save``."""
    from tqdm.auto import tqdm

    from ..methods import drafter_weights, make_drafter
    from .compare import fingerprints_of
    from ..utils import provenance, write_result
    from .compare import benchmark_prompts

    p = cfg.drafter.block_size - 1
    ks = list(ks or range(1, p + 1))
    per_benchmark = per_benchmark or cfg.eval.prompts_per_benchmark
    max_new_tokens = max_new_tokens or cfg.eval.max_new_tokens
    load_before = os.getloadavg()
    drafters = {m: make_drafter(m, cfg, target, seed=cfg.seed, untrained_ok=True) for m in methods}
    variants = [(m, None, False) for m in methods if m != "xpress"]
    if "xpress" in methods:
        variants += [("xpress", k, False) for k in ks] + [("xpress", None, True)]
    prompts = benchmark_prompts(cfg, target, per_benchmark)
    rows, passes = [], {f"K={cfg.head.max_iters}": [], f"K={p}": []}
    for pr in tqdm(prompts, desc="tau vs K", unit="prompt", disable=not progress):
        replay = prepare_replay(target, pr["ids"], max_new_tokens)
        for m, d in drafters.items():
            blocks = all_blocks(d, replay)
            for method, k, seq in [v for v in variants if v[0] == m]:
                r = replay_method(d, replay, blocks, k, seq)
                label = "sequential" if seq else (f"K={k}" if k is not None else "")
                rows.append({"bench": pr["bench"], "id": pr["id"], "method": method, "K": k,
                             "variant": label, "tokens": r["tokens"], "steps": r["steps"], "tau": r["tau"]})
                if method == "xpress" and label in passes:
                    passes[label] += r["passes"]
    summary = summarize(rows)
    result = {"what": "tau at T=0 against the Jacobi budget K, replayed from the target's greedy continuation",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "max_iters": cfg.head.max_iters, "ks": ks, "benchmarks": list(cfg.data.benchmarks),
              "prompts_per_benchmark": per_benchmark, "max_new_tokens": max_new_tokens,
              "weights": {m: drafter_weights(d) for m, d in drafters.items()},
              "fingerprints": fingerprints_of(drafters),
              "summary": summary, "passes": passes, "rows": rows,
              "provenance": provenance(cfg.preset, load_average_before=load_before, load_average_after=os.getloadavg())}
    if save:
        write_result(paths.RESULTS / cfg.preset, "tau_vs_k", result, summary)
    return result


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (method, variant, benchmark): tokens, steps, tau = tokens / steps; ``bench = "avg"``: the mean of
    the per-benchmark taus (as the paper averages)."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        g = groups.setdefault((r["method"], r["variant"], r["K"], r["bench"]), {"tokens": 0, "steps": 0, "prompts": 0})
        g["tokens"] += r["tokens"]
        g["steps"] += r["steps"]
        g["prompts"] += 1
    out = [{"method": m, "variant": v, "K": k, "bench": b, **g, "tau": g["tokens"] / max(1, g["steps"])}
           for (m, v, k, b), g in groups.items()]
    for key in dict.fromkeys((o["method"], o["variant"], o["K"]) for o in out):  # first-seen order: the same file every run
        per = [o for o in out if (o["method"], o["variant"], o["K"]) == key and o["bench"] != "avg"]
        out.append({"method": key[0], "variant": key[1], "K": key[2], "bench": "avg",
                    "tokens": sum(o["tokens"] for o in per), "steps": sum(o["steps"] for o in per),
                    "prompts": sum(o["prompts"] for o in per), "tau": sum(o["tau"] for o in per) / len(per)})
    return out
