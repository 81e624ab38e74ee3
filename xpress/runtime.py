"""A lean forward for Llama-family targets over a pre-allocated KV cache, built for decoding.

Why it exists: on two CPU cores, the transformers forward of SmolLM2-135M spends a 16-token verify at
about 2x a one-token step (the K/V cache grows by concatenation, small ops are not fused, and float32
weights make a step memory-bound). This module runs the same weights with

- the K/V written in place into a buffer that grows geometrically (:class:`StaticKV`); rolling back a
  rejected tail only moves the length;
- fused projections (one matmul for q, k, v and one for gate and up), prepacked once into oneDNN's
  blocked layout (:class:`Linear`; in float32 too, where it beat MKL's ``F.linear`` at 1 and 16 rows in
  a probe on a 2-core AVX2 EPYC);
- weights in the target dtype: bfloat16 where the CPU has native bf16 dot products (``target.dtype:
  auto``, :func:`resolve_dtype`), float32 elsewhere; norms, RoPE, softmax and the residual stream stay
  float32;
- attention written so that **a query row's result never depends on how many rows are computed with it**
  (:func:`invariant_attention`): the softmax subtracts the row maximum, its sums and the value product
  are formed over fixed 64-column chunks aligned to absolute cache columns and combined by a sequential
  scan, so masked or absent columns add exact zeros; in float32 its two products run on blocks of exactly
  :data:`QUERY_BLOCK` tokens' rows (:func:`row_blocks`), as MKL's kernel changes with the row count. The
  prepacked projections are row-invariant (oneDNN's bf16 kernels up to a reduction depth of
  :data:`K_CHUNK`, its float32 ones at SmolLM2's shapes), all checked at load by
  :func:`check_row_invariance`, so a 16-token verify reproduces 16 one-token steps bit for bit and
  speculative decoding equals greedy decoding by construction, not by luck. Long prefills run in chunks
  of :data:`ROW_CHUNK` tokens.

In float32 on an AVX2 CPU, and in bf16 on a CPU with AMX tiles (whose products it then runs, any number of
rows at about the cost of one) or with AVX512-BF16 (VDPBF16PS on 16 lanes), each decoder layer can instead be one call of a C++ kernel
(``target.kernels``, :mod:`xpress.kernels`, ``xpress/csrc/fused_cpu.cpp``): the same function, row-invariant
by the same construction (every row's arithmetic is fixed whatever the number of rows), without the ~60
PyTorch dispatches a layer costs here.

Supported: ``model_type`` in :data:`SUPPORTED` with default RoPE (Llama: SmolLM2; Qwen3: per-head q/k
RMSNorm); the fused C++ layer runs Llama only. Anything else runs through transformers (``target.runtime:
transformers``). :func:`lean_support` is the one question of what runs here (a model, a dtype, the fused
kernels or not) and why not: :class:`LeanModel` refuses exactly its cases, and every caller that picks a runtime
(:func:`xpress.targets.choose_runtime`, the studies) asks it first.

Shapes: ``b`` rows, ``n`` new tokens, ``L`` cached columns, ``H`` hidden, ``nh`` / ``nkv`` query / key-value
heads of width ``hd``, ``g = nh // nkv`` query heads per key-value head, ``C`` key chunks of ``CHUNK``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .cpu import cpu_flags, onednn_bf16, simulated_class

SUPPORTED = ("llama", "qwen3")
CHUNK = 64  # key columns per chunk of the softmax sums (absolute cache columns 0-63, 64-127, ...)
ROW_CHUNK = 128  # tokens per forward in a long prefill (bounds the score matrix; rows stay invariant)
K_CHUNK = 1024  # bf16 matmuls over more input features than this are split (row-invariant up to it here)
QUERY_BLOCK = 4  # float32 attention at batch 1: query rows are computed in blocks of this many tokens (row_blocks)
M_CHUNK_AMX = 32  # on AMX CPUs, bf16 matmuls over more rows than this are split into row blocks (see Linear)


class RuntimeUnsupported(ValueError):
    """A model the lean runtime cannot run exactly (architecture or RoPE variant); use transformers."""


def native_bf16() -> bool:
    """Whether this machine multiplies bf16 natively: a CUDA device with bf16, or a CPU whose oneDNN has
    bf16 kernels (AVX512-BF16 or AMX-BF16)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return onednn_bf16()


def cpu_features() -> dict[str, bool]:
    """The CPU's matrix features that decide the target dtype (:func:`xpress.cpu.cpu_flags`)."""
    flags = cpu_flags()
    return {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "onednn_bf16": native_bf16() if not torch.cuda.is_available() else False,
            **({"simulated_class": simulated_class()} if simulated_class() != "native" else {})}


def bf16_row_block() -> int:
    """Rows per call of a prepacked bf16 matmul (:class:`Linear`): :data:`M_CHUNK_AMX` on a CPU with AMX-BF16,
    where oneDNN changes kernel (and summation order) with the number of rows, else 0 (any number)."""
    return M_CHUNK_AMX if cpu_features()["amx_bf16"] else 0


_LAST_CHOICE: dict[str, Any] = {}


def record_choice(choice: dict[str, Any]) -> None:
    """Remember the runtime and dtype a target was loaded with (:func:`xpress.targets.choose_runtime`)."""
    _LAST_CHOICE.clear()
    _LAST_CHOICE.update({k: choice[k] for k in ("runtime", "dtype", "dtype_setting", "runtime_setting")},
                        kernels=choice.get("kernels"), attention=choice.get("attention"),
                        drafter_products=choice.get("drafter_products"), frame_rows=choice.get("frame_rows"),
                        row_invariant=choice.get("row_invariance", {}).get("exact"),
                        cpu_features=choice.get("cpu_features"))


def runtime_choice() -> dict[str, Any]:
    """The runtime, dtype and row-invariance of the last target loaded in this process ({} if none): part
    of every provenance block (:func:`xpress.utils.provenance`)."""
    return dict(_LAST_CHOICE)


def resolve_dtype(name: str) -> torch.dtype:
    """``target.dtype`` as a torch dtype; ``auto`` is bfloat16 where :func:`native_bf16`, else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ============================================================================================ KV cache
class StaticKV:
    """Pre-allocated keys and values for every layer: ``keys[i]`` / ``values[i]`` [b, nkv, capacity, hd].

    The first :meth:`get_seq_length` columns hold the cache; writes go in place after them, the capacity
    grows geometrically (a multiple of :data:`CHUNK`), :meth:`crop` only moves the length. The interface
    is the part of transformers' ``Cache`` that the decoding loop uses (``get_seq_length``, ``crop``) plus
    :meth:`gather_columns` for ragged batches.

    A cache with one row per sequence (:meth:`LeanModel.prefill_row`, :meth:`LeanModel.step_rows`,
    :meth:`LeanModel.forward_rows`: every sequence from column 0) leaves each row's length to its caller; its own
    length is then the most columns any row has written, which :meth:`reserve` keeps when it grows.
    """

    def __init__(self, n_layers: int, batch: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256) -> None:
        self.shape = (batch, n_kv, head_dim)
        self.dtype, self.device = dtype, device
        self.length = 0
        cap = _round_up(max(capacity, CHUNK), CHUNK)
        self.keys = [self._empty(cap) for _ in range(n_layers)]
        self.values = [self._empty(cap) for _ in range(n_layers)]
        self.tiles: list[tuple[torch.Tensor, torch.Tensor]] = []  # tile_store(): the fused bf16 attention's layouts
        self.tiles_upto = 0  # columns 0..tiles_upto-1 of `tiles` match the keys and values

    def tile_store(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of batch row 0 in the layouts the fused kernel's bf16 attention reads
        (``key_tiles``, ``value_tiles`` [nkv, capacity hd] int16, bf16 bits; see keys_to_tiles in
        xpress/csrc/fused_cpu.cpp), made at the first call and again when the capacity grew; valid for columns
        0..:attr:`tiles_upto`-1: the kernel lays out only the columns after them, so that a one-token step does
        not round the whole cache again. Every write other than the fused layer's lowers ``tiles_upto``."""
        b, nkv, hd = self.shape
        if not self.tiles or self.tiles[0][0].shape[1] != self.capacity * hd:
            self.tiles = [(torch.zeros(nkv, self.capacity * hd, dtype=torch.int16),
                           torch.zeros(nkv, self.capacity * hd, dtype=torch.int16)) for _ in self.keys]
            self.tiles_upto = 0
        return self.tiles

    def tiles_stale_from(self, column: int) -> None:
        """Columns from ``column`` on were (or will be) written outside the fused layer: lay them out again."""
        self.tiles_upto = min(self.tiles_upto, column)

    def _empty(self, capacity: int) -> torch.Tensor:
        b, nkv, hd = self.shape
        return torch.zeros(b, nkv, capacity, hd, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        """Make room for ``length`` columns (rounded up to a whole chunk), doubling at least."""
        if length <= self.capacity:
            return
        cap = _round_up(max(length, 2 * self.capacity), CHUNK)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = self._empty(cap)
                new[:, :, :self.length] = old[:, :, :self.length]
                store[i] = new

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put the new columns' k, v [b, nkv, n, hd] after the cached ones (the length moves in :meth:`advance`)."""
        n = k.shape[2]
        self.tiles_stale_from(self.length)
        self.keys[layer][:, :, self.length:self.length + n] = k
        self.values[layer][:, :, self.length:self.length + n] = v

    def advance(self, n: int) -> None:
        self.length += n

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` columns; a negative number removes that many (transformers' rule).
        The dropped columns stay in the buffer (masked, overwritten by the next write)."""
        self.length = self.length + max_length if max_length < 0 else min(self.length, max_length)
        self.tiles_stale_from(self.length)

    def row(self, r: int) -> "StaticKV":
        """Row ``r`` as a one-row cache over the same storage, empty (length 0) and of fixed capacity: what a
        one-sequence forward (:meth:`LeanModel.prefill_row`) writes into it lands in row ``r`` of this cache."""
        return _RowKV(self, r)

    def gather_columns(self, idx: torch.Tensor) -> None:
        """Row i keeps cache columns ``idx[i]`` [b, kept] in that order (ragged-batch compaction)."""
        kept = idx.shape[1]
        b, nkv, hd = self.shape
        g = idx[:, None, :, None].expand(b, nkv, kept, hd)
        for store in (self.keys, self.values):
            for t in store:
                t[:, :, :kept] = t[:, :, :self.length].gather(2, g)
        self.length = kept
        self.tiles_stale_from(0)


class _RowKV(StaticKV):
    """One row of a :class:`StaticKV` (:meth:`StaticKV.row`): views of its buffers, which it cannot grow."""

    def __init__(self, cache: StaticKV, r: int) -> None:  # noqa: D107 (no super().__init__: no new buffers)
        self.shape, self.dtype, self.device, self.length = (1, *cache.shape[1:]), cache.dtype, cache.device, 0
        self.keys = [t[r:r + 1] for t in cache.keys]
        self.values = [t[r:r + 1] for t in cache.values]
        self.tiles, self.tiles_upto = [], 0

    def tile_store(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # a row of a batch cache keeps no store (its steps, layer_rows, lay out their columns each call)

    def reserve(self, length: int) -> None:
        if length > self.capacity:
            raise ValueError(f"a cache row holds {self.capacity} columns, {length} were asked: allocate a larger cache")


_NO_TILES = torch.empty(0, 0, dtype=torch.int16)  # layer()'s key_tiles / value_tiles where a cache keeps no store

GATE_UP_BLOCK = 16  # the fused kernels' panel width: a thread that computes 16 gate columns has their up columns


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gate and up weights [I, H] each as one [2 I, H] weight whose rows alternate in blocks of
    :data:`GATE_UP_BLOCK` (gate rows 0-15, up rows 0-15, gate rows 16-31, ...): one product gives both, and in the
    fused kernels the thread that computed a block of gate columns applies SiLU(gate) * up to it
    (``silu_panel`` in xpress/csrc/fused_cpu.cpp). :func:`split_gate_up` undoes it on the product."""
    I, b = gate.shape[0], GATE_UP_BLOCK
    if I % b:
        raise RuntimeUnsupported(f"an MLP width of {I} (the lean runtime needs a multiple of {b})")
    return torch.stack([gate.detach().view(I // b, b, -1), up.detach().view(I // b, b, -1)], 1).reshape(2 * I, -1)


def split_gate_up(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up [..., I] from the product [..., 2 I] with an :func:`interleave_gate_up` weight."""
    blocks = gu.unflatten(-1, (-1, 2, GATE_UP_BLOCK))
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ============================================================================================ weights
class Linear:
    """``y = x @ weight.T`` for a weight [out, in], in the form that is fastest and row-invariant here.

    On a CPU (float32, or bf16 where native) the weight is prepacked once into oneDNN's blocked layout for
    16-row products (``torch.ops.mkldnn._reorder_linear_weight``; faster than ``F.linear`` at 1 and at 16 rows
    in probes on 2-core EPYCs, in bf16 and float32, and a row's bits do not depend on how many
    rows are computed with it). In bf16 a product over more than :data:`K_CHUNK` input features is summed, in
    float32, from equal parts of at most that many (oneDNN's bf16 kernels are row-invariant up to that
    depth). On a CPU with AMX-BF16, oneDNN switches kernel above 32-64 rows (to AMX tiles, which
    accumulate in another order: measured on a 2-core Xeon, rows differ by up to 0.28 in the logits), so there
    the rows are computed in blocks of at most :data:`M_CHUNK_AMX` (``row_block``), which keeps every row on
    the kernel a one-token step uses. Otherwise it is ``F.linear``. ``__call__`` returns the matmul dtype, or
    float32 when split.

    Given ``kernels`` (the fused C++ module; a float32 weight with a multiple of 16 rows), the weight is packed
    for its ``linear`` instead (``fused``, [out / 16, in, 16]) and every product runs there: in a probe on a
    2-core AVX2 EPYC (2026-12-03) it ran 1.1-1.5x oneDNN's products at 32-2,048 rows (float32, two threads),
    and it is row-invariant.
    """

    def __init__(self, weight: torch.Tensor, packed: bool, row_block: int = 0, kernels: Any = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.row_block = row_block  # 0: any number of rows in one call
        self.kernels = kernels if (kernels is not None and self.out_features % 16 == 0 and kernel_fits(weight)) else None
        if self.kernels is not None:
            w = weight.detach().contiguous()
            # float32: [out / 16, in, 16]; bf16 (AMX tiles): [out / 16, in / 2, 16, 2]
            self.fused = self.kernels.pack(w) if w.dtype == torch.float32 else self.kernels.pack_bf16(w)
            self.packed, self.slices, self.weights = True, [(0, self.in_features)], []
            return
        k = self.in_features
        parts = -(-k // K_CHUNK) if packed and weight.dtype == torch.bfloat16 else 1
        step = -(-k // parts)
        self.slices = [(s, min(k, s + step)) for s in range(0, k, step)]
        self.packed = packed
        w = weight.detach().contiguous()
        self.weights = [torch.ops.mkldnn._reorder_linear_weight(w[:, a:b].contiguous(), 16) if packed else w
                        for a, b in self.slices]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weights[0])
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.kernels is not None:
            return self.kernels.linear(x2.float().contiguous(), self.fused).view(*lead, self.out_features)
        if self.row_block and x2.shape[0] > self.row_block:
            out = torch.cat([self._rows(x2[r:r + self.row_block]) for r in range(0, x2.shape[0], self.row_block)])
        else:
            out = self._rows(x2)
        return out.reshape(*lead, self.out_features)

    def _rows(self, x2: torch.Tensor) -> torch.Tensor:
        """The product for rows x2 [m, in] -> [m, out]."""
        out = None
        for (a, b), w in zip(self.slices, self.weights):
            y = torch.ops.mkldnn._linear_pointwise(x2 if len(self.slices) == 1 else x2[:, a:b].contiguous(), w,
                                                   None, "none", [], "")
            out = y if len(self.slices) == 1 else (y.float() if out is None else out + y.float())
        return out


def kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the fused C++ products take this weight [out, in]: float32, or bf16 with ``in`` a multiple of
    32 (the AMX tiles' depth; the caller has checked that the module runs them, ``bf16_ready()``)."""
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0)


def amx_fits(cfg: Any) -> bool:
    """Whether every product of a Llama config reads a multiple of 32 features (the AMX tiles' depth): the
    hidden width, the attention width (heads x head width) and the MLP width."""
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return all(d % 32 == 0 for d in (int(cfg.hidden_size), int(cfg.num_attention_heads) * hd, int(cfg.intermediate_size)))


def lean_support(model: Any, dtype: torch.dtype, kernels: Any = None) -> tuple[bool, str]:
    """Whether :class:`LeanModel` runs ``model`` (a transformers ``*ForCausalLM``) in ``dtype`` on the device its
    weights are on, with the fused C++ ``kernels`` if given (the module of :func:`xpress.kernels.fused_cpu`),
    and if not, why: ``(True, "")`` or ``(False, reason)``. The one capability query a caller asks before
    choosing a runtime (studies fall back to the transformers forward and record the reason); the lean
    runtime refuses exactly these cases (:class:`RuntimeUnsupported` with the same reason)."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", "?")
    if model_type not in SUPPORTED:
        return False, f"model_type {model_type!r} (the lean runtime runs {', '.join(SUPPORTED)})"
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if rope.get("rope_type", "default") != "default":
        return False, f"RoPE type {rope.get('rope_type')!r} (the lean runtime runs the default)"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return False, "attention or MLP biases"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        return False, "sliding-window attention"
    if int(cfg.intermediate_size) % GATE_UP_BLOCK:
        return False, f"an MLP width of {cfg.intermediate_size} (the lean runtime needs a multiple of {GATE_UP_BLOCK})"
    if kernels is None:
        return True, ""
    if model_type != "llama" or next(model.parameters()).device.type != "cpu":
        return False, f"the fused kernels run Llama models on a CPU (this target: {model_type})"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"the fused kernels run float32 or bf16, not {dtype}"
    if dtype == torch.bfloat16 and not (kernels.bf16_ready() and amx_fits(cfg)):
        return False, "the fused kernels run bf16 on AMX tiles or with AVX512-BF16, over multiples of 32 features"
    return True, ""


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [H] float32
    wqkv: Linear  # [(nh + 2 nkv) hd, H]
    wo: Linear  # [H, nh hd]
    ln2: torch.Tensor  # [H] float32
    wgu: Linear  # [2 I, H]: gate and up rows interleaved in blocks of 16 (interleave_gate_up)
    wd: Linear  # [H, I]
    q_norm: torch.Tensor | None  # [hd] float32 (Qwen3) or None
    k_norm: torch.Tensor | None
    fused: tuple[torch.Tensor, ...] = ()  # wqkv, wo, wgu, wd packed for the fused kernels, [N / 16, K, 16] each


def attention_name(lean: LeanModel) -> str:
    """What the fused layer's attention computes in (provenance's ``attention``)."""
    if not lean.tile_attention:
        return "float32 (fused kernel)"
    from .kernels import bf16_unit

    unit = bf16_unit(lean.kernels)
    return f"bf16 products on {unit}" if lean.kernels.amx_ready() else f"bf16 products with {unit}"


class LeanModel:
    """The weights of a transformers Llama/Qwen3 ``*ForCausalLM`` rearranged for :meth:`forward`.

    ``dtype`` is the matmul dtype (the weights'); norms, RoPE tables, the residual stream and the softmax
    statistics stay float32. ``kernels``: the compiled module of :func:`xpress.kernels.fused_cpu`, or None.
    Given one (float32, a Llama model), a forward of one sequence runs each decoder layer as one C++ call
    (:meth:`_fused_block`), exact by the same construction; a left-padded batch of several rows (:meth:`forward`)
    runs the PyTorch layer with the C++ kernel's products (:class:`Linear`), while a cache with one row per
    sequence (:meth:`prefill_row`, :meth:`step_rows`, :meth:`forward_rows`) runs every row through the C++
    layer, each bit for bit as alone. ``attention``: ``auto`` runs a fused bf16 layer's
    attention products in bf16 too (:attr:`tile_attention`: AMX tiles, or AVX512-BF16 without them),
    ``float32`` keeps them in float32.
    """

    def __init__(self, model: Any, dtype: torch.dtype, kernels: Any = None, attention: str = "auto") -> None:
        cfg = model.config
        ok, why = lean_support(model, dtype, kernels=kernels)
        if not ok:
            raise RuntimeUnsupported(why)
        self.config = cfg
        self.dtype = dtype
        self.device = next(model.parameters()).device
        bf16 = dtype == torch.bfloat16
        self.packed = self.device.type == "cpu" and (dtype == torch.float32 or (bf16 and native_bf16()))  # see Linear
        self.row_block = bf16_row_block() if self.packed and bf16 else 0
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.hidden = int(cfg.hidden_size)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.n_layers = int(cfg.num_hidden_layers)
        self.kernels = kernels
        # the fused bf16 layer's attention products in bf16 (attend_bf16 in xpress/csrc/fused_cpu.cpp): on AMX
        # tiles or, without them, with AVX512-BF16; the kernels' `tiles` argument
        self.tile_attention = (kernels is not None and bf16 and self.head_dim % 32 == 0 and attention == "auto"
                               and kernels.bf16_ready())
        # the dtype activations are cast to before a product, and the K/V cache's: the matmul dtype, except
        # with the fused kernels, which take float32 activations (bf16 products round them inside)
        self.act = torch.float32 if kernels is not None else dtype
        base = model.model
        f32 = torch.float32

        def w(t: torch.Tensor) -> Linear:  # with the kernels: packed for them, batches included
            return Linear(t.detach().to(dtype), packed=self.packed, row_block=self.row_block, kernels=kernels)

        def fused(*ls: Linear) -> tuple[torch.Tensor, ...]:  # the packed weights the C++ layer reads
            return tuple(x.fused for x in ls) if kernels is not None else ()

        # RoPE pairs feature j with j + hd/2 in every head; the rows of wq and wk (and the q/k norms) are
        # reordered so that each pair is adjacent and RoPE becomes one complex product (:meth:`_block`).
        # q and k get the same order, so their dot products, and everything after, are unchanged.
        hd = self.head_dim
        pair = torch.arange(hd).view(2, hd // 2).t().reshape(-1)  # [0, hd/2, 1, hd/2 + 1, ...]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [heads * hd, ...] with each head's rows reordered
            return t.view(-1, hd, *t.shape[1:])[:, pair].reshape(t.shape)

        self.layers = []
        for layer in base.layers:
            at, mlp = layer.self_attn, layer.mlp
            wqkv = w(torch.cat([heads(at.q_proj.weight), heads(at.k_proj.weight), at.v_proj.weight]))
            wo, wgu = w(at.o_proj.weight), w(interleave_gate_up(mlp.gate_proj.weight, mlp.up_proj.weight))
            wd = w(mlp.down_proj.weight)
            self.layers.append(LayerWeights(
                ln1=layer.input_layernorm.weight.detach().to(f32), wqkv=wqkv, wo=wo,
                ln2=layer.post_attention_layernorm.weight.detach().to(f32), wgu=wgu, wd=wd,
                q_norm=heads(at.q_norm.weight.detach().to(f32)) if hasattr(at, "q_norm") else None,
                k_norm=heads(at.k_norm.weight.detach().to(f32)) if hasattr(at, "k_norm") else None,
                fused=fused(wqkv, wo, wgu, wd)))
        self.norm = base.norm.weight.detach().to(f32)
        self.embed = base.embed_tokens.weight.detach().to(dtype)  # [V, H]
        self.lm_head = w(model.get_output_embeddings().weight)  # [V, H]
        self.lm_head_fused = fused(self.lm_head)  # () or ([V / 16, H, 16],)
        inv_freq = base.rotary_emb.inv_freq.detach().to(f32)
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.inv_freq = inv_freq  # [hd / 2]
        self._rot = torch.empty(0, self.head_dim // 2, dtype=torch.complex64)
        self.capture: list | None = None  # when a list: every forward appends (features, normed hidden, logits)
        self.capture_layers: list[int] = []  # the layers whose residual streams the capture keeps

    # ------------------------------------------------------------------------------------- pieces
    def new_cache(self, batch: int, capacity: int = 256) -> StaticKV:
        return StaticKV(self.n_layers, batch, self.n_kv, self.head_dim, self.act, self.device, capacity)

    def _rope_table(self, max_pos: int) -> torch.Tensor:
        """RoPE as complex rotations [positions, hd / 2] complex64 for positions 0..max_pos-1 (grown
        geometrically): ``scale * exp(i * pos * inv_freq)``."""
        if self._rot.shape[0] < max_pos:
            n = max(max_pos, 2 * self._rot.shape[0], 1024)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq.cpu())
            self._rot = torch.polar(torch.full_like(freqs, self.rope_scale), freqs).to(self.device)
        return self._rot

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    # ------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: StaticKV, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                feature_layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids`` [b, n] after the ``L`` columns of ``cache`` and append their K/V.

        position_ids [b, n] (default ``L..L+n-1``); attention_mask [b, L + n] 1 = real column, 0 = hole
        (None: every column is real). Returns logits [b, k, V] float32 for the last ``k = logits_to_keep``
        positions (0 = all) and, when ``feature_layers`` is given, the concatenated residual streams after
        those layers [b, n, len(feature_layers) H] in the model dtype (None otherwise). A long input is run
        in chunks of :data:`ROW_CHUNK` tokens, each seeing the ones before.
        """
        b, n = input_ids.shape
        L0 = cache.length
        if position_ids is None:
            position_ids = torch.arange(L0, L0 + n, device=input_ids.device).expand(b, n)
        cache.reserve(L0 + n)
        keep = n if logits_to_keep <= 0 else min(logits_to_keep, n)
        watch = self.capture is not None
        layers = feature_layers if not watch else list(dict.fromkeys([*(feature_layers or []), *self.capture_layers]))
        logits, feats, normed = [], [], []
        # one sequence, no holes, not regeneration's capture (whose batches run the PyTorch path): fused
        fused = (self.kernels is not None and b == 1 and not watch
                 and (attention_mask is None or bool(attention_mask.all())))
        for s in range(0, n, ROW_CHUNK):
            e = min(n, s + ROW_CHUNK)
            mask = None if attention_mask is None else attention_mask[:, :L0 + e]
            block = self._fused_block if fused else self._block
            h, f = block(input_ids[:, s:e], cache, position_ids[:, s:e], mask, layers)
            if watch:
                normed.append(self._final_norm(h, fused))
            if e > n - keep:  # some of these positions' logits are asked for
                x = normed[-1] if watch else self._final_norm(h, fused)
                x = x[:, max(0, n - keep - s):]
                logits.append(self.kernels.linear(x[0].float().contiguous(), self.lm_head_fused[0])[None] if fused
                              else self.lm_head(x).float())
            if f is not None:
                feats.append(f)
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 1)  # noqa: E731
        logits = cat(logits)
        features = cat(feats) if feats else None
        if watch:  # the states regeneration stores: the capture layers' features, the normed hidden, the logits
            H = self.hidden
            pick = [layers.index(j) for j in self.capture_layers]
            self.capture.append((torch.cat([features[..., i * H:(i + 1) * H] for i in pick], -1), cat(normed), logits))
            if feature_layers is not None:
                features = torch.cat([features[..., layers.index(j) * H:(layers.index(j) + 1) * H]
                                      for j in feature_layers], -1)
            else:
                features = None
        return logits, features

    # ------------------------------------------------------------------ one cache row per sequence
    def prefill_row(self, ids: torch.Tensor, cache: StaticKV, row: int, feature_layers: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run one sequence's ids [n] from position 0 into row ``row`` of ``cache`` (what the row held is
        overwritten) with the fused kernels, exactly as :meth:`forward` runs it alone. Returns the final-normed
        hidden states [n, H], the last position's logits [V] float32 and the features after
        ``feature_layers`` [n, len(feature_layers) H] (None without)."""
        if self.kernels is None:
            raise RuntimeUnsupported("prefill_row runs the fused kernels (target.kernels=fused, float32)")
        n = ids.shape[0]
        view = cache.row(row)
        view.reserve(n)  # a row cannot grow: refuses a prompt longer than the cache
        cache.length = max(cache.length, n)  # the columns some row holds (kept when a later step grows the cache)
        pos = torch.arange(n, device=ids.device)[None]  # [1, n]
        normed, feats = [], []
        for s in range(0, n, ROW_CHUNK):
            h, f = self._fused_block(ids[None, s:s + ROW_CHUNK], view, pos[:, s:s + ROW_CHUNK], None, feature_layers)
            normed.append(self._final_norm(h, True)[0])
            if f is not None:
                feats.append(f[0])
        normed = normed[0] if len(normed) == 1 else torch.cat(normed)
        logits = self.kernels.linear(normed[-1:].float().contiguous(), self.lm_head_fused[0])[0]
        return normed, logits, (None if feature_layers is None else torch.cat(feats) if len(feats) > 1 else feats[0])

    def step_rows(self, tokens: torch.Tensor, cache: StaticKV, rows: torch.Tensor, lengths: torch.Tensor,
                  feature_layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One forward of m tokens, each after the cached columns of its sequence's row: token i goes after the
        ``lengths[i]`` columns of row ``rows[i]`` (int64 [m] each) of ``cache`` and writes its keys and values at
        column ``lengths[i]`` (the caller keeps the lengths; the cache grows to hold them). ``layer_rows``
        (xpress/csrc/fused_cpu.cpp) writes every token's keys and values before any attention and token i attends
        to columns ``0..lengths[i]`` of its row, so the pairs (row, length) must be distinct but a row may repeat:
        a row given at lengths ``L, L + 1, ..`` runs a causal block (:meth:`forward_rows`). Each token's numbers
        are bit for bit those of a :meth:`forward` of its sequence alone. Returns the final-normed hidden states
        [m, H], the logits [m, V] float32 and the features [m, F] float32 (or None)."""
        if self.kernels is None:
            raise RuntimeUnsupported("step_rows runs the fused kernels (target.kernels=fused, float32)")
        top = int(lengths.max()) + 1
        cache.reserve(top)  # copies the first cache.length columns: the most any row holds
        cache.length = max(cache.length, top)
        rot = torch.view_as_real(self._rope_table(top)[lengths]).contiguous()  # [m, hd / 2, 2]
        h = self.embed[tokens].float()  # [m, H]
        want = set(feature_layers or ())
        feats = {}
        for i, lw in enumerate(self.layers):
            wqkv, wo, wgu, wd = lw.fused
            h = self.kernels.layer_rows(h, lw.ln1, wqkv, wo, lw.ln2, wgu, wd, rot, cache.keys[i], cache.values[i],
                                        rows, lengths, self.n_heads, self.n_kv, self.eps, self.tile_attention)
            if i in want:
                feats[i] = h
        normed = self.kernels.rms_norm(h, self.norm, self.eps).to(self.dtype)  # what the LM head reads
        logits = self.kernels.linear(normed.float(), self.lm_head_fused[0])
        return normed, logits, (torch.cat([feats[j] for j in feature_layers], -1) if feature_layers else None)

    @torch.no_grad()
    def forward_rows(self, input_ids: torch.Tensor, cache: StaticKV, lengths: torch.Tensor,
                     feature_layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids`` [b, n]: row i's n tokens after the ``lengths[i]`` (int64 [b]) cached columns of row i
        of ``cache`` (one row per sequence, every sequence from column 0: no padding, no holes), writing their
        keys and values at columns ``lengths[i] .. lengths[i] + n - 1`` (the caller advances the lengths by what it
        keeps; columns past them are overwritten by the next forward). Positions are the columns. The n tokens are
        flattened into one :meth:`step_rows` (causal within the block), in chunks of :data:`ROW_CHUNK` tokens per
        row, so row i's numbers are bit for bit those of a :meth:`forward` of its sequence alone. Returns logits
        [b, n, V] float32 and, with ``feature_layers``, the features [b, n, len(feature_layers) H] float32."""
        b, n = input_ids.shape
        dev = input_ids.device
        logits, feats = [], []
        for s in range(0, n, ROW_CHUNK):
            e = min(n, s + ROW_CHUNK)
            rows = torch.arange(b, device=dev).repeat_interleave(e - s)  # [b (e - s)]: row 0's tokens, row 1's, ..
            at = (lengths[:, None] + torch.arange(s, e, device=dev)).reshape(-1)  # their columns
            _, lg, f = self.step_rows(input_ids[:, s:e].reshape(-1), cache, rows, at, feature_layers)
            logits.append(lg.view(b, e - s, -1))
            if f is not None:
                feats.append(f.view(b, e - s, -1))
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 1)  # noqa: E731
        return cat(logits), (cat(feats) if feats else None)

    def _final_norm(self, h: torch.Tensor, fused: bool) -> torch.Tensor:
        """The final RMSNorm of h [b, n, H] float32 (the fused kernel's at batch 1), in the matmul dtype: what the
        LM head reads (bf16 products round their input to it), so the stored hidden states give its logits."""
        if fused:
            return self.kernels.rms_norm(h[0].contiguous(), self.norm, self.eps)[None].to(self.dtype)
        return self._rms(h, self.norm).to(self.dtype)

    def _fused_block(self, ids: torch.Tensor, cache: StaticKV, pos: torch.Tensor, mask: torch.Tensor | None,
                     feature_layers: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_block` for one sequence (b = 1, every cache column real) with each decoder layer one call
        of the C++ kernel ``layer`` (xpress/csrc/fused_cpu.cpp), which writes the new K/V in place."""
        n = ids.shape[1]
        L = cache.length
        rot = torch.view_as_real(self._rope_table(int(pos.max()) + 1)[pos[0]]).contiguous()  # [n, hd / 2, 2]
        h = self.embed[ids[0]].float()  # [n, H] residual stream, float32
        feats = []
        want = set(feature_layers or ())
        store = cache.tile_store() if self.tile_attention else []
        start = min(cache.tiles_upto, L)
        for i, lw in enumerate(self.layers):
            wqkv, wo, wgu, wd = lw.fused
            kt, vt = store[i] if store else (_NO_TILES, _NO_TILES)
            h = self.kernels.layer(h, lw.ln1, wqkv, wo, lw.ln2, wgu, wd, rot, cache.keys[i][0], cache.values[i][0],
                                   L, self.n_heads, self.n_kv, self.eps, self.tile_attention, kt, vt, start)
            if i in want:
                feats.append(h[None])
        cache.advance(n)
        if store:
            cache.tiles_upto = L + n
        if feature_layers is None:
            return h[None], None
        return h[None], torch.cat([feats[sorted(want).index(j)] for j in feature_layers], dim=-1)

    def _block(self, ids: torch.Tensor, cache: StaticKV, pos: torch.Tensor, mask: torch.Tensor | None,
               feature_layers: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk of at most ROW_CHUNK tokens: the residual stream after the last layer [b, n, H]
        float32 and the features (or None)."""
        b, n = ids.shape
        L = cache.length
        cache.tiles_stale_from(L)  # _layer writes columns L..L+n-1 in place
        rot = self._rope_table(int(pos.max()) + 1)[pos][:, :, None]  # [b, n, 1, hd / 2] complex
        bias = attention_bias(b, n, L, self.n_heads // self.n_kv, mask, ids.device)  # [b, 1, n g, Lc], Lc = L + n rounded up to CHUNK
        h = self.embed[ids].float()  # [b, n, H] residual stream, float32
        feats = []
        want = set(feature_layers or ())
        for i, lw in enumerate(self.layers):
            h = self._layer(h, lw, cache.keys[i], cache.values[i], L, rot, bias)
            if i in want:
                feats.append(h.to(self.act))
        cache.advance(n)
        if feature_layers is None:
            return h, None
        return h, torch.cat([feats[sorted(want).index(j)] for j in feature_layers], dim=-1)

    def _layer(self, h: torch.Tensor, lw: LayerWeights, keys: torch.Tensor, values: torch.Tensor, L: int,
               rot: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """One decoder layer on the residual stream h [b, n, H] float32 -> [b, n, H]; writes the new K/V into
        columns L.. of this layer's ``keys`` / ``values`` buffers [b, nkv, capacity, hd]."""
        b, n, _ = h.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        g, Lc = nh // nkv, bias.shape[-1]
        qkv = lw.wqkv(self._rms(h, lw.ln1).to(self.act)).view(b, n, nh + 2 * nkv, hd)
        qk = qkv[:, :, :nh + nkv].float()
        if lw.q_norm is not None:  # Qwen3: RMSNorm over each head's q and k before RoPE
            qk = torch.cat([self._rms(qk[:, :, :nh], lw.q_norm), self._rms(qk[:, :, nh:], lw.k_norm)], dim=2)
        qk = torch.view_as_real(torch.view_as_complex(qk.reshape(b, n, nh + nkv, hd // 2, 2)) * rot)
        qk = qk.reshape(b, n, nh + nkv, hd).to(self.act)  # RoPE applied, [b, n, nh + nkv, hd]
        keys[:, :, L:L + n] = qk[:, :, nh:].transpose(1, 2)
        values[:, :, L:L + n] = qkv[:, :, nh + nkv:].to(self.act).transpose(1, 2)
        q = qk[:, :, :nh].reshape(b, n, nkv, g, hd).transpose(1, 2).reshape(b, nkv, n * g, hd)
        att = invariant_attention(q, keys[:, :, :Lc], values[:, :, :Lc], bias, g)  # [b, nkv, n g, hd]
        att = att.view(b, nkv, n, g, hd).transpose(1, 2).reshape(b, n, nh * hd)
        h = h + lw.wo(att.to(self.act)).float()
        gate, up = split_gate_up(lw.wgu(self._rms(h, lw.ln2).to(self.act)))
        return h + lw.wd((F.silu(gate) * up).to(self.act)).float()


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                        group: int = 1) -> torch.Tensor:
    """Attention whose result for one query never depends on the other queries or on masked columns.

    q [b, nkv, n g, hd] (RoPE applied, matmul dtype; rows ordered (token, query head in the group), ``g =
    group``); keys, values [b, nkv, Lc, hd] with ``Lc`` a multiple of :data:`CHUNK`; bias [b, 1, n g, Lc]
    float32, 0 where the row may attend and -inf elsewhere (:func:`attention_bias`). Returns
    [b, nkv, n g, hd] float32.

    The scores are a matmul whose rows are independent (see :func:`row_blocks`). The softmax subtracts
    the row's maximum (exact in any order). Its denominator and the value product are computed per chunk of
    CHUNK columns (a fixed-length reduction and a matmul of fixed depth; masked columns are exact zeros) and
    the chunks are combined by a cumulative sum, a sequential scan, so trailing empty chunks add exact
    zeros. Hence a 16-token verify and 16 one-token steps give the same bits.
    """
    b, nkv, R, hd = q.shape
    Lc = keys.shape[2]
    C = Lc // CHUNK
    s = row_blocks(q, keys.transpose(-1, -2), group)  # [b, nkv, R, Lc]
    s = s.float().mul_(1.0 / math.sqrt(hd)).add_(bias)
    top = s.amax(-1, keepdim=True).clamp_min_(-1e30)  # a row that may see nothing (a hole) gets exp(-inf) = 0
    p = s.sub_(top).exp_().view(b, nkv, R, C, CHUNK)
    den = p.sum(-1).cumsum(-1)[..., -1:]  # [b, nkv, R, 1]
    o = row_blocks(p.to(values.dtype).transpose(2, 3), values.view(b, nkv, C, CHUNK, hd), group)  # [b, nkv, C, R, hd]
    num = o.float().cumsum(2)[:, :, -1]  # [b, nkv, R, hd]
    return num / den.clamp_min(1e-30)


def row_blocks(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """``torch.matmul(x, w)`` with the rows of x (its second-to-last dimension) computed so that each row's
    bits do not depend on how many rows there are.

    bf16 (oneDNN): one matmul; its rows are independent at any count (:func:`check_row_invariance`).
    float32 on a CPU (MKL), batch 1 (``x.shape[0]``; the regime whose exactness the project claims: AR and
    speculative decoding of one sequence): the kernel changes with the number of rows (a 16-token verify's
    48 query rows per key-value head and a step's 3 gave different last bits), so the rows are zero-padded
    to whole blocks of exactly ``QUERY_BLOCK * group`` and every block is one matmul of that shape, whatever
    the row's position in it. A step pays for QUERY_BLOCK tokens' rows, a 16-token verify makes 16 /
    QUERY_BLOCK calls: 4 was the best trade on a 2-core AVX2 EPYC (16 made a step at 1,000 tokens of context
    slower than the transformers forward). A batch of several sequences is one matmul (its rows sit at other
    cache columns anyway; see docs/inference.md).
    """
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] == 1):
        return torch.matmul(x, w)
    m = QUERY_BLOCK * group
    R = x.shape[-2]
    if R % m:
        pad = torch.zeros(*x.shape[:-2], m - R % m, x.shape[-1], dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=-2)
    out = [torch.matmul(x[..., r:r + m, :], w) for r in range(0, x.shape[-2], m)]
    return (out[0] if len(out) == 1 else torch.cat(out, dim=-2))[..., :R, :]


def attention_bias(b: int, n: int, L: int, g: int, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The additive mask of :func:`invariant_attention`: [b, 1, n g, Lc] float32 over the first ``Lc``
    columns (``L + n`` rounded up to a whole chunk). New token j sees columns ``< L + j + 1`` that are real
    (``mask`` [b, L + n], 1 = real; None = all real); each token's row repeats for the g query heads of a group."""
    Lc = _round_up(L + n, CHUNK)
    col = torch.arange(Lc, device=device)
    ok = (col[None, :] <= (L + torch.arange(n, device=device))[:, None])[None]  # [1, n, Lc]
    if mask is not None:
        real = torch.zeros(b, Lc, dtype=torch.bool, device=device)
        real[:, :mask.shape[1]] = mask.bool()
        ok = ok & real[:, None, :]
    bias = torch.zeros(ok.shape, device=device).masked_fill_(~ok, float("-inf"))  # [b or 1, n, Lc]
    return bias[:, None, :, None].expand(-1, 1, n, g, Lc).reshape(bias.shape[0], 1, n * g, Lc)


# ===================================================================================== invariance
def check_row_invariance(lean: LeanModel, context: int = 150, n: int = 16, seed: int = 0) -> dict[str, Any]:
    """Run ``n`` random tokens after ``context`` random ones three ways -- in the prefill (one call over all
    ``context + n``, in chunks of :data:`ROW_CHUNK`), as one n-token forward (a verify) and as n one-token
    forwards (steps) -- and compare their logits and K/V bit for bit. Returns ``{"exact": bool,
    "max_abs_diff": float, "context": context, "n": n}``. The lean runtime keeps bf16 only where this holds."""
    gen = torch.Generator().manual_seed(seed)
    V = lean.embed.shape[0]
    ids = torch.randint(V, (1, context + n), generator=gen).to(lean.device)
    runs = []
    for how in ("prefill", "verify", "steps"):
        cache = lean.new_cache(1, context + n)
        if how == "prefill":
            logits, _ = lean.forward(ids, cache, logits_to_keep=n)
        else:
            lean.forward(ids[:, :context], cache, logits_to_keep=1)
            if how == "verify":
                logits, _ = lean.forward(ids[:, context:], cache, logits_to_keep=0)
            else:
                logits = torch.cat([lean.forward(ids[:, context + j:context + j + 1], cache, logits_to_keep=1)[0]
                                    for j in range(n)], dim=1)
        runs.append((logits, [t[:, :, :context + n] for t in cache.keys + cache.values]))
    (ref, ref_kv), others = runs[-1], runs[:-1]
    exact = all(torch.equal(lg, ref) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv)) for lg, kv in others)
    diff = max(float((lg - ref).abs().max()) for lg, _ in others)
    return {"exact": exact, "max_abs_diff": diff, "context": context, "n": n}
