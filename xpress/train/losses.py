"""The training objective of the paper's Section 4.3 (Eq. 13-15), in named pieces.

Per block position ``k = 1 .. P`` (``P = B - 1``) with weight ``w_k = exp(-(k-1)/gamma)`` (Eq. 14):

    L(p) = sum_k w_k [ ce_weight * (-log p_k(x*_k)) + tv_weight * ||p_k - p^t_k||_1 ] / sum_k w_k

averaged over the valid (block, position) pairs. ``||p - p^t||_1 = 2 TV = 2 (1 - acceptance)`` (Eq. 13),
so the L1 term is the acceptance rate the target will grant. Distributions live on the draft vocabulary
(``Vd`` ids); the target's mass outside it is unreachable for the drafter and counts in the L1 term as it
should (``p`` is zero there). The cross-entropy is taken where the regenerated token lies inside the
draft vocabulary.

The full objective (Eq. 15, with the weights named for what they do; the paper's text, Section 5.1,
gives 0.3 for the consistency term and anneals the drafter anchor 0.6 -> 0.2):

    L_total = L(p_refined)                                   # teacher-forced refiner
            + anchor_weight(step) * L(p_base)                # the drafter anchor
            + consistency_weight * L(p_refined | argmax base) # the refiner fed the drafter's own tokens

The plain drafter (method ``dflash``) is trained with ``L(p_base)`` alone.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def position_weights(positions: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for k = 1 .. positions: [positions] float32."""
    k = torch.arange(positions, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def anchor_weight(step: int, steps: int, start: float, end: float) -> float:
    """The drafter-anchor weight at ``step`` (0-based) of ``steps``: linear from ``start`` to ``end``."""
    if steps <= 1:
        return end
    return start + (end - start) * min(1.0, step / (steps - 1))


def target_distribution(hidden: torch.Tensor, lse: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
    """The target's probabilities over the draft vocabulary from its captured final hidden state.

    hidden [..., H] (the target's final-normed state before the token), lse [...] (logsumexp of its
    full logits there), readout [Vd, H] (``lm_head.weight[d2t]``) -> [..., Vd] float32, summing to the
    target's mass inside the draft vocabulary (at most 1).
    """
    logits = F.linear(hidden.to(readout.dtype), readout).float()
    return torch.exp(logits - lse.float()[..., None])


class _FusedRowTerms(torch.autograd.Function):
    """:func:`row_terms` in one C++ call forward and one backward (``loss_forward`` / ``loss_backward`` in
    xpress/csrc/fused_cpu.cpp): each row's V logits are read a few times while they sit in L1, where autograd
    over the PyTorch operations makes a dozen passes through memory over [rows, V] tensors."""

    @staticmethod
    def forward(ctx, logits, labels, p_target, mod):
        shape = logits.shape
        ce, l1, p, u = mod.loss_forward(logits.reshape(-1, shape[-1]).contiguous(), labels.reshape(-1).contiguous(),
                                        p_target.reshape(-1, shape[-1]).float().contiguous())
        ctx.save_for_backward(p, u, labels.reshape(-1).contiguous())
        ctx.mod, ctx.shape = mod, shape
        return ce.view(shape[:-1]), l1.view(shape[:-1])

    @staticmethod
    def backward(ctx, g_ce, g_l1):
        p, u, labels = ctx.saved_tensors
        g = ctx.mod.loss_backward(p, u, labels, g_ce.reshape(-1).float().contiguous(),
                                  g_l1.reshape(-1).float().contiguous())
        return g.view(ctx.shape), None, None, None


def row_terms(logits: torch.Tensor, labels: torch.Tensor, p_target: torch.Tensor, kernel=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 14's two terms per row: logits [..., Vd] (any float dtype; computed in float32), labels [...] draft
    ids (-1: outside the draft vocabulary, no cross-entropy there), p_target [..., Vd] -> ``ce`` [...] (
    ``-log p(label)``, 0 where the label is -1) and ``l1`` [...] (``||p - p_target||_1`` plus the target's mass
    outside the draft vocabulary). ``kernel`` (:func:`xpress.kernels.for_training`): the same function in one C++ call, to
    float32 rounding, where ``Vd`` is a multiple of 8; else PyTorch operations."""
    if kernel is not None and logits.shape[-1] % 8 == 0 and logits.dtype in (torch.float32, torch.bfloat16):
        return _FusedRowTerms.apply(logits, labels, p_target, kernel)
    logp = torch.log_softmax(logits.float(), dim=-1)
    in_vocab = labels >= 0
    ce = -logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1) * in_vocab
    p = logp.exp()
    l1 = (p - p_target).abs().sum(-1) + (1.0 - p_target.sum(-1)).clamp_min(0)
    return ce, l1


def distribution_loss(logits: torch.Tensor, labels: torch.Tensor, p_target: torch.Tensor, valid: torch.Tensor,
                      weights: torch.Tensor, ce_weight: float, tv_weight: float, kernel=None) -> dict[str, torch.Tensor]:
    """Eq. 14 over a batch of blocks.

    logits [n, P, Vd] (any float dtype; computed in float32), labels [n, P] draft ids (-1: outside the
    draft vocabulary, no cross-entropy there), p_target [n, P, Vd], valid [n, P] bool, weights [P];
    ``kernel``: see :func:`row_terms`. Returns ``loss`` (the weighted mean of ``ce_weight * ce + tv_weight *
    l1``), and the weighted means ``ce`` (over in-vocabulary positions) and ``l1`` for logging.
    """
    ce, l1 = row_terms(logits, labels, p_target, kernel)  # [n, P] each
    w, total, w_ce = loss_weights(labels, valid, weights)
    return {"loss": (w * (ce_weight * ce + tv_weight * l1)).sum() / total,
            "ce": (w * ce).sum() / w_ce, "l1": (w * l1).sum() / total}


def loss_weights(labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`distribution_loss`'s weights: ``w`` [n, P] (``weights`` where valid, else 0) and the two
    denominators, ``sum w`` and ``sum w`` over in-vocabulary labels (each at least 1e-12). A loss computed in
    chunks of blocks sums ``w * term`` per chunk and divides once by these."""
    w = weights[None, :] * valid  # [n, P]
    return w, w.sum().clamp_min(1e-12), (w * (labels >= 0)).sum().clamp_min(1e-12)


def teacher_forced_acceptance(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
                              ) -> tuple[torch.Tensor, float]:
    """Greedy acceptance under teacher forcing: per position ``k`` the fraction of blocks whose argmax
    at every ``j <= k`` equals the regenerated token (the target's greedy choice), over blocks valid at
    ``k``: [P]; and the implied tau ``1 + sum_k accept_k`` over blocks valid at every position (NaN if
    none). For a causal head fed the gold prefix this is exactly the greedy acceptance of its sequential
    decode."""
    return acceptance_of_choices(logits.argmax(-1), labels, valid)


def acceptance_of_choices(choice: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
                          ) -> tuple[torch.Tensor, float]:
    """:func:`teacher_forced_acceptance` from the argmax ids ``choice`` [n, P] (the chunked loss keeps only them)."""
    match = (choice == labels) & valid  # [n, P]
    run = match.long().cumprod(-1).bool()
    per_pos = (run & valid).sum(0).float() / valid.sum(0).clamp_min(1).float()
    full = valid.all(-1)
    tau = 1.0 + run[full].float().sum(-1).mean().item() if bool(full.any()) else math.nan
    return per_pos, tau
