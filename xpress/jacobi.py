"""Resolving a causal correction over a block: parallel Jacobi refinement (paper Algorithm 1, Eq. 11,
Theorem 1) and the left-to-right sequential reference.

Shapes: ``b`` blocks, ``P = B - 1`` drafted positions, ``Vd`` draft vocabulary. Tokens ``y`` [b, P] are
draft ids; the previous-token input ``prev`` [b, P] = ``[anchor, y_1 .. y_{P-1}]`` is in TARGET ids (the
anchor may lie outside the draft vocabulary), mapped with the block's :class:`DraftVocab`.

A ``logits_fn(prev, rows, k=None)`` gives the corrected logits ``s + delta``: ``prev`` [n, P] int64 target
ids for the blocks ``rows`` [n] int64 of the batch; with ``k=None`` all positions at once, [n, P, Vd]
(one parallel pass); with ``k`` (0-based) only position ``k``, [n, Vd]. Position ``k`` must depend on the
tokens only through ``prev[:, :k+1]`` (Proposition 1); :func:`corrected_logits` builds one from base
logits and a head's correction.

Sampling (``temperature > 0``) uses the Gumbel-max trick with noise ``g`` [b, P, Vd] drawn ONCE per block:
``y_k = argmax(l_k / T + g_k)`` is an exact sample of ``softmax(l_k / T)``, and with the noise fixed the
update is a deterministic function of the prefix, so Theorem 1 applies: the Jacobi fixed point is exactly
the sequential sample under the same noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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
    return logits.argmax(-1) if temperature <= 0 else (logits / temperature + noise).argmax(-1)


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32: [..., Vd]."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def prev_tokens(anchor: torch.Tensor, tokens: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """anchor [n] target ids, tokens [n, P] draft ids -> prev [n, P] = [anchor, y_1 .. y_{P-1}] target ids."""
    y = tokens[:, :-1] if vocab is None else vocab.to_target(tokens[:, :-1])
    return torch.cat([anchor[:, None], y], dim=1)


def corrected_logits(base_logits: torch.Tensor, correction: Callable[..., torch.Tensor]) -> LogitsFn:
    """The ``logits_fn`` ``s + delta`` for base logits [b, P, Vd] and a head's correction
    (``FoldedRefiner`` or ``MarkovHead.bias``: ``(prev, rows, k) -> delta``)."""
    def logits_fn(prev: torch.Tensor, rows: torch.Tensor, k: int | None = None) -> torch.Tensor:
        s = base_logits[rows] if k is None else base_logits[rows, k]
        return s + correction(prev, rows, k)
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
                  init: torch.Tensor | None = None, return_trajectory: bool = False) -> RefineResult:
    """Parallel refinement (Algorithm 1) with adaptive stopping per block.

    base_logits [b, P, Vd] float32 (the drafter's ``s``), anchor [b] target ids, ``vocab`` the draft
    vocabulary of the logits (None: draft ids are target ids); ``noise`` [b, P, Vd] Gumbel noise (default:
    drawn from ``generator``; ignored at T=0). The seed ``Y^(0)`` is
    ``init`` [b, P] draft ids if given, else the drafter's own choice ``select(s)`` (argmax at T=0; at T>0
    the drafter's sample under the block's noise). Each pass recomputes all positions of the blocks that
    are still changing in one ``logits_fn`` call; a block stops (and is never recomputed) when a pass
    leaves it unchanged, or after ``min(max_iters, P)`` passes: by Theorem 1 the iterate is the
    sequential decode after P passes, so a confirming pass is never needed. ``iters`` counts the passes.

    Losslessness at T>0 for any K. The returned ``q_k = softmax(l_k / T)`` uses the logits ``l_k`` that
    ``y_k`` was drawn from, i.e. computed from the previous iterate's prefix (equal to the final block's
    prefix once converged). By causality, the iterate's token at position ``i`` depends on the noise at
    positions ``<= i`` only (the seed is per-position; a custom ``init`` must not depend on later noise),
    so ``l_k`` is a function of ``g_{<k}`` and independent of ``g_k``: given everything before it, ``y_k``
    is an exact draw from ``q_k``, and the drafted prefix ``y_{<k}`` is a function of ``g_{<k}`` too. That is
    all speculative sampling needs (the proposal at ``k`` may depend on any information independent of
    ``g_k``), so the acceptance test with ``q`` is lossless even if K stops before convergence. Adaptive
    stopping changes nothing: once a block is a fixed point, further passes reproduce the same tokens and
    logits, so the result is that of a fixed K.
    """
    b, p, _ = base_logits.shape
    noise = block_noise(base_logits, temperature, generator, noise)
    y = (select(base_logits, temperature, noise) if init is None else init).clone()
    q = None if noise is None else torch.zeros_like(base_logits, dtype=torch.float32)
    iters = torch.zeros(b, dtype=torch.int64, device=base_logits.device)
    active = torch.arange(b, device=base_logits.device)
    trajectory = [y.clone()] if return_trajectory else None
    for _ in range(min(max_iters, p)):
        new, logits = jacobi_step(logits_fn, y[active], anchor[active], active, temperature,
                                  None if noise is None else noise[active], vocab=vocab)
        iters[active] += 1
        if q is not None:
            q[active] = distribution(logits, temperature)
        settled = (new == y[active]).all(dim=-1)
        y[active] = new
        if trajectory is not None:
            trajectory.append(y.clone())
        active = active[~settled]
        if active.numel() == 0:
            break
    return RefineResult(y, q, iters, trajectory)


def sequential_refine(logits_fn: LogitsFn, base_logits: torch.Tensor, anchor: torch.Tensor,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None, *, vocab: DraftVocab | None = None) -> RefineResult:
    """The left-to-right reference: P dependent steps, ``y_k = select(l_k(y_{<k}))`` (what the Markov head
    always does, and the exact fixed point of :func:`jacobi_refine`). base_logits [b, P, Vd], anchor [b]
    target ids, noise [b, P, Vd] or None -> RefineResult(tokens [b, P] draft ids, q [b, P, Vd] or None at
    T=0, iters [b] = P for every block). ``logits_fn`` is called once per position ``k`` -> [b, Vd]."""
    b, p, _ = base_logits.shape
    noise = block_noise(base_logits, temperature, generator, noise)
    y = torch.zeros(b, p, dtype=torch.int64, device=base_logits.device)  # positions >= k are not read at k
    q = None if noise is None else torch.zeros_like(base_logits, dtype=torch.float32)
    rows = torch.arange(b, device=base_logits.device)
    for k in range(p):
        logits = logits_fn(prev_tokens(anchor, y, vocab), rows, k)  # [b, Vd]
        y[:, k] = select(logits, temperature, None if noise is None else noise[:, k])
        if q is not None:
            q[:, k] = distribution(logits, temperature)
    return RefineResult(y, q, torch.full((b,), p, dtype=torch.int64, device=base_logits.device))
