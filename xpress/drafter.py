"""The dFlash block-diffusion drafter (arXiv 2602.06036), compatible with the released checkpoints.

``DFlashDraftModel`` is a small Qwen3-style decoder (RMSNorm'd q/k per head, grouped-query attention,
SwiGLU MLP, pre-norm residual layers, rotary positions) with NO embedding and NO LM head of its own: it
reads its input embeddings from the target's frozen ``embed_tokens`` and scores with the target's frozen
``lm_head`` (:meth:`DFlashDraftModel.attach`); neither is saved with the drafter.

Shapes: ``b`` batch, ``L`` context length, ``nb`` blocks per sequence, ``B`` block size, ``H`` hidden,
``F = len(target_layer_ids) * H`` context-feature width, ``nh``/``kvh`` query/key-value heads, ``d`` head dim.

KV injection. A context token's target features become ``ctx = hidden_norm(fc(features))`` [b, L, H]
once; in EVERY layer the keys are ``cat(k_proj(ctx), k_proj(block))`` (each k_norm'd, then rotated at its
own absolute position) and the values likewise, while queries come from the block only. The context is
not updated from layer to layer, so its per-layer keys and values are computed once per token and cached
(:class:`ContextCache`). A block is ``[anchor, MASK x (B-1)]`` at positions ``anchor_pos .. +B-1``; it sees
the valid context keys strictly before the anchor and attends bidirectionally within itself. The hidden
state at block position ``k`` (after the final ``norm``) predicts the token AT ``anchor_pos + k`` (no shift);
base logits are read at positions ``1 .. B-1``.

One masked attention serves training and inference: training runs ``nb`` anchor blocks per sequence in
one forward over the whole context (:meth:`DFlashDraftModel.encode_context` then ``forward``), inference
runs one block per sequence against the cached context. Ragged batches are masked entries
(``ContextCache.valid``) with explicit positions, so padding holes are harmless.

Mask token. When ``config.mask_token_id`` is set (Qwen3: 151669, the first row past the tokenizer), the
MASK input is that row of the target's embedding. A target without a spare row (SmolLM2: exactly 49152
rows, all tokens) gets a learned ``mask_embedding`` [H] parameter owned by the drafter, stored as an extra
tensor ``mask_embedding`` in ``model.safetensors`` with ``dflash_config.mask_token_id = null``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import kernels, paths
from .runtime import interleave_gate_up
from .utils import atomic_save_safetensors, atomic_write_json


class CheckpointNotFoundError(FileNotFoundError):
    """A drafter checkpoint that is not where it was looked for; the message says how to get one."""


class DrafterMismatchError(ValueError):
    """A drafter that does not fit the target it is paired with; the message names both values."""


# ------------------------------------------------------------------------------------------- config
@dataclass
class DFlashConfig:
    """The drafter's shape; :meth:`to_json` writes the released ``config.json`` layout."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_target_layers: int
    target_layer_ids: list[int]
    vocab_size: int
    block_size: int  # B, the anchor plus B-1 drafted positions (cfg.drafter.block_size when built fresh)
    mask_token_id: int | None = None  # None: the drafter owns a learned `mask_embedding`
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        dflash = {"mask_token_id": d.pop("mask_token_id"), "target_layer_ids": d.pop("target_layer_ids")}
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **d, "dflash_config": dflash,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "layer_types": ["full_attention"] * self.num_hidden_layers}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DFlashConfig":
        """Read a released (or our own) ``config.json``; unknown keys are ignored."""
        dflash = d.get("dflash_config") or {}
        heads = int(d["num_attention_heads"])
        theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 1e6
        return cls(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            num_hidden_layers=int(d["num_hidden_layers"]), num_target_layers=int(d["num_target_layers"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]], vocab_size=int(d["vocab_size"]),
            block_size=int(d["block_size"]), mask_token_id=dflash.get("mask_token_id"),
            rope_theta=float(theta), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)))


# ------------------------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim, computed in float32 (Qwen3's RMSNorm); at inference in one
    call of the fused CPU kernel where the target loaded it (:func:`xpress.kernels.rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = kernels.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` without bias (the checkpoint's names) whose inference forward goes through
    :func:`xpress.kernels.linear`: the fused CPU kernel where the target loaded it, F.linear otherwise
    (always under autograd, so training is unchanged)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for absolute ``positions`` [b, n]: cos, sin [b, 1, n, head_dim] (half-split layout).
    The sin table carries the rotation's sign: its first half is negated, so that :func:`apply_rope` is
    ``x * cos + roll(x, d/2) * sin`` (bit for bit ``x * cos + cat(-x2, x1) * sin``: negation is exact)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [b, n, d/2]
    sin = angles.sin()
    return (torch.cat([angles, angles], dim=-1).cos()[:, None].to(dtype),
            torch.cat([-sin, sin], dim=-1)[:, None].to(dtype))


class RopeTable:
    """:func:`rope` for positions ``0 .. n-1``, computed once and grown geometrically (an inference round
    otherwise recomputes the same angles, a dozen small operations, twice); :meth:`__call__` gathers the
    rows of ``positions``. Entries are :func:`rope`'s at the same positions (the same operations on the same
    float32 angles; cos and sin may round a last bit differently in a long tensor than in a short one)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._cos = self._sin = torch.empty(0, head_dim)  # [n, d] each

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, n] int64, all >= 0 -> cos, sin [b, 1, n, d] of ``dtype``. ``end``: one past the
        largest position, where the caller knows it."""
        need = end if end is not None else int(positions.max()) + 1 if positions.numel() else 0
        self._cover(need, dtype, positions.device)
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def span(self, start: int, end: int, dtype: torch.dtype, device: torch.device | str
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [end - start, d] of positions ``start .. end - 1`` (views of the table: no gather)."""
        self._cover(end, dtype, device)
        return self._cos[start:end], self._sin[start:end]

    def _cover(self, need: int, dtype: torch.dtype, device: torch.device | str) -> None:
        c = self._cos
        if c.shape[0] < need or c.dtype != dtype or c.device != torch.device(device):
            n = max(need, 2 * c.shape[0] if c.dtype == dtype else 0, 1024)
            with torch.inference_mode(False), torch.no_grad():  # a plain constant, whatever mode builds it
                cos, sin = rope(torch.arange(n, device=device)[None], self.head_dim, self.theta, dtype)
            self._cos, self._sin = cos[0, 0], sin[0, 0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, heads, n, d] by the tables of :func:`rope` (rotate-half: ``(x1, x2)`` pairs with
    ``(-x2, x1)``; the sign sits in ``sin``)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention of block queries over [context keys, block keys]."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.nh, self.kvh, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.nh * self.d)
        self.k_proj = Linear(c.hidden_size, self.kvh * self.d)
        self.v_proj = Linear(c.hidden_size, self.kvh * self.d)
        self.o_proj = Linear(self.nh * self.d, c.hidden_size)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, n, H] -> keys (k_norm, then RoPE), values: [b, kvh, n, d] each."""
        return self._kv(*kernels.linears(x, (self.k_proj.weight, self.v_proj.weight)), cos, sin)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k, v [b, n, kvh * d] -> keys (k_norm, then RoPE), values: [b, kvh, n, d] each."""
        b, n, _ = k.shape
        k = self.k_norm(k.view(b, n, self.kvh, self.d)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(b, n, self.kvh, self.d).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: "torch.Tensor | BlockLayout | None") -> torch.Tensor:
        """x [b, n, H] (block), ctx_k/ctx_v [b, kvh, L, d], mask [b, 1, n, L + n] bool (True = attend; None:
        every key) or a :class:`BlockLayout` (the same mask, computed by the C++ kernel) -> [b, n, H]. The q, k
        and v products are one call (:func:`xpress.kernels.linears`)."""
        b, n, _ = x.shape
        q, k, v = kernels.linears(x, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        q = apply_rope(self.q_norm(q.view(b, n, self.nh, self.d)).transpose(1, 2), cos, sin)
        k, v = self._kv(k, v, cos, sin)
        if isinstance(mask, BlockLayout):
            o = mask.attend(q, ctx_k, ctx_v, k, v)  # [b, nh, n, d]
        else:
            k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [b, kvh, L + n, d]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [b, nh, n, d]
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.nh * self.d))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = kernels.linears(x, (self.gate_proj.weight, self.up_proj.weight))  # one product
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual attention + MLP; 11 tensors."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
              ctx_v: torch.Tensor) -> torch.Tensor | None:
        """:meth:`forward` for one block of n rows after a context it wholly attends (no mask), in one call of
        the fused CPU kernel (``draft_layer`` in xpress/csrc/fused_cpu.cpp) where :func:`xpress.kernels.linear`
        would use it: x [n, H], cos / sin [n, d], ctx_k / ctx_v [kvh, L, d] -> [n, H]; else None. The same
        function; attention and SiLU are summed and evaluated in the kernel's orders, so values agree to float32
        rounding, not bit for bit."""
        at, mlp = self.self_attn, self.mlp
        qkv = (at.q_proj.weight, at.k_proj.weight, at.v_proj.weight)
        gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
        o, down = at.o_proj.weight, mlp.down_proj.weight
        mod = kernels.kernel_for(x, *qkv, o, *gate_up, down)
        mixed = kernels.bf16_products() and any(w.shape[1] % 32 for w in (qkv[0], o, down))  # bf16 and float32
        if mod is None or mixed or at.d % 16 or at.d > 256:  # (the kernel's four products share one dtype)
            return None
        return mod.draft_layer(
            x.contiguous(), self.input_layernorm.weight, kernels.packed_copy(mod, qkv), at.q_norm.weight,
            at.k_norm.weight, kernels.packed_copy(mod, (o,)), self.post_attention_layernorm.weight,
            kernels.packed_copy(mod, gate_up, combine=interleave_gate_up), kernels.packed_copy(mod, (down,)),
            cos.contiguous(), sin.contiguous(), ctx_k.contiguous(), ctx_v.contiguous(), at.nh, at.kvh,
            self.input_layernorm.eps)


# ------------------------------------------------------------------------------------------ context
@dataclass
class ContextCache:
    """The drafter's context: per-layer keys/values of the injected target features.

    keys, values: one [b, kvh, L, d] tensor per drafter layer; positions [b, L] int64 absolute positions;
    valid [b, L] bool (False = padding of a ragged batch, never attended). Grows by concatenation; padded
    entries stay in place as masked holes. Known on the host, so that a forward need not ask the tensors:
    ``dense`` (no entry is padding) and ``end`` (one past the largest position, padding included).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor
    dense: bool = False
    end: int = 0

    def append(self, other: "ContextCache") -> "ContextCache":
        """This context followed by ``other`` (same batch), along L."""
        return ContextCache(
            keys=[torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)],
            values=[torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)],
            positions=torch.cat([self.positions, other.positions], dim=1),
            valid=torch.cat([self.valid, other.valid], dim=1),
            dense=self.dense and other.dense, end=max(self.end, other.end))


def block_attention_mask(ctx_positions: torch.Tensor, ctx_valid: torch.Tensor, anchor_pos: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Who block tokens attend to: [b, 1, nb*B, L + nb*B] bool for ``nb`` blocks per sequence.

    ctx_positions, ctx_valid: [b, L]; anchor_pos: [b, nb]. A token of block ``a`` sees the valid context
    keys at positions strictly before ``anchor_pos[a]`` and every token of its own block.
    """
    b, nb = anchor_pos.shape
    ctx = ctx_valid[:, None, :] & (ctx_positions[:, None, :] < anchor_pos[:, :, None])  # [b, nb, L]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [b, nb*B, L]
    which = torch.arange(nb * block_size, device=anchor_pos.device) // block_size  # [nb*B]
    own = (which[:, None] == which[None, :]).expand(b, -1, -1)  # [b, nb*B, nb*B]
    return torch.cat([ctx, own], dim=-1)[:, None]


@dataclass
class BlockLayout:
    """:func:`block_attention_mask` where the context is one run of valid keys at positions 0, 1, ... (training
    batches): block ``a`` of sequence ``s`` attends the first ``lim[s, a]`` context keys and its own block. With
    ``kernel`` (the CPU's compiled kernels) the C++ ``block_attention_forward`` / ``_backward`` compute it, reading
    only those columns; without (a GPU) PyTorch's flex attention does, over a block mask of the same rule, so
    the dense scores [b, nh, nb*B, L + nb*B] are never materialised (compiled on CUDA; eager elsewhere, as the
    CPU test runs it). lim [b, nb] int64."""

    lim: torch.Tensor
    block_size: int
    kernel: Any = None
    _flex_mask: Any = None  # the flex BlockMask, built on first use and shared by the layers

    @classmethod
    def of(cls, context: "ContextCache", anchor_pos: torch.Tensor, block_size: int, kernel) -> "BlockLayout | None":
        """The layout of these blocks after ``context``, or None where the context is not such a run."""
        b, L = context.positions.shape
        dev = context.positions.device
        if (kernel is not None and dev.type != "cpu") or not bool(
                (context.positions == torch.arange(L, device=dev)).all()
                and (context.valid[:, 1:] <= context.valid[:, :-1]).all()):
            return None
        lengths = context.valid.sum(1, keepdim=True)  # [b, 1]
        return cls(torch.minimum(anchor_pos, lengths).clamp_min(0).contiguous(), block_size, kernel)

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Attention of the blocks' queries q [b, nh, n, d] over [ctx_k, k] / [ctx_v, v] ([b, kvh, L | n, d])
        under this layout -> [b, nh, n, d]."""
        if self.kernel is not None:
            return _BlockAttention.apply(q, ctx_k, ctx_v, k, v, self.lim, self.block_size, self.kernel)
        from torch.nn.attention.flex_attention import create_block_mask

        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [b, kvh, L + n, d]
        if torch.is_autocast_enabled(q.device.type):  # the products in the autocast dtype, as SDPA's would be
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        b, n, L, B, lim = q.shape[0], q.shape[2], ctx_k.shape[2], self.block_size, self.lim
        if self._flex_mask is None:
            def rule(s, h, qi, kv):  # block a = qi // B sees context keys < lim[s, a] and its own B keys
                a = qi // B
                return ((kv < L) & (kv < lim[s, a])) | ((kv >= L) & ((kv - L) // B == a))

            self._flex_mask = create_block_mask(rule, b, None, n, L + n, device=q.device)
        return _flex(q.device.type)(q, k.to(q.dtype), v.to(q.dtype), block_mask=self._flex_mask, enable_gqa=True)


_FLEX: dict[str, Any] = {}


def _flex(device_type: str):
    """flex_attention, compiled on CUDA (where only the compiled kernel avoids the dense scores), eager elsewhere."""
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


class _BlockAttention(torch.autograd.Function):
    """Attention of the blocks' rows over their :class:`BlockLayout` columns: the same function as
    ``scaled_dot_product_attention`` over :func:`block_attention_mask` (to float32 rounding; float32 inside,
    the result in q's dtype), each row reading only the columns it attends."""

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, k, v, lim, block_size, mod):
        args = [t.float().contiguous() for t in (q, ctx_k, ctx_v, k, v)]  # [b, nh, n, d], [b, kvh, L | n, d]
        scale = q.shape[-1] ** -0.5
        o, lse = mod.block_attention_forward(*args, lim, block_size, scale)  # [b, nh, n, d], [b, nh, n]
        ctx.save_for_backward(*args, lim, o, lse)
        ctx.block_size, ctx.scale, ctx.mod = block_size, scale, mod
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, d_o):
        q, ctx_k, ctx_v, k, v, lim, o, lse = ctx.saved_tensors
        grads = ctx.mod.block_attention_backward(d_o.float().contiguous(), q, ctx_k, ctx_v, k, v, lim, o, lse,
                                                 ctx.block_size, ctx.scale)
        return (*grads, None, None, None)


# -------------------------------------------------------------------------------------------- model
class DFlashDraftModel(nn.Module):
    """The dFlash drafter. Tensor names follow the released checkpoint (58 tensors for 5 layers):
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
    ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
    ``fc.weight`` [H, F], ``hidden_norm.weight``, ``norm.weight``, and ``mask_embedding`` [H] only when
    ``config.mask_token_id`` is None.

    Shapes: ``encode_context(features [b, L, F], positions [b, L]) -> ContextCache`` (per layer K/V
    [b, kvh, L, d]); ``forward(anchor [b, nb], anchor_pos [b, nb], context) -> hidden [b, nb, B, H]``;
    ``base_logits(hidden [..., H]) -> [..., Vd]`` float32.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mask_token_id is None:
            self.mask_embedding = nn.Parameter(nn.init.normal_(torch.empty(c.hidden_size), std=0.02))  # [H]
        # the target's frozen (embed_tokens, lm_head): a plain tuple, so neither is a submodule, trained or saved
        self._target_io: tuple[nn.Embedding, nn.Linear] | None = None
        self._readout: tuple | None = None  # (weight, its version, d2t, weight[d2t]): readout_weight()'s copy
        self._rope_table = RopeTable(c.head_dim, c.rope_theta)
        self.gradient_checkpointing = False  # train.gradient_checkpointing: recompute each layer in backward

    # ------------------------------------------------------------------------------- target binding
    def attach(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> "DFlashDraftModel":
        """Use the target's ``embed_tokens`` [V, H] and ``lm_head`` [V, H] (not copied, not saved)."""
        self._target_io = (embed_tokens, lm_head)
        return self

    def _io(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._target_io is None:
            raise RuntimeError("the drafter has no target embeddings: call drafter.attach(target.embed_tokens(), "
                               "target.lm_head()) (from_target/from_pretrained(target=...) do it)")
        return self._target_io

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---------------------------------------------------------------------------------------- forward
    def encode_context(self, features: torch.Tensor, positions: torch.Tensor,
                       valid: torch.Tensor | None = None) -> ContextCache:
        """Target features [b, L, F] at absolute ``positions`` [b, L] -> the per-layer context K/V.
        ``valid`` [b, L] bool marks real entries (default: all)."""
        end = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._rope_table(positions, self.dtype, end)
        kv = self._fused_context(features, cos, sin)
        if kv is None:
            ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [b, L, H]
            kv = [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]
        dense = valid is None or bool(valid.all())
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        return ContextCache([k for k, _ in kv], [v for _, v in kv], positions, valid, dense, end)

    def _fused_context(self, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`encode_context`'s per-layer keys and values [1, kvh, L, d] for one sequence (features [1, L, F],
        cos / sin [1, 1, L, d]) in one call of the fused CPU kernel (``draft_context``), where
        :func:`xpress.kernels.linear` would use it; else None. The same operations in the same order."""
        attn = [layer.self_attn for layer in self.layers]
        kv_weights = [(a.k_proj.weight, a.v_proj.weight) for a in attn]
        mod = kernels.kernel_for(features, self.fc.weight, *(w for pair in kv_weights for w in pair))
        d = self.config.head_dim
        if mod is None or features.shape[0] != 1 or d % 16 or d > 256:
            return None
        out = mod.draft_context(features[0].contiguous(), kernels.packed_copy(mod, (self.fc.weight,)),
                                self.hidden_norm.weight, [kernels.packed_copy(mod, pair) for pair in kv_weights],
                                [a.k_norm.weight for a in attn], cos[0, 0].contiguous(), sin[0, 0].contiguous(),
                                self.config.num_key_value_heads, self.config.rms_norm_eps)
        return [(out[2 * i][None], out[2 * i + 1][None]) for i in range(len(attn))]

    def empty_context(self, batch: int, device: torch.device | str | None = None) -> ContextCache:
        """A context of length 0 for ``batch`` sequences."""
        device = device or self.fc.weight.device
        c, n = self.config, len(self.layers)
        empty = torch.zeros(batch, c.num_key_value_heads, 0, c.head_dim, dtype=self.dtype, device=device)
        return ContextCache([empty] * n, [empty] * n, torch.zeros(batch, 0, dtype=torch.int64, device=device),
                            torch.zeros(batch, 0, dtype=torch.bool, device=device), dense=True, end=0)

    def embed_block(self, anchor: torch.Tensor) -> torch.Tensor:
        """Anchor target ids [b, nb] -> block inputs [b, nb*B, H]: each block ``[anchor, MASK x (B-1)]``."""
        embed, _ = self._io()
        b, nb = anchor.shape
        B, H = self.block_size, self.config.hidden_size
        mask = self.mask_embedding if self.config.mask_token_id is None else embed.weight[self.config.mask_token_id]
        x = torch.cat([embed(anchor).to(self.dtype)[:, :, None], mask.to(self.dtype).expand(b, nb, B - 1, H)], dim=2)
        return x.reshape(b, nb * B, H)

    def forward(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, context: ContextCache,
                attention_kernel=None) -> torch.Tensor:
        """Denoise ``nb`` blocks per sequence in one pass.

        anchor, anchor_pos: [b, nb] int64 (target ids, absolute positions); context: the sequence's
        context (:meth:`encode_context`, or the inference cache); ``attention_kernel``: the compiled kernels,
        to compute several blocks' attention over a context of consecutive positions with them
        (:class:`BlockLayout`; training), else None. Returns the final-normed block hidden states
        [b, nb, B, H]; ``[:, :, 1:]`` are the drafted positions that :meth:`base_logits` reads.
        """
        b, nb = anchor.shape
        B = self.block_size
        if b == 1 and nb == 1 and context.dense and context.end <= (a := int(anchor_pos)):
            fused = self._fused_block(anchor, a, context)  # inference's one block, where the kernel is loaded
            if fused is not None:
                return fused
        x = self.embed_block(anchor)  # [b, nb*B, H]
        pos = (anchor_pos[:, :, None] + torch.arange(B, device=anchor.device)).reshape(b, nb * B)
        # one block per sequence after a context that is all real and all before its anchor (inference's
        # case): every key is attended, so no mask is built
        first = int(anchor_pos.min()) if nb == 1 and context.dense else -1
        # several blocks per sequence (training): the C++ kernel's layout on a CPU, flex attention on a GPU
        layout = (BlockLayout.of(context, anchor_pos, B, attention_kernel) if nb > 1 and (
            (attention_kernel is not None and self.config.head_dim in (16, 32, 64, 128)) or anchor.device.type == "cuda")
            else None)
        mask = (None if context.end <= first else layout or  # [b, 1, nb*B, L+nb*B]
                block_attention_mask(context.positions, context.valid, anchor_pos, B))
        cos, sin = self._rope_table(pos, self.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer, k, v in zip(self.layers, context.keys, context.values):
            if recompute:  # keep only the layer's input; its activations are recomputed in backward
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, k, v, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, k, v, mask)
        return self.norm(x).view(b, nb, B, -1)

    def _fused_block(self, anchor: torch.Tensor, a: int, context: ContextCache) -> torch.Tensor | None:
        """:meth:`forward` of one block (anchor [1, 1] at position ``a``) after a context of one sequence that
        lies wholly before it, each layer one call of the fused CPU kernel (:meth:`DecoderLayer.fused`), with
        no gathers: [1, 1, B, H]; None where the kernel does not apply."""
        embed, _ = self._io()
        B, H = self.block_size, self.config.hidden_size
        mask = self.mask_embedding if self.config.mask_token_id is None else embed.weight[self.config.mask_token_id]
        x = torch.cat([embed.weight[anchor[0]].to(self.dtype), mask.to(self.dtype).expand(B - 1, H)])  # [B, H]
        cos, sin = self._rope_table.span(a, a + B, self.dtype, anchor.device)  # [B, d] each
        for layer, k, v in zip(self.layers, context.keys, context.values):
            x = layer.fused(x, cos, sin, k[0], v[0])
            if x is None:
                return None
        return self.norm(x).view(1, 1, B, -1)

    def base_logits(self, hidden: torch.Tensor, vocab=None, float32: bool = True) -> torch.Tensor:
        """Base logits ``s = lm_head.weight[vocab.d2t] @ h``: hidden [..., H] -> float32 [..., Vd]
        (the full target vocabulary when ``vocab`` is None; the targets' lm_heads have no bias). ``float32=False``:
        in the product's own dtype (bf16 under autocast: the chunked training loss keeps them so)."""
        w = self.readout_weight(vocab, hidden.device)
        s = kernels.linear(hidden.to(w.dtype), w)
        return s.float() if float32 else s

    def readout_weight(self, vocab=None, device: torch.device | str | None = None) -> torch.Tensor:
        """The target lm_head's rows of the draft vocabulary, ``lm_head.weight[vocab.d2t]`` [Vd, H] (the whole
        weight when ``vocab`` is None or the full vocabulary). The gathered copy is kept until the weight
        changes (another tensor or an in-place update) or another vocabulary is asked for: gathering 4,096 rows
        of SmolLM2's 49,152 took longer than the drafter's own forward at every round."""
        _, lm_head = self._io()
        w = lm_head.weight
        if vocab is None or vocab.is_identity:
            return w
        d2t = vocab.on(torch.device(device) if device is not None else w.device)[0]
        if torch.is_grad_enabled() and w.requires_grad:  # a trained readout: gather anew, keeping the graph
            return w[d2t]
        kept = self._readout
        if kept is None or kept[0] is not w or kept[1] != kernels.version(w) or kept[2] is not d2t:
            with torch.no_grad():
                kept = self._readout = (w, kernels.version(w), d2t, w[d2t])
        return kept[3]

    # ------------------------------------------------------------------------------ target matching
    def check_matches(self, target) -> None:
        """Raise :class:`DrafterMismatchError` if this drafter cannot run on ``target`` (a Target)."""
        c = self.config
        problems = []
        if c.hidden_size != target.hidden_size:
            problems.append(f"hidden size: drafter {c.hidden_size}, target {target.hidden_size}")
        if c.vocab_size != target.vocab_size:
            problems.append(f"vocabulary: drafter {c.vocab_size}, target {target.vocab_size}")
        if c.num_target_layers != target.num_layers:
            problems.append(f"target layers: drafter built for {c.num_target_layers}, target has {target.num_layers}")
        if list(c.target_layer_ids) != list(target.layer_ids):
            problems.append(
                f"feature layers: drafter reads {c.target_layer_ids} (width {len(c.target_layer_ids) * c.hidden_size}), "
                f"target exposes {target.layer_ids} (width {target.feature_size}); set "
                f"drafter.num_target_features={len(c.target_layer_ids)} if the layer count is the issue")
        if problems:
            raise DrafterMismatchError(
                f"the drafter does not fit target {target.name!r}: " + "; ".join(problems)
                + ". Use a drafter trained for this target (or a fresh one: new_drafter / DFlashDraftModel.from_target).")

    @classmethod
    def from_target(cls, target, cfg) -> "DFlashDraftModel":
        """A fresh (randomly initialised) drafter shaped for ``target`` (a Target) and ``cfg`` (a Config):
        hidden size, heads, head dim, RoPE and norm eps from the target; layers, block size and
        intermediate size (0 = the target's) from ``cfg.drafter``. The MASK input is the first embedding
        row past the tokenizer when the target has one, else a learned ``mask_embedding``."""
        tc = target.model.config
        heads = int(tc.num_attention_heads)
        rope_params = getattr(tc, "rope_parameters", None) or {}
        n_tokens = len(target.tokenizer)
        config = DFlashConfig(
            hidden_size=target.hidden_size,
            intermediate_size=cfg.drafter.intermediate_size or int(tc.intermediate_size),
            num_attention_heads=heads, num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(tc, "head_dim", None) or target.hidden_size // heads),
            num_hidden_layers=cfg.drafter.num_layers, num_target_layers=target.num_layers,
            target_layer_ids=list(target.layer_ids), vocab_size=target.vocab_size,
            block_size=cfg.drafter.block_size,
            mask_token_id=n_tokens if target.vocab_size > n_tokens else None,
            rope_theta=float(rope_params.get("rope_theta") or getattr(tc, "rope_theta", None) or 1e6),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)))
        model = cls(config).to(device=target.device, dtype=target.dtype)
        return model.attach(target.embed_tokens(), target.lm_head())

    # ---------------------------------------------------------------------------------------- file i/o
    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (released layout), each atomically."""
        folder = Path(folder)
        config = {**self.config.to_json(), "dtype": str(self.dtype).removeprefix("torch.")}
        atomic_write_json(folder / "config.json", config)
        atomic_save_safetensors(folder / "model.safetensors", self.state_dict(), metadata={"format": "pt"})
        return folder

    @classmethod
    def from_pretrained(cls, name: str | os.PathLike, target=None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "DFlashDraftModel":
        """Load a drafter from a folder (``config.json`` + ``model.safetensors`` or its sharded index) or a
        hub id such as ``z-lab/Qwen3-8B-DFlash-b16``. With ``target`` (a Target): checked against it
        (:meth:`check_matches`), attached to its embeddings, and moved to its device and dtype."""
        folder = locate_checkpoint(name)
        config = DFlashConfig.from_json(json.loads((folder / "config.json").read_text()))
        state = _read_state(folder)
        with torch.device("meta"):
            model = cls(config)
        expected, found = set(model.state_dict()), set(state)
        if expected != found:
            raise ValueError(f"{folder}: not a DFlashDraftModel of this config; missing tensors "
                             f"{sorted(expected - found)[:5]}, unexpected {sorted(found - expected)[:5]}")
        model.load_state_dict(state, assign=True)
        if target is not None:
            model.check_matches(target)
            dtype, device = dtype or target.dtype, device or target.device
            model.attach(target.embed_tokens(), target.lm_head())
        return model.to(device=device, dtype=dtype)


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for s in shards for k, v in load_file(str(folder / s)).items()}
    raise CheckpointNotFoundError(f"{folder} holds no model.safetensors (nor a sharded index); it is not a "
                                  f"drafter checkpoint: save one with DFlashDraftModel.save_pretrained")


def locate_checkpoint(name: str | os.PathLike) -> Path:
    """A local folder holding ``config.json`` (relative paths: from the repository root), else a hub id
    downloaded with ``huggingface_hub``. Raises :class:`CheckpointNotFoundError` naming the path."""
    folder = paths.resolve(name)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise CheckpointNotFoundError(f"{folder} has no config.json: not a drafter checkpoint folder "
                                          f"(expected config.json + model.safetensors)")
        return folder
    text = str(name)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:  # offline, unknown repo, no access: one clear message
            raise CheckpointNotFoundError(
                f"drafter checkpoint {text!r} is not a local folder ({folder} does not exist) and could not be "
                f"downloaded from the hub ({e.__class__.__name__}); download it where the hub is reachable "
                f"(huggingface-cli download {text} --local-dir <folder>) and point drafter.checkpoint at "
                f"that folder") from None
    if paths.is_rehearsal_path(name):
        raise CheckpointNotFoundError(f"rehearsal drafter folder {folder} does not exist yet; write it with "
                                      f"`python -m xpress rehearsal-assets --preset <preset>` (notebook 00 runs it)")
    raise CheckpointNotFoundError(f"drafter checkpoint folder {folder} does not exist; give a folder holding "
                                  f"config.json + model.safetensors, or a hub id such as z-lab/Qwen3-8B-DFlash-b16")
