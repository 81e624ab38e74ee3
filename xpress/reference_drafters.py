"""Two reference drafters that bracket every real one: the floor and the ceiling of acceptance.

``RandomDrafter``: uniformly random tokens over the target vocabulary, ``q`` uniform; tau stays near 1
(each round still commits the target's own correction token).

``OracleDrafter``: the target's own greedy continuation of the committed context; at T = 0 every draft
is accepted, so tau = B wherever EOS or max_new_tokens does not cut a round. Its drafts come from the
target itself, computed incrementally with its OWN KV cache (one 1-token target forward per new token,
each token computed once and remembered), never from the verifying forward. That work is reported by the
decoding loop as ``draft`` time. Call :meth:`OracleDrafter.prepare` before a timed run to compute the
continuations up front: then ``propose`` only reads them and ``draft`` is ~0 -- the "free perfect
drafter" ceiling of the speculative loop. At T > 0 the oracle still proposes the greedy continuation of
what was actually committed (it recomputes after a sampled token diverges from it), with ``q`` one-hot on
the proposed token, so rejection sampling stays lossless.
"""
from __future__ import annotations

from typing import Any

import torch

from .config import Config
from .protocol import Draft
from .targets import Target, lm_logits


def _block_size(block_size: int | Config) -> int:
    return int(block_size.drafter.block_size if isinstance(block_size, Config) else block_size)


class RandomDrafter:
    """Uniform random drafts over the target vocabulary ``V`` (q = 1/V everywhere).

    ``block_size``: B, an int or a :class:`~xpress.config.Config` (``cfg.drafter.block_size``). Draws use
    the ``generator`` given to ``propose``, or the drafter's own one seeded with ``seed`` when None.
    """

    def __init__(self, target: Target, block_size: int | Config, seed: int = 0) -> None:
        self.block_size = _block_size(block_size)
        self.vocab_size = int(target.vocab_size)
        self.device = target.device
        self._generator = torch.Generator(device=self.device).manual_seed(seed)

    def reset(self, prompt_ids: list[list[int]]) -> None:
        pass

    def extend(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        pass

    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Draft:
        b, n = anchor.shape[0], self.block_size - 1
        tokens = torch.randint(self.vocab_size, (b, n), generator=generator or self._generator,
                               device=self.device)
        q = None
        if temperature > 0:  # a stride-0 view: no [b, n, V] allocation
            q = torch.full((1, 1, 1), 1.0 / self.vocab_size, device=self.device).expand(b, n, self.vocab_size)
        return Draft(tokens=tokens, q=q)


class _GreedyRow:
    """One sequence's greedy continuation, grown with the target and its own KV cache.

    ``seq``: tokens 0.. of the sequence as the oracle knows it (committed context, then greedy guesses;
    possibly a list shared with the drafter's memory, only ever appended to with greedy tokens);
    ``committed``: the tokens the decoding loop committed; ``agreed``: length of the prefix of ``seq``
    confirmed equal to ``committed``; ``cached``: how many tokens of ``seq`` the own cache holds.
    """

    def __init__(self, seq: list[int], agreed: int) -> None:
        self.seq, self.agreed, self.cached, self.cache = seq, agreed, 0, None
        self.committed: list[int] = list(seq[:agreed])

    def sync(self, upto: int) -> None:
        """Check ``seq[:upto]`` (which must exist) against ``committed[:upto]``; after a divergence (a
        sampled token that is not the greedy one) continue from the committed tokens in a new list."""
        lo = self.agreed
        have, want = self.seq[lo:upto], self.committed[lo:upto]
        if have != want:
            j = lo + next(k for k, (h, w) in enumerate(zip(have, want)) if h != w)
            self.seq = self.committed[:upto]
            if self.cached > j:  # drop the own cache from the first differing token on
                self.cache.crop(j - self.cached)
                self.cached = j
        self.agreed = upto

    def grow(self, target: Target, upto: int) -> None:
        """Append greedy tokens until ``len(seq) >= upto`` (one target forward per token)."""
        device = target.device
        while len(self.seq) < upto:
            new = torch.tensor([self.seq[self.cached:]], dtype=torch.long, device=device)
            pos = torch.arange(self.cached, len(self.seq), device=device)[None]
            logits, self.cache = lm_logits(target, new, self.cache, pos, None)
            self.cached = len(self.seq)
            self.seq.append(int(logits[0, -1].argmax()))


class OracleDrafter:
    """The target's own greedy continuation as drafts (see the module docstring for its cost model).

    Continuations are remembered per prompt across :meth:`reset` calls, so a second run on the same
    prompts (or one after :meth:`prepare`) drafts for free.
    """

    def __init__(self, target: Target, block_size: int | Config) -> None:
        self.block_size = _block_size(block_size)
        self.target = target
        self._memory: dict[tuple[int, ...], list[int]] = {}
        self._rows: list[_GreedyRow] = []

    @torch.inference_mode()
    def prepare(self, prompts: list[list[int]], n_tokens: int) -> None:
        """Compute (and remember) ``n_tokens`` greedy tokens after each prompt, ignoring EOS; with
        ``n_tokens >= max_new_tokens + block_size`` a later run drafts without any target forward."""
        self.reset(prompts)
        for row, p in zip(self._rows, prompts):
            row.grow(self.target, len(p) + n_tokens)
            row.cache, row.cached = None, 0  # keep the token ids only

    def reset(self, prompt_ids: list[list[int]]) -> None:
        self._rows = []
        for p in prompt_ids:
            key = tuple(p)
            seq = self._memory.setdefault(key, list(p))  # shared: growing it grows the memory
            self._rows.append(_GreedyRow(seq, len(p)))

    def extend(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        for row, toks, pos, ok in zip(self._rows, tokens.tolist(), positions.tolist(), valid.tolist()):
            for t, p, v in zip(toks, pos, ok):
                if v:
                    _place(row.committed, p, t)

    @torch.inference_mode()
    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Draft:
        n = self.block_size - 1
        drafts = []
        for row, a, p in zip(self._rows, anchor.tolist(), anchor_pos.tolist()):
            _place(row.committed, p, a)
            row.sync(p + 1)
            row.grow(self.target, p + 2 + n)  # one more than drafted: covers the next bonus token
            drafts.append(row.seq[p + 1:p + 1 + n])
        tokens = torch.tensor(drafts, dtype=torch.long, device=self.target.device)
        q = None
        if temperature > 0:
            q = torch.nn.functional.one_hot(tokens, self.target.vocab_size).float()
        return Draft(tokens=tokens, q=q)


def _place(seq: list[Any], pos: int, value: Any) -> None:
    """``seq[pos] = value``, growing ``seq`` by one when ``pos == len(seq)``."""
    if pos < len(seq):
        seq[pos] = value
    else:
        seq.append(value)
