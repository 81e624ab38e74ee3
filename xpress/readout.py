"""The correction heads' vocabulary readout at inference, ``W z`` with ``W`` [V, r] (xPress ``W_r``, the
Markov head's ``W2``): exact float32 logits, and at T=0 an exact argmax of ``s + W z`` that reads a
bfloat16 copy of ``W``.

Why. At batch 1 a refinement step is bound by streaming ``W`` (at the paper's shapes 151936 x 256 float32,
155 MB, read once per Jacobi pass or Markov step). At T=0 only the argmax of the corrected logits is used,
so most of that precision is wasted: any logit that is far below the maximum cannot win.

How (:meth:`Readout.argmax`, the *certified* argmax). For each row:

1. ``a = s + bf16(W) bf16(z)`` (one oneDNN bfloat16 GEMM with float32 accumulation, AMX where present; the
   product is returned in bfloat16, then widened and added to ``s`` in float32).
2. A bound ``e`` on ``|a_v - l_v|`` for every ``v``, where ``l = s + W z`` in float32. Rounding ``W`` and
   ``z`` to bfloat16 (unit roundoff ``u = 2^-8``) moves each product ``w_vi z_i`` by at most ``(2u + u^2)
   |w_vi z_i|``, float32 accumulation over ``r`` terms by ``~r 2^-24`` of the same sum, rounding the
   product to bfloat16 by ``u |W z|_v``; by Cauchy-Schwarz ``sum_i |w_vi z_i| <= ||w_v|| ||z||``. So
   ``e = 4u max_v ||w_v|| ||z|| + 2^-18 |max a|`` (the last term covers the float32 additions) is a bound,
   with room to spare.
3. The exact argmax ``v*`` satisfies ``a_v* >= l_v* - e >= l_top - e >= a_top - 2e``, where ``top`` is
   the argmax of ``a``; so every token with ``a_v >= max a - 2e`` is a candidate and no other can win.
   Candidates are found through the maxima of 256-wide vocabulary slices (few slices reach the
   threshold), and their logits recomputed in float32 from the float32 ``W``; the winner is the largest,
   the first index on ties, as ``argmax``.

The result is the float32 argmax: two float32 evaluations of the same logit (a GEMM and a dot product)
can differ in the last bits, so a token could differ only where two logits tie to float32 rounding,
which is the same freedom any two float32 kernels have. Non-finite values fall back to the float32 path.
Used at T=0 only: at T>0 the sampled token's distribution ``q`` needs every logit exactly.

When. ``Readout.fast``: ``None`` (default) uses the certified argmax on the CPU, in float32 without
autograd, when oneDNN has a bfloat16 GEMM and ``V >= FAST_MIN_VOCAB`` (below that the float32 readout is
already cheap: the cpu preset's 4096-token draft vocabulary never uses it); ``True`` forces it wherever it
can run (tests), ``False`` never.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .cpu import onednn_bf16

PACK_ROWS = 16  # the batch the readout weight is reordered for (a Jacobi pass reads out <= P rows per block)
ARGMAX_CHUNK = 256  # vocabulary slice of :func:`argmax_last` and of the certified argmax
FAST_MIN_VOCAB = 32768  # vocabulary size from which ``fast=None`` uses the certified bfloat16 argmax
UNIT_BF16 = 2.0 ** -8  # bfloat16 unit roundoff (8 significand bits)
SLACK = 4 * UNIT_BF16  # per ||w_v|| ||z||: covers the input and output roundings and the accumulation
ADD_SLACK = 2.0 ** -18  # per |max a|: covers the float32 additions of ``s``


def argmax_last(x: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``x.argmax(-1)``, exactly (first index on ties, NaN counts as the maximum): x [..., V] -> [...] int64.

    On the CPU a long last dimension (from 64 slices: 16k entries, where the two cost about the same on two
    cores) is reduced in two stages, the maxima of ``chunk``-wide slices (a vectorised ``amax``), then the
    first slice holding the overall maximum and the first index inside it; several times faster than
    ``argmax`` over a 150k vocabulary. Elsewhere, ``argmax`` itself (one operation instead of a dozen)."""
    v = x.shape[-1]
    if x.device.type != "cpu" or v < 64 * chunk or x.dtype not in (torch.float32, torch.float64):
        return x.argmax(-1)
    peaks = slice_maxima(x, chunk)  # [..., n]
    first = peaks.argmax(-1, keepdim=True) * chunk  # [..., 1]: start of the first slice holding the maximum
    idx = (first + torch.arange(chunk, device=x.device)).clamp_max(v - 1)  # a clamped tail repeats its last entry
    return (first + x.gather(-1, idx).argmax(-1, keepdim=True)).squeeze(-1)


def slice_maxima(x: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """The maxima of consecutive ``chunk``-wide slices of the last dimension: x [..., V] -> [..., ceil(V/chunk)]
    (the last slice may be shorter)."""
    v = x.shape[-1]
    n = v // chunk
    peaks = x[..., :n * chunk].unflatten(-1, (n, chunk)).amax(-1)  # [..., n]
    if n * chunk < v:
        peaks = torch.cat([peaks, x[..., n * chunk:].amax(-1, keepdim=True)], dim=-1)  # the short tail slice
    return peaks


class Readout:
    """Inference readout of a weight ``W`` [V, r] (passed on each call, so the live parameter is read; the
    derived copies are kept until its storage or version changes).

    :meth:`logits` is ``W z`` in float32 (on the CPU through a oneDNN copy of ``W`` reordered once for
    small batches, ~1.5x faster than the plain GEMM for the 1-15 rows of a refinement step; the same
    product to rounding). :meth:`argmax` is the argmax of ``base + W z`` (module docstring).
    """

    fast: bool | None = None

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None  # W reordered for oneDNN, float32
        self._packed_bf16: torch.Tensor | None = None  # bf16(W) reordered for oneDNN
        self._w_norm_max: float = 0.0  # max_v ||w_v||_2
        self.rows_certified = 0  # rows resolved by the certified argmax so far, and
        self.candidates = 0  # the float32 candidates they recomputed (their ratio: the pruning achieved)

    # ----------------------------------------------------------------------------------- caches
    def _refresh(self, w: torch.Tensor) -> None:
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key == self._key:
            return
        self._key, self._packed, self._packed_bf16, self._w_norm_max = key, None, None, 0.0
        if w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
            except (RuntimeError, AttributeError):
                self._packed = None

    def _bf16(self, w: torch.Tensor) -> torch.Tensor | None:
        """The packed bfloat16 copy of ``W`` (made on first use), or None where it cannot be made."""
        if self._packed_bf16 is None and self._key is not None and onednn_bf16():
            with torch.no_grad():
                try:
                    self._packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(
                        w.detach().to(torch.bfloat16), PACK_ROWS)
                except (RuntimeError, AttributeError):
                    self._packed_bf16 = None
                self._w_norm_max = float(w.detach().norm(dim=1).max()) if w.shape[0] else 0.0
        return self._packed_bf16

    @staticmethod
    def _plain(z: torch.Tensor, w: torch.Tensor) -> bool:
        """Autograd or a non-CPU/non-float32 call: the plain ``F.linear``."""
        return (z.device.type != "cpu" or z.dtype != torch.float32 or w.dtype != torch.float32
                or (torch.is_grad_enabled() and (z.requires_grad or w.requires_grad)))

    # ----------------------------------------------------------------------------------- logits
    def logits(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``W z``: z [..., r] -> [..., V] float32. Where the target's products run bf16 on AMX tiles, so does
        this (:func:`xpress.kernels.linear`: half the bytes of the float32 copy)."""
        if self._plain(z, w):
            return F.linear(z, w).float()
        if kernels.bf16_products() and z.numel():
            return kernels.linear(z, w)
        self._refresh(w)
        flat = z.reshape(-1, z.shape[-1])
        if self._packed is None or flat.shape[0] == 0:
            return F.linear(z, w)
        out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self._packed, None, "none", [], "")
        return out.view(*z.shape[:-1], out.shape[-1])

    # ----------------------------------------------------------------------------------- argmax
    def use_fast(self, w: torch.Tensor, z: torch.Tensor) -> bool:
        """Whether :meth:`argmax` takes the certified bfloat16 path for this call."""
        if self.fast is False or self._plain(z, w):
            return False
        if self.fast is None and w.shape[0] < FAST_MIN_VOCAB:
            return False
        self._refresh(w)
        return self._bf16(w) is not None

    def argmax(self, w: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The argmax over the vocabulary of ``base + W z`` (first index on ties): z [..., r], base [..., V]
        float32 -> [...] int64. Certified bfloat16 path when :meth:`use_fast`, else the float32 logits."""
        if not self.use_fast(w, z):
            return argmax_last(self.logits(w, z).add_(base))
        lead = z.shape[:-1]
        tokens = self._certified(w, z.reshape(-1, z.shape[-1]), base.reshape(-1, base.shape[-1]))
        return tokens.view(lead)

    def _certified(self, w: torch.Tensor, z: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """z [R, r], base [R, V] -> [R] int64 (module docstring, steps 1-3)."""
        n_rows, v = base.shape
        if n_rows == 0:
            return torch.zeros(0, dtype=torch.int64)
        approx = torch.ops.mkldnn._linear_pointwise(z.to(torch.bfloat16).contiguous(), self._packed_bf16, None,
                                                    "none", [], "").float().add_(base)  # a [R, V]
        peaks = slice_maxima(approx)  # [R, S]
        top = peaks.amax(-1)  # [R]
        if not bool(torch.isfinite(top).all()):
            return argmax_last(self.logits(w, z).add_(base))
        bound = SLACK * self._w_norm_max * z.norm(dim=-1) + ADD_SLACK * top.abs()  # e [R]
        threshold = top - 2 * bound  # [R]
        pair = (peaks >= threshold[:, None]).nonzero()  # [M, 2]: (row, slice) holding a candidate
        rows = pair[:, 0]
        cols = (pair[:, 1:] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK)).clamp_max(v - 1)  # [M, C]
        hit = (approx[rows[:, None], cols] >= threshold[rows, None]).nonzero()  # [K, 2]: (pair, offset)
        cand_row, cand_tok = rows[hit[:, 0]], cols[hit[:, 0], hit[:, 1]]  # [K], [K]
        self.rows_certified += n_rows
        self.candidates += cand_row.numel()
        exact = (w[cand_tok] * z[cand_row]).sum(-1) + base[cand_row, cand_tok]  # float32 logits [K]
        if not bool(torch.isfinite(exact).all()):
            return argmax_last(self.logits(w, z).add_(base))
        best = torch.full((n_rows,), float("-inf")).scatter_reduce(0, cand_row, exact, "amax")  # [R]
        win = exact == best[cand_row]
        return torch.full((n_rows,), v, dtype=torch.int64).scatter_reduce(0, cand_row[win], cand_tok[win], "amin")
