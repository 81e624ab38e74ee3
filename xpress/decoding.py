"""Decoding: the autoregressive baseline, the speculative loop with any :class:`~xpress.protocol.Drafter`,
and the acceptance rules.

Shapes: ``b`` sequences, block size ``B`` (anchor + ``n`` drafts: the drafter's ``B - 1``, or ``k = decode.draft_tokens``),
target vocabulary ``V``.

One speculative round (the dFlash inference layout, docs/background.md)::

    draft = drafter.propose(anchor [b], anchor_pos [b])             # tokens [b, n], q [b, n, V] (T > 0)
    logits = target([anchor, d_1 .. d_n])                          # ONE forward, [b, B, V]
    n_acc, next = greedy_accept | rejection_accept                 # [b], [b]
    commit d_1 .. d_{n_acc}, next                                  # n_acc + 1 tokens (bonus included)
    drop the rejected K/V, drafter.extend(anchor, d_1 .. d_{n_acc})  # everything committed but ``next``
    anchor <- next

Prefill runs the prompt without its last token; that token is the first anchor, so every generated token
comes out of a verification step and ``sum(accept_lengths) == len(token_ids)``.

Batches (``b > 1``) keep the target's KV cache in one of two ways (:func:`batch_cache`). Where the target runs
the lean runtime on the fused CPU kernels (:func:`xpress.targets.per_row_cache`), every sequence owns one cache
row from column 0 (:class:`RowKV`): a round writes each row's verify block after that row's own length, and the
length advances by what the row keeps, so there is no padding and no hole, and every row's numbers are bit for bit
those of a batch-1 forward: at T = 0 each row equals batch-1 greedy AR token for token, in float32 and bf16.
Elsewhere (the transformers runtime, ``target.kernels=torch``, regeneration's state capture) the rows share one
left-padded cache (:class:`RaggedKV`): every round appends the verified block for all rows and marks each row's
rejected positions as holes in a 2D attention mask; positions are passed explicitly. Holes never change what a
row attends to, so each row decodes as it would alone up to floating-point reduction order (its tokens sit at
other cache columns): a greedy token can flip at a near-tie. With ``b == 1`` the plain cache is used (no holes:
the rejected tail is cropped off and no mask is passed).

Timing: every step records seconds per stage in ``Generation.step_times`` -- speculative: ``draft``
(the drafter's own ``Draft.timings["draft"]``, plus ``extend``; for a drafter that reports no ``draft``
time, such as the reference drafters, the wall clock around ``propose`` minus any reported ``refine``),
``refine`` (``Draft.timings["refine"]``, 0 when not reported), ``verify`` (target forward + acceptance
rule) and ``bookkeeping`` (commit, stop checks, cache crop); autoregressive: ``forward`` (target forward +
token choice) and ``bookkeeping``. On a CPU the clock is ``perf_counter`` (:class:`xpress.utils.Stopwatch`);
on CUDA each stage records CUDA events (:class:`xpress.utils.EventStopwatch`) that are read back once, when
the call returns, so a round waits for the device only where the loop needs a value on the host: the one
transfer of the round's acceptance, commit and per-row stats (speculative) or the chosen token (AR).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .protocol import Draft, Drafter
from .readout import argmax_last
from .targets import (Target, TargetStep, encode_chat, forward_rows, lm_logits, new_row_cache, per_row_cache,
                      prefill_rows, target_forward)
from .utils import EventSpan, EventStopwatch, now, stage_clock

SPEC_STAGES = ("draft", "refine", "verify", "bookkeeping")
COMPACT_MIN_HOLES = 32  # RaggedKV compacts once every row has at least this many holes
AR_STAGES = ("forward", "bookkeeping")
OnRound = Callable[[int, int], None]  # on_round(tokens committed, rows advanced) after every target step


# ================================================================================ acceptance (pure)
def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / T)`` in float32; ``logits`` [..., V] -> [..., V]."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``probs`` [b, V] (non-negative, any positive total) -> [b] int64.

    By the inverse CDF: token ``v`` is drawn when a uniform ``u`` in ``[0, total)`` falls in ``[c_{v-1}, c_v)``,
    ``c`` the running sum of the row in float64 (each token's mass is its probability to about 1e-16; a zero
    wins only if ``u * total`` rounds up to the total, and then it is the last token). ``torch.multinomial``
    draws from the same distribution but took 1,052 us a row over a 49k vocabulary on two CPU cores, about a
    tenth of a decoding step; this took 57 us (a one-off micro-benchmark on a 2-core Xeon)."""
    cdf = probs.double().cumsum(-1)  # [b, V]
    u = torch.rand(probs.shape[:-1] + (1,), generator=generator, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def choose_token(logits: torch.Tensor, temperature: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Argmax (T = 0; :func:`xpress.readout.argmax_last`, ``argmax``'s result, 3-5x sooner over a 49k vocabulary
    in a one-off micro-benchmark on a 2-core Xeon) or a draw from ``softmax(logits / T)``: ``logits`` [b, V] -> [b] int64."""
    if temperature == 0:
        return argmax_last(logits)
    return sample(target_probs(logits, temperature), generator)


def _offered(accepted: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``accepted`` [b, n] bool with the positions past each row's ``lengths`` [b] (None: none) set False."""
    if lengths is None:
        return accepted
    return accepted & (torch.arange(accepted.shape[1], device=accepted.device) < lengths[:, None])


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix of ``draft`` equal to the target's argmax.

    draft [b, n] int64; target_logits [b, n + 1, V] (position k scores the token after block position k,
    i.e. row 0 scores d_1 and row n the bonus); ``lengths`` [b] (optional): row i offers only its first
    ``lengths[i]`` drafts (:class:`xpress.protocol.Draft`). Returns ``n_accepted`` [b] in 0..n and
    ``next_token`` [b]: the target's argmax after the accepted prefix (the correction, or the bonus when all
    offered drafts are accepted).
    """
    best = argmax_last(target_logits)  # [b, n + 1]
    n_acc = _offered(draft == best[:, :-1], lengths).long().cumprod(-1).sum(-1)
    return n_acc, best.gather(1, n_acc[:, None]).squeeze(1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` over the last axis: p, q [..., V] -> [..., V].

    Where ``p <= q`` everywhere (only if p == q, when rejection cannot happen) it falls back to ``p``.
    """
    r = (p - q).clamp_min_(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def rejection_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None = None,
                     residual: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                     lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    draft [b, n] int64 drawn from q [b, n, V]; p [b, n + 1, V] the target's distributions (softmax of
    logits / T) at the same positions plus the bonus position. d_k is accepted with probability
    ``min(1, p_k(d_k) / q_k(d_k))``; at the first rejection the replacement is drawn from
    ``residual(p_k, q_k)`` (default :func:`residual_distribution`, looked up at call time so a test can
    swap it); if all n are accepted the bonus is drawn from ``p_n``. ``lengths`` [b] (optional): row i offers
    only its first ``lengths[i]`` drafts, and after accepting them all its next token is drawn from ``p``
    there. Returns ``n_accepted`` [b] and ``next_token`` [b].
    """
    residual = residual or residual_distribution
    b, n = draft.shape
    idx = draft[..., None]
    p_d = p[:, :n].gather(-1, idx).squeeze(-1)  # [b, n]
    q_d = q.gather(-1, idx).squeeze(-1).to(p_d.dtype)
    u = torch.rand(b, n, generator=generator, device=p.device)
    accept = u * q_d < p_d  # u < p/q without dividing; q_d == 0 (impossible draw) accepts iff p_d > 0
    n_acc = _offered(accept, lengths).long().cumprod(-1).sum(-1)
    rows = torch.arange(b, device=p.device)
    p_next = p[rows, n_acc]  # [b, V]
    rejected = n_acc < (n if lengths is None else lengths)
    # after a rejection at k = n_acc: residual(p_k, q_k); after n acceptances: residual(p_n, 0) = p_n
    q_next = q[rows, n_acc.clamp_max(n - 1)].to(p.dtype) * rejected[:, None] if n else torch.zeros_like(p_next)
    return n_acc, sample(residual(p_next, q_next), generator)


# ================================================================================= generation record
@dataclass
class Generation:
    """One generated sequence and how it was made.

    token_ids:      generated ids (prompt excluded); the EOS/stop token is kept when it ended the sequence.
    accept_lengths: tokens committed per target step (speculative: per verification, bonus included,
                    after EOS/max_new_tokens truncation; autoregressive: 1 per forward, prefill included).
    draft_accepts:  per step, accepted drafts + 1 before truncation (speculative; equals
                    ``accept_lengths`` except on the step cut by EOS or max_new_tokens).
    step_times:     seconds per stage, one list entry per step (see the module docstring for stages).
    prefill_s:      prompt prefill (speculative: + the drafter's ``extend`` of the prompt).
    total_s:        wall time from the start of the call until this sequence finished.
    stats:          per-step values from ``Draft.stats`` (e.g. Jacobi ``iters``).
    """

    token_ids: list[int]
    prompt_len: int
    finish_reason: str = "length"  # "stop" (EOS or a stop id) | "length" (max_new_tokens)
    accept_lengths: list[int] = field(default_factory=list)
    draft_accepts: list[int] = field(default_factory=list)
    step_times: dict[str, list[float]] = field(default_factory=dict)
    prefill_s: float = 0.0
    total_s: float = 0.0
    stats: dict[str, list] = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Committed tokens per target step, bonus included (mean over steps)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s > 0 else 0.0

    def stage_totals(self) -> dict[str, float]:
        """Seconds per stage summed over steps, plus ``prefill`` and ``total``."""
        out = {k: float(sum(v)) for k, v in self.step_times.items()}
        return {**out, "prefill": self.prefill_s, "total": self.total_s}

    def to_record(self) -> dict[str, Any]:
        """A JSON-able dict (per-step lists included)."""
        return {"token_ids": self.token_ids, "prompt_len": self.prompt_len,
                "finish_reason": self.finish_reason, "accept_lengths": self.accept_lengths,
                "draft_accepts": self.draft_accepts,
                "timings": {**self.stage_totals(), "steps": self.step_times}, "stats": self.stats}


def summarize(generations: Sequence[Generation]) -> dict[str, float]:
    """Totals over many generations: tokens, steps, tau (= tokens / steps), seconds, tokens/s, stages.

    ``seconds`` sums each generation's ``total_s``: meant for generations decoded one after another
    (batch 1). Rows of one batched call overlap in time; time such a run by its wall clock instead.
    """
    tokens = sum(len(g.token_ids) for g in generations)
    steps = sum(g.n_steps for g in generations)
    seconds = sum(g.total_s for g in generations)
    stages: dict[str, float] = {}
    for g in generations:
        for k, v in g.stage_totals().items():
            if k != "total":
                stages[k] = stages.get(k, 0.0) + v
    return {"sequences": len(generations), "tokens": tokens, "steps": steps,
            "tau": tokens / max(1, steps), "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            **{f"{k}_s": v for k, v in stages.items()}}


def speedup(ar: dict[str, float], spec: dict[str, float]) -> float:
    """AR time per output token / speculative time per output token (same prompts, same run)."""
    return (ar["seconds"] / max(1, ar["tokens"])) / max(1e-12, spec["seconds"] / max(1, spec["tokens"]))


# ====================================================================================== ragged KV
def left_pad(seqs: Sequence[Sequence[int]], device: torch.device | str = "cpu",
             pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token lists to a batch: ``ids`` [b, L] int64, ``valid`` [b, L] bool, ``positions`` [b, L]
    int64 (0.. for the real tokens, 0 on pads)."""
    b, L = len(seqs), max((len(s) for s in seqs), default=0)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    valid = torch.zeros(b, L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, L - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            valid[i, L - len(s):] = True
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    return ids.to(device), valid.to(device), positions.to(device)


class RaggedKV:
    """Bookkeeping for one target KV cache shared by ``b`` rows that advance by different amounts.

    Column j of the cache holds, per row, a committed token (``mask[i, j]`` True) or a hole. :meth:`prefill`
    and :meth:`forward` run the target with :meth:`attention_mask`'s mask (:class:`RowKV` has the same calls);
    call :meth:`commit` after a forward of ``n`` new columns. Trailing
    columns that are holes in every row are cropped; once every row has ``min_holes`` holes the cache is
    compacted (each row's kept columns gathered, in order, to the right end) -- the K/V carry their RoPE
    positions, and causality follows column order, which compaction keeps. With ``b == 1`` there is no
    mask at all: rejected columns are simply cropped.
    """

    def __init__(self, batch: int, device: torch.device | str, min_holes: int | None = None) -> None:
        self.cache: Any = None
        self.length = 0  # columns in the cache
        self.counts = [0] * batch  # committed columns per row (host copy)
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device) if batch > 1 else None
        self.min_holes = COMPACT_MIN_HOLES if min_holes is None else min_holes
        self._holes = False  # any hole among the cached columns

    def prefill(self, target: Target, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                hidden_states: bool) -> TargetStep:
        """Run the left-padded prompts ``ids`` [b, L] (``valid``, ``positions`` [b, L]: :func:`left_pad`) into a
        new cache and commit them. Returns the logits after the last column [b, 1, V] float32 and, with
        ``hidden_states``, the features [b, L, F] (None otherwise)."""
        out = self.forward(target, ids, positions, hidden_states, logits_to_keep=1, new=valid)
        self.commit(out.cache, valid)
        return out

    def forward(self, target: Target, ids: torch.Tensor, positions: torch.Tensor, hidden_states: bool,
                logits_to_keep: int = 0, new: torch.Tensor | None = None) -> TargetStep:
        """n new columns for every row, ``ids`` at ``positions`` [b, n], after the cache (:meth:`commit` says
        next which to keep; ``new``: their validity [b, n], all real when None). Returns the logits of the last
        ``logits_to_keep`` positions (0: all) [b, k, V] float32 and, with ``hidden_states``, the features
        [b, n, F]."""
        mask = self.attention_mask(ids.shape[1] if new is None else new)
        if hidden_states:
            return target_forward(target, ids, self.cache, positions, mask, logits_to_keep)
        logits, cache = lm_logits(target, ids, self.cache, positions, mask, logits_to_keep)
        return TargetStep(logits=logits, features=None, cache=cache)

    def attention_mask(self, new: torch.Tensor | int) -> torch.Tensor | None:
        """The [b, L + n] mask for a forward of n new columns: ``new`` is their validity [b, n] bool, or n
        when all of them are real; ``None`` when nothing is masked (always so in the batch-1 case)."""
        if self.mask is None:
            return None
        if isinstance(new, int):
            if not self._holes:
                return None
            new = self.mask.new_ones(self.mask.shape[0], new)
        elif not self._holes and bool(new.all()):
            return None
        return torch.cat([self.mask, new], dim=1)

    def commit(self, cache: Any, keep: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """After a forward of n new columns, say which hold committed tokens.

        ``keep`` [b, n] bool with ``counts`` (host ints): row i keeps the first ``counts[i]`` new columns
        (a verified block; no device sync). ``keep`` alone: any pattern, e.g. a left-padded prefill
        (counted on the device). Neither: one new column, kept in every row (an autoregressive step).
        """
        self.cache = cache
        n = cache.get_seq_length() - self.length
        if keep is None:
            keep, counts, used = None, [1] * len(self.counts), 1
        elif counts is None:
            counts = keep.sum(1).tolist()
            used = int(keep.any(0).nonzero().max()) + 1 if max(counts) else 0
        else:
            used = max(counts)
        if self.mask is not None:
            new = self.mask.new_ones(self.mask.shape[0], 1) if keep is None else keep[:, :used]
            self.mask = torch.cat([self.mask, new], dim=1)
        if used < n:
            cache.crop(used - n)  # transformers >= 5: a negative count removes that many columns
        self.length += used
        self.counts = [c + k for c, k in zip(self.counts, counts)]
        self._holes = self._holes or min(counts) < used
        if self._holes and self.mask is not None and self.length - max(self.counts) >= self.min_holes:
            self._compact(max(self.counts))

    def _compact(self, kept: int) -> None:
        b, L = self.mask.shape
        score = self.mask.long() * L + torch.arange(L, device=self.mask.device)
        idx = score.argsort(dim=1)[:, L - kept:]  # holes first, then the row's kept columns in order
        self.mask = self.mask.gather(1, idx)
        if hasattr(self.cache, "gather_columns"):  # the lean runtime's StaticKV
            self.cache.gather_columns(idx)
            self.length = kept
            self._holes = min(self.counts) < kept
            return
        for layer in self.cache.layers:
            g = idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        self.length = kept
        self._holes = min(self.counts) < kept


class RowKV:
    """Bookkeeping for a target KV cache with one row per sequence (:func:`xpress.targets.per_row_cache`: the
    lean runtime on the fused CPU kernels), the role of :class:`RaggedKV` with the same calls.

    Row i holds its sequence's committed tokens at columns ``0..lengths[i] - 1``: no padding and no holes, and the
    positions are the columns. :meth:`forward` writes each row's n new tokens at columns ``lengths[i]..`` (causal
    within the block); :meth:`commit` advances each row's length by what it keeps, so the rejected columns are
    overwritten by the next forward. Every row's numbers are bit for bit those of a forward of its sequence alone.
    """

    def __init__(self, target: Target, batch: int, capacity: int) -> None:
        self.cache = new_row_cache(target, batch, capacity)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # committed columns per row (CPU: the kernels read them)

    def prefill(self, target: Target, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                hidden_states: bool) -> TargetStep:
        """Run each row's prompt (its ``valid`` tokens of the left-padded ``ids`` [b, L], :func:`left_pad`) into
        its own row from column 0. Returns the logits after each prompt's last token [b, 1, V] float32 and, with
        ``hidden_states``, the features in the left-padded layout [b, L, F] (zeros on the padding)."""
        seqs = [row[ok].tolist() for row, ok in zip(ids, valid)]
        last, feats = prefill_rows(target, seqs, self.cache, hidden_states)
        self.lengths = valid.sum(1).cpu()
        features = None
        if hidden_states:
            L = ids.shape[1]
            features = torch.zeros(*ids.shape, target.feature_size, dtype=target.dtype, device=ids.device)
            for i, f in enumerate(feats):
                if f is not None:
                    features[i, L - f.shape[0]:] = f
        return TargetStep(logits=last[:, None], features=features, cache=self.cache)

    def forward(self, target: Target, ids: torch.Tensor, positions: torch.Tensor, hidden_states: bool,
                logits_to_keep: int = 0) -> TargetStep:
        """Row i's n new tokens ``ids`` [b, n] after its ``lengths[i]`` columns (``positions`` [b, n], which are
        those columns, are not read). Returns the logits of the last ``logits_to_keep`` positions (0: all)
        [b, k, V] float32 and, with ``hidden_states``, the features [b, n, F]."""
        out = forward_rows(target, ids, self.cache, self.lengths, hidden_states)
        if logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    def commit(self, cache: Any, keep: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """After a forward, advance each row by the new columns it keeps: the first ``counts[i]`` (host ints),
        else ``keep`` [b, n] bool's count, else one (an autoregressive step). ``cache``: the forward's (this one)."""
        if keep is None:
            self.lengths += 1
        else:
            self.lengths += torch.as_tensor(list(counts)) if counts is not None else keep.sum(1).cpu()


CACHES = ("auto", "rows", "shared")  # batch_cache's kinds


def batch_cache(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                kind: str = "auto") -> RaggedKV | RowKV:
    """The target cache of a batched call: one row per sequence (:class:`RowKV`: each row bit for bit as alone)
    where the target's forward keeps one (:func:`xpress.targets.per_row_cache`) and there are several prompts,
    else the shared left-padded cache (:class:`RaggedKV`; at batch 1 the plain cache, never a hole).
    ``kind``: ``auto`` (that choice), ``shared`` (the shared cache whatever the target; the comparison of
    :mod:`xpress.studies.batch_cache`) or ``rows`` (refused where the target cannot keep rows)."""
    if kind not in CACHES:
        raise ValueError(f"cache={kind!r}: use one of {', '.join(CACHES)}")
    b = len(prompts)
    rows = b > 1 and per_row_cache(target)
    if kind == "rows" and not per_row_cache(target):
        raise ValueError("cache='rows' needs the lean runtime on the fused CPU kernels (target.kernels=fused)")
    if (rows and kind == "auto") or kind == "rows":
        return RowKV(target, b, max(len(p) for p in prompts) + max_new_tokens)
    return RaggedKV(b, target.device)


# ==================================================================================== shared helpers
def _stop_tensor(target: Target, stop_ids: Sequence[int] | None, device: torch.device) -> torch.Tensor:
    ids = sorted(set(target.eos_token_ids) | set(stop_ids or ()))
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_prompts(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    for p in prompts:
        if len(p) < 1:
            raise ValueError("a prompt must hold at least one token")
        target.check_fits(len(p), max_new_tokens)


def _commit(proposed: torch.Tensor, length: torch.Tensor, stops: torch.Tensor,
            remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row's proposed tokens right after its first stop token and at its remaining budget.

    proposed [b, m] int64 (the row's first ``length`` entries are candidates), length [b], remaining [b].
    Returns ``count`` [b] (tokens to commit) and ``stopped`` [b] bool (a stop token is among them).
    """
    m = proposed.shape[1]
    in_range = torch.arange(m, device=proposed.device) < length[:, None]
    is_stop = torch.isin(proposed, stops) & in_range
    has_stop = is_stop.any(1)
    first_stop = torch.where(has_stop, is_stop.long().argmax(1) + 1, length)
    count = torch.minimum(first_stop, remaining)
    stopped = has_stop & (first_stop <= remaining)
    return count, stopped


class _Rows:
    """Per-row Python records of a batched generation."""

    def __init__(self, prompts: Sequence[Sequence[int]], stages: Sequence[str], device: torch.device) -> None:
        self.gens = [Generation(token_ids=[], prompt_len=len(p), step_times={s: [] for s in stages})
                     for p in prompts]
        self.device = device
        self.t0 = now(device)

    def record(self, active: list[int], tokens: list[list[int]], counts: list[int], raw: list[int] | None,
               times: dict[str, float] | None, stats: dict[str, list]) -> None:
        """Append one step to the rows in ``active``: their first ``counts[i]`` of ``tokens[i]``, the
        acceptance before truncation ``raw`` (None = counts), stage ``times`` (None = no step_times
        entry) and per-row ``stats`` (lists of length b)."""
        for i in active:
            g = self.gens[i]
            g.token_ids.extend(tokens[i][:counts[i]])
            g.accept_lengths.append(counts[i])
            g.draft_accepts.append(raw[i] if raw is not None else counts[i])
            if times is not None:
                for k in g.step_times:
                    g.step_times[k].append(times.get(k, 0.0))
            for k, v in stats.items():
                g.stats.setdefault(k, []).append(v[i])

    def finish(self, rows: list[int], stopped: list[bool]) -> None:
        if not rows:
            return
        elapsed = now(self.device) - self.t0
        for i in rows:
            self.gens[i].total_s = elapsed
            self.gens[i].finish_reason = "stop" if stopped[i] else "length"

    def read_times(self) -> None:
        """Read back the CUDA-event stage times (:class:`xpress.utils.EventSpan`) as seconds: one wait for the
        device, at the end of the call."""
        for g in self.gens:
            for times in g.step_times.values():
                times[:] = [float(t) for t in times]

    def set_prefill(self) -> None:
        """Record the time since the start of the call as every row's prefill."""
        elapsed = now(self.device) - self.t0
        for g in self.gens:
            g.prefill_s = elapsed


def _charge_draft(sw: Any, timings: dict[str, Any], wall: Any) -> None:
    """Charge one ``propose`` call to the ``draft`` and ``refine`` stages: the drafter's own
    ``Draft.timings`` where it reports them, else the ``wall`` clock around the call (minus any reported
    ``refine``), for drafters that measure nothing (the reference drafters). On CUDA the values are
    :class:`xpress.utils.EventSpan` sums, read back later."""
    def value(t: Any) -> Any:
        return t if isinstance(t, EventSpan) else float(t)

    refine = value(timings.get("refine", 0.0))
    sw.add("refine", refine)
    rest = wall - refine
    sw.add("draft", value(timings["draft"]) if "draft" in timings else
           (rest.nonnegative() if isinstance(rest, EventSpan) else max(0.0, rest)))


def _per_row(stats: dict[str, Any], b: int, read: dict[str, list] | None = None) -> dict[str, list]:
    """``Draft.stats`` as per-row lists of length b: a [b, ...] tensor or a length-b list is split by row,
    anything else is repeated for every row; ``read``: the per-row lists of stats already read to the host."""
    out = {}
    for k, v in stats.items():
        if read and k in read:
            v = read[k]
        elif isinstance(v, torch.Tensor):
            v = v.tolist()
        out[k] = v if isinstance(v, list) and len(v) == b else [v] * b
    return out


# =========================================================================================== autoregressive
@torch.inference_mode()
def generate_ar_batch(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      stop_ids: Sequence[int] | None = None, on_round: OnRound | None = None,
                      cache: str = "auto") -> list[Generation]:
    """Autoregressive decoding of ``b`` prompts (the target cache of :func:`batch_cache`): one target forward
    per token.

    Stops a row at an EOS/stop token (kept) or after ``max_new_tokens``; finished rows keep being fed
    (their results are frozen) until every row is done. Returns one :class:`Generation` per prompt.
    ``on_round(tokens, steps)`` (progress bars) is called after every step with the tokens it committed
    and the rows it advanced. ``cache``: :func:`batch_cache`'s ``kind``.
    """
    _check_prompts(target, prompts, max_new_tokens)
    dev = target.device
    b = len(prompts)
    rows = _Rows(prompts, AR_STAGES, dev)
    sw = stage_clock(dev)
    kv = batch_cache(target, prompts, max_new_tokens, cache)
    stops = set(target.eos_token_ids) | set(stop_ids or ())
    ids, valid, pos = left_pad(prompts, dev)
    out = kv.prefill(target, ids, valid, pos, hidden_states=False)
    token = choose_token(out.logits[:, -1], temperature, generator)
    pos = pos[:, -1:] + 1  # [b, 1]
    rows.set_prefill()
    live = list(range(b))
    first = True  # the token chosen from the prefill has no entry in step_times
    while True:
        with sw("bookkeeping"):
            tok_l = token.tolist()
            stopped = [t in stops for t in tok_l]
            done = [i for i in live if stopped[i] or len(rows.gens[i].token_ids) + 1 >= max_new_tokens]
        times = sw.pop()
        rows.record(live, [[t] for t in tok_l], [1] * b, None, None if first else times, {})
        if on_round:
            on_round(len(live), len(live))
        rows.finish(done, stopped)
        if done:
            finished = set(done)
            live = [i for i in live if i not in finished]
        first = False
        if not live:
            break
        with sw("forward"):
            out = kv.forward(target, token[:, None], pos, hidden_states=False, logits_to_keep=1)
            token = choose_token(out.logits[:, -1], temperature, generator)
        with sw("bookkeeping"):
            kv.commit(out.cache)
            pos = pos + 1
    if isinstance(sw, EventStopwatch):
        rows.read_times()
    return rows.gens


def generate_ar(target: Target, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, stop_ids: Sequence[int] | None = None,
                on_round: OnRound | None = None) -> Generation:
    """Autoregressive decoding of one prompt (``prompt_ids``: token ids, chat template applied).

    Greedy at ``temperature == 0``, else sampling from ``softmax(logits / T)`` with ``generator``.
    """
    return generate_ar_batch(target, [list(prompt_ids)], max_new_tokens, temperature, generator, stop_ids,
                             on_round)[0]


# ============================================================================================ speculative
@torch.inference_mode()
def generate_speculative_batch(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]],
                               max_new_tokens: int, temperature: float = 0.0,
                               generator: torch.Generator | None = None,
                               stop_ids: Sequence[int] | None = None,
                               on_round: OnRound | None = None, cache: str = "auto") -> list[Generation]:
    """Speculative decoding of ``b`` prompts with ``drafter`` (ragged acceptance; the target cache of
    :func:`batch_cache`).

    Lossless: at T = 0 each row equals greedy :func:`generate_ar`; at T > 0 each row is distributed as
    autoregressive sampling from ``softmax(logits / T)`` (rejection sampling with the drafter's ``q``).
    Returns one :class:`Generation` per prompt. ``on_round(tokens, steps)`` (progress bars) is called
    after every round with the tokens it committed and the rows it verified. ``cache``: :func:`batch_cache`'s
    ``kind``.
    """
    _check_prompts(target, prompts, max_new_tokens)
    dev = target.device
    b = len(prompts)
    rows = _Rows(prompts, SPEC_STAGES, dev)
    sw = stage_clock(dev)
    kv = batch_cache(target, prompts, max_new_tokens, cache)
    stops = _stop_tensor(target, stop_ids, dev)
    drafter.reset([list(p) for p in prompts])
    ctx, valid, ctx_pos = left_pad([p[:-1] for p in prompts], dev)
    if ctx.shape[1]:
        out = kv.prefill(target, ctx, valid, ctx_pos, hidden_states=True)
        drafter.extend(ctx, out.features, ctx_pos, valid)
    anchor = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=dev)
    anchor_pos = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=dev)
    rows.set_prefill()

    active = torch.ones(b, dtype=torch.bool, device=dev)
    remaining = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)
    live = list(range(b))  # host copy of the active rows
    while live:
        t0 = sw.mark()  # the previous stage ended synchronised (CPU) or recorded its end event (CUDA)
        draft: Draft = drafter.propose(anchor, anchor_pos, temperature, generator)
        _charge_draft(sw, draft.timings, sw.since(t0))
        with sw("verify"):
            block = torch.cat([anchor[:, None], draft.tokens], dim=1)  # [b, B]: the anchor + the k drafted tokens
            B = block.shape[1]  # k + 1 rows: the drafter's block size, or fewer (decode.draft_tokens)
            arange_B = torch.arange(B, device=dev)
            positions = anchor_pos[:, None] + arange_B
            out = kv.forward(target, block, positions, hidden_states=True)
            if temperature == 0:
                n_acc, nxt = greedy_accept(draft.tokens, out.logits, draft.lengths)
            elif draft.q is None:
                raise ValueError(f"{type(drafter).__name__}.propose returned no q at temperature "
                                 f"{temperature}; lossless rejection sampling needs it")
            else:
                n_acc, nxt = rejection_accept(draft.tokens, draft.q, target_probs(out.logits, temperature),
                                              generator, lengths=draft.lengths)
        with sw("bookkeeping"):
            proposed = torch.cat([draft.tokens, nxt[:, None]], dim=1).scatter_(1, n_acc[:, None], nxt[:, None])
            count, stopped = _commit(proposed, n_acc + 1, stops, remaining)
            count = count * active
            remaining -= count
            done = active & (stopped | (remaining == 0))
            active = active & ~done
            keep = torch.where(active, n_acc + 1, 0)  # anchor + accepted drafts stay in the cache
            anchor = torch.where(active, nxt, anchor)
            anchor_pos = anchor_pos + keep
            # one device -> host transfer for everything the Python side needs, the drafter's per-row counts
            # (Draft.stats int64 [b] tensors, e.g. Jacobi iters) included
            counted = [k for k, v in draft.stats.items()
                       if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and tuple(v.shape) == (b,)]
            host = torch.cat([proposed, torch.stack([count, n_acc + 1, keep, stopped, done]
                                                    + [draft.stats[k] for k in counted], 1)], 1).tolist()
            toks = [h[:B] for h in host]
            count_l, raw_l, keep_l, stop_l, done_l, *stat_l = (list(c) for c in zip(*(h[B:] for h in host)))
            kv.commit(out.cache, arange_B < keep[:, None], keep_l)
        with sw("draft"):
            k_max = max(keep_l)
            if k_max:
                drafter.extend(block[:, :k_max], out.features[:, :k_max], positions[:, :k_max],
                               arange_B[:k_max] < keep[:, None])
        rows.record(live, toks, count_l, raw_l, sw.pop(), _per_row(draft.stats, b, dict(zip(counted, stat_l))))
        if on_round:
            on_round(sum(count_l[i] for i in live), len(live))
        rows.finish([i for i in live if done_l[i]], stop_l)
        live = [i for i in live if not done_l[i]]
    if isinstance(sw, EventStopwatch):
        rows.read_times()
    return rows.gens


def generate_speculative(target: Target, drafter: Drafter, prompt_ids: Sequence[int], max_new_tokens: int,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         stop_ids: Sequence[int] | None = None, on_round: OnRound | None = None) -> Generation:
    """Speculative decoding of one prompt with any :class:`~xpress.protocol.Drafter` (batch 1: the
    rejected tail is cropped off the DynamicCache; no attention mask)."""
    return generate_speculative_batch(target, drafter, [list(prompt_ids)], max_new_tokens, temperature,
                                      generator, stop_ids, on_round)[0]


def generate_batch(target: Target, drafter: Drafter | None, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                   stop_ids: Sequence[int] | None = None, on_round: OnRound | None = None) -> list[Generation]:
    """:func:`generate_ar_batch` when ``drafter`` is None, else :func:`generate_speculative_batch`;
    ``on_round(tokens, steps)`` follows every target step (progress bars; off by default)."""
    if drafter is None:
        return generate_ar_batch(target, prompts, max_new_tokens, temperature, generator, stop_ids, on_round)
    return generate_speculative_batch(target, drafter, prompts, max_new_tokens, temperature, generator,
                                      stop_ids, on_round)


# ============================================================================================ multi-turn
def answer_text(target: Target, generation: Generation) -> str:
    """The generated text without special tokens (the EOS that ended the turn is dropped)."""
    return target.tokenizer.decode(generation.token_ids, skip_special_tokens=True)


def generate_conversations(target: Target, conversations: Sequence[Sequence[str]], drafter: Drafter | None,
                           max_new_tokens: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                           stop_ids: Sequence[int] | None = None, batch_size: int = 1,
                           on_done: Callable[[int], None] | None = None,
                           on_round: OnRound | None = None) -> list[list[Generation]]:
    """Multi-turn decoding (MT-Bench convention): turn t+1 follows the model's OWN answer to turn t.

    ``conversations``: per conversation, its user turns. For each turn the chat (thinking off) is
    re-encoded with the previous user turns and the model's decoded answers, then decoded with
    ``drafter`` (None = autoregressive), ``batch_size`` conversations at a time (turn by turn).
    Returns, per conversation, one :class:`Generation` per turn. ``on_done(i)`` is called when
    conversation ``i`` is complete and ``on_round(tokens, steps)`` after every target step (progress bars).
    """
    out: list[list[Generation]] = [[] for _ in conversations]
    for start in range(0, len(conversations), batch_size):
        group = list(range(start, min(start + batch_size, len(conversations))))
        answers: dict[int, list[str]] = {i: [] for i in group}
        for t in range(max(len(conversations[i]) for i in group)):
            live = [i for i in group if t < len(conversations[i])]
            prompts = []
            for i in live:
                chat = [m for q, a in zip(conversations[i][:t], answers[i]) for m in (q, a)]
                prompts.append(encode_chat(target.tokenizer, chat + [conversations[i][t]]))
            for i, g in zip(live, generate_batch(target, drafter, prompts, max_new_tokens, temperature,
                                                 generator, stop_ids, on_round)):
                out[i].append(g)
                answers[i].append(answer_text(target, g))
        for i in group:
            if on_done:
                on_done(i)
    return out


def generate_conversation(target: Target, turns: Sequence[str], drafter: Drafter | None, max_new_tokens: int,
                          temperature: float = 0.0,
                          generator: torch.Generator | None = None,
                          stop_ids: Sequence[int] | None = None) -> list[Generation]:
    """One conversation (see :func:`generate_conversations`): a :class:`Generation` per user turn."""
    return generate_conversations(target, [list(turns)], drafter, max_new_tokens, temperature, generator,
                                  stop_ids)[0]
