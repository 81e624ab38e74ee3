"""Where a target forward spends its time: ``python -m xpress bench target-cost --preset cpu``.

The preset's target runs ``n`` new tokens (1, 4, 8, 16) after ``L`` tokens of context (64, 300, 1000) in the
lean runtime (:mod:`xpress.runtime`), in float32 and, where the machine multiplies bf16 natively, in
bfloat16, and through the transformers forward in float32 (the path the project used before the lean
runtime). Each lean forward is split into components, each timed on its own over all the layers with the
forward's own shapes and weights:

- ``linear``: the four projections of every layer (q/k/v, o, gate/up, down);
- ``attention``: :func:`xpress.runtime.invariant_attention` of every layer over its ``L + n`` columns;
- ``cache update``: writing the new keys and values of every layer into the cache;
- ``lm head``: the final norm and the readout of the kept positions (1 for a step, n for a verify);
- ``other``: the whole forward minus those (norms, RoPE, residual adds, casts, Python).

Where the fused C++ kernels build (:mod:`xpress.kernels`), the lean forward with each layer one C++ call is
timed too (runtime ``lean-fused``; ``forward`` only, its layer is one call that cannot be split): in float32,
and in bfloat16 where its products run on AMX tiles. Each runtime is first asked of
:func:`xpress.runtime.lean_support`; what the target cannot run (the fused layer of a Qwen3 target) is listed
in the file's ``skipped`` with the reason.

Everything is timed in one process with interleaved sweeps (:func:`xpress.timing.time_calls`). The
ratio ``forward(n) / forward(1)`` at a context is the break-even tau of an n-token verify with free
drafting: a speculative round must commit that many tokens to match autoregressive decoding.

    from xpress.studies.target_cost import run_target_cost
    result = run_target_cost("cpu")      # results/cpu/target_cost.{json,csv}

The last section times the whole step and verify of any target at given :class:`xpress.studies.shapes.Shapes`
(:func:`time_target`; a random transformers Qwen3 of the paper's shapes from :func:`random_target`): notebook
05's latency study puts them beside the drafter's own costs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .. import paths
from ..timing import time_call, time_calls
from .shapes import Shapes

CONTEXTS = (64, 300, 1000)
NEW_TOKENS = (1, 4, 8, 16)
COMPONENTS = ("linear", "attention", "cache update", "lm head", "other")


def lean_calls(lean: Any, context: int, n: int, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """The whole forward of ``n`` random tokens after ``context`` random ones (``forward``, cache cropped
    back after each call) and its components (see the module docstring), as callables."""
    from ..runtime import CHUNK, attention_bias

    gen = torch.Generator().manual_seed(seed)
    V, H = lean.embed.shape
    nh, nkv, hd = lean.n_heads, lean.n_kv, lean.head_dim
    g, dt = nh // nkv, lean.act  # the activations' dtype (float32 with the fused kernels)
    cache = lean.new_cache(1, context + n)
    lean.forward(torch.randint(V, (1, context), generator=gen), cache, logits_to_keep=1)
    ids = torch.randint(V, (1, n), generator=gen)
    keep = 1 if n == 1 else 0  # a step keeps one logit, a verify all of them

    def forward():
        lean.forward(ids, cache, logits_to_keep=keep)
        cache.crop(-n)

    x = torch.randn(1, n, H, generator=gen).to(dt)
    inter = lean.layers[0].wd.in_features
    xi = torch.randn(1, n, inter, generator=gen).to(dt)

    def linear():
        for lw in lean.layers:
            lw.wqkv(x)
            lw.wo(x)
            lw.wgu(x)
            lw.wd(xi)

    bias = attention_bias(1, n, context, g, None, ids.device)
    Lc = bias.shape[-1]
    cache.reserve(Lc)
    q = torch.randn(1, nkv, g * n, hd, generator=gen).to(dt)
    assert Lc % CHUNK == 0

    def attention():
        from ..runtime import invariant_attention

        for i in range(lean.n_layers):
            invariant_attention(q, cache.keys[i][:, :, :Lc], cache.values[i][:, :, :Lc], bias, g)

    k = torch.randn(1, nkv, n, hd, generator=gen).to(dt)

    def cache_update():
        for i in range(lean.n_layers):
            cache.write(i, k, k)

    h = torch.randn(1, max(1, n if keep == 0 else 1), H, generator=gen)

    def lm_head():
        lean.lm_head(F.rms_norm(h, (H,), lean.norm, lean.eps).to(dt)).float()

    return {"forward": forward, "linear": linear, "attention": attention, "cache update": cache_update,
            "lm head": lm_head}


def transformers_call(target: Any, context: int, n: int, seed: int = 0) -> Callable[[], Any]:
    """The transformers forward of ``n`` random tokens after ``context`` (a DynamicCache, cropped back
    after each call), as the decoding loops ran it before the lean runtime: the verify keeps every logit."""
    from ..targets import lm_logits

    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(target.vocab_size, (1, context), generator=gen)
    with torch.inference_mode():
        _, cache = lm_logits(target, ctx, None, torch.arange(context)[None], None)
    ids = torch.randint(target.vocab_size, (1, n), generator=gen)
    pos = torch.arange(context, context + n)[None]
    keep = 1 if n == 1 else n

    @torch.inference_mode()
    def call():
        lm_logits(target, ids, cache, pos, None, logits_to_keep=keep)
        cache.crop(-n)
    return call


def break_even(rows: Sequence[dict], block: int) -> list[dict[str, Any]]:
    """Per runtime, dtype and context: the 1-token step, the ``block``-token verify, their ratio (the
    break-even tau with free drafting) from the ``forward`` rows."""
    t = {(r["runtime"], r["dtype"], r["context"], r["new_tokens"]): r["median_ms"] for r in rows
         if r["component"] == "forward"}
    out = []
    for (rt, dt, L, n), ms in t.items():
        if n == 1 and (rt, dt, L, block) in t:
            verify = t[(rt, dt, L, block)]
            out.append({"runtime": rt, "dtype": dt, "context": L, "step_ms": ms, "verify_ms": verify,
                        "block": block, "verify_over_step": verify / ms, "break_even_tau": verify / ms})
    return out


def run_target_cost(preset: str = "cpu", contexts: Sequence[int] = CONTEXTS, new_tokens: Sequence[int] = NEW_TOKENS,
                    repeats: int = 7, warmup: int = 1, dtypes: Sequence[str] | None = None,
                    old_path: bool = True, out_dir: str | Path | None = None, overrides: Sequence[str] = (),
                    progress: bool = True) -> dict[str, Any]:
    """Time the preset target's forward per component (module docstring); write
    ``results/<preset>/target_cost.{json,csv}`` (atomically) and return the JSON payload.

    ``dtypes``: the lean runtime's dtypes to time (default: float32, and bfloat16 where native).
    ``old_path``: also time the transformers forward in float32 (``forward`` only).
    """
    import sys

    from ..config import load_config
    from ..runtime import LeanModel, lean_support, native_bf16
    from ..targets import load_target
    from ..utils import load_average, load_check, other_cpu_use, provenance, write_result

    load_start, others_start = load_average(), other_cpu_use()
    cfg = load_config(preset, list(overrides) + ["target.dtype=float32", "target.runtime=transformers"])
    target = load_target(cfg)  # the float32 transformers model: the old path, and the weights of every lean copy
    dtypes = list(dtypes or (["float32"] + (["bfloat16"] if native_bf16() else [])))
    fns: dict[str, Callable[[], Any]] = {}
    keys: dict[str, tuple] = {}
    skipped: list[dict[str, str]] = []  # the runtimes this target or machine cannot run, and why (lean_support)
    for dt in dtypes:
        ok, why = lean_support(target.model, getattr(torch, dt))
        if not ok:
            skipped.append({"runtime": "lean", "dtype": dt, "reason": why})
            continue
        lean = LeanModel(target.model, getattr(torch, dt))
        for L in contexts:
            for n in new_tokens:
                for comp, fn in lean_calls(lean, L, n).items():
                    name = f"lean {dt} L={L} n={n} {comp}"
                    fns[name], keys[name] = fn, ("lean", dt, L, n, comp)
    from ..kernels import fused_cpu
    from ..kernels import status as kernel_status

    fused = fused_cpu()
    for dt in dtypes:  # float32 on any AVX2 CPU, bf16 where the AMX tiles run
        ok, why = (False, f"the fused kernels are not available ({kernel_status().get('reason', '')})") \
            if fused is None else lean_support(target.model, getattr(torch, dt), kernels=fused)
        if not ok:
            skipped.append({"runtime": "lean-fused", "dtype": dt, "reason": why})
            continue
        lean = LeanModel(target.model, getattr(torch, dt), kernels=fused)
        for L in contexts:
            for n in new_tokens:
                name = f"lean-fused {dt} L={L} n={n} forward"
                fns[name], keys[name] = lean_calls(lean, L, n)["forward"], ("lean-fused", dt, L, n, "forward")
    if old_path:
        for L in contexts:
            for n in new_tokens:
                name = f"transformers float32 L={L} n={n} forward"
                fns[name], keys[name] = transformers_call(target, L, n), ("transformers", "float32", L, n, "forward")
    if progress:
        print(f"target cost: {len(fns)} calls x {repeats} interleaved sweeps", file=sys.stderr)
    with torch.inference_mode():
        timed = time_calls(fns, repeats, warmup, target.device)
    rows = []
    for name, t in timed.items():
        rt, dt, L, n, comp = keys[name]
        rows.append({"runtime": rt, "dtype": dt, "context": L, "new_tokens": n, "component": comp,
                     "median_ms": t["median_ms"], "q1_ms": t["q1_ms"], "q3_ms": t["q3_ms"], "repeats": t["repeats"]})
    for dt in dtypes:  # other = forward - the timed components
        if any(s["runtime"] == "lean" and s["dtype"] == dt for s in skipped):
            continue
        for L in contexts:
            for n in new_tokens:
                parts = {r["component"]: r["median_ms"] for r in rows
                         if (r["runtime"], r["dtype"], r["context"], r["new_tokens"]) == ("lean", dt, L, n)}
                rows.append({"runtime": "lean", "dtype": dt, "context": L, "new_tokens": n, "component": "other",
                             "median_ms": parts["forward"] - sum(parts[c] for c in COMPONENTS[:-1]),
                             "q1_ms": None, "q3_ms": None, "repeats": repeats})
    block = max(new_tokens)
    load = load_check(load_start, load_average(), own_load=torch.get_num_threads(),
                      others=(others_start, other_cpu_use()))
    result = {
        "what": "target forward time per component: n new tokens after L tokens of context, batch 1",
        "preset": preset, "target": target.name, "contexts": list(contexts), "new_tokens": list(new_tokens),
        "dtypes": dtypes, "repeats": repeats, "components": list(COMPONENTS),
        "order": "interleaved sweeps over every (runtime, dtype, L, n, component), order rotated each sweep",
        "skipped": skipped, "break_even": break_even(rows, block), "rows": rows,
        "load_warning": load["load_warning"],
        "provenance": provenance(preset, **load),
    }
    write_result(Path(out_dir) if out_dir else paths.RESULTS / preset, "target_cost", result, rows)
    return result


# ====================================================================== step and verify (notebook 05)
def random_target(shapes: Shapes, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A transformers Qwen3 causal LM of ``shapes`` with random weights (seeded, no download), in ``dtype``
    on ``device``, eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = shapes
    config = Qwen3Config(vocab_size=s.target_vocab, hidden_size=s.hidden, intermediate_size=s.target_intermediate,
                         num_hidden_layers=s.target_layers, num_attention_heads=s.heads,
                         num_key_value_heads=s.kv_heads, head_dim=s.head_dim, max_position_embeddings=40960,
                         tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: no float32 copy of 8B weights
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval().requires_grad_(False)


def time_target(model, shapes: Shapes, repeats: int, warmup: int, seed: int = 0,
                frames: int = 0) -> dict[str, dict[str, float]]:
    """The target's 1-token decoding step (lean: one logit) and its B-token verification (every logit
    and the hidden states, as the decoding loop asks), after a ``shapes.context``-token prompt; the
    cache is cropped back after each call; :func:`xpress.timing.time_call` of each over ``repeats`` calls
    after ``warmup`` ones, random ids drawn from ``seed``. ``model``: a transformers causal LM, or the lean runtime
    (:class:`xpress.runtime.LeanModel`) that a preset's target computes with. ``frames`` > 0 (transformers
    only): the same two on frames of that many positions too (:func:`xpress.targets.frame_forward`, what
    ``target.frame_rows`` runs; the context's position in its frame decides whether a verify takes one
    frame or two)."""
    from transformers import DynamicCache

    from ..runtime import LeanModel
    from ..targets import target_layer_ids

    L, B = shapes.context, shapes.block_size
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, LeanModel):
        dev = model.device
        ctx = torch.randint(model.embed.shape[0], (1, L), generator=g).to(dev)
        kv = model.new_cache(1, L + B)
        model.forward(ctx, kv, logits_to_keep=1)
        feature_layers = target_layer_ids(model.n_layers, shapes.target_features)

        def lean_call(n: int, verify: bool) -> Callable[[], None]:
            ids = torch.randint(model.embed.shape[0], (1, n), generator=g).to(dev)

            @torch.inference_mode()
            def run() -> None:
                model.forward(ids, kv, logits_to_keep=0 if verify else 1,
                              feature_layers=feature_layers if verify else None)
                kv.crop(-n)
            return run

        return {"target step (1 token)": time_call(lean_call(1, False), repeats, warmup, dev),
                f"target verify ({B} tokens)": time_call(lean_call(B, True), repeats, warmup, dev)}
    from ..targets import frame_forward

    dev = next(model.parameters()).device
    ctx = torch.randint(model.config.vocab_size, (1, L), generator=g).to(dev)
    layer_ids = target_layer_ids(model.config.num_hidden_layers, shapes.target_features)

    def plain(ids, cache, pos, verify: bool) -> None:  # the transformers forward as the decoding loop calls it
        model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True,
              output_hidden_states=verify, logits_to_keep=0 if verify else 1)

    def framed(ids, cache, pos, verify: bool) -> None:  # the same on frames (target.frame_rows = frames)
        frame_forward(model, frames, layer_ids, ids, cache, pos, 0 if verify else 1, verify)

    def timed(forward: Callable, suffix: str) -> dict[str, dict[str, float]]:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            forward(ctx, cache, None, False)  # the L-token prompt

        def call(n: int, verify: bool) -> Callable[[], None]:
            ids = torch.randint(model.config.vocab_size, (1, n), generator=g).to(dev)
            pos = torch.arange(L, L + n, device=dev)[None]

            @torch.inference_mode()
            def run() -> None:
                forward(ids, cache, pos, verify)
                cache.crop(-n)  # back to the L-token prompt
            return run

        return {f"target step (1 token{suffix})": time_call(call(1, False), repeats, warmup, dev),
                f"target verify ({B} tokens{suffix})": time_call(call(B, True), repeats, warmup, dev)}

    return {**timed(plain, ""), **(timed(framed, f", frames of {frames}") if frames else {})}
