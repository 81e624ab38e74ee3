"""``ModelDrafter``: the dFlash drafter plus an optional correction head, behind the drafter protocol
(:mod:`xpress.protocol`), and its checkpoints.

Methods:
  ``dflash``  the plain drafter: greedy argmax of the base logits at T=0, independent samples of
              ``softmax(s / T)`` at T>0 (``q`` = that softmax).
  ``markov``  DSpark's Markov head, decoded left to right (B-1 serial steps).
  ``xpress``  the xPress refiner, resolved by Jacobi passes (at most K = ``cfg.head.max_iters``, adaptive);
              ``refine="sequential"`` decodes it left to right instead (the exact fixed point).

Checkpoint folder (``checkpoints/<preset>/<method>/`` by default): the released dFlash layout
(``config.json`` + ``model.safetensors``), ``draft_vocab.safetensors`` (absent: the full vocabulary, as for
a released dFlash checkpoint), and for a head ``head.json`` + ``head.safetensors``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from . import paths
from .drafter import CheckpointNotFoundError, ContextCache, DFlashConfig, DFlashDraftModel, DrafterMismatchError
from .heads import FoldedRefiner, MarkovHead, XPressRefiner
from .jacobi import (RefineResult, corrected_logits, distribution, gumbel_noise, jacobi_refine, jacobi_refine_one,
                     jacobi_rollout, select, sequential_refine)
from .protocol import Draft
from .utils import atomic_dir, atomic_save_safetensors, atomic_write_json, stage_clock
from .config import AUTO, parse_draft_tokens
from .verify_length import VerifyCosts, calibrate, draft_lengths
from .vocab import DraftVocab

__all__ = ["METHODS", "CheckpointNotFoundError", "CheckpointUnreadableError", "DrafterMismatchError", "ModelDrafter",
           "build_drafter", "new_drafter", "save_drafter", "load_drafter"]

METHODS = ("dflash", "markov", "xpress")  # the methods this module builds (xpress.methods.MODEL_METHODS names them too)
HEADS = {"markov": MarkovHead, "xpress": XPressRefiner}


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {', '.join(METHODS)}")


def train_hint(preset: str, method: str) -> str:
    """How to get a missing checkpoint, for error messages."""
    return (f"train one with `python -m xpress train --preset {preset} --method {method}` (after "
            f"`python -m xpress regenerate --preset {preset}`), or pass a checkpoint folder (--checkpoint)")


class ModelDrafter:
    """A :class:`DFlashDraftModel` (attached to its target) with the head of ``method``; fulfils
    :class:`xpress.protocol.Drafter` for a batch of sequences, ragged ones included (the context cache
    keeps padding entries as masked holes).

    ``max_iters``: K, the Jacobi budget (``cfg.head.max_iters``). ``weights``: ``"trained"`` (loaded from a
    checkpoint) or ``"untrained"`` (fresh), as reported by :func:`xpress.methods.drafter_weights`.
    ``draft_tokens``: k, how many of the B - 1 drafted tokens :meth:`propose` returns (the first k; 0 = all;
    ``cfg.decode.draft_tokens``). The block is drafted whole and refined only as far as its first k positions
    need (both heads are causal), so the k tokens and their ``q`` are those of the full draft. ``"auto"``:
    k is chosen per round and row from the drafter's base distribution and ``verify_costs``, before refining
    (:mod:`xpress.verify_length`; set by :func:`build_drafter` / :func:`new_drafter` from a calibration).
    """

    def __init__(self, drafter: DFlashDraftModel, head: XPressRefiner | MarkovHead | None, vocab: DraftVocab,
                 method: str, max_iters: int, refine: str = "jacobi", weights: str = "untrained",
                 draft_tokens: int = 0):
        _check_method(method)
        wanted = HEADS.get(method, type(None))
        if not isinstance(head, wanted):
            raise ValueError(f"method {method!r} takes a {wanted.__name__} head, got {type(head).__name__}")
        if refine not in ("jacobi", "sequential"):
            raise ValueError(f"refine={refine!r}: use jacobi or sequential")
        if weights not in ("trained", "untrained"):
            raise ValueError(f"weights={weights!r}: use trained or untrained")
        if head is not None and head.vocab != vocab:
            raise ValueError("the head was built for another draft vocabulary")
        if isinstance(head, XPressRefiner) and head.positions != drafter.block_size - 1:
            raise ValueError(f"the refiner mixes {head.positions} positions, the drafter drafts {drafter.block_size - 1}")
        self.drafter, self.head, self.vocab = drafter, head, vocab
        self.method, self.max_iters, self.refine, self.weights = method, max_iters, refine, weights
        self.block_size = drafter.block_size
        self.auto = parse_draft_tokens(draft_tokens, self.block_size) == AUTO
        self.draft_tokens = self.block_size - 1 if self.auto else (draft_tokens or self.block_size - 1)
        self.verify_costs: VerifyCosts | None = None  # auto: what a round costs (verify_length.calibrate)
        self.fingerprint: str | None = None  # checkpoint_fingerprint() of the folder it was loaded from
        self.context: ContextCache | None = None  # set by reset()
        self.compiled_refine = None  # compile(): the fixed-pass rollout, torch.compile'd
        self.compiled_draft = None  # compile(): the drafter's forward and base readout, torch.compile'd

    def compile(self, backend: str = "inductor") -> "ModelDrafter":
        """The compiled harness (``decode.compile``): refine with the fixed-pass rollout (:meth:`fixed_refine`),
        ``torch.compile``'d for its fixed shapes (a CUDA graph on CUDA: :func:`xpress.compiled.compile_fn`; the
        tokens are those of the adaptive refinement, :func:`xpress.jacobi.jacobi_rollout`), and draft with
        :meth:`draft_block` compiled with symbolic shapes (the context grows every round, so no graph).
        ``refine="sequential"`` keeps the eager refinement."""
        from .compiled import compile_fn

        if self.refine == "jacobi":
            self.compiled_refine = compile_fn(self.fixed_refine, self.device, backend)
        self.compiled_draft = compile_fn(self.draft_block, self.device, backend, dynamic=True)
        return self

    def draft_block(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, context: ContextCache,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block after ``anchor`` [b] at ``anchor_pos`` [b]: its states h [b, P, H] and the base
        logits [b, k, Vd] of the first ``k`` positions (k passed in: copies that share the networks, as
        :func:`xpress.studies.draft_length.at_lengths` makes, share this compiled function too)."""
        h = self.drafter(anchor[:, None], anchor_pos[:, None], context)[:, 0, 1:]  # [b, P, H]
        return h, self.drafter.base_logits(h[:, :k], self.vocab)

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    # ------------------------------------------------------------------------------------- protocol
    def reset(self, prompt_ids: list[list[int]]) -> None:
        """Start ``len(prompt_ids)`` sequences with an empty context."""
        self.context = self.drafter.empty_context(len(prompt_ids), self.device)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        """Append the target ``features`` [b, n, F] of committed tokens at ``positions`` [b, n]; ``valid``
        [b, n] False marks padding (kept as masked entries). The drafter reads features only, not ``tokens``."""
        if self.context is None:
            raise RuntimeError("call reset() before extend()")
        self.context = self.context.append(self.drafter.encode_context(features, positions, valid))

    @torch.no_grad()
    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Draft:
        """Draft k = ``draft_tokens`` tokens after ``anchor`` [b] at ``anchor_pos`` [b]: tokens [b, k] target
        ids, ``q`` [b, k, V] float32 (None at T=0), timings (s) ``draft`` (drafter forward, base readout, mapping to
        target ids) and ``refine`` (this method's token choice: head, Jacobi passes), stats ``iters`` [b]. On
        CUDA the timings are :class:`xpress.utils.EventSpan` values (``float()`` reads them back)."""
        if self.context is None:
            raise RuntimeError("call reset() before propose()")
        sw = stage_clock(self.device)  # on CUDA: event spans, read back by the caller
        stats: dict[str, Any] = {}
        with sw("draft"):
            h, base = (self.compiled_draft or self.draft_block)(anchor, anchor_pos, self.context,
                                                                self.draft_tokens)  # [b, P, H], [b, k, Vd]
            if self.auto:  # the verify length from the drafter's confidence, before any token is drawn
                if self.verify_costs is None:
                    raise RuntimeError("decode.draft_tokens=auto needs verify_costs (xpress.verify_length.calibrate)")
                t = temperature if temperature > 0 else 1.0
                confidence = torch.softmax(base.float() / t, dim=-1).amax(-1)  # [b, P]
                lengths = draft_lengths(confidence, self.verify_costs)  # [b]
                base = base[:, :int(lengths.max())]  # [b, k, Vd]: only these positions are refined
                stats["draft_k"] = lengths
        with sw("refine"):
            result = self.refine_block(h, base, anchor, temperature, generator)
            stats["iters"] = result.iters
        with sw("draft"):
            tokens = self.vocab.to_target(result.tokens)
            q = None if result.q is None else self.vocab.to_target_probs(result.q)
        ragged = self.auto and bool((lengths < base.shape[1]).any())  # rows that verify fewer than the block's k
        return Draft(tokens=tokens, q=q, timings=sw.pop(), stats=stats, lengths=lengths if ragged else None)

    def refine_block(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, temperature: float,
                     generator: torch.Generator | None = None) -> RefineResult:
        """This method's tokens for the first k positions of a block: drafter states h [b, P, H] (all P:
        the refiner reads their mean) and those positions' base logits [b, k, Vd] (draft ids; k <= P) ->
        tokens [b, k]. Both heads are causal (position i reads the tokens before it and the block's states),
        so the first k positions alone are refined, and are what the whole block's refinement gives them:
        k sequential steps, or at most k Jacobi passes (Theorem 1), on k positions."""
        (b, k, vd), p = base.shape, h.shape[1]
        # T > 0: the whole block's Gumbel noise, of which the first k positions read theirs, so that the k
        # tokens are the full draft's first k under the same generator
        noise = None if temperature <= 0 else gumbel_noise((b, p, vd), generator, base.device)[:, :k]
        if self.compiled_refine is not None:
            weights = self.head.folded_weights() if self.method == "xpress" else ()  # cached, outside the graph
            return self.compiled_refine(h, base, anchor, temperature, noise, *weights)
        if self.method == "dflash":
            q = None if noise is None else distribution(base, temperature)
            iters = torch.zeros(b, dtype=torch.int64, device=base.device)
            return RefineResult(select(base, temperature, noise), q, iters)
        correction = self.head.fold(h)
        if self.method == "markov" and noise is None and b == 1:  # one block at T=0: one call where it applies
            tokens = correction.steps(anchor, base)
            if tokens is not None:
                return RefineResult(tokens, None, torch.full((1,), k, dtype=torch.int64, device=base.device))
        if k < p and self.method == "xpress":
            correction = correction.first(k)
        logits_fn = corrected_logits(base, correction)
        if self.method == "markov" or self.refine == "sequential":
            return sequential_refine(logits_fn, base, anchor, temperature, noise=noise, vocab=self.vocab)
        if b == 1 and min(self.max_iters, k) >= 1:  # one block: the same passes without the batch's bookkeeping
            return jacobi_refine_one(correction, base, anchor, min(self.max_iters, k), temperature, noise,
                                     vocab=self.vocab)
        return jacobi_refine(logits_fn, base, anchor, min(self.max_iters, k), temperature, noise=noise,
                             vocab=self.vocab)

    def fixed_refine(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, temperature: float,
                     noise: torch.Tensor | None, *folded: torch.Tensor) -> RefineResult:
        """:meth:`refine_block` without a data-dependent exit or host read, for a compiled graph: dflash selects
        from the base logits; markov decodes its k positions left to right (k fixed steps); xpress runs
        ``min(K, k)`` dense Jacobi passes (:func:`xpress.jacobi.jacobi_rollout`). Products are plain
        ``F.linear`` readouts (what the compiler fuses), the same functions as the eager path's to float32
        rounding. ``folded``: :meth:`XPressRefiner.folded_weights` (xpress), computed outside the graph."""
        b, k, _ = base.shape
        if self.method == "dflash":
            q = None if noise is None else distribution(base, temperature)
            return RefineResult(select(base, temperature, noise), q, torch.zeros(b, dtype=torch.int64, device=base.device))
        head, vocab = self.head, self.vocab
        if self.method == "markov":
            def step(prev: torch.Tensor, rows: torch.Tensor, i: int) -> torch.Tensor:  # [b, Vd]
                return head.w_2(head.w_1(vocab.input_index(prev[:, i]))).float() + base[:, i]
            return sequential_refine(step, base, anchor, temperature, noise=noise, vocab=vocab)
        table, a_h, a_g, mixer = folded
        u = h @ a_h.T + h.mean(dim=1, keepdim=True) @ a_g.T  # [b, P, r]: XPressRefiner.fold's token-free part
        fold = FoldedRefiner(head, torch.einsum("dkj,bjd->bkd", mixer, u), mixer, table)
        if k < h.shape[1]:
            fold = fold.first(k)
        return jacobi_rollout(lambda prev: head.w_r(fold.latent(prev)).float() + base, base, anchor,
                              min(self.max_iters, k), temperature, noise, vocab=vocab)


# ------------------------------------------------------------------------------------- construction
def default_vocab(cfg, target) -> DraftVocab:
    """The full vocabulary when ``cfg.drafter.draft_vocab_size`` is 0, else a placeholder of that size: the
    lowest ids plus the EOS ids. Real runs pass ``DraftVocab.from_counts`` of the regenerated data."""
    size = cfg.drafter.draft_vocab_size
    if size == 0:
        return DraftVocab.full(target.vocab_size)
    return DraftVocab.from_counts(torch.zeros(target.vocab_size), size, always=target.eos_token_ids)


def new_head(method: str, cfg, drafter: DFlashDraftModel, vocab: DraftVocab) -> XPressRefiner | MarkovHead | None:
    """A fresh head for ``method`` (None for dflash), on the drafter's device and dtype."""
    _check_method(method)
    if method == "dflash":
        return None
    if method == "xpress":
        head = XPressRefiner(vocab, drafter.config.hidden_size, drafter.block_size - 1, cfg.head.rank)
    else:
        head = MarkovHead(vocab, cfg.head.markov_rank)
    return head.to(device=drafter.fc.weight.device, dtype=drafter.dtype)


def new_drafter(method: str, cfg, target, vocab: DraftVocab | None = None, seed: int = 0,
                refine: str = "jacobi") -> ModelDrafter:
    """A :class:`ModelDrafter` with fresh random weights (seeded), shaped by ``cfg`` for ``target``; the
    head starts as the identity correction. Tests and training start here."""
    _check_method(method)
    vocab = vocab or default_vocab(cfg, target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = DFlashDraftModel.from_target(target, cfg)
        head = new_head(method, cfg, net, vocab)
    return with_verify_costs(ModelDrafter(net, head, vocab, method, cfg.head.max_iters, refine,
                                          draft_tokens=cfg.decode.draft_tokens), target)


def with_verify_costs(drafter: ModelDrafter, target) -> ModelDrafter:
    """``drafter`` with its :class:`VerifyCosts` measured on ``target`` when it chooses its verify length
    (``decode.draft_tokens=auto``); unchanged otherwise."""
    if drafter.auto and drafter.verify_costs is None:
        drafter.verify_costs = calibrate(target, drafter)
    return drafter


# ------------------------------------------------------------------------------------------ checkpoint
def save_drafter(folder: str | os.PathLike, drafter_net: DFlashDraftModel, head: XPressRefiner | MarkovHead | None,
                 vocab: DraftVocab, method: str) -> Path:
    """Write a checkpoint folder in one atomic rename: ``config.json`` + ``model.safetensors`` (released
    dFlash layout), ``draft_vocab.safetensors``, and for a head ``head.json`` + ``head.safetensors``."""
    _check_method(method)
    folder = paths.resolve(folder)
    with atomic_dir(folder) as tmp:
        drafter_net.save_pretrained(tmp)
        vocab.save(tmp / "draft_vocab.safetensors")
        if head is not None:
            atomic_save_safetensors(tmp / "head.safetensors", head.state_dict(), metadata={"format": "pt"})
            atomic_write_json(tmp / "head.json", {"method": method, "class": type(head).__name__,
                                                  "config": head.config()})
    return folder


WEIGHT_FILES = ("model.safetensors", "head.safetensors", "draft_vocab.safetensors")


def checkpoint_fingerprint(folder: str | os.PathLike) -> str:
    """16 hex digits of SHA-256 over the tensors of a checkpoint folder's weight files (:data:`WEIGHT_FILES`,
    those present): each tensor's file, name, dtype, shape and bytes, in name order. Two folders with the same
    weights get the same fingerprint whatever else differs (file headers, config, trainer state), so that a
    study can name the drafters it decoded and a reader can tell whether two files decoded the same ones."""
    import hashlib

    from safetensors import safe_open

    folder = paths.resolve(folder)
    h = hashlib.sha256()
    for name in WEIGHT_FILES:
        if not (folder / name).is_file():
            continue
        with safe_open(str(folder / name), framework="pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                h.update(f"{name}/{key}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_block_size(net: DFlashDraftModel, cfg, source: str | os.PathLike) -> None:
    """Raise :class:`DrafterMismatchError` when the drafter loaded from ``source`` drafts blocks of another
    size than ``cfg.drafter.block_size``: the preset is the one source of truth for B."""
    have, want = net.block_size, cfg.drafter.block_size
    if have != want:
        raise DrafterMismatchError(
            f"the drafter at {source} was trained for block_size={have} (its config.json), but the preset "
            f"sets drafter.block_size={want}; use a checkpoint trained for block size {want}, or set "
            f"drafter.block_size={have}")


class CheckpointUnreadableError(DrafterMismatchError):
    """A checkpoint folder that cannot be used as asked: a truncated or foreign file, a broken JSON, a
    checkpoint of another method or preset. The message names the file, the problem and the fix."""


def _retrain_hint(folder: Path, cfg, method: str) -> str:
    return (f"delete the folder {folder} and retrain with `python -m xpress train --preset {cfg.preset} "
            f"--method {method}`, or pass --checkpoint a folder trained for {method} on this preset")


@contextmanager
def _reading(file: Path, folder: Path, cfg, method: str) -> Iterator[None]:
    """Turn a failure to read ``file`` of a checkpoint into one :class:`CheckpointUnreadableError` line;
    a mismatch with the target or the preset keeps its own message, with the fix appended."""
    try:
        yield
    except CheckpointNotFoundError:
        raise
    except DrafterMismatchError as e:
        raise CheckpointUnreadableError(f"{str(e).rstrip('.')}; or {_retrain_hint(folder, cfg, method)}") from None
    except Exception as e:  # truncated or random bytes, broken JSON, tensors of another shape
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise CheckpointUnreadableError(f"{file} is unreadable or does not fit this checkpoint "
                                        f"({e.__class__.__name__}: {detail}); {_retrain_hint(folder, cfg, method)}") from None


def _head_method(folder: Path, cfg, method: str) -> str | None:
    """The method named by the folder's ``head.json`` (None without one); a broken file is an error."""
    import json

    meta_file = folder / "head.json"
    if not meta_file.is_file():
        return None
    with _reading(meta_file, folder, cfg, method):
        return json.loads(meta_file.read_text()).get("method")


def load_drafter(folder: str | os.PathLike, method: str, cfg, target, refine: str = "jacobi",
                 dtype: torch.dtype | None = None) -> ModelDrafter:
    """Load a checkpoint folder written by :func:`save_drafter` (or a released dFlash folder for
    ``dflash``), checked against ``target`` and against ``cfg`` (block size; K = ``cfg.head.max_iters``), in
    ``dtype`` (default: the target's; training resumes its float32 master weights).
    Any file that cannot be read, and a checkpoint of another method, target or preset, raises
    :class:`CheckpointUnreadableError` naming the file and how to replace it."""
    import json

    from safetensors.torch import load_file

    _check_method(method)
    folder = paths.resolve(folder)
    saved = _head_method(folder, cfg, method)
    if saved is not None and saved != method:
        raise CheckpointUnreadableError(f"{folder} holds a {saved} checkpoint (its head.json), not {method}; pass "
                                        f"--checkpoint a folder trained for {method}, or train one with `python -m "
                                        f"xpress train --preset {cfg.preset} --method {method}`")
    with _reading(folder / "config.json", folder, cfg, method):
        DFlashConfig.from_json(json.loads((folder / "config.json").read_text()))
    with _reading(folder / "model.safetensors", folder, cfg, method):
        net = DFlashDraftModel.from_pretrained(folder, target=target, dtype=dtype)
        check_block_size(net, cfg, folder)
    vocab_file = folder / "draft_vocab.safetensors"
    with _reading(vocab_file, folder, cfg, method):
        vocab = DraftVocab.load(vocab_file) if vocab_file.is_file() else DraftVocab.full(target.vocab_size)
        if vocab.target_size != target.vocab_size:
            raise DrafterMismatchError(f"{vocab_file}: draft vocabulary of a {vocab.target_size}-token target, "
                                       f"but target {target.name!r} has {target.vocab_size}.")
    head = None
    if method != "dflash":
        meta_file, weights = folder / "head.json", folder / "head.safetensors"
        if not (meta_file.is_file() and weights.is_file()):
            raise CheckpointNotFoundError(
                f"{folder} holds a drafter but no {method} head ({meta_file.name} + {weights.name}); "
                f"{train_hint(cfg.preset, method)}")
        with _reading(weights, folder, cfg, method):
            head = HEADS[method](vocab, **json.loads(meta_file.read_text())["config"])
            head.load_state_dict(load_file(str(weights)))
            head = head.to(device=target.device, dtype=net.dtype)
    drafter = ModelDrafter(net, head, vocab, method, cfg.head.max_iters, refine, weights="trained",
                           draft_tokens=cfg.decode.draft_tokens)
    drafter.fingerprint = checkpoint_fingerprint(folder)
    return with_verify_costs(drafter, target)


def build_drafter(method: str, cfg, target, checkpoint: str | os.PathLike | None = None,
                  refine: str = "jacobi") -> ModelDrafter:
    """The trained drafter for ``method``: from ``checkpoint`` (a folder) or ``checkpoints/<preset>/<method>/``;
    for ``dflash`` with no such folder, from ``cfg.drafter.checkpoint`` (a released checkpoint: hub id or
    folder). Raises :class:`CheckpointNotFoundError` naming the path and how to get one, and
    :class:`DrafterMismatchError` when the checkpoint does not fit ``target`` or ``cfg.drafter.block_size``."""
    _check_method(method)
    folder = paths.resolve(checkpoint) if checkpoint else paths.CHECKPOINTS / cfg.preset / method
    if (folder / "config.json").is_file():
        return load_drafter(folder, method, cfg, target, refine)
    if method == "dflash" and cfg.drafter.checkpoint and not checkpoint:
        net = DFlashDraftModel.from_pretrained(cfg.drafter.checkpoint, target=target)
        check_block_size(net, cfg, cfg.drafter.checkpoint)
        return with_verify_costs(ModelDrafter(net, None, DraftVocab.full(target.vocab_size), method,
                                              cfg.head.max_iters, refine, weights="trained",
                                              draft_tokens=cfg.decode.draft_tokens), target)
    hint = (", or set drafter.checkpoint to a released dFlash checkpoint (hub id or folder, e.g. "
            "z-lab/Qwen3-8B-DFlash-b16 for Qwen3-8B)" if method == "dflash" else "")
    raise CheckpointNotFoundError(f"no {method} checkpoint at {folder}: {train_hint(cfg.preset, method)}{hint}")
