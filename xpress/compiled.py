"""The compiled harness (``decode.compile``): the transformers target's forward on a static KV cache,
``torch.compile``'d for the fixed shapes of batch-1 decoding, and the helper that compiles the refiners'
fixed-pass rollouts (:meth:`xpress.proposer.ModelDrafter.compile`).

What the paper's Table 1 timed on its GPU: every module compiled, the correction rollout a CUDA graph. The
eager harness (``decode.compile: false``) runs transformers' forward with a growing ``DynamicCache``, a new
shape every step. Here (docs/gpu.md, "The compiled Table 1 harness"):

- :class:`StaticKVCache`: one sequence's KV cache, a transformers ``StaticCache`` of
  ``decode.static_cache_len`` columns allocated once per target and reused by every generation (fixed
  addresses, so CUDA graphs replay over it), plus the number of columns written. A forward of ``n`` new tokens
  writes columns ``length .. length + n - 1`` (transformers' static layers keep that count on the device)
  and each query attends to the columns up to its own position (``cache_position``: the static cache's
  causal mask), so dropping a rejected tail is setting the count back (:meth:`CompiledForward.rewind`): the
  stale columns are never read and are overwritten by the next forward.
- :class:`CompiledForward`: called as the transformers model is (``input_ids``, ``past_key_values``,
  ``position_ids``, ``output_hidden_states``, ``logits_to_keep``), so :func:`xpress.targets.frame_forward`
  and every caller of :func:`xpress.targets.target_forward` drive it unchanged. Forwards of the row counts in
  ``rows`` (1-row steps, the verify block, ``target.frame_rows``) run a ``torch.compile``'d function
  (``dynamic=False``: one graph per row count; ``mode="reduce-overhead"``, CUDA graphs, on CUDA with
  inductor); any other length (the prompt's prefill) runs the same model eagerly on the same static cache.
  Several sequences at once (ragged batches: a mask of holes) keep the eager ``DynamicCache`` path.

:func:`compile_fn` is the one place that calls ``torch.compile``. On a CPU it compiles without CUDA graphs
(float32 on the transformers runtime; tests/test_compiled.py checks that greedy tokens equal the eager
path's). Nothing here imports the decoding engine.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

RECOMPILE_LIMIT = 64  # graphs per compiled function: one per fixed shape (row counts, logits kept, features)


class CompiledError(RuntimeError):
    """A compiled-path forward that cannot run as asked; the message says how to fix it."""


def uses_cuda_graphs(device: torch.device | str, backend: str) -> bool:
    """Whether :func:`compile_fn` captures CUDA graphs: inductor on a CUDA device."""
    return torch.device(device).type == "cuda" and backend == "inductor"


def compile_fn(fn: Callable, device: torch.device | str, backend: str = "inductor", dynamic: bool = False) -> Callable:
    """``torch.compile(fn)`` for fixed shapes (``dynamic=False``): ``mode="reduce-overhead"`` (CUDA graphs) on
    CUDA with inductor, plain ``backend`` elsewhere (a CPU: no graphs). With CUDA graphs the outputs live in
    the graph's memory, overwritten by the next replay, so the returned function marks a new step before
    each call and returns copies of the output tensors. ``dynamic=True`` (shapes that change every call, such
    as the drafter's growing context): compiled with symbolic shapes and never graphed."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, RECOMPILE_LIMIT)
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    if dynamic:
        return torch.compile(fn, backend=backend, dynamic=True)
    if not uses_cuda_graphs(device, backend):
        return torch.compile(fn, backend=backend, dynamic=False)
    compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)

    def replay(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    return replay


class StaticKVCache:
    """One sequence's handle on :class:`CompiledForward`'s static cache: ``length`` columns written (the cache's
    ``get_seq_length()``), ``crop`` as ``DynamicCache.crop`` (a negative count drops that many columns).
    Valid until the next :meth:`CompiledForward.new_cache`, which hands the storage to a new sequence."""

    def __init__(self, owner: "CompiledForward") -> None:
        self.owner, self.length = owner, 0

    @property
    def capacity(self) -> int:
        return self.owner.capacity

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def crop(self, n: int) -> None:
        self.length = max(0, self.length + n) if n < 0 else min(self.length, n)
        self.owner.rewind(self.length)


class CompiledForward:
    """The transformers ``model``'s forward on a static cache of ``capacity`` columns for batch-1 decoding,
    compiled for the row counts ``rows`` (module docstring). ``backend``: :func:`compile_fn`'s."""

    def __init__(self, model: Any, capacity: int, rows: set[int], backend: str = "inductor") -> None:
        self.model, self.capacity, self.rows, self.backend = model, capacity, set(rows), backend
        self.device = next(model.parameters()).device
        self._static: Any = None  # the transformers StaticCache, allocated on first use
        self._current: StaticKVCache | None = None
        self._compiled = compile_fn(self._forward, self.device, backend)

    @property
    def cuda_graphs(self) -> bool:
        return uses_cuda_graphs(self.device, self.backend)

    def new_cache(self, batch: int) -> Any:
        """A fresh cache: the static one (batch 1; any earlier :class:`StaticKVCache` handle becomes invalid) or,
        for several rows, a transformers ``DynamicCache`` (the eager path of ragged batches)."""
        from transformers import DynamicCache, StaticCache

        if batch != 1:
            return DynamicCache(config=self.model.config)
        if self._static is None:
            self._static = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        self._current = StaticKVCache(self)
        self.rewind(0)
        return self._current

    def rewind(self, length: int) -> None:
        """Set where the next forward writes: transformers' static layers count the columns written on the
        device (``cumulative_length``, a static tensor the graphs read) and write there; set in place, no
        host synchronisation."""
        for layer in self._static.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)

    def _forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, logits_to_keep: int,
                 hidden_states: bool) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=input_ids, position_ids=cache_position[None], cache_position=cache_position,
                         past_key_values=self._static, use_cache=True, output_hidden_states=hidden_states,
                         logits_to_keep=logits_to_keep)
        return out.logits, (out.hidden_states if hidden_states else None)

    def __call__(self, input_ids: torch.Tensor, past_key_values: Any = None, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                 output_hidden_states: bool = False, logits_to_keep: int = 0) -> Any:
        """One forward, as ``model(...)`` is called: returns ``.logits`` [1, kept, V], ``.hidden_states`` (a
        tuple: embeddings, then every layer's output; None unless asked) and ``.past_key_values``."""
        cache = past_key_values
        if not isinstance(cache, StaticKVCache):  # several rows (or a caller's own cache): the eager model
            return self.model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids,
                              attention_mask=attention_mask, use_cache=use_cache,
                              output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)
        if cache is not self._current:
            raise CompiledError("this static-cache handle was replaced by a newer sequence's (decode.compile runs "
                                "one sequence at a time per target); finish one generation before starting another")
        if attention_mask is not None or input_ids.shape[0] != 1:
            raise CompiledError("the static cache holds one sequence without holes; ragged batches take "
                                "new_cache(batch > 1)")
        n, start = input_ids.shape[1], cache.length
        if start + n > self.capacity:
            raise CompiledError(f"the static KV cache holds {self.capacity} columns (decode.static_cache_len) and "
                                f"this forward needs {start + n}; raise decode.static_cache_len or set "
                                f"decode.compile=false")
        cache_position = (position_ids[0] if position_ids is not None
                          else torch.arange(start, start + n, device=input_ids.device))
        fn = self._compiled if n in self.rows else self._forward  # other lengths (prefill): eager, same cache
        logits, hidden = fn(input_ids, cache_position, logits_to_keep, output_hidden_states)
        cache.length = start + n
        return SimpleNamespace(logits=logits, hidden_states=hidden, past_key_values=cache)

    def describe(self) -> dict[str, Any]:
        """For provenance: the backend, CUDA graphs or not, the cache's columns and the compiled row counts."""
        return {"compiled": True, "compile_backend": self.backend, "cuda_graphs": self.cuda_graphs,
                "static_cache_len": self.capacity, "compiled_rows": sorted(self.rows)}
