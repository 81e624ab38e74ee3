"""One block of the latency study (:mod:`xpress.studies.latency`): random modules at given shapes (the
drafter with its context, the target's readout, the xPress refiner made the slowest case for Jacobi
refinement, the Markov head) and the decodes it times on them: the refiner's K passes, the Markov head's
P serial steps, each readout alone, and a dense rollout with no host synchronisation (what a CUDA graph
captures). Nothing here times anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..drafter import DFlashConfig, DFlashDraftModel
from ..heads import MarkovHead, XPressRefiner, randomize_
from ..jacobi import corrected_logits, jacobi_refine, prev_tokens, select, sequential_refine
from ..vocab import DraftVocab
from .shapes import Shapes


def _fill_random_(module: nn.Module, std: float, generator: torch.Generator) -> nn.Module:
    """Every matrix N(0, std^2), every norm weight 1 (in place, drawn on the module's device by
    ``generator``, which must live there): a random model of realistic scale."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
    return module


# ======================================================================================= the modules
@dataclass
class Block:
    """The random modules and inputs of one block at ``shapes`` (batch 1): the drafter with its context
    (``context_len`` tokens), the target's ``lm_head`` (the readout), the refiner and the Markov head, and
    the drafter's output for the block: ``h`` [1, P, H], ``base`` [1, P, Vd] float32."""

    shapes: Shapes
    drafter: DFlashDraftModel
    context: Any
    lm_head: nn.Linear
    vocab: DraftVocab
    refiner: XPressRefiner
    markov: MarkovHead
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    h: torch.Tensor = field(init=False)
    base: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        with torch.no_grad():
            self.h = self.forward()
            self.base = self.readout()

    def forward(self) -> torch.Tensor:
        """The drafter's forward for the block: [1, P, H]."""
        return self.drafter(self.anchor[:, None], self.anchor_pos[:, None], self.context)[:, 0, 1:]

    def readout(self) -> torch.Tensor:
        """The base logits through the target's lm_head: [1, P, Vd] float32."""
        return self.drafter.base_logits(self.h, self.vocab)


def worst_case_(refiner: XPressRefiner, hidden_scale: float = 0.1) -> XPressRefiner:
    """Make a random refiner the slowest case for Jacobi refinement, in place: no mixing (``L = 0``) and a
    weak hidden-state path, so each position's choice is a pseudo-random function of its previous token
    (a chain ``y_k = f(y_{k-1})``). From a wrong seed, pass t then fixes exactly one more position
    (Theorem 1's bound is tight) and changes every later one, so K passes are run and pass t recomputes
    P - t + 1 positions: the cost of K, not of an easy block."""
    with torch.no_grad():
        refiner.mix.zero_()
        refiner.w_h.weight.mul_(hidden_scale)
        refiner.w_g.weight.mul_(hidden_scale)
    return refiner


def build_block(shapes: Shapes, lc: Any) -> Block:
    """Random modules of ``shapes`` on ``lc.device`` in ``lc.dtype`` (see :class:`Block`); ``lc``: the study's
    :class:`xpress.studies.latency.LatencyConfig` (not imported: latency imports this module)."""
    dev, dtype, s = torch.device(lc.device), lc.torch_dtype, shapes
    g = torch.Generator().manual_seed(lc.seed)
    g_dev = torch.Generator(device=dev).manual_seed(lc.seed)
    config = DFlashConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
                          num_key_value_heads=s.kv_heads, head_dim=s.head_dim, num_hidden_layers=s.drafter_layers,
                          num_target_layers=s.target_layers,
                          target_layer_ids=list(range(1, 1 + s.target_features)), vocab_size=s.target_vocab,
                          block_size=s.block_size, mask_token_id=None)
    with torch.device("meta"):
        drafter, lm_head = DFlashDraftModel(config), nn.Linear(s.hidden, s.target_vocab, bias=False)
    drafter = _fill_random_(drafter.to(dtype).to_empty(device=dev), 0.02, g_dev).eval().requires_grad_(False)
    lm_head = _fill_random_(lm_head.to(dtype).to_empty(device=dev), 0.02, g_dev).requires_grad_(False)
    embed = nn.Embedding.from_pretrained(lm_head.weight, freeze=True)  # tied: no second V x H matrix
    drafter.attach(embed, lm_head)
    vocab = DraftVocab.full(s.target_vocab) if s.vocab >= s.target_vocab else DraftVocab.from_ids(range(s.vocab), s.target_vocab)
    refiner = worst_case_(randomize_(XPressRefiner(vocab, s.hidden, s.positions, s.rank), lc.scale, g))
    markov = randomize_(MarkovHead(vocab, s.markov_rank), 1.0, g)
    refiner = refiner.to(device=dev, dtype=dtype).requires_grad_(False)
    markov = markov.to(device=dev, dtype=dtype).requires_grad_(False)
    L = s.context
    with torch.no_grad():
        features = torch.randn(1, L, s.target_features * s.hidden, generator=g).to(device=dev, dtype=dtype)
        positions = torch.arange(L, device=dev)[None]
        context = drafter.encode_context(features, positions)
        refiner.folded_weights()  # folded once per weights, not per block
    anchor = torch.tensor([7], device=dev)
    return Block(s, drafter, context, lm_head, vocab, refiner, markov, anchor, torch.tensor([L], device=dev))


# ===================================================================================== refinement
def refine_xpress(block: Block, k: int, init: torch.Tensor | None = None, incremental: bool = True,
                  logits_hook: Callable | None = None):
    """Fold the refiner for the block and run ``k`` Jacobi passes (adaptive): a RefineResult."""
    fn = corrected_logits(block.base, block.refiner.fold(block.h))
    if logits_hook is not None:
        fn = logits_hook(fn)
    return jacobi_refine(fn, block.base, block.anchor, k, vocab=block.vocab, init=init, incremental=incremental)


def refine_markov(block: Block):
    """The Markov head's P serial steps: a RefineResult."""
    return sequential_refine(corrected_logits(block.base, block.markov.fold()), block.base, block.anchor,
                             vocab=block.vocab)


def on_float32(fn: Callable[[], Any], *reads) -> Callable[[], Any]:
    """``fn`` run with the float32 readout on the :class:`xpress.readout.Readout` objects ``reads`` (their
    ``fast`` set to False for the call, then back to the default)."""
    def run() -> Any:
        for r in reads:
            r.fast = False
        try:
            return fn()
        finally:
            for r in reads:
                r.fast = None
    return run


def count_work(block: Block, k: int, init: torch.Tensor | None, incremental: bool = True) -> dict[str, float]:
    """Passes run and readout rows computed by one refinement (an untimed run)."""
    rows = []

    def hook(fn):
        def counted(prev, r, kk=None, lo=0):
            out = fn(prev, r, kk, lo)
            rows.append(out.shape[0] * out.shape[1])
            return out
        return counted

    with torch.no_grad():
        res = refine_xpress(block, k, init, incremental, hook)
    return {"passes": float(res.iters.float().mean()), "positions": float(sum(rows))}


def readout_alone(block: Block, y: torch.Tensor) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The T=0 readout of each decode alone (``Readout.argmax`` of ``s + W z``, on the block's own latents
    from ``y`` [1, P]): the Markov head's for one row (what a serial step reads out) and the refiner's
    for all P rows (a full Jacobi pass). ``P t(markov) / (K t(xpress))`` is the Markov / xPress ratio K
    passes would reach if each decode cost only its readouts (``readout_only_k4``)."""
    prev = prev_tokens(block.anchor, y, block.vocab)
    with torch.no_grad():
        z = block.refiner.fold(block.h).latent(prev)[0]  # [P, r]
        zm = block.markov.latent(prev, k=0)  # [1, r]
    base = block.base[0]  # [P, Vd]
    mark, ref = block.markov, block.refiner
    return (lambda: mark.read.argmax(mark.w_2.weight, zm, base[:1])), (lambda: ref.read.argmax(ref.w_r.weight, z, base))


def dense_rollout(block: Block, k: int, y0: torch.Tensor, step: Callable | None = None) -> torch.Tensor:
    """``k`` dense Jacobi passes with no early stop and no host synchronisation (capturable in a CUDA
    graph): y0 [1, P] draft ids -> Y^(k) [1, P]. Equal to :func:`jacobi_refine` at ``max_iters = k`` from
    ``y0`` (a fixed point repeats itself). ``step``: the pass ``(folded, y) -> y`` (e.g. compiled)."""
    folded = block.refiner.fold(block.h)
    step = step or (lambda f, y: pass_tokens(block, f, y))
    y = y0
    for _ in range(k):
        y = step(folded, y)
    return y


def pass_tokens(block: Block, folded, y: torch.Tensor) -> torch.Tensor:
    """One dense Jacobi pass at T = 0: y [1, P] -> [1, P]."""
    rows = torch.zeros(1, dtype=torch.int64, device=y.device)
    return select(folded(prev_tokens(block.anchor, y, block.vocab), rows).add_(block.base), 0.0, None)
