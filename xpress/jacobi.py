"""Resolving a causal correction over a block: parallel Jacobi refinement (paper Algorithm 1, Eq. 11,
Theorem 1) and the left-to-right sequential reference.

Shapes: ``b`` blocks, ``P = B - 1`` drafted positions, ``Vd`` draft vocabulary. Tokens ``y`` [b, P] are
draft ids; the previous-token input ``prev`` [b, P] = ``[anchor, y_1 .. y_{P-1}]`` is in TARGET ids (the
anchor may lie outside the draft vocabulary), mapped with the block's :class:`DraftVocab`.

A ``logits_fn(prev, rows, k=None)`` gives the corrected logits ``s + delta``: ``prev`` [n, P] int64 target
ids for the blocks ``rows`` [n] int64 of the batch; with ``k=None`` all positions at once, [n, P, Vd]
(one parallel pass); with ``k`` (0-based) only position ``k``, [n, Vd]; with the keyword ``lo`` (used by
:func:`jacobi_refine` when ``lo > 0``) only positions ``lo .. P-1``, [n, P-lo, Vd]. Position ``k`` must
depend on the tokens only through ``prev[:, :k+1]`` (Proposition 1); :func:`corrected_logits` builds one
from base logits and a head's correction. An optional attribute ``logits_fn.argmax`` with the same
arguments returns the T=0 tokens (the argmax of those logits) directly; refinement at T=0 then never asks
for the logits (:mod:`xpress.readout`: at a large vocabulary the argmax reads a bfloat16 readout and
recomputes only the few candidates that could win in float32).

Incremental passes. By causality a position's logits change only when its prefix changes: if a pass
changed no token before position ``m``, the logits of positions ``0 .. m`` are those of the previous pass.
:func:`jacobi_refine` therefore tracks, per block, the first position whose prefix changed and recomputes
only the positions from there on (the first ``t`` positions are final after ``t`` passes, Theorem 1, so a
pass never recomputes more than ``P - t + 1`` of them). The tokens, ``iters``, trajectory and ``q`` are
those of the dense algorithm (``incremental=False``, every position every pass).

Sampling (``temperature > 0``) uses the Gumbel-max trick with noise ``g`` [b, P, Vd] drawn ONCE per block:
``y_k = argmax(l_k / T + g_k)`` is an exact sample of ``softmax(l_k / T)``, and with the noise fixed the
update is a deterministic function of the prefix, so Theorem 1 applies: the Jacobi fixed point is exactly
the sequential sample under the same noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .readout import argmax_last
from .vocab import DraftVocab

LogitsFn = Callable[..., torch.Tensor]


@dataclass
class RefineResult:
    """tokens: [b, P] int64 draft ids. q: [b, P, Vd] float32, the exact distribution each token was drawn
    from (``None`` at T=0). iters: [b] int64 parallel passes (Jacobi) or dependent steps (sequential)
    used per block. trajectory: ``[Y^(0), Y^(1), ...]`` each [b, P] (a converged block repeats its fixed
    point), when asked for."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    iters: torch.Tensor
    trajectory: list[torch.Tensor] | None = None


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Standard Gumbel noise of ``shape`` (float32); ``generator`` must live on ``device``."""
    u = torch.rand(shape, generator=generator, device=device)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))


def block_noise(base_logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor | None:
    """The block's Gumbel noise [b, P, Vd]: ``noise`` if given, fresh from ``generator`` otherwise;
    ``None`` at T=0."""
    if temperature <= 0:
        return None
    if noise is None:
        return gumbel_noise(tuple(base_logits.shape), generator, base_logits.device)
    if noise.shape != base_logits.shape:
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(base_logits.shape)}")
    return noise


def select(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None) -> torch.Tensor:
    """logits [..., Vd] -> tokens [...]: argmax at T=0 (first index on ties), else the Gumbel-max sample
    ``argmax(logits / T + noise)`` of ``softmax(logits / T)``."""
    return argmax_last(logits) if temperature <= 0 else argmax_last(logits / temperature + noise)


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32: [..., Vd]."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def prev_tokens(anchor: torch.Tensor, tokens: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """anchor [n] target ids, tokens [n, P] draft ids -> prev [n, P] = [anchor, y_1 .. y_{P-1}] target ids."""
    y = tokens[:, :-1] if vocab is None else vocab.to_target(tokens[:, :-1])
    return torch.cat([anchor[:, None], y], dim=1)


def corrected_logits(base_logits: torch.Tensor, correction: Callable[..., torch.Tensor]) -> LogitsFn:
    """The ``logits_fn`` ``s + delta`` for base logits [b, P, Vd] and a head's correction
    (``XPressRefiner.fold(h)``, ``MarkovHead.fold()`` or any ``(prev, rows, k, lo=0) -> delta``, a new
    tensor, to which ``s`` is added in place: the [n, P, Vd] logits are materialised once).

    When the correction has ``choose(prev, base, rows, k, lo)`` (the heads' folds), the function also
    carries ``logits_fn.argmax(prev, rows, k=None, lo=0)``: the tokens ``argmax(s + delta)`` [n, P-lo] or
    [n], which :func:`jacobi_refine` and :func:`sequential_refine` use at T=0 (through the certified
    readout of :mod:`xpress.readout` at large vocabularies: the same tokens, without float32 logits)."""
    def base_of(rows: torch.Tensor, k: int | None, lo: int) -> torch.Tensor:
        if k is not None:
            return base_logits[rows, k]
        one = base_logits.shape[0] == 1 and rows.numel() == 1  # the only block: a view, no gathered copy
        return base_logits[:, lo:] if one else base_logits[rows, lo:]

    def logits_fn(prev: torch.Tensor, rows: torch.Tensor, k: int | None = None, lo: int = 0) -> torch.Tensor:
        if k is not None:
            return correction(prev, rows, k).add_(base_of(rows, k, lo))
        delta = correction(prev, rows, k) if lo == 0 else correction(prev, rows, k, lo=lo)
        return delta.add_(base_of(rows, k, lo))

    choose = getattr(correction, "choose", None)
    if choose is not None:
        def argmax(prev: torch.Tensor, rows: torch.Tensor, k: int | None = None, lo: int = 0) -> torch.Tensor:
            return choose(prev, base_of(rows, k, lo), rows, k, lo)
        logits_fn.argmax = argmax
    return logits_fn


def jacobi_step(logits_fn: LogitsFn, tokens: torch.Tensor, anchor: torch.Tensor, rows: torch.Tensor,
                temperature: float = 0.0, noise: torch.Tensor | None = None, *,
                vocab: DraftVocab | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Jacobi update (Eq. 11) of the blocks ``rows``: tokens [n, P] draft ids, anchor [n], noise
    [n, P, Vd] or None -> (new tokens [n, P], the logits they were chosen from [n, P, Vd])."""
    logits = logits_fn(prev_tokens(anchor, tokens, vocab), rows)
    return select(logits, temperature, noise), logits


def jacobi_refine(logits_fn: LogitsFn, base_logits: torch.Tensor, anchor: torch.Tensor, max_iters: int,
                  temperature: float = 0.0, generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None, *, vocab: DraftVocab | None = None,
                  init: torch.Tensor | None = None, return_trajectory: bool = False,
                  incremental: bool = True) -> RefineResult:
    """Parallel refinement (Algorithm 1) with adaptive stopping per block.

    base_logits [b, P, Vd] float32 (the drafter's ``s``), anchor [b] target ids, ``vocab`` the draft
    vocabulary of the logits (None: draft ids are target ids); ``noise`` [b, P, Vd] Gumbel noise (default:
    drawn from ``generator``; ignored at T=0). The seed ``Y^(0)`` is
    ``init`` [b, P] draft ids if given, else the drafter's own choice ``select(s)`` (argmax at T=0; at T>0
    the drafter's sample under the block's noise). Each pass updates the blocks that are still changing
    in one ``logits_fn`` call; a block stops (and is never recomputed) when a pass leaves it unchanged, or
    after ``min(max_iters, P)`` passes: by Theorem 1 the iterate is the sequential decode after P passes,
    so a confirming pass is never needed. ``iters`` counts the passes.

    ``incremental`` (default) recomputes, per block, only the positions whose prefix changed in the
    previous pass (module docstring); ``False`` recomputes every position every pass, the algorithm as
    written. Both give the same tokens, ``iters``, trajectory and ``q``: a kept position's logits are
    the ones the dense pass would recompute from the same prefix.

    Losslessness at T>0 for any K. The returned ``q_k = softmax(l_k / T)`` uses the logits ``l_k`` that
    ``y_k`` was drawn from, i.e. computed from the previous iterate's prefix (equal to the final block's
    prefix once converged). By causality, the iterate's token at position ``i`` depends on the noise at
    positions ``<= i`` only (the seed is per-position; a custom ``init`` must not depend on later noise),
    so ``l_k`` is a function of ``g_{<k}`` and independent of ``g_k``: given everything before it, ``y_k``
    is an exact draw from ``q_k``, and the drafted prefix ``y_{<k}`` is a function of ``g_{<k}`` too. That is
    all speculative sampling needs (the proposal at ``k`` may depend on any information independent of
    ``g_k``), so the acceptance test with ``q`` is lossless even if K stops before convergence. Adaptive
    stopping changes nothing: once a block is a fixed point, further passes reproduce the same tokens and
    logits, so the result is that of a fixed K. ``q`` is one softmax at the end over the kept logits
    (none is computed at T=0).
    """
    b, p, _ = base_logits.shape
    dev = base_logits.device
    noise = block_noise(base_logits, temperature, generator, noise)
    y = (select(base_logits, temperature, noise) if init is None else init).clone()
    drawn_from = None if noise is None else torch.zeros_like(base_logits, dtype=torch.float32)  # l_k per y_k
    iters = torch.zeros(b, dtype=torch.int64, device=dev)
    start = torch.zeros(b, dtype=torch.int64, device=dev)  # first position whose prefix changed last pass
    active = torch.arange(b, device=dev)
    trajectory = [y.clone()] if return_trajectory else None
    for _ in range(min(max_iters, p)):
        iters[active] += 1
        if not incremental:
            start[active] = 0
        changed = _incremental_pass(logits_fn, y, anchor, active, start, temperature, noise, drawn_from, vocab)
        if trajectory is not None:
            trajectory.append(y.clone())
        active = active[changed]
        if active.numel() == 0:
            break
    q = None if drawn_from is None else (distribution(drawn_from, temperature) if max_iters >= 1 else drawn_from)
    return RefineResult(y, q, iters, trajectory)


def jacobi_refine_one(correction, base_logits: torch.Tensor, anchor: torch.Tensor, max_iters: int,
                      temperature: float = 0.0, noise: torch.Tensor | None = None, *,
                      vocab: DraftVocab | None = None) -> RefineResult:
    """:func:`jacobi_refine` for a single block (b = 1, inference's case) in dense passes without the batch's
    bookkeeping (active set, per-block starts, gathered rows): the same tokens, ``iters`` and ``q`` (those of
    the dense algorithm, which the incremental one equals) in far fewer operations, which matters where each
    costs more than its arithmetic (a round's refinement runs with caches cold from the verify).

    correction: a head's fold for this block (``XPressRefiner.fold(h)``): ``choose(prev, base)`` the T=0
    tokens, ``correction(prev)`` the delta [1, P, Vd]; prev [1, P] target ids. base_logits [1, P, Vd];
    anchor [1]; noise [1, P, Vd] (T>0; the block's). ``max_iters`` >= 1. ``q`` is the softmax of the last
    pass's logits: every token of that pass was drawn from them (a pass that changes nothing, or the last
    one allowed)."""
    if max_iters < 1:
        raise ValueError(f"max_iters={max_iters}: the one-block refinement needs at least one pass")
    y = select(base_logits, temperature, noise)  # [1, P]: Y^(0), the drafter's own choice
    logits, passes = None, 0
    for _ in range(min(max_iters, y.shape[1])):
        passes += 1
        prev = prev_tokens(anchor, y, vocab)
        if noise is None or temperature <= 0:
            new = correction.choose(prev, base_logits)
        else:
            logits = correction(prev).add_(base_logits)  # [1, P, Vd]
            new = select(logits, temperature, noise)
        if torch.equal(new, y):  # a pass that changes nothing: the fixed point
            break
        y = new
    q = None if logits is None else distribution(logits, temperature)
    return RefineResult(y, q, torch.full((1,), passes, dtype=torch.int64, device=y.device))


def jacobi_rollout(logits_of: Callable[[torch.Tensor], torch.Tensor], base_logits: torch.Tensor,
                   anchor: torch.Tensor, passes: int, temperature: float = 0.0, noise: torch.Tensor | None = None, *,
                   vocab: DraftVocab | None = None) -> RefineResult:
    """:func:`jacobi_refine` as a fixed number of dense passes with no data-dependent exit and no host read,
    for a compiled graph (a CUDA graph on a GPU: :meth:`xpress.proposer.ModelDrafter.compile`).

    ``logits_of(prev)`` -> the corrected logits ``s + delta`` [b, P, Vd] for prev [b, P] target ids; base_logits
    [b, P, Vd]; anchor [b]; ``passes`` >= 1 (``min(K, P)``); noise [b, P, Vd] at T > 0. Exactly the adaptive
    result: a pass that leaves a block unchanged is its fixed point, and every later pass recomputes the same
    logits from the same prefix, so the tokens and ``q`` (the softmax of the last pass's logits, those every
    token was drawn from) are those of stopping there. ``iters`` [b] (on the device) counts the passes the
    adaptive algorithm makes: those that changed the block, plus the one that confirmed it, at most ``passes``."""
    if passes < 1:
        raise ValueError(f"passes={passes}: the rollout needs at least one pass")
    y = select(base_logits, temperature, noise)  # [b, P]: Y^(0)
    moved, logits = [], None
    for _ in range(passes):
        logits = logits_of(prev_tokens(anchor, y, vocab))  # [b, P, Vd]
        new = select(logits, temperature, noise)
        moved.append((new != y).any(dim=1))  # [b]
        y = new
    iters = (torch.stack(moved, dim=1).long().cumprod(dim=1).sum(dim=1) + 1).clamp_max(passes)
    q = None if noise is None or temperature <= 0 else distribution(logits, temperature)
    return RefineResult(y, q, iters)


def _incremental_pass(logits_fn: LogitsFn, y: torch.Tensor, anchor: torch.Tensor, active: torch.Tensor,
                      start: torch.Tensor, temperature: float, noise: torch.Tensor | None,
                      drawn_from: torch.Tensor | None, vocab: DraftVocab | None) -> torch.Tensor:
    """One Jacobi pass over the blocks ``active`` [a], in place: positions ``>= start`` [b] of each block are
    recomputed (one ``logits_fn`` call from the lowest start on; positions below a block's own start keep
    their token and logits), ``y`` [b, P] and ``drawn_from`` [b, P, Vd] (T>0) updated, ``start`` set to one
    past each block's first changed position. Returns [a] bool: the block changed."""
    p = y.shape[1]
    work = active[start[active] < p]  # blocks with at least one position to recompute
    if work.numel() == 0:
        return torch.zeros(active.shape, dtype=torch.bool, device=y.device)
    lo = int(start[work].min())
    prev = prev_tokens(anchor[work], y[work], vocab)
    choose = getattr(logits_fn, "argmax", None) if drawn_from is None and temperature <= 0 else None
    if choose is not None:  # T=0: the tokens alone
        logits, new = None, choose(prev, work, lo=lo)  # [n, P-lo]
    else:
        logits = logits_fn(prev, work, lo=lo) if lo else logits_fn(prev, work)  # [n, P-lo, Vd]
        new = select(logits, temperature, None if noise is None else noise[work, lo:])
    old = y[work, lo:]  # [n, P-lo]
    kept = torch.arange(lo, p, device=y.device) < start[work, None]  # [n, P-lo]: logits still valid
    same_start = bool((start[work] == lo).all())  # then no position of the call is kept (always at b = 1)
    if not same_start:
        new = torch.where(kept, old, new)
    if drawn_from is not None:
        drawn_from[work, lo:] = logits if same_start else torch.where(kept[..., None], drawn_from[work, lo:], logits)
    diff = new != old  # [n, P-lo]
    moved = diff.any(dim=1)
    y[work, lo:] = new
    start[work] = torch.where(moved, diff.int().argmax(dim=1) + lo + 1, p)
    return torch.isin(active, work[moved])


def sequential_refine(logits_fn: LogitsFn, base_logits: torch.Tensor, anchor: torch.Tensor,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None, *, vocab: DraftVocab | None = None,
                      positions: int | None = None) -> RefineResult:
    """The left-to-right reference: P dependent steps, ``y_k = select(l_k(y_{<k}))`` (what the Markov head
    always does, and the exact fixed point of :func:`jacobi_refine`). base_logits [b, P, Vd], anchor [b]
    target ids, noise [b, P, Vd] or None -> RefineResult(tokens [b, P] draft ids, q [b, P, Vd] or None at
    T=0, iters [b] = the steps taken). ``logits_fn`` is called once per position ``k`` -> [b, Vd].
    ``positions``: stop after the first n (the rest stay 0 in tokens and q; default P)."""
    b, p, _ = base_logits.shape
    noise = block_noise(base_logits, temperature, generator, noise)
    y = torch.zeros(b, p, dtype=torch.int64, device=base_logits.device)  # positions >= k are not read at k
    q = None if noise is None else torch.zeros_like(base_logits, dtype=torch.float32)
    rows = torch.arange(b, device=base_logits.device)
    choose = getattr(logits_fn, "argmax", None) if noise is None else None
    steps = p if positions is None else min(p, positions)
    for k in range(steps):
        if choose is not None:  # T=0: the tokens alone
            y[:, k] = choose(prev_tokens(anchor, y, vocab), rows, k)
            continue
        logits = logits_fn(prev_tokens(anchor, y, vocab), rows, k)  # [b, Vd]
        y[:, k] = select(logits, temperature, None if noise is None else noise[:, k])
        if q is not None:
            q[:, k] = distribution(logits, temperature)
    return RefineResult(y, q, torch.full((b,), steps, dtype=torch.int64, device=base_logits.device))
