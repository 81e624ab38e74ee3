"""Co-training of the drafter and its correction head (paper 4.3 and 5.1), resumable, under accelerate.

    python -m xpress train --preset cpu --method xpress          # one process
    accelerate launch -m xpress train --preset qwen3-8b ...     # several GPUs or nodes (DDP)
    torchrun --nproc_per_node 2 -m xpress train ...              # the same with torchrun (gloo on CPU)

Stages. With ``train.warm_start_steps > 0`` a plain drafter is trained first (stage ``warmstart``,
checkpoint ``checkpoints/<preset>/warmstart/``), once, for every method; then each method (``dflash``,
``markov``, ``xpress``) is co-trained from that drafter for the same ``train.steps`` on the same data with
the same recipe, so that their tau compare. With ``train.refiner_only`` (a released dFlash checkpoint on
the GPU preset) the drafter is frozen and only the head trains.

Blocks, as in the public dFlash recipe: per sequence ``train.anchors_per_seq`` random anchors ``a`` among
the positions whose next token is supervised (the last prompt token, where inference starts, included);
the block is ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``; it sees the context features strictly
before ``a`` and itself bidirectionally (:func:`xpress.drafter.block_attention_mask`), and position ``k``
is scored against ``x_{a+k}``. All anchors of a batch go through the drafter in ONE forward, exactly the
computation of the inference path (``extend`` + ``propose``), which a test checks.

Randomness is a function of (seed, step, rank) alone, so a run stopped at step ``s`` and resumed from its
checkpoint continues bit for bit like an uninterrupted run (model, AdamW state and the log are saved).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .. import distributed, kernels, paths
from ..config import Config
from ..drafter import DFlashDraftModel
from ..heads import MarkovHead, XPressRefiner
from ..proposer import METHODS, ModelDrafter, checkpoint_fingerprint, load_drafter, new_drafter, save_drafter
from ..utils import DeferredInterrupt
from ..vocab import DraftVocab
from .losses import (acceptance_of_choices, anchor_weight, distribution_loss, loss_weights, position_weights,
                     row_terms, target_distribution)
from .regenerate import RegenData, config_hash, regen_signature

STATE_FILE = "train_state.json"
TRAINER_FILE = "trainer_state.pt"
WARM_START = "warmstart"


class TrainingError(RuntimeError):
    """Training input that does not fit (missing data, a checkpoint of another config, a corrupt file);
    the message says how to fix it."""


# ---------------------------------------------------------------------------------------------- vocab
def build_vocab(cfg: Config, target, data: RegenData) -> tuple[DraftVocab, dict[str, float]]:
    """The draft vocabulary from the regenerated training tokens (``drafter.draft_vocab_size`` most
    frequent, EOS always in; 0 = the full vocabulary) and its coverage of the validation tokens."""
    if cfg.drafter.draft_vocab_size == 0:
        vocab = DraftVocab.full(target.vocab_size)
    else:
        vocab = DraftVocab.from_counts(data.token_counts(target.vocab_size, "train"), cfg.drafter.draft_vocab_size,
                                       always=target.eos_token_ids)
    val = data.token_counts(target.vocab_size, "val")
    inside = float(val[vocab.d2t].sum()) / max(1, int(val.sum()))
    train = data.token_counts(target.vocab_size, "train")
    return vocab, {"draft_vocab_size": vocab.size, "val_token_coverage": inside,
                   "train_token_coverage": float(train[vocab.d2t].sum()) / max(1, int(train.sum()))}


def init_from_target_layers(drafter: DFlashDraftModel, target) -> list[int]:
    """Copy the target's top ``num_layers`` decoder layers into the drafter's layers (same names and
    shapes: attention projections, MLP, the two layer norms; q/k norms where the target has them).
    Returns the target layer ids used."""
    layers = list(target.model.get_decoder().layers)
    ids = list(range(len(layers) - len(drafter.layers), len(layers)))
    with torch.no_grad():
        for mine, i in zip(drafter.layers, ids):
            theirs = dict(layers[i].named_parameters())
            for name, p in mine.named_parameters():
                if name in theirs and theirs[name].shape == p.shape:
                    p.copy_(theirs[name].to(p.dtype))
                elif not name.endswith(("q_norm.weight", "k_norm.weight")):
                    raise TrainingError(f"drafter.init_from_target: target layer {i} has no {name} of shape "
                                        f"{tuple(p.shape)}; set drafter.init_from_target=false")
    return ids


# ---------------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    """One training batch. ``b`` sequences padded to ``L``, ``nb`` anchors each, ``P = B - 1``.

    features [b, L, F] float32, positions [b, L] int64, valid [b, L] bool: the context;
    anchor_ids, anchor_pos [b, nb] int64, anchor_valid [b, nb] bool;
    labels [b, nb, P] target ids (x_{a+k}), label_valid [b, nb, P] bool;
    t_hidden [b, nb, P, H] float32 and t_lse [b, nb, P]: the target's state before each label.
    """

    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    anchor_ids: torch.Tensor
    anchor_pos: torch.Tensor
    anchor_valid: torch.Tensor
    labels: torch.Tensor
    label_valid: torch.Tensor
    t_hidden: torch.Tensor
    t_lse: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(**{k: v.to(device) for k, v in asdict(self).items()})


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The RNG of one step on one process (resume-exact: no state carried between steps)."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def online_states(target, ids: torch.Tensor, valid: torch.Tensor, chunk: int = 0) -> dict[str, torch.Tensor]:
    """The target states that regeneration would have cached, computed now by one teacher-forced
    forward over right-padded ``ids`` [b, L] (``valid`` [b, L]): features [b, L, F], hidden [b, L, H]
    (final-normed) and lse [b, L], float32, on the target's device (for presets that do not cache them, e.g.
    Qwen3-8B, where the features would take ~40 kB per token).

    ``chunk`` (``train.state_chunk_tokens``): 0 takes lse from the forward's full logits [b, L, V]; else the
    forward keeps one position's logits and lse is computed ``chunk`` tokens at a time from the captured
    hidden state (the one the target distribution is read from) and the LM head, so the [b, L, V] logits
    (7.5 GB in float32 at Qwen3-8B's 4 x 3072 tokens) never exist."""
    from ..targets import target_forward
    from .regenerate import capture_target_states

    with torch.no_grad(), capture_target_states(target) as calls:
        step = target_forward(target, ids.to(target.device), attention_mask=valid.long().to(target.device),
                              logits_to_keep=1 if chunk else 0)
    hidden = calls[-1].hidden
    if chunk:
        w = target.lm_head().weight  # [V, H]
        flat = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            lse = torch.cat([torch.logsumexp(F.linear(flat[i:i + chunk].to(w.dtype), w).float(), dim=-1)
                             for i in range(0, flat.shape[0], chunk)]).view(hidden.shape[:-1])
    else:
        lse = torch.logsumexp(step.logits, dim=-1)
    return {"features": step.features.float(), "hidden": hidden.float(), "lse": lse}


def make_batch(data: RegenData, rows: list[int], cfg: Config, generator: torch.Generator,
               anchors: list[list[int]] | None = None, target=None) -> Batch:
    """Collate sequences ``rows`` (cut to ``train.max_len``) with random anchors (or the given ones).
    Target states come from the regenerated cache, or from ``target`` when the data hold none."""
    B, nb, max_len = cfg.drafter.block_size, cfg.train.anchors_per_seq, cfg.train.max_len
    P = B - 1
    seqs = [data.input_ids[i][:max_len] for i in rows]
    L = max(len(s) for s in seqs)
    b = len(rows)
    ids = torch.zeros(b, L, dtype=torch.long)
    valid = torch.zeros(b, L, dtype=torch.bool)
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = torch.tensor(s)
        valid[j, :len(s)] = True
    if data.has_states:
        states = [data.states(i) for i in rows]
        feats = torch.zeros(b, L, states[0]["features"].shape[1])
        hid = torch.zeros(b, L, states[0]["hidden"].shape[1])
        lse = torch.zeros(b, L)
        for j, (s, st) in enumerate(zip(seqs, states)):
            T = len(s)
            feats[j, :T] = torch.from_numpy(np.asarray(st["features"][:T], dtype=np.float32))
            hid[j, :T] = torch.from_numpy(np.asarray(st["hidden"][:T], dtype=np.float32))
            lse[j, :T] = torch.from_numpy(np.nan_to_num(np.asarray(st["lse"][:T], dtype=np.float32)))
    elif target is not None:  # on the target's device: a GPU's states never travel to the host and back
        st = online_states(target, ids, valid, cfg.train.state_chunk_tokens)
        feats, hid, lse = (st[k] for k in ("features", "hidden", "lse"))
    else:
        raise TrainingError(f"{data.folder} holds no captured target states and no target was given to compute them")
    H = hid.shape[-1]
    a_pos = torch.zeros(b, nb, dtype=torch.long)
    a_valid = torch.zeros(b, nb, dtype=torch.bool)
    for j, (i, s) in enumerate(zip(rows, seqs)):
        T = len(s)
        if anchors is not None:
            chosen = torch.tensor(anchors[j], dtype=torch.long)
        else:
            first = data.prompt_len[i] - 1  # the last prompt token: where decoding starts
            candidates = torch.arange(first, T - 1)  # the next token is a supervised response token
            pick = torch.randperm(len(candidates), generator=generator)[:nb]
            chosen = candidates[pick.sort().values]
        a_pos[j, :len(chosen)] = chosen
        a_valid[j, :len(chosen)] = True
    k = torch.arange(1, P + 1)
    where = a_pos[:, :, None] + k  # [b, nb, P] positions of the labels
    lengths = valid.sum(1)[:, None, None]
    label_valid = (where < lengths) & a_valid[:, :, None]
    where = where.clamp_max(L - 1)
    labels = ids.gather(1, where.reshape(b, -1)).view(b, nb, P)
    before = (where - 1).reshape(b, -1)
    before = before.to(hid.device)
    t_hidden = hid.gather(1, before[..., None].expand(-1, -1, H)).view(b, nb, P, H)
    t_lse = lse.gather(1, before).view(b, nb, P)
    return Batch(features=feats, positions=torch.arange(L).expand(b, L).clone(), valid=valid,
                 anchor_ids=ids.gather(1, a_pos), anchor_pos=a_pos, anchor_valid=a_valid,
                 labels=labels, label_valid=label_valid, t_hidden=t_hidden, t_lse=t_lse)


# ---------------------------------------------------------------------------------------------- model
class CoTrainer(nn.Module):
    """Drafter + head as one module (what DDP wraps). ``forward(batch)`` -> logits over the draft
    vocabulary, each [n, P, Vd] with ``n = b * nb``: ``base`` (the drafter), and for a head ``refined``
    (teacher-forced: previous tokens ``[x_a, x*_{a+1} .. x*_{a+P-1}]``) and ``consistency`` (previous
    tokens ``[x_a, argmax base]``), plus the drafter's block states ``hidden`` [n, P, H]."""

    def __init__(self, drafter: DFlashDraftModel, head: XPressRefiner | MarkovHead | None, vocab: DraftVocab,
                 attention: str = "torch"):
        super().__init__()
        self.drafter, self.head, self.vocab = drafter, head, vocab
        self.attention = attention  # train.attention_kernel: auto (the C++ kernel where it builds) or torch

    def forward(self, batch: Batch, consistency: bool = True, attention: str | None = None,
                chunks: "LossChunks | None" = None) -> dict[str, torch.Tensor]:
        """The logits above; with ``chunks`` (``train.loss_chunk_blocks``) the loss's sums instead, computed
        chunk by chunk (:meth:`LossChunks.sums`), so that no [n, P, Vd] tensor exists beyond one chunk's."""
        d = self.drafter
        context = d.encode_context(batch.features, batch.positions, batch.valid)
        kernel = kernels.for_training(attention or self.attention, batch.features.device)
        hidden = d(batch.anchor_ids, batch.anchor_pos, context, attention_kernel=kernel)  # [b, nb, B, H]
        b, nb, B, H = hidden.shape
        h = hidden[:, :, 1:].reshape(b * nb, B - 1, H)  # [n, P, H]
        if chunks is not None:
            return {"hidden": h, **chunks.sums(self, h, batch, consistency)}
        base = d.base_logits(h, self.vocab)  # [n, P, Vd]
        out = {"hidden": h, "base": base}
        if self.head is None:
            return out
        anchor = batch.anchor_ids.reshape(-1, 1)
        gold = torch.cat([anchor, batch.labels.reshape(b * nb, -1)[:, :-1]], dim=1)  # [n, P]
        out["refined"] = base + self._delta(h, gold)
        if consistency:
            own = self.vocab.to_target(base.detach().argmax(-1))[:, :-1]
            out["consistency"] = base + self._delta(h, torch.cat([anchor, own], dim=1))
        return out

    def _delta(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.head(h, prev) if isinstance(self.head, XPressRefiner) else self.head(prev)


TERMS = ("base", "refined", "consistency")


@dataclass
class LossChunks:
    """Eq. 14's vocabulary-wide terms computed ``blocks`` blocks at a time (``train.loss_chunk_blocks``): per
    chunk the drafter's logits (in the product's dtype: bf16 under autocast), the target's distribution, the
    heads' logits and the per-row terms are made, reduced to weighted sums, and dropped; under activation
    checkpointing the chunk is recomputed in backward, so backward too holds one chunk's [c, P, Vd] tensors
    at a time. The sums over chunks divided by :func:`~.losses.loss_weights`' denominators are
    :func:`~.losses.distribution_loss` of the whole batch (a test checks values and gradients)."""

    blocks: int
    readout: torch.Tensor  # [Vd, H]: the target's LM head rows of the draft vocabulary
    weights: torch.Tensor  # [P]: w_k
    ce_weight: float
    tv_weight: float
    kernel: Any = None  # the loss's C++ row terms (CPU) or None

    @classmethod
    def of(cls, cfg: Config, readout: torch.Tensor) -> "LossChunks | None":
        """The preset's chunking, or None for the one-piece loss (``train.loss_chunk_blocks: 0``)."""
        t = cfg.train
        if not t.loss_chunk_blocks:
            return None
        return cls(t.loss_chunk_blocks, readout, position_weights(cfg.drafter.block_size - 1, t.gamma, readout.device),
                   t.ce_weight, t.tv_weight, kernels.for_training(t.loss_kernel, readout.device))

    def sums(self, module: "CoTrainer", h: torch.Tensor, batch: Batch, consistency: bool) -> dict[str, torch.Tensor]:
        """h [n, P, H] -> ``sums`` [terms, 3] (per term of :data:`TERMS` present: sum of ``w (ce_weight ce +
        tv_weight l1)``, of ``w ce`` and of ``w l1``) and the argmax ids ``choice_base``, ``choice_final`` [n, P]."""
        n, P, _ = h.shape
        labels = module.vocab.to_draft(batch.labels.reshape(n, P))
        w, _, _ = loss_weights(labels, batch.label_valid.reshape(n, P), self.weights)
        args = (batch.anchor_ids.reshape(n, 1), batch.labels.reshape(n, P), labels, w,
                batch.t_hidden.reshape(n, P, -1), batch.t_lse.reshape(n, P))
        parts = []
        for i in range(0, n, self.blocks):
            part = [h[i:i + self.blocks], *(a[i:i + self.blocks] for a in args)]
            if torch.is_grad_enabled():
                parts.append(torch.utils.checkpoint.checkpoint(self._chunk, module, consistency, *part,
                                                               use_reentrant=False))
            else:
                parts.append(self._chunk(module, consistency, *part))
        return {"sums": sum(p[0] for p in parts), "choice_base": torch.cat([p[1] for p in parts]),
                "choice_final": torch.cat([p[2] for p in parts])}

    def _chunk(self, module: "CoTrainer", consistency: bool, h, anchor, gold, labels, w, t_hidden, t_lse):
        """One chunk of c blocks: h [c, P, H], anchor [c, 1], gold [c, P] target ids, labels [c, P] draft ids,
        w [c, P], t_hidden [c, P, H_t], t_lse [c, P] -> (sums [terms, 3], argmax base, argmax final [c, P])."""
        base = module.drafter.base_logits(h, module.vocab, float32=False)  # [c, P, Vd], bf16 under autocast
        p_t = target_distribution(t_hidden, t_lse, self.readout)  # [c, P, Vd] float32, no gradient
        logits = {"base": base}
        if module.head is not None:
            logits["refined"] = base + module._delta(h, torch.cat([anchor, gold[:, :-1]], dim=1))
            if consistency:
                own = module.vocab.to_target(base.detach().argmax(-1))[:, :-1]
                logits["consistency"] = base + module._delta(h, torch.cat([anchor, own], dim=1))
        rows = []
        for name in TERMS:
            if name in logits:
                ce, l1 = row_terms(logits[name], labels, p_t, self.kernel)  # [c, P] each
                rows.append(torch.stack([(w * (self.ce_weight * ce + self.tv_weight * l1)).sum(), (w * ce).sum(),
                                         (w * l1).sum()]))
        final = logits.get("refined", base)
        return torch.stack(rows), base.detach().argmax(-1), final.detach().argmax(-1)


def compute_loss(out: dict[str, torch.Tensor], batch: Batch, vocab: DraftVocab, readout: torch.Tensor,
                 cfg: Config, anchor_w: float) -> tuple[torch.Tensor, dict[str, float]]:
    """L_total (Eq. 15; see :mod:`.losses`) and the logged terms, from :class:`CoTrainer`'s logits or, chunked,
    from its sums (:class:`LossChunks`)."""
    t = cfg.train
    P = batch.labels.shape[-1]
    labels = vocab.to_draft(batch.labels.reshape(-1, P))
    valid = batch.label_valid.reshape(-1, P)
    if "sums" in out:
        _, total, w_ce = loss_weights(labels, valid, position_weights(P, t.gamma, labels.device))
        terms = {name: {"loss": s[0] / total, "ce": s[1] / w_ce, "l1": s[2] / total}
                 for name, s in zip(TERMS, out["sums"])}  # base, then refined and consistency where present
        return _total(terms, anchor_w, t, out["choice_final"], out["choice_base"], labels, valid)
    p_t = target_distribution(batch.t_hidden.reshape(-1, P, batch.t_hidden.shape[-1]),
                              batch.t_lse.reshape(-1, P), readout)
    w = position_weights(P, t.gamma, labels.device)
    kernel = kernels.for_training(t.loss_kernel, labels.device)
    terms = {name: distribution_loss(out[name], labels, p_t, valid, w, t.ce_weight, t.tv_weight, kernel)
             for name in TERMS if name in out}
    final = out.get("refined", out["base"])
    return _total(terms, anchor_w, t, final.detach().argmax(-1), out["base"].detach().argmax(-1), labels, valid)


def _total(terms: dict[str, dict[str, torch.Tensor]], anchor_w: float, t, final: torch.Tensor, base: torch.Tensor,
           labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 15 from the terms, and the log: the terms, the loss and the teacher-forced acceptance of the final
    and (with a head) the base argmax ids ``final``, ``base`` [n, P]."""
    if "refined" in terms:
        total = terms["refined"]["loss"] + anchor_w * terms["base"]["loss"]
        if "consistency" in terms:
            total = total + t.consistency_weight * terms["consistency"]["loss"]
    else:
        total = terms["base"]["loss"]
    logs = {f"{name}_{k}": v.item() for name, d in terms.items() for k, v in d.items()}
    per_pos, tf_tau = acceptance_of_choices(final, labels, valid)
    logs.update(loss=total.item(), tf_tau=tf_tau, tf_accept=per_pos.tolist(), anchor_weight=anchor_w)
    if "refined" in terms:
        logs["tf_tau_base"] = acceptance_of_choices(base, labels, valid)[1]
    return total, logs


# ------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def tau_by_decoding(target, drafter: ModelDrafter, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """Greedy speculative decoding of ``prompts`` (batch 1): tau = committed tokens per verification."""
    from ..decoding import generate_speculative

    tokens = steps = 0
    for p in prompts:
        g = generate_speculative(target, drafter, p, max_new_tokens)
        tokens += len(g.token_ids)
        steps += g.n_steps
    return {"tau": tokens / max(1, steps), "tokens": tokens, "steps": steps, "prompts": len(prompts)}


VAL_ANCHORS, VAL_BATCH = 16, 4  # teacher_forced_val's blocks: fixed, so runs of other shapes compare


@torch.no_grad()
def teacher_forced_val(module: CoTrainer, data: RegenData, cfg: Config, target=None,
                       rows: list[int] | None = None) -> dict[str, float]:
    """Teacher-forced acceptance on the WHOLE validation split (held-out regenerated sequences), with
    anchors drawn from a fixed generator so every evaluation scores the same blocks: ``tf_tau`` (the head's
    refined distribution, or the drafter's for ``dflash``), ``tf_tau_base`` (the drafter's) and the number
    of blocks. A low-noise training signal beside :func:`tau_by_decoding` (tens of thousands of positions
    instead of a few prompts); it measures generalisation, which the training batches' ``tf_tau`` does not.
    ``rows``: score these sequences instead (e.g. training ones, to measure the generalisation gap).

    Always in float32, without autocast, whoever calls it: ``accelerate`` turns a prepared module's
    ``forward`` into one under bf16 autocast where training uses it, so a stage's own validation used to score
    its weights under autocast and a later rescoring of the same checkpoint without (2.3571 against 2.3598
    teacher-forced tau for the same xPress weights, 2 of 742 blocks). The class's ``forward`` is called
    directly, past that wrapper, with autocast off, and with ``train.attention_kernel``'s attention."""
    rows = data.indices("val") if rows is None else rows
    if not rows:
        return {}
    # the same blocks whatever the training batch shape: VAL_ANCHORS anchors per sequence, fixed batch
    cfg = replace(cfg, train=replace(cfg.train, anchors_per_seq=VAL_ANCHORS, batch_size=VAL_BATCH))
    was_training = module.training
    module.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    device = next(module.parameters()).device
    P = cfg.drafter.block_size - 1
    labels, base, final, valid = [], [], [], []
    for i in range(0, len(rows), cfg.train.batch_size):
        batch = make_batch(data, rows[i:i + cfg.train.batch_size], cfg, gen, target=target).to(device)
        with torch.autocast(device.type, enabled=False):
            out = type(module).forward(module, batch, consistency=False,  # not the instance's autocast wrapper
                                       attention=cfg.train.attention_kernel)
        labels.append(module.vocab.to_draft(batch.labels.reshape(-1, P)))
        valid.append(batch.label_valid.reshape(-1, P))
        base.append(out["base"].argmax(-1))
        final.append(out.get("refined", out["base"]).argmax(-1))
    module.train(was_training)
    labels, valid = torch.cat(labels), torch.cat(valid)
    full = valid.all(-1)

    def tau(choice: list[torch.Tensor]) -> float:
        run = ((torch.cat(choice) == labels) & valid).long().cumprod(-1)
        return 1.0 + run[full].float().sum(-1).mean().item() if bool(full.any()) else math.nan

    return {"tf_tau": tau(final), "tf_tau_base": tau(base), "blocks": int(full.sum())}


@torch.no_grad()
def accepted_at(module: CoTrainer, data: RegenData, cfg: Config, row: int, anchors: Sequence[int], k: int,
                target=None, chunk: int = 64) -> torch.Tensor:
    """Teacher-forced accepted drafts at ``anchors`` (positions in regenerated sequence ``row``, each with its
    next ``k`` tokens inside the first ``train.max_len``): [len(anchors)] int64, each in 0..k, how many of the
    block's first ``k`` choices (the head's refined argmax given the sequence's tokens before it; the
    drafter's for dflash) equal the sequence's next tokens, in a row. At T = 0 this is what a decoding round
    anchored there accepts: a refined position reads the tokens before it, which are the sequence's wherever
    the round is still accepting."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    out = []
    for s in range(0, len(anchors), chunk):
        part = list(anchors[s:s + chunk])
        c = replace(cfg, train=replace(cfg.train, anchors_per_seq=len(part)))
        batch = make_batch(data, [row], c, torch.Generator(), anchors=[part], target=target).to(device)
        got = module(batch, consistency=False)
        choice = got.get("refined", got["base"]).argmax(-1)[:, :k]  # [n, k]
        labels = module.vocab.to_draft(batch.labels.reshape(len(part), -1))[:, :k]
        hit = (choice == labels) & batch.label_valid.reshape(len(part), -1)[:, :k]
        out.append(hit.long().cumprod(-1).sum(-1).cpu())
    module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- stages
# train keys that only a stage with a head reads (or, for ``steps``, that the warm start does not run)
COTRAINING_ONLY = ("steps", "consistency_weight", "anchor_weight_start", "anchor_weight_end", "refiner_only")
# train keys added after checkpoints were first signed, and the value that reproduces what ran before them: at
# that value a key is left out of the signature, so those checkpoints still continue their stages
UNSIGNED_AT = {"loss_kernel": "torch", "attention_kernel": "torch"}
# train keys that change nothing a stage computes, never signed
UNSIGNED = ("snapshot_steps",)


def kernels_ran(train_cfg, device) -> dict[str, str]:
    """Which path each :data:`UNSIGNED_AT` computation takes here, ``"fused"`` or ``"torch"`` (recorded with a stage)."""
    return {k: kernels.for_training_name(getattr(train_cfg, k), device) for k in UNSIGNED_AT}


def stage_signature(cfg: Config, stage: str, method: str, steps: int, init: str | None,
                    every_key: bool = False, init_as_given: bool = False) -> dict[str, Any]:
    """What makes a stage's result: config sections, data, method, steps and its starting point.

    A plain drafter trained from scratch (the warm start, a from-scratch lever) reads neither the head
    section nor the co-training keys (:data:`COTRAINING_ONLY`), so changing those does not retrain it. A
    co-training stage keeps all of ``train``: it names its start only by folder, and ``warm_start_steps``
    and the rest of the recipe stand in for what that folder holds. ``every_key``: keep them all, as
    checkpoints written before 2026-12-04 were signed (still accepted: :func:`run_stage`). ``init`` is signed
    as :func:`xpress.paths.portable` shows it, so that a moved clone resumes; ``init_as_given``: the path
    as passed, as checkpoints written before 2026-12-05 were signed (still accepted). Keys of :data:`UNSIGNED_AT`
    at their earlier value are left out."""
    train, head = asdict(cfg.train), asdict(cfg.head)
    train = {k: v for k, v in train.items() if k not in UNSIGNED and (k not in UNSIGNED_AT or UNSIGNED_AT[k] != v)}
    if method == "dflash" and init is None and not every_key:
        train = {k: v for k, v in train.items() if k not in COTRAINING_ONLY}
        head = None
    if init is not None and not init_as_given:
        init = paths.portable(init)
    return {"stage": stage, "method": method, "steps": steps, "init": init, "seed": cfg.seed,
            "drafter": asdict(cfg.drafter), "head": head, "train": train,
            "data": config_hash(regen_signature(cfg))}


def checkpoint_dir(cfg: Config, stage: str) -> Path:
    return paths.CHECKPOINTS / cfg.preset / stage


def snapshot_dir(cfg: Config, stage: str, step: int) -> Path:
    """Where ``train.snapshot_steps`` keeps the stage's drafter and head at ``step``."""
    return paths.CHECKPOINTS / cfg.preset / f"{stage}-step{step}"


def read_state(folder: Path) -> dict | None:
    """The stage state of a checkpoint folder (None if absent); a corrupt one is a TrainingError."""
    f = folder / STATE_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"{f} is unreadable ({e.__class__.__name__}); remove {folder} or pass --overwrite") from None


def _save(folder: Path, module: CoTrainer, vocab: DraftVocab, method: str, optimizer, step: int,
          steps: int, signature: dict, log: list[dict], extra: dict) -> None:
    from ..utils import atomic_dir, atomic_write_json

    with atomic_dir(folder) as tmp:
        save_drafter(tmp, module.drafter, module.head, vocab, method)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "log": log}, tmp / TRAINER_FILE)
        atomic_write_json(tmp / STATE_FILE, {"method": method, "step": step, "steps": steps,
                                              "complete": step >= steps, "signature": signature,
                                              "signature_hash": config_hash(signature),
                                              "fingerprint": checkpoint_fingerprint(tmp), **extra})


def _lr(step: int, steps: int, cfg: Config) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine decay to 0."""
    warm = max(1, int(cfg.train.warmup_frac * steps))
    if step < warm:
        return cfg.train.lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return cfg.train.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def resolve_mixed_precision(name: str) -> str:
    """``train.mixed_precision`` for accelerate: ``auto`` is bf16 autocast where this machine multiplies bf16
    natively (a GPU, or a CPU with AVX512-BF16 or AMX), else float32 ("no")."""
    from ..runtime import native_bf16

    if name == "auto":
        return "bf16" if native_bf16() else "no"
    return name


def _accepted_signatures(cfg: Config, stage: str, method: str, steps: int, init: str | None) -> list[dict]:
    """The signatures under which a checkpoint continues this stage: today's, and the older forms
    (:func:`stage_signature`'s ``every_key`` and ``init_as_given``)."""
    return [stage_signature(cfg, stage, method, steps, init, every_key=e, init_as_given=g)
            for e in (False, True) for g in (False, True)]


def _resumable_state(folder: Path, signatures: list[dict], overwrite: bool) -> dict | None:
    """The state of ``folder``'s checkpoint if it continues this stage (one of its ``signatures``), else None;
    a checkpoint of another signature is a TrainingError unless ``overwrite`` (then the stage starts over)."""
    state = read_state(folder)
    if state is not None and state.get("signature_hash") not in {config_hash(s) for s in signatures}:
        if not overwrite:
            raise TrainingError(f"{folder} holds a checkpoint of another config or method (method {state.get('method')!r}, "
                                f"step {state.get('step')}); remove it or pass --overwrite to start over")
        return None
    return state


def _starting_point(cfg: Config, folder: Path, state: dict | None, method: str, target, vocab: DraftVocab,
                    init: str | None) -> tuple[ModelDrafter, dict | None, int, list[dict]]:
    """(drafter, trainer state, first step, log so far): the checkpoint's when ``state`` says one is there,
    else a fresh drafter (its plain-drafter weights from ``init``, or from the target's layers when
    ``drafter.init_from_target``), step 0 and an empty log."""
    if state is not None:
        try:
            drafter = load_drafter(folder, method, cfg, target, dtype=torch.float32)  # the saved master weights
            trainer_state = torch.load(folder / TRAINER_FILE, weights_only=False)
        except Exception as e:  # a truncated or foreign file: one clear line
            raise TrainingError(f"checkpoint {folder} is corrupt or incomplete ({e.__class__.__name__}: "
                                f"{str(e).splitlines()[0][:200]}); remove it or pass --overwrite") from None
        if drafter.vocab != vocab:
            raise TrainingError(f"{folder} was trained with another draft vocabulary; pass --overwrite")
        return drafter, trainer_state, int(trainer_state["step"]), list(trainer_state["log"])
    drafter = new_drafter(method, cfg, target, vocab, seed=cfg.seed)
    if init is not None:
        try:  # a checkpoint folder (the warm start), or a released drafter (folder or hub id)
            warm = DFlashDraftModel.from_pretrained(init, target=target, dtype=torch.float32)
        except Exception as e:
            raise TrainingError(f"cannot start from {init} ({e.__class__.__name__}: {str(e).splitlines()[0][:200]})") from None
        drafter.drafter.load_state_dict(warm.state_dict())
    elif cfg.drafter.init_from_target:
        init_from_target_layers(drafter.drafter, target)
    return drafter, None, 0, []


def training_rows(cfg: Config, data: RegenData) -> list[int]:
    """The regenerated sequences a stage trains on: the training split, or its first
    ``train.train_sequences`` (a prefix, so that smaller sets nest, for the data-scaling curve)."""
    rows = data.indices("train")
    if cfg.train.train_sequences:
        if cfg.train.train_sequences > len(rows):
            raise TrainingError(f"train.train_sequences={cfg.train.train_sequences} exceeds the {len(rows)} "
                                f"regenerated training sequences; lower it or raise data.n_train_prompts")
        rows = rows[:cfg.train.train_sequences]
    if not rows:
        raise TrainingError(f"{data.folder} holds no training sequences")
    return rows


def step_rows(train_rows: list[int], cfg: Config, step: int, rank: int, world: int) -> list[int]:
    """This rank's ``train.batch_size`` sequences at ``step``: one draw of ``batch_size x world`` rows from
    (seed, step) alone, split by rank: a resumed run draws what the uninterrupted one did, and no two ranks
    depend on each other's state."""
    pick = torch.randint(len(train_rows), (cfg.train.batch_size * world,), generator=step_generator(cfg.seed, step, -1))
    return [train_rows[i] for i in pick[rank * cfg.train.batch_size:(rank + 1) * cfg.train.batch_size].tolist()]


def train_step(model, optimizer, accelerator, params: list, batch: Batch, vocab: DraftVocab, readout: torch.Tensor,
               cfg: Config, step: int, steps: int, consistency: bool) -> tuple[dict[str, Any], torch.Tensor]:
    """One optimiser step at ``step`` of ``steps``: the scheduled learning rate and anchor weight, the
    forward and loss under the accelerator's autocast, backward, gradient clipping. Returns (the loss's
    log entries, the gradient norm before clipping)."""
    for g in optimizer.param_groups:
        g["lr"] = _lr(step, steps, cfg)
    aw = anchor_weight(step, steps, cfg.train.anchor_weight_start, cfg.train.anchor_weight_end)
    with accelerator.autocast():
        out = model(batch, consistency=consistency, chunks=LossChunks.of(cfg, readout))
        loss, logs = compute_loss(out, batch, vocab, readout, cfg, aw)
    optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_(params, cfg.train.grad_clip)
    optimizer.step()
    return logs, grad_norm


def trainable_module(cfg: Config, drafter: ModelDrafter, method: str) -> CoTrainer:
    """The module that trains: the drafter and its head in a :class:`CoTrainer`, in training mode, with float32
    master weights whatever the target's dtype (a bf16 target computes under autocast; AdamW's updates of
    lr 6e-4 would fall below bf16's spacing near 1), the drafter's layers recomputed in backward where
    ``train.gradient_checkpointing`` says; with ``train.refiner_only`` the drafter is frozen. The target's
    embedding and LM head it borrows stay in the target's dtype and on its device."""
    module = CoTrainer(drafter.drafter, drafter.head, drafter.vocab, cfg.train.attention_kernel).float().train()
    module.drafter.gradient_checkpointing = cfg.train.gradient_checkpointing
    if cfg.train.refiner_only and method != "dflash":
        module.drafter.requires_grad_(False)  # only the head trains; the anchor term then has no effect
    return module


def build_trainable(cfg: Config, method: str, target=None, vocab: DraftVocab | None = None) -> CoTrainer:
    """The module a stage of ``method`` trains (:func:`trainable_module`) over a fresh drafter, for a check of
    what trains (its parameters' dtypes and devices): the preset's target is loaded on this process's device
    unless given; ``vocab``: the draft vocabulary (default: :func:`xpress.proposer.default_vocab`, the full
    vocabulary where ``drafter.draft_vocab_size`` is 0)."""
    from ..proposer import default_vocab
    from ..targets import load_target

    if method not in METHODS:
        raise TrainingError(f"method={method!r}: use one of {', '.join(METHODS)}")
    distributed.local_device(cfg.target.device)
    target = target or load_target(cfg)
    return trainable_module(cfg, new_drafter(method, cfg, target, vocab or default_vocab(cfg, target), seed=cfg.seed),
                            method)


def _trainable(cfg: Config, drafter: ModelDrafter, method: str, trainer_state: dict | None, accelerator
               ) -> tuple[CoTrainer, Any, Any, list]:
    """(module, the accelerator's model and optimizer, the trained parameters) for a stage: the drafter and
    its head in a :class:`CoTrainer` (the head alone trains with ``train.refiner_only``), AdamW resumed
    from ``trainer_state`` when there is one."""
    module = trainable_module(cfg, drafter, method)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    if trainer_state is not None:
        optimizer.load_state_dict(trainer_state["optimizer"])
    model, optimizer = accelerator.prepare(module, optimizer)
    return module, model, optimizer, params


def _validate(module: CoTrainer, method: str, vocab: DraftVocab, cfg: Config, data: RegenData, target,
              prompts: list) -> dict[str, float] | None:
    """The stage's validation: tau by decoding ``prompts`` (the first ``train.eval_prompts`` validation
    prompts) and the teacher-forced scores of the validation split (keys ``val_*``); None without prompts.
    The module is back in training mode afterwards."""
    if not prompts:
        return None
    tf = teacher_forced_val(module, data, cfg, None if data.has_states else target)
    module.eval()
    md = ModelDrafter(module.drafter, module.head, vocab, method, cfg.head.max_iters)
    result = tau_by_decoding(target, md, prompts, cfg.train.eval_max_new_tokens)
    module.train()
    return {**result, **{f"val_{k}": v for k, v in tf.items()}}


def _save_rank_weights(folder: Path, module: CoTrainer, rank: int, accelerator) -> None:
    """``rank<r>.safetensors``: this process's own weights, for the tests that check the ranks stay equal."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
              str(folder / f"rank{rank}.safetensors"))
    accelerator.wait_for_everyone()


@dataclass
class _StageRun:
    """One stage's training, set up: the module and its optimizer, the data and what a step, a checkpoint and
    a validation need. :func:`run_stage` opens it (:meth:`open`), runs its steps and writes its summary."""
    cfg: Config
    stage: str
    method: str
    steps: int
    folder: Path
    signature: dict
    accelerator: Any
    data: RegenData
    target: Any
    vocab: DraftVocab
    coverage: dict
    module: CoTrainer
    model: Any
    optimizer: Any
    params: list
    readout: torch.Tensor  # [Vd, H]: the target's LM head rows of the draft vocabulary
    train_rows: list[int]
    start: int
    log: list[dict]

    @classmethod
    def open(cls, cfg: Config, stage: str, method: str, steps: int, folder: Path, signature: dict,
             state: dict | None, init: str | None, target, data: RegenData | None, accelerator) -> "_StageRun":
        """The stage from its checkpoint (``state``) or from ``init`` / a fresh drafter; every rank agrees on
        the configuration first."""
        from ..targets import load_target

        distributed.local_device(cfg.target.device)  # this rank's GPU, before anything is loaded
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg.train.mixed_precision),
                                      cpu=not torch.cuda.is_available())
        distributed.agree("config hash", config_hash(signature),
                          "launch every rank with the same --preset, --method and overrides")
        data = data or RegenData.load(cfg)
        target = target or load_target(cfg)
        vocab, coverage = build_vocab(cfg, target, data)
        drafter, trainer_state, start, log = _starting_point(cfg, folder, state, method, target, vocab, init)
        module, model, optimizer, params = _trainable(cfg, drafter, method, trainer_state, accelerator)
        readout = target.lm_head().weight.detach()[vocab.d2t.to(target.device)].to(accelerator.device)
        return cls(cfg, stage, method, steps, folder, signature, accelerator, data, target, vocab, coverage,
                   module, model, optimizer, params, readout, training_rows(cfg, data), start, log)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def evaluate(self) -> dict[str, float] | None:
        """The validation (:func:`_validate`) on the main process; None elsewhere."""
        if not self.main:
            return None
        prompts = self.data.prompts("val")[:self.cfg.train.eval_prompts]
        return _validate(self.module, self.method, self.vocab, self.cfg, self.data, self.target, prompts)

    def save(self, step: int) -> None:
        _save(self.folder, self.module, self.vocab, self.method, self.optimizer, step, self.steps, self.signature,
              self.log, {"vocab": self.coverage})

    def step(self, step: int) -> tuple[dict[str, Any], torch.Tensor, int]:
        """Optimiser step ``step`` on this rank's batch: (its log entries, the gradient norm, the supervised
        tokens over all ranks)."""
        cfg, acc = self.cfg, self.accelerator
        world, rank = acc.num_processes, acc.process_index
        batch = make_batch(self.data, step_rows(self.train_rows, cfg, step, rank, world), cfg,
                           step_generator(cfg.seed, step, rank), target=self.target).to(acc.device)
        consistency = cfg.train.consistency_weight > 0 and self.method != "dflash"  # dflash has no head
        logs, grad_norm = train_step(self.model, self.optimizer, acc, self.params, batch, self.vocab, self.readout,
                                     cfg, step, self.steps, consistency)
        return logs, grad_norm, int(batch.label_valid.sum()) * world

    def run(self, end: int, progress: bool) -> tuple[int, bool]:
        """Steps from :attr:`start` to ``end``, logging every ``train.log_every`` (with a validation every
        ``train.eval_every``) and checkpointing every ``train.checkpoint_every``. Ctrl-C stops at the next
        step boundary. Returns (the step reached, whether it was interrupted)."""
        from tqdm.auto import tqdm

        t = self.cfg.train
        bar = tqdm(total=self.steps, initial=self.start, desc=f"train {self.stage}", unit="step",
                   disable=not (progress and self.main), dynamic_ncols=True)
        t_last, tokens_since = time.perf_counter(), 0
        step, interrupted = self.start, False
        with DeferredInterrupt() as stop:
            try:
                while step < end and not stop.requested:
                    logs, grad_norm, tokens = self.step(step)
                    step += 1
                    tokens_since += tokens
                    bar.update(1)
                    if step % t.log_every == 0 or step == self.steps:
                        now = time.perf_counter()
                        row = {"step": step, "lr": self.optimizer.param_groups[0]["lr"],
                               "grad_norm": float(grad_norm), "tokens_per_s": tokens_since / max(now - t_last, 1e-9),
                               **logs}
                        t_last, tokens_since = now, 0
                        if t.eval_every and step % t.eval_every == 0 and step < self.steps:
                            row["val"] = self.evaluate()
                        self.log.append(row)
                        bar.set_postfix(loss=f"{logs['loss']:.3f}", tf_tau=f"{logs['tf_tau']:.2f}",
                                        tok_s=f"{row['tokens_per_s']:.0f}")
                    if self.main and step % t.checkpoint_every == 0 and step < end:
                        self.save(step)
                    if self.main and step in t.snapshot_steps and step < self.steps and self.stage != WARM_START:
                        save_drafter(snapshot_dir(self.cfg, self.stage, step), self.module.drafter,
                                     self.module.head, self.vocab, self.method)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                bar.close()
        return step, interrupted or stop.requested

    def summary(self, step: int, interrupted: bool, final_eval: dict | None, seconds: float) -> dict[str, Any]:
        """The stage summary ``run_stage`` returns (and ``train_<stage>.json`` holds)."""
        return {"stage": self.stage, "method": self.method, "step": step, "steps": self.steps,
                "complete": step >= self.steps, "interrupted": interrupted, "seconds": seconds,
                "vocab": self.coverage, "mixed_precision": self.accelerator.mixed_precision,
                **kernels_ran(self.cfg.train, self.accelerator.device),
                "train_sequences": len(self.train_rows),
                "train_response_tokens": self.data.answer_tokens(self.train_rows),
                "final_val": final_eval, "checkpoint": paths.portable(self.folder),
                "fingerprint": (read_state(self.folder) or {}).get("fingerprint"), "skipped": False}


def run_stage(cfg: Config, stage: str, method: str, steps: int, *, target=None, data: RegenData | None = None,
              init: str | None = None, progress: bool = True, overwrite: bool = False,
              stop_after: int | None = None, accelerator=None, write_log: bool = True) -> dict[str, Any]:
    """Train one stage to ``steps`` steps, resuming its checkpoint; returns the stage summary.

    ``init``: a checkpoint folder whose DRAFTER weights start this stage (the head starts fresh), or
    None for a fresh drafter. ``stop_after``: stop (with a checkpoint) once this step is reached, as an
    interruption would. ``write_log``: write ``results/<preset>/train_<stage>.{json,csv}`` (off for
    probes). A complete stage of the same signature is skipped.
    """
    if method not in METHODS:
        raise TrainingError(f"method={method!r}: use one of {', '.join(METHODS)}")
    folder = checkpoint_dir(cfg, stage)
    signature = stage_signature(cfg, stage, method, steps, init)
    state = _resumable_state(folder, _accepted_signatures(cfg, stage, method, steps, init), overwrite)
    if state is not None and state.get("complete"):
        return {"stage": stage, "method": method, "skipped": True, **state}

    run = _StageRun.open(cfg, stage, method, steps, folder, signature, state, init, target, data, accelerator)
    t_stage = time.perf_counter()
    step, interrupted = run.run(steps if stop_after is None else min(steps, stop_after), progress)
    final_eval = run.evaluate() if step >= steps and not interrupted else None
    if final_eval is not None and run.log:
        run.log[-1]["val"] = final_eval
    if run.main:
        run.save(step)
    run.accelerator.wait_for_everyone()
    if os.environ.get("XPRESS_SAVE_EVERY_RANK") == "1":  # tests: each process's own weights (DDP keeps them equal)
        _save_rank_weights(folder, run.module, run.accelerator.process_index, run.accelerator)
    summary = run.summary(step, interrupted, final_eval, time.perf_counter() - t_stage)
    if run.main and write_log:
        _write_stage_log(cfg, stage, summary, run.log, signature, run.accelerator.num_processes)
    if interrupted:
        raise KeyboardInterrupt
    return summary


def _write_stage_log(cfg: Config, stage: str, summary: dict, log: list[dict], signature: dict, world: int) -> None:
    """``results/<preset>/train_<stage>.json`` (summary, log, signature, provenance) and its log as CSV."""
    from ..utils import atomic_write_json, atomic_write_text, provenance

    out = paths.RESULTS / cfg.preset
    atomic_write_json(out / f"train_{stage}.json", {**summary, "log": log, "signature": signature,
                                                    "provenance": provenance(cfg.preset, world_size=world)})
    atomic_write_text(out / f"train_{stage}.csv", _csv(log))


def _csv(log: list[dict]) -> str:
    import csv
    import io

    flat = []
    for row in log:
        r = {k: v for k, v in row.items() if k not in ("tf_accept", "val")}
        r.update({f"tf_accept_{k + 1}": a for k, a in enumerate(row.get("tf_accept", []))})
        if row.get("val"):
            r["val_tau"] = row["val"]["tau"]
            r.update({k: v for k, v in row["val"].items() if k.startswith("val_tf")})
        flat.append(r)
    keys = list(dict.fromkeys(k for r in flat for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(flat)
    return buf.getvalue()


def train(cfg: Config, method: str, *, progress: bool = True, overwrite: bool = False,
          stop_after: int | None = None) -> dict[str, Any]:
    """Train ``method`` on the preset: the shared warm start (if ``train.warm_start_steps``), then the
    method's co-training stage. Returns the summaries of both stages."""
    from ..targets import load_target

    distributed.local_device(cfg.target.device)  # cuda: this rank's own GPU (LOCAL_RANK), before any load
    data = RegenData.load(cfg)
    target = load_target(cfg)
    out: dict[str, Any] = {}
    init = None
    if cfg.drafter.checkpoint:  # a released dFlash drafter: every method starts from it, no warm start
        init = cfg.drafter.checkpoint
    elif cfg.train.warm_start_steps > 0:
        out[WARM_START] = run_stage(cfg, WARM_START, "dflash", cfg.train.warm_start_steps, target=target,
                                    data=data, progress=progress, overwrite=overwrite, stop_after=stop_after)
        if not out[WARM_START]["complete"] or (stop_after is not None and stop_after <= cfg.train.warm_start_steps):
            return out  # interrupted, or told to stop at the warm start's end: the method's stage is not opened
        init = str(checkpoint_dir(cfg, WARM_START))
        stop_after = None if stop_after is None else stop_after - cfg.train.warm_start_steps
    out[method] = run_stage(cfg, method, method, cfg.train.steps, target=target, data=data, init=init,
                            progress=progress, overwrite=overwrite, stop_after=stop_after)
    return out
