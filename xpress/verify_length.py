"""The verify length chosen per round from the drafter's confidence (``decode.draft_tokens: auto``).

A round drafts the block, refines its first ``k`` positions and verifies the anchor and those ``k`` tokens in
one target forward of ``k + 1`` rows. Verifying fewer rows is cheaper where that forward is bound by
arithmetic (a CPU), and refining fewer positions is cheaper for every head; both lose little where the later
positions would be rejected anyway. With ``auto`` each row of a round gets its own ``k``, chosen after the
drafter's forward and before any token is drawn:

    c_i  = the largest probability of the drafter's distribution at position i (i = 1 .. P): softmax(s_i) of
           the base logits s_i, at temperature 1 when T = 0, at T when T > 0
    E_j  = 1 + sum_{i <= j} prod_{l <= i} c_l    the expected tokens a round commits when it verifies j drafts
                                                 (acceptance stops at the first rejection; +1: the target's token)
    r_j  = E_j / (D(j) + V(j + 1))               expected tokens per second; D(j): drafting the block and
                                                 refining its first j positions, V(n): a verify of n rows
                                                 (seconds, :class:`VerifyCosts`)
    k    = the first j in 1 .. P with r_{j+1} <= r_j (or P)

Only the first ``k`` positions are then refined (both heads are causal, so they are the whole block's first
``k``). Why this is lossless at T > 0 as well as at T = 0: the base logits are computed from the context and
the anchor alone, so ``k`` is fixed before any drafted token is drawn, and each drafted token is still a draw
from the ``q`` the verifier is given. A rule that read a drawn token's own probability would not be:
``tests/test_sampling.py`` shows such a rule failing the distribution test that a per-position rule passes.
At T = 0 every k gives greedy AR's tokens.

Why the base distribution and not the refined one: reading the refined block's confidence needs the whole
block refined first, plus a readout of its corrected logits, which is the cost a shorter verify is meant to
save (docs/log/2026-12-strength.md has the measurement). For dFlash the two are the same distribution.

``V`` and ``D`` are measured once per target and drafter on the machine that decodes (:func:`calibrate`:
medians of interleaved repeats at a context of 256 tokens), and every study that decodes with ``auto``
records them (:meth:`VerifyCosts.to_record`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch


CALIBRATION_CONTEXT = 256  # tokens before the timed verifies
CALIBRATION_REPEATS = 5


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds a round costs: ``draft_s[j - 1]`` drafting the block and refining its first ``j`` positions
    (j = 1 .. P; one number: the same for every j) and ``verify_s[n - 1]``, a target verify of ``n`` rows,
    for n = 1 .. B (the anchor plus up to B - 1 drafts)."""

    draft_s: float | tuple[float, ...]
    verify_s: tuple[float, ...]
    source: str = "given"

    def __post_init__(self) -> None:
        draft = self.draft_s if isinstance(self.draft_s, tuple) else (float(self.draft_s),)
        if not self.verify_s or any(v <= 0 for v in self.verify_s) or not draft or min(draft) < 0:
            raise ValueError("VerifyCosts: verify_s must hold a positive time per row count (1 .. B) and "
                             "draft_s times >= 0")
        object.__setattr__(self, "draft_s", draft)

    def round_s(self, drafts: int) -> float:
        """A round's seconds when it refines and verifies ``drafts`` drafted tokens (``drafts + 1`` rows)."""
        d = self.draft_s[min(drafts, len(self.draft_s)) - 1]
        return d + self.verify_s[min(drafts, len(self.verify_s) - 1)]

    def round_table(self, drafts: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[drafts] float64: :meth:`round_s` for 1 .. ``drafts`` (cached per length and device)."""
        memo = self.__dict__.setdefault("_tables", {})
        key = (drafts, str(device))
        if key not in memo:
            memo[key] = torch.tensor([self.round_s(j) for j in range(1, drafts + 1)], dtype=torch.float64,
                                     device=device)
        return memo[key]

    def to_record(self) -> dict[str, Any]:
        return {"draft_ms": [1e3 * d for d in self.draft_s], "verify_ms": [1e3 * v for v in self.verify_s],
                "source": self.source}


def draft_lengths(confidence: torch.Tensor, costs: VerifyCosts) -> torch.Tensor:
    """Each row's k (module docstring) from the per-position confidences [b, P]: [b] int64 in 1 .. P, P
    capped at the rows the costs cover. Row i goes on to j + 1 while r_{j+1} > r_j, compared as
    ``g_{j+1} S_j > E_j (S_{j+1} - S_j)`` (g_{j+1} = prod_{l <= j+1} c_l, the expected gain of the next draft;
    S_j = D(j) + V(j + 1)) in float64, so a gain far below E_j's rounding still counts where the next row is
    free."""
    P = min(confidence.shape[1], len(costs.verify_s) - 1)
    if P <= 1:
        return torch.ones(confidence.shape[0], dtype=torch.int64, device=confidence.device)
    gain = torch.cumprod(confidence[:, :P].double().clamp(0.0, 1.0), dim=1)  # [b, P]
    e = 1.0 + gain.cumsum(dim=1)  # [b, P]: E_1 .. E_P
    s = costs.round_table(P, e.device)  # [P]
    go_on = (gain[:, 1:] * s[:-1] > e[:, :-1] * (s[1:] - s[:-1])).long().cumprod(1)  # [b, P - 1]: still climbing
    return 1 + go_on.sum(1)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def calibrate(target: Any, drafter: Any, context: int = CALIBRATION_CONTEXT,
              repeats: int = CALIBRATION_REPEATS) -> VerifyCosts:
    """Measure :class:`VerifyCosts` for ``drafter`` (an ``auto`` drafter) on ``target``: after a prefill of
    ``context`` synthetic tokens, the target's verify of n = 1 .. B rows (the cache cropped back after each)
    and the drafter's ``propose`` with each fixed j = 1 .. P, in interleaved sweeps of ``repeats`` (the first
    sweep a warm-up); medians. The verify times are cached on the target per block size."""
    from .targets import target_forward

    dev = target.device
    B = drafter.block_size
    if context <= B:
        raise ValueError(f"calibrate: context={context} must exceed the block size {B}")
    ids = (torch.arange(context, device=dev) * 7919 + 11) % max(2, min(target.vocab_size, 32000))  # [context]
    prompt = ids[None]
    out = target_forward(target, prompt[:, :-1], None, None, None, logits_to_keep=1)
    cache, L = out.cache, context - 1
    drafter.reset([ids.tolist()])
    drafter.extend(prompt[:, :-1], out.features, torch.arange(L, device=dev)[None],
                   torch.ones(1, L, dtype=torch.bool, device=dev))
    anchor, anchor_pos = prompt[:, -1], torch.tensor([L], device=dev)
    memo = getattr(target, "_verify_costs", None)
    if memo is None:
        memo = {}
        try:
            target._verify_costs = memo
        except AttributeError:
            pass
    verify = memo.get(B)
    times: dict[int, list[float]] = {n: [] for n in range(1, B + 1)}
    draft: dict[int, list[float]] = {j: [] for j in range(1, B)}
    saved = drafter.auto, drafter.draft_tokens
    try:
        for sweep in range(repeats + 1):
            drafter.auto = False  # the timed proposes refine a fixed j positions
            for j in range(1, B):
                drafter.draft_tokens = j
                t0 = _clock(dev)
                drafter.propose(anchor, anchor_pos, 0.0)
                if sweep:
                    draft[j].append(_clock(dev) - t0)
            if verify is not None:
                continue
            for n in range(1, B + 1):
                block = ids[None, :n]  # [1, n]: context > B
                pos = L + torch.arange(n, device=dev)[None]
                t0 = _clock(dev)
                target_forward(target, block, cache, pos, None)
                if sweep:
                    times[n].append(_clock(dev) - t0)
                cache.crop(L)
    finally:
        drafter.auto, drafter.draft_tokens = saved
    if verify is None:
        verify = tuple(median(times[n]) for n in range(1, B + 1))
        memo[B] = verify
    return VerifyCosts(tuple(median(draft[j]) for j in range(1, B)), verify,
                       f"calibrate(context={context}, repeats={repeats})")
