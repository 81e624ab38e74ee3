"""Greedy decoding of many prompts with continuous batching, on the fused CPU kernels: regeneration's engine.

Every sequence owns one row of a pre-allocated KV cache (:class:`xpress.runtime.StaticKV`, ``[slots, nkv,
capacity, hd]`` per layer) from its prefill to its last token, at columns ``0..len - 1`` (no left padding).
A step feeds one token of every running sequence through ``layer_rows`` (xpress/csrc/fused_cpu.cpp): the
weights are read once for all of them, each attends over its own columns. When a sequence stops, its row
goes to the next prompt at once, so no step decodes padding or a finished row, and a shard's last long
answer does not hold the batch.

Exact by construction: the kernels give every token the same sequence of float operations whatever ran
beside it (the row-invariant products; ``attend`` over the sequence's own columns), so each sequence's
tokens, features, hidden states and logits equal a batch-1 greedy decode of it alone
(:func:`xpress.decoding.generate_ar`) bit for bit, and do not depend on the batch size or on the order of
the prompts (``tests/test_continuous.py``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .readout import argmax_last


@dataclass
class Finished:
    """One answered prompt: the greedy tokens, why they stopped and, with ``capture_layers``, the target's
    states over ``prompt + tokens`` (T positions), as regeneration stores them."""

    index: int  # position of the prompt in the input
    token_ids: list[int]  # the answer, a stop token kept
    finish_reason: str  # "stop" or "length"
    features: np.ndarray | None = None  # [T, F] float16: the capture layers' outputs; the last row zeros (never fed)
    hidden: np.ndarray | None = None  # [T, H] float16: the final-normed hidden states; the last row zeros
    lse: np.ndarray | None = None  # [T] float32: logsumexp of the logits where they were computed, else NaN


def available(target) -> bool:
    """Whether ``target`` runs the lean runtime on the fused CPU kernels, which this engine needs."""
    lean = getattr(target, "runtime", None)
    return lean is not None and getattr(lean, "kernels", None) is not None and hasattr(lean.kernels, "layer_rows")


class _Seq:
    """A running sequence: its answer so far and the captured rows (lists of arrays, concatenated at the end)."""

    def __init__(self, index: int, prompt: Sequence[int]) -> None:
        self.index, self.n_prompt = index, len(prompt)
        self.tokens: list[int] = []
        self.features: list[np.ndarray] = []
        self.hidden: list[np.ndarray] = []
        self.lse: list[float] = []


@torch.inference_mode()
def generate_greedy(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int,
                    stop_ids: Sequence[int] | None = None, capture_layers: Sequence[int] | None = None,
                    on_step: Callable[[int], None] | None = None) -> Iterator[Finished]:
    """Answer ``prompts`` (token ids, chat template applied) greedily, at most ``batch`` at a time; yield a
    :class:`Finished` as each ends (in order of completion; ``index`` says which prompt).

    A sequence stops at an EOS or stop token (kept) or after ``max_new_tokens`` tokens, as
    :func:`xpress.decoding.generate_ar_batch` stops a row. ``capture_layers``: keep the outputs of these
    decoder layers (the drafter's features), the final-normed hidden state and the logsumexp of the logits at
    every fed position. ``on_step(tokens)`` (progress bars) is called after every prefill and step with the
    number of tokens it chose.
    """
    if not available(target):
        raise ValueError("continuous batching needs the lean runtime on the fused CPU kernels (a float32 Llama "
                         "target on an AVX2 CPU, target.kernels=auto or fused); set data.regen_engine=batched")
    if batch < 1 or max_new_tokens < 1:
        raise ValueError(f"batch={batch} and max_new_tokens={max_new_tokens} must be at least 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt: every prompt needs at least one token (the chat template's)")
    lean = target.runtime
    stops = set(target.eos_token_ids) | set(stop_ids or ())
    layers = list(capture_layers) if capture_layers is not None else None
    capacity = max((len(p) for p in prompts), default=1) + max_new_tokens
    slots = min(batch, max(1, len(prompts)))
    cache = lean.new_cache(slots, capacity)  # keys / values [slots, nkv, capacity rounded up, hd] per layer
    queue = deque(range(len(prompts)))
    running: dict[int, _Seq] = {}  # cache row -> its sequence
    free = list(range(slots))[::-1]
    lengths = torch.zeros(slots, dtype=torch.long)  # cached columns per row
    last = torch.zeros(slots, dtype=torch.long)  # each running row's latest token, fed by the next step

    def keep(seq: _Seq, feats, normed, logits) -> None:
        if layers is None:
            return
        seq.features.append(feats.to(torch.float16).numpy())
        seq.hidden.append(normed.to(torch.float16).numpy())
        seq.lse.append(float(torch.logsumexp(logits, dim=-1)))

    def choose(row: int, seq: _Seq, token: int) -> Finished | None:
        """Append the chosen token; end the sequence (free its row) if it stops."""
        stopped = token in stops
        seq.tokens.append(token)
        if not (stopped or len(seq.tokens) >= max_new_tokens):
            last[row] = token
            return None
        del running[row]
        free.append(row)
        return _finish(seq, "stop" if stopped else "length", layers is not None)

    while queue or running:
        while queue and free:  # fill every free row with a new prompt: its prefill chooses its first token
            row, i = free.pop(), queue.popleft()
            seq = _Seq(i, prompts[i])
            running[row] = seq
            ids = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            normed, logits, feats = lean.prefill_row(ids, cache, row, layers)
            keep(seq, feats, normed, logits)
            lengths[row] = len(ids)
            done = choose(row, seq, int(logits.argmax()))
            if on_step:
                on_step(1)
            if done is not None:
                yield done
        if not running:
            continue
        rows = torch.tensor(sorted(running), dtype=torch.long)
        normed, logits, feats = lean.step_rows(last[rows], cache, rows, lengths[rows].contiguous(), layers)
        chosen = argmax_last(logits).tolist()
        if layers is not None:
            # one row at a time: a reduction over [m, V] may sum in another order than over one row's [V]
            f16 = (feats.to(torch.float16).numpy(), normed.to(torch.float16).numpy(),
                   [float(torch.logsumexp(x, dim=-1)) for x in logits])
        lengths[rows] += 1
        finished = []
        for j, row in enumerate(rows.tolist()):
            seq = running[row]
            if layers is not None:
                seq.features.append(f16[0][j:j + 1])
                seq.hidden.append(f16[1][j:j + 1])
                seq.lse.append(f16[2][j])
            done = choose(row, seq, chosen[j])
            if done is not None:
                finished.append(done)
        if on_step:
            on_step(len(chosen))
        yield from finished


def _finish(seq: _Seq, reason: str, captured: bool) -> Finished:
    """The sequence's result; its captured rows laid out over prompt + answer as regeneration stores them:
    row t of the features / hidden states is position t's (the prompt's from the prefill, then one per fed
    token), the last token's row is zeros (it is never fed), and ``lse`` holds the prefill's at the last prompt
    position and each step's at the position it fed."""
    out = Finished(seq.index, seq.tokens, reason)
    if not captured:
        return out
    feats, hidden = np.concatenate(seq.features), np.concatenate(seq.hidden)  # [T - 1, F], [T - 1, H]
    T = seq.n_prompt + len(seq.tokens)
    assert feats.shape[0] == T - 1, (feats.shape, T)
    lse = np.full(T, np.nan, dtype=np.float32)
    lse[seq.n_prompt - 1:seq.n_prompt - 1 + len(seq.lse)] = seq.lse  # one per fed position: n_prompt - 1 .. T - 2
    out.features = np.concatenate([feats, np.zeros((1, feats.shape[1]), feats.dtype)])
    out.hidden = np.concatenate([hidden, np.zeros((1, hidden.shape[1]), hidden.dtype)])
    out.lse = lse
    return out
