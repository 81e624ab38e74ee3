"""The drafter protocol: the one interface the decoding engine calls and every drafter fulfils.

A round of speculative decoding, for a batch of ``b`` sequences and block size ``B``::

    drafter.reset(prompt_ids)                          # new sequences
    drafter.extend(tokens, features, positions, valid)  # target features of newly committed tokens
    draft = drafter.propose(anchor, anchor_pos, temperature, generator)
    # target verifies [anchor, draft.tokens] in one forward, accepts a prefix + a bonus token ...

Context: every committed token except the newest (the anchor) has had its target features passed to
``extend``; the anchor's features are not known until the target verifies the next block.

Drafters (``drafter``, ``heads``, ``jacobi``, ``proposer``, ``reference_drafters``) never import
``decoding``; decoding only sees this protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class Draft:
    """What a drafter proposes for one round.

    tokens:  [b, B-1] int64, draft token ids in the TARGET vocabulary, for positions
             anchor_pos+1 .. anchor_pos+B-1.
    q:       [b, B-1, V_target] float32, the exact distribution each token was drawn from (zero
             outside a draft vocabulary), so that rejection sampling is lossless; ``None`` at T=0,
             where acceptance only compares tokens with the target's argmax.
    timings: seconds spent, by stage: ``draft`` (drafter forward + base readout) and ``refine``
             (correction head / Jacobi iterations).
    stats:   anything per round worth recording, e.g. ``{"iters": [b] int64}`` Jacobi passes used.
    lengths: [b] int64, how many of the ``tokens`` each row offers for verification (a prefix; the rest
             are ignored), or ``None``: all of them. Whether row i offers its token j + 1 may depend on its
             tokens up to j, never on token j + 1 itself (``decode.draft_tokens=auto``; xpress.verify_length).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    lengths: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """Anything that drafts ``block_size - 1`` tokens after an anchor."""

    block_size: int

    def reset(self, prompt_ids: list[list[int]]) -> None:
        """Forget all context; start ``len(prompt_ids)`` new sequences (their prompt token ids given
        for drafters that need them, e.g. the oracle)."""

    def extend(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        """Append committed context: ``tokens`` [b, n] int64, their target ``features`` [b, n, F],
        absolute ``positions`` [b, n] int64, ``valid`` [b, n] bool (False marks padding in ragged
        batches: those entries must be ignored)."""

    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Draft:
        """Draft after ``anchor`` [b] int64 (the last committed token) at ``anchor_pos`` [b] int64."""
