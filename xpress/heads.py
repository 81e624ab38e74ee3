"""Correction heads on the drafter's base logits: the xPress refiner (paper Eq. 5-9) and the DSpark Markov
head (the paper's baseline). Both return a bias ``delta`` added to the base logits ``s_k``; the plain
drafter (method ``dflash``) has no head.

Indexing. A block is ``x_0 .. x_{B-1}``: ``x_0`` is the anchor (given), ``x_1 .. x_P`` are drafted, with
``P = B - 1``. Head inputs are the drafter's final-normed hidden states at the drafted positions,
``h`` [b, P, H] (what the target ``lm_head`` reads), and the previous tokens ``prev`` [b, P] = ``x_0 ..
x_{P-1}`` in TARGET ids (the anchor may lie outside the draft vocabulary: :meth:`DraftVocab.input_index`).
Output ``delta`` [b, P, Vd]: row ``i`` corrects the logits of ``x_{i+1}`` and depends on the tokens only
through ``prev[:, :i+1]`` = ``x_0 .. x_i``. The paper's ``B`` in Eq. 3-8 counts these ``P`` refined positions.

Both heads zero-initialise their vocabulary readout (``W_r``, ``W2``), so a fresh head is the identity
correction (``delta = 0``): co-training starts from the drafter's own logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .readout import FAST_MIN_VOCAB, Readout
from .vocab import DraftVocab

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class XPressRefiner(nn.Module):
    """The xPress causal refiner ``R = Read . Trans . Mix . Fuse`` (paper Eq. 5-9), rank ``r``.

    Fuse (Eq. 5):  ``a_k = W_in [W_h h_k || W_g g || W_e[x_{k-1}]]``, with ``g`` the mean of ``h`` over the
                   P refined positions (the final-normed drafter states ``h_1 .. h_P``, anchor excluded).
    Mix (Eq. 6):   ``c^(d) = (I + L^(d)) a^(d)`` per channel ``d``; ``L`` [r, P, P] is made strictly lower
                   triangular by masking (``tril(-1)``) on every use, so upper entries never act.
    Trans (Eq. 7): ``z_k = c_k + W_2 sigma(W_1 c_k)``, ``W_1`` r -> 2r, ``W_2`` 2r -> r, sigma = SiLU (or GELU).
    Read (Eq. 8):  ``delta_k = W_r z_k`` over the draft vocabulary (``W_r`` [Vd, r], zero at init).

    Attributes map to the paper: ``w_h``, ``w_g`` (r x H), ``w_e`` ((Vd+1) x r rows: ``W_e`` transposed, with
    the out-of-vocabulary row ``Vd``), ``w_in`` (r x 3r), ``mix`` (L), ``w_1``, ``w_2``, ``w_r``. No biases,
    as in the equations. ``L`` starts at zero (Mix = identity) and ``W_r`` at zero (delta = 0).
    """

    def __init__(self, vocab: DraftVocab, hidden_size: int, positions: int, rank: int,
                 activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: use one of {sorted(ACTIVATIONS)}")
        self.vocab, self.hidden_size, self.positions, self.rank, self.activation = (
            vocab, hidden_size, positions, rank, activation)
        r, vd = rank, vocab.size
        self.w_h = nn.Linear(hidden_size, r, bias=False)
        self.w_g = nn.Linear(hidden_size, r, bias=False)
        self.w_e = nn.Embedding(vd + 1, r)
        self.w_in = nn.Linear(3 * r, r, bias=False)
        self.mix = nn.Parameter(torch.zeros(r, positions, positions))  # L [r, P, P]; used via tril(-1)
        self.w_1 = nn.Linear(r, 2 * r, bias=False)
        self.w_2 = nn.Linear(2 * r, r, bias=False)
        self.w_r = nn.Linear(r, vd, bias=False)
        nn.init.zeros_(self.w_r.weight)
        self._table_key: tuple | None = None
        self._table: tuple[torch.Tensor, ...] | None = None  # folded_weights()
        self.read = Readout()  # inference readout of W_r (packed copies, certified argmax)

    def config(self) -> dict:
        """Constructor arguments (besides the vocabulary), for ``head.json``."""
        return {"hidden_size": self.hidden_size, "positions": self.positions, "rank": self.rank,
                "activation": self.activation}

    def mixer(self) -> torch.Tensor:
        """``I + L`` with ``L`` strictly lower triangular: [r, P, P]."""
        eye = torch.eye(self.positions, dtype=self.mix.dtype, device=self.mix.device)
        return eye + self.mix.tril(-1)

    def trans(self, c: torch.Tensor) -> torch.Tensor:
        """Trans (Eq. 7): c [..., r] -> z [..., r]. Without autograd on the CPU the two products take the fused
        kernel where the target loaded it (:func:`xpress.kernels.linear`, as the drafter's layers do)."""
        return c + kernels.linear(ACTIVATIONS[self.activation](kernels.linear(c, self.w_1.weight)), self.w_2.weight)

    def trans_read(self, c: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """Trans then Read (Eq. 7-8): c [..., r] -> delta [..., Vd] (float32). ``packed``: the readout
        through :meth:`readout` (inference)."""
        z = self.trans(c)
        return (self.readout(z) if packed else self.w_r(z)).float()

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        """``W_r z`` for inference: z [..., r] -> [..., Vd] float32 (:meth:`xpress.readout.Readout.logits`:
        a oneDNN copy of ``W_r`` on the CPU without autograd, ``w_r(z)`` elsewhere)."""
        return self.read.logits(self.w_r.weight, z)

    def forward(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced correction for all positions at once: h [b, P, H], prev [b, P] target ids
        (``x_0 .. x_{P-1}``) -> delta [b, P, Vd]."""
        return self.from_embeddings(h, self.w_e(self.vocab.input_index(prev)))

    def from_embeddings(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Fuse, Mix, Trans, Read as written in the paper, from token embeddings ``e`` [b, P, r]
        (``W_e[x_{k-1}]``) and h [b, P, H] -> delta [b, P, Vd]. (Lets autograd look at d delta / d e.)"""
        g = self.w_g(h.mean(dim=1, keepdim=True)).expand(-1, h.shape[1], -1)  # [b, P, r]
        a = self.w_in(torch.cat([self.w_h(h), g, e], dim=-1))  # Fuse: [b, P, r]
        c = torch.einsum("dkj,bjd->bkd", self.mixer(), a)  # Mix: c_k = sum_{j<=k} (I+L)_{kj} a_j
        return self.trans_read(c)

    # ------------------------------------------------------------------------------------ inference
    def folded_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``W_in`` folded into its three inputs: the token table ``W_e W_in,e^T`` [Vd+1, r], ``W_in,h W_h`` and
        ``W_in,g W_g`` [r, H]; and the mixer ``I + L`` [r, P, P]. They depend only on the weights, so they are
        kept until one changes (tracked by tensor identity and version)."""
        ws = (self.w_e.weight, self.w_in.weight, self.w_h.weight, self.w_g.weight, self.mix)
        key = tuple((w.data_ptr(), w._version) for w in ws)
        if key != self._table_key:
            r, (w_e, w_in, w_h, w_g, _) = self.rank, ws
            with torch.no_grad():
                self._table = (w_e @ w_in[:, 2 * r:].T, w_in[:, :r] @ w_h, w_in[:, r:2 * r] @ w_g, self.mixer())
            self._table_key = key
        return self._table

    @torch.no_grad()
    def fold(self, h: torch.Tensor) -> "FoldedRefiner":
        """The inference operator for one batch of blocks, h [b, P, H] (paper 4.1, "Low overhead").

        Fuse and Mix are linear, so ``c = (I+L)(u + E[x])`` splits into a token-independent part
        ``(I+L) u`` with ``u_k = W_in,h W_h h_k + W_in,g W_g g``, computed here once per block, and the
        folded token table ``E`` (:meth:`folded_weights`). A Jacobi pass is then a gather, one mixing
        contraction, Trans and Read. ``W_in``'s two state thirds are folded into ``W_h`` and ``W_g`` too
        (:meth:`folded_weights`), so ``u`` is two products. For one block (b = 1) where the head's products
        take the fused CPU kernel, ``refine_fold`` computes it in one call (the same function to float32
        rounding: its mean and mixing sum in order).
        """
        table, a_h, a_g, m = self.folded_weights()
        mod = kernels.kernel_for(h, a_h, a_g) if h.shape[0] == 1 else None
        if mod is not None and self.rank % 16 == 0:  # one block: one call of the fused kernel (refine_fold)
            base = mod.refine_fold(h[0].contiguous(), kernels.packed_copy(mod, (a_h,)),
                                   kernels.packed_copy(mod, (a_g,)), m)[None]
        else:
            u = kernels.linear(h, a_h) + kernels.linear(h.mean(dim=1, keepdim=True), a_g)  # [b, P, r]
            base = torch.einsum("dkj,bjd->bkd", m, u)
        return FoldedRefiner(self, base=base, mixer=m, table=table)


@dataclass
class FoldedRefiner:
    """An :class:`XPressRefiner` folded for one batch of blocks (:meth:`XPressRefiner.fold`).

    base: [b, P, r] the mixed token-independent part; mixer: [r, P, P] ``I + L``; table: [Vd+1, r].
    Inference only (built without gradients).
    """

    head: XPressRefiner
    base: torch.Tensor
    mixer: torch.Tensor
    table: torch.Tensor

    def latent(self, prev: torch.Tensor, rows: torch.Tensor | None = None, k: int | None = None,
               lo: int = 0) -> torch.Tensor:
        """The readout's input ``z`` (after Trans) for the batch ``rows`` [n] (default all) from prev [n, P]
        target ids: [n, P, r]; only positions ``lo .. P-1``: [n, P-lo, r]; or only position ``k`` (0-based,
        reading ``prev[:, :k+1]``): [n, r]. A gather of the folded table, one mixing contraction, Trans."""
        base = self.base if rows is None else self.base[rows]
        idx = self.head.vocab.input_index(prev)
        if k is None:
            e = self.table[idx]  # [n, P, r]
            c = base[:, lo:] + torch.einsum("dkj,njd->nkd", self.mixer[:, lo:], e)  # [n, P-lo, r]
        else:
            c = base[:, k] + torch.einsum("dj,njd->nd", self.mixer[:, k, :k + 1], self.table[idx[:, :k + 1]])
        return self.head.trans(c)

    def first(self, k: int) -> "FoldedRefiner":
        """The operator of the block's first ``k`` positions alone (prev [n, k] -> [n, k, Vd]), the same
        function as the whole block's there: position ``i`` reads only rows and columns ``<= i`` of the mixer
        (the dropped columns multiply zeros), and the per-block part keeps its mean over all P states."""
        return FoldedRefiner(self.head, self.base[:, :k], self.mixer[:, :k, :k], self.table)

    def __call__(self, prev: torch.Tensor, rows: torch.Tensor | None = None, k: int | None = None,
                 lo: int = 0) -> torch.Tensor:
        """delta (the readout of :meth:`latent`): [n, P, Vd], [n, P-lo, Vd] or [n, Vd]."""
        return self.head.readout(self.latent(prev, rows, k, lo))

    def choose(self, prev: torch.Tensor, base: torch.Tensor, rows: torch.Tensor | None = None,
               k: int | None = None, lo: int = 0) -> torch.Tensor:
        """The argmax of ``base + delta`` (T=0) without materialising float32 logits where the certified
        readout applies (:mod:`xpress.readout`): base [n, P-lo, Vd] or [n, Vd] -> tokens [n, P-lo] or [n].
        A whole block of one sequence takes one call of the fused CPU kernel where it applies
        (:meth:`_fused_pass`)."""
        if rows is None and k is None and lo == 0 and prev.shape[0] == 1:
            tokens = self._fused_pass(prev, base)
            if tokens is not None:
                return tokens
        return self.head.read.argmax(self.head.w_r.weight, self.latent(prev, rows, k, lo), base)

    def _fused_pass(self, prev: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
        """:meth:`choose` for one block (prev [1, P] target ids, base [1, P, Vd]) in one call of the fused CPU
        kernel (``refine_pass`` in xpress/csrc/fused_cpu.cpp: gather, Mix, Trans, Read and the argmax) where
        :func:`xpress.kernels.linear` would run the head's products, with SiLU and a vocabulary below the
        certified readout's; else None. The same function to float32 rounding (its mixing sums and SiLU are
        the kernel's)."""
        head = self.head
        w_1, w_2, w_r = head.w_1.weight, head.w_2.weight, head.w_r.weight
        mod = kernels.kernel_for(base, w_1, w_2, w_r)
        if mod is None or head.activation != "silu" or head.rank % 16 or (
                head.read.fast is not False and w_r.shape[0] >= FAST_MIN_VOCAB):
            return None
        idx = head.vocab.input_index(prev[0])  # [P] rows of the folded table
        return mod.refine_pass(idx.contiguous(), self.base[0].contiguous(), self.mixer.contiguous(), self.table,
                               kernels.packed_copy(mod, (w_1,)), kernels.packed_copy(mod, (w_2,)),
                               kernels.packed_copy(mod, (w_r,)), base[0].contiguous())[None]


class MarkovHead(nn.Module):
    """The DSpark Markov head (arXiv 2607.05147): ``bias_k = W2 W1[x_{k-1}]``.

    ``w_1``: (Vd+1) x r embedding of the previous token (row ``Vd`` for tokens outside the draft
    vocabulary), ``w_2``: r -> Vd linear, zero at init. At inference the P positions are decoded one after
    another (``sequential_refine``): each bias needs the token just chosen before it.

    Shapes: ``forward(prev [b, P] target ids) -> bias [b, P, Vd]`` (teacher-forced, all positions);
    ``bias(prev [n, P], rows [n], k) -> [n, Vd]`` for position ``k`` alone (one serial step).
    """

    def __init__(self, vocab: DraftVocab, rank: int):
        super().__init__()
        self.vocab, self.rank = vocab, rank
        self.w_1 = nn.Embedding(vocab.size + 1, rank)
        self.w_2 = nn.Linear(rank, vocab.size, bias=False)
        nn.init.zeros_(self.w_2.weight)
        self.read = Readout()  # inference readout of W2 (packed copies, certified argmax)

    def config(self) -> dict:
        return {"rank": self.rank}

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [b, n] target ids -> bias [b, n, Vd] (float32), each row from its own previous token."""
        return self.w_2(self.w_1(self.vocab.input_index(prev))).float()

    def latent(self, prev: torch.Tensor, rows: torch.Tensor | None = None, k: int | None = None,
               lo: int = 0) -> torch.Tensor:
        """The readout's input ``W1[x_{k-1}]``: prev [n, P] -> [n, P-lo, r], or only position ``k``: [n, r]
        (``rows`` is irrelevant: the head has no per-block state)."""
        return self.w_1(self.vocab.input_index(prev[:, lo:] if k is None else prev[:, k]))

    def bias(self, prev: torch.Tensor, rows: torch.Tensor | None = None, k: int | None = None,
             lo: int = 0) -> torch.Tensor:
        """The same correction interface as :class:`FoldedRefiner`: prev [n, P] -> [n, P-lo, Vd], or only
        position ``k``: [n, Vd], through the inference readout (:class:`xpress.readout.Readout`)."""
        return self.read.logits(self.w_2.weight, self.latent(prev, rows, k, lo))

    def choose(self, prev: torch.Tensor, base: torch.Tensor, rows: torch.Tensor | None = None,
               k: int | None = None, lo: int = 0) -> torch.Tensor:
        """As :meth:`FoldedRefiner.choose`: the argmax of ``base + bias`` at T=0."""
        return self.read.argmax(self.w_2.weight, self.latent(prev, rows, k, lo), base)

    def fold(self, h: torch.Tensor | None = None) -> "MarkovCorrection":
        """The inference correction for a batch of blocks, as :meth:`XPressRefiner.fold` (the head has no
        per-block state: ``h`` is not read)."""
        return MarkovCorrection(self)


@dataclass
class MarkovCorrection:
    """A :class:`MarkovHead` as a correction for :func:`xpress.jacobi.corrected_logits`: called, its
    :meth:`MarkovHead.bias`; :meth:`choose`, its T=0 argmax."""

    head: MarkovHead

    def __call__(self, prev: torch.Tensor, rows: torch.Tensor | None = None, k: int | None = None,
                 lo: int = 0) -> torch.Tensor:
        return self.head.bias(prev, rows, k, lo)

    def choose(self, prev: torch.Tensor, base: torch.Tensor, rows: torch.Tensor | None = None,
               k: int | None = None, lo: int = 0) -> torch.Tensor:
        return self.head.choose(prev, base, rows, k, lo)

    def steps(self, anchor: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
        """The T=0 sequential decode of one block (anchor [1] target id, base [1, k, Vd]) -> tokens [1, k] draft
        ids, in one call of the fused CPU kernel (``markov_steps``: each step's readout and argmax) where
        :func:`xpress.kernels.linear` would run the head's readout, below the certified readout's vocabularies;
        else None. The same readout products as :meth:`MarkovHead.choose` on the kernel."""
        head = self.head
        w_1, w_2 = head.w_1.weight, head.w_2.weight
        mod = kernels.kernel_for(base, w_2)
        if mod is None or base.shape[0] != 1 or w_1.dtype != torch.float32 or (
                head.read.fast is not False and w_2.shape[0] >= FAST_MIN_VOCAB):
            return None
        row = int(head.vocab.input_index(anchor)[0])  # the anchor's row of W1
        return mod.markov_steps(row, w_1, kernels.packed_copy(mod, (w_2,)), base[0].contiguous())[None]


# ------------------------------------------------------------------------------------------ analysis
def dependency_matrices(refiner: XPressRefiner, h: torch.Tensor, prev: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """What each correction reads, measured with autograd on one block: h [P, H], prev [P] target ids.

    Returns ``tokens`` [P, P] = sum |d delta_k / d W_e[x_j]| and ``hidden`` [P, P] = sum |d delta_k / d h_j|
    (summed over the vocabulary and the input features). Row ``i`` is refined position ``k = i + 1``;
    token column ``j`` is ``x_j`` (j = 0 .. P-1, ``x_0`` the anchor), hidden column ``j`` is ``h_{j+1}``.
    An entry is exactly zero when the output does not depend on that input.
    """
    e = refiner.w_e(refiner.vocab.input_index(prev[None])).detach()  # [1, P, r]
    je, jh = torch.autograd.functional.jacobian(lambda e, h: refiner.from_embeddings(h, e), (e, h[None]),
                                                vectorize=True)  # [1, P, Vd, 1, P, r], [1, P, Vd, 1, P, H]
    return je.abs().sum(dim=(0, 2, 3, 5)), jh.abs().sum(dim=(0, 2, 3, 5))


# ------------------------------------------------------------------------------------------ counting
def count_params(module: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in module.parameters())


def count_flops(method: str, vocab_size: int, hidden_size: int, rank: int, block_size: int,
                iters: int | None = None) -> dict[str, int]:
    """Refinement cost per block at inference, as implemented (FLOPs = 2 x multiply-adds; gathers,
    argmax and element-wise ops not counted).

    method ``xpress`` (folded, :class:`FoldedRefiner`; ``iters`` = K Jacobi passes, default P) or
    ``markov`` (P serial steps of one position). Returns ``setup`` (once per block: xPress fold),
    ``per_pass`` (one Jacobi pass over all P positions / one Markov step), ``passes`` (dependent steps),
    ``total`` and ``weights_read`` (parameter elements streamed per block: the vocabulary readout is read
    once per pass, which dominates latency at batch 1). The folded token table costs ``2 (Vd+1) r^2`` once
    per weight update and is not counted.
    """
    v, h, r, p = vocab_size, hidden_size, rank, block_size - 1
    if method == "xpress":
        setup = 2 * (p * h * r + h * r + p * r * r + r * r + r * p * p)  # W_h h, W_g g, W_in (h, g), Mix
        per_pass = 2 * (r * p * p + 4 * p * r * r + p * r * v)  # Mix of tokens, Trans, Read
        passes = p if iters is None else iters
        per_pass_weights = r * p * p + 4 * r * r + r * v
        setup_weights = 2 * h * r + 2 * r * r
    elif method == "markov":
        setup, per_pass, passes = 0, 2 * r * v, p
        per_pass_weights, setup_weights = r * v + r, 0
    else:
        raise ValueError(f"method={method!r}: use xpress or markov")
    return {"setup": setup, "per_pass": per_pass, "passes": passes, "total": setup + passes * per_pass,
            "weights_read": setup_weights + passes * per_pass_weights}


def randomize_(module: nn.Module, scale: float = 1.0, generator: torch.Generator | None = None) -> nn.Module:
    """Fill every parameter with N(0, scale^2 / fan_in), fan_in = its last dim (1 for vectors), in place.
    For property checks on untrained heads, whose zero readout would make delta identically 0."""
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale / fan_in ** 0.5)
    return module
