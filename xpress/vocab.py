"""The draft vocabulary: the ONE place that maps draft token ids to target token ids and back.

A drafter may read out over a subset of the target vocabulary (``Vd <= V`` rows of the target's
``lm_head``), the most frequent tokens of the regenerated training data: a full 49k readout made a CPU
training step about ten times slower. Everything the drafter and its heads emit (logits, tokens,
distributions) is in draft ids; everything the target and the decoding engine see is in target ids.

    d2t  [Vd] int64   draft id -> target id
    t2d  [V]  int64   target id -> draft id, or -1 outside the draft vocabulary

Heads that embed the previous token (xPress ``W_e``, Markov ``W1``) have ``Vd + 1`` input rows: a
previous token outside the draft vocabulary (e.g. an anchor the target chose) reads the extra row ``Vd``
(:meth:`DraftVocab.input_index`).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

from .utils import atomic_save_safetensors


class DraftVocab:
    """A subset of a target vocabulary of size ``V``, in a fixed order of ``Vd`` draft ids.

    Build one with :meth:`full`, :meth:`from_ids` or :meth:`from_counts`. ``d2t``/``t2d`` live on the
    CPU; the mapping methods use a copy on the device of their input, made once per device.
    """

    def __init__(self, d2t: torch.Tensor, target_size: int):
        d2t = torch.as_tensor(d2t, dtype=torch.int64, device="cpu").flatten()
        if d2t.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(d2t.min()) < 0 or int(d2t.max()) >= target_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {target_size}) (the target vocabulary)")
        if d2t.unique().numel() != d2t.numel():
            raise ValueError("draft vocabulary ids must be unique")
        self.target_size = int(target_size)
        self.d2t = d2t  # [Vd]
        self.t2d = torch.full((self.target_size,), -1, dtype=torch.int64, device=d2t.device)  # [V]
        self.t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {d2t.device: (self.d2t, self.t2d)}
        # the full vocabulary in target order: mappings are identities and skipped
        self.is_identity = d2t.numel() == self.target_size and bool(
            torch.equal(d2t, torch.arange(self.target_size, device=d2t.device)))

    # ------------------------------------------------------------------------------------ constructors
    @classmethod
    def full(cls, target_size: int) -> "DraftVocab":
        """The whole target vocabulary, draft id == target id."""
        return cls(torch.arange(target_size, device="cpu"), target_size)

    @classmethod
    def from_ids(cls, ids: Iterable[int] | torch.Tensor, target_size: int) -> "DraftVocab":
        """Exactly these target ids (unique), in this order."""
        return cls(torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids), target_size)

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> "DraftVocab":
        """The ``size`` most frequent target ids of ``counts`` [V] (ties: lower id first), always
        including the ids in ``always`` (EOS and other special tokens the drafter must be able to
        propose). Draft ids follow ascending target id."""
        counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
        target_size = counts.numel()
        always = sorted({int(i) for i in always})
        if not 0 < size <= target_size or len(always) > size:
            raise ValueError(f"size={size} must lie in [{max(1, len(always))}, {target_size}]")
        score = counts.clone()
        score[always] = float("inf")
        # stable descending sort: ties keep ascending id order
        chosen = torch.sort(score, descending=True, stable=True).indices[:size]
        return cls(torch.sort(chosen).values, target_size)

    # ---------------------------------------------------------------------------------------- mapping
    @property
    def size(self) -> int:
        """``Vd``, the number of draft ids."""
        return self.d2t.numel()

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t, t2d) on ``device``, copied once and kept."""
        if device not in self._tables:
            self._tables[device] = (self.d2t.to(device), self.t2d.to(device))
        return self._tables[device]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids [...] -> target ids [...] (int64)."""
        return draft_ids if self.is_identity else self.on(draft_ids.device)[0][draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids [...] -> draft ids [...] (int64), -1 where a token lies outside the vocabulary."""
        return target_ids if self.is_identity else self.on(target_ids.device)[1][target_ids]

    def contains(self, target_ids: torch.Tensor) -> torch.Tensor:
        """[...] bool: which target ids the draft vocabulary holds."""
        return self.to_draft(target_ids) >= 0

    def input_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Row of a head's ``Vd + 1``-row input embedding for target ids [...]: the draft id, or ``Vd``
        (the out-of-vocabulary row) for tokens outside the draft vocabulary."""
        d = self.to_draft(target_ids)
        return torch.where(d >= 0, d, self.size)

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Distributions over draft ids [..., Vd] -> over target ids [..., V], zero outside."""
        if self.is_identity:
            return q
        out = q.new_zeros(*q.shape[:-1], self.target_size)
        out[..., self.on(q.device)[0]] = q
        return out

    # -------------------------------------------------------------------------------------------- i/o
    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"d2t": [Vd] int64, "target_size": [] int64}``."""
        return {"d2t": self.d2t.cpu(), "target_size": torch.tensor(self.target_size)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "DraftVocab":
        return cls(state["d2t"], int(state["target_size"]))

    def save(self, path: str | os.PathLike) -> None:
        """Write ``state_dict()`` as safetensors, atomically."""
        atomic_save_safetensors(path, self.state_dict(), metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DraftVocab":
        from safetensors.torch import load_file

        return cls.from_state_dict(load_file(str(path)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DraftVocab) and self.target_size == other.target_size
                and torch.equal(self.d2t.cpu(), other.d2t.cpu()))

    def __repr__(self) -> str:
        return f"DraftVocab(size={self.size}, target_size={self.target_size})"
