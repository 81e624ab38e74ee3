"""The memory of one training step, modelled and measured (``python -m xpress bench train-memory``).

The model (:func:`step_memory`) adds, in bytes, what one process holds during a step of ``method``:

- ``target``: the frozen target's weights in its dtype (``params x 2`` in bf16), plus the readout copy
  ``lm_head.weight[d2t]`` [Vd, H] the stage keeps;
- ``trainable``: float32 master weights of the drafter and the head (``4 x params``; the drafter is frozen under
  ``train.refiner_only``), their gradients (4 bytes), AdamW's two moments (8 bytes) and, under bf16 autocast,
  the weights' bf16 copies that autocast keeps for backward (2 bytes);
- ``batch``: the context features [b, L, F] and the target's states at the labels [n, P, H], float32;
- ``activations``: what the drafter keeps for backward: the context's K/V and inputs, and per layer the tensors
  its operations save (counted operation by operation in :func:`layer_activation_bytes`), for every layer, or
  under ``train.gradient_checkpointing`` each layer's input and one layer's activations (the one recomputed);
- ``loss``: one chunk of ``c = train.loss_chunk_blocks`` blocks (all ``n`` blocks when 0) at its peak, in
  units ``U = c x P x Vd x 4`` bytes: the chunk's bf16 logits, the target's distribution, and per term of Eq. 15
  the three float32 tensors autograd saves (log-softmax, its exp, the difference whose absolute value is the
  L1 term) plus the one being made: 6.5 U for dflash (one term), 13.5 U for markov and xpress (three terms:
  base, refined, consistency, the last two each a float32 tensor of its own);
- ``states``: the teacher-forced target forward that makes the states online (``data.cache_features: false``):
  every layer's hidden state kept for the features, the MLP's widest tensors, and one chunk of
  ``train.state_chunk_tokens`` positions' logits for the logsumexp (all positions when 0).

The step's phases peak at different times, so the peak is ``fixed + max(states, forward/backward, optimizer)``
with ``fixed`` = target + master weights + batch; forward/backward = activations + autocast copies + the
head's gradients + the loss chunk; optimizer = gradients + AdamW's moments + its temporaries. On a CPU the
process's baseline (Python, torch and the imports, measured in the same fresh process before the step) is
added; on CUDA the allocator's own count starts at 0 and the baseline is 0. ``first_step=True`` models a
fresh process's only step (AdamW's moments appear at its end); ``False`` the steady state of training (the
moments live through every step), which is what the full-width prediction for a preset uses.

The measurement (:func:`measure`) runs ONE step per method, each in a fresh subprocess, at the preset's loss
shapes (vocabulary, batch, anchors, block, max length) with random weights in the target's architecture
(Qwen3) whose widths are divided by ``width_divisor`` (hidden, MLP, attention heads; head width kept) and whose
layers may be fewer; "peak" is that process's resident-set maximum (``ru_maxrss``, nothing subtracted) on a
CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from .. import paths
from ..config import Config, load_config
from ..gpu_budget import Dims, target_dims

GB = 1e9
FITS_GB = 80.0  # the paper trained on H100 80GB GPUs
LOSS_UNITS = {"dflash": 6.5, "markov": 13.5, "xpress": 13.5}  # live [c, P, Vd] float32 tensors at the chunk's peak
KNOWN_VOCAB = 151936  # Qwen3-8B's LM head rows


def _bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16", "bf16") else 4


def head_params(method: str, cfg: Config, vocab: int, hidden: int) -> int:
    """Parameters of ``method``'s head (:mod:`xpress.heads`): xPress ``w_h, w_g`` (r x H), ``w_e`` ((Vd+1) x r),
    ``w_in`` (r x 3r), ``L`` (r x P x P), ``w_1, w_2`` (2r x r each), ``w_r`` (Vd x r); Markov ``w_1``
    ((Vd+1) x r), ``w_2`` (Vd x r); none for dflash."""
    P = cfg.drafter.block_size - 1
    if method == "xpress":
        r = cfg.head.rank
        return 2 * r * hidden + (vocab + 1) * r + 3 * r * r + r * P * P + 4 * r * r + vocab * r
    if method == "markov":
        r = cfg.head.markov_rank
        return (vocab + 1) * r + vocab * r
    return 0


def drafter_params(cfg: Config, t: Dims) -> int:
    """The dFlash drafter's parameters on target ``t``: its layers, ``fc`` [H, F] and two norms."""
    body = replace(t, layers=cfg.drafter.num_layers, intermediate=cfg.drafter.intermediate_size or t.intermediate)
    return body.body_params() + cfg.drafter.num_target_features * t.hidden * t.hidden + t.hidden


def layer_activation_bytes(t: Dims, ab: int) -> int:
    """Bytes one drafter layer saves for backward per block token, with the products in ``ab``-byte floats
    (bf16 autocast: 2) and the residual stream, norms, RoPE and attention in float32: the norms' normalised
    values and the residual (12 H); the products' inputs cast to ``ab`` (q/k/v, o, gate/up: 2 H + Q,
    where the cast is a copy); q and k: the product's output, its float32 copy, the normed, rolled and rotated
    values (``ab + 16`` bytes each per width Q = heads x head_dim, K = kv_heads x head_dim); v: output and float32
    copy; attention: its output, the transposed copy; the MLP: gate, up, SiLU and product (4 I)."""
    Q, K, H, I = t.heads * t.head_dim, t.kv_heads * t.head_dim, t.hidden, t.intermediate
    cast = ab if ab != 4 else 0  # an autocast copy exists only below float32
    return (12 * H + cast * (2 * H + Q) + (ab + 16) * (Q + K) + (ab + 4) * K + 8 * Q + 4 * ab * I)


@dataclass(frozen=True)
class StepShapes:
    """What a step's memory depends on: the preset's sizes and dtypes (``target_bytes``: the target's weights,
    ``compute_bytes``: the products under autocast) and the target's shape."""

    t: Dims
    batch: int
    max_len: int
    anchors: int
    block: int
    features: int
    draft_vocab: int
    loss_chunk: int  # blocks per chunk (all blocks when unchunked)
    state_chunk: int  # positions per chunk of the logsumexp (all when unchunked)
    checkpointing: bool
    target_bytes: int
    compute_bytes: int
    online_states: bool
    cuda: bool

    @classmethod
    def of(cls, cfg: Config, t: Dims | None = None, cuda: bool | None = None) -> "StepShapes":
        t = t or target_dims(cfg)
        tr = cfg.train
        n = tr.batch_size * tr.anchors_per_seq
        cuda = cfg.target.device.startswith("cuda") if cuda is None else cuda
        dtype = "bfloat16" if cfg.target.dtype == "auto" and cuda else cfg.target.dtype
        if cfg.target.dtype == "auto" and not cuda:
            from ..runtime import native_bf16

            dtype = "bfloat16" if native_bf16() else "float32"
        mixed = tr.mixed_precision if tr.mixed_precision != "auto" else ("bf16" if dtype == "bfloat16" else "no")
        return cls(t=t, batch=tr.batch_size, max_len=tr.max_len, anchors=tr.anchors_per_seq, block=cfg.drafter.block_size,
                   features=cfg.drafter.num_target_features * t.hidden, draft_vocab=cfg.drafter.draft_vocab_size or t.vocab,
                   loss_chunk=min(tr.loss_chunk_blocks or n, n),
                   state_chunk=min(tr.state_chunk_tokens or tr.batch_size * tr.max_len, tr.batch_size * tr.max_len),
                   checkpointing=tr.gradient_checkpointing, target_bytes=_bytes(dtype),
                   compute_bytes=2 if mixed == "bf16" else 4, online_states=not cfg.data.cache_features, cuda=cuda)


def step_memory(cfg: Config, method: str, shapes: StepShapes | None = None, baseline: float = 0.0,
                first_step: bool = False) -> dict[str, Any]:
    """The modelled peak of one training step of ``method`` (module docstring), in bytes: ``{"peak": ...,
    "components": {...}, "phases": {...}}``. ``baseline``: the process's bytes before the step (CPU RSS after
    the imports)."""
    s = shapes or StepShapes.of(cfg)
    t, ab, tb = s.t, s.compute_bytes, s.target_bytes
    b, L, nb, B = s.batch, s.max_len, s.anchors, s.block
    P, n, V, H = B - 1, s.batch * s.anchors, s.draft_vocab, t.hidden
    tokens = n * B  # block tokens through the drafter
    ph = head_params(method, cfg, V, H)
    pd = drafter_params(cfg, t)
    frozen = cfg.train.refiner_only and method != "dflash"
    trained = ph + (0 if frozen else pd)
    c = {
        "target_weights": tb * (t.params() + V * H),  # + the readout copy lm_head.weight[d2t]
        "master_weights": 4 * (pd + ph),
        "batch": 4 * (b * L * s.features + n * P * H + 2 * b * L),
        "gradients": 4 * trained,
        "adam_moments": 8 * trained,
        "autocast_copies": (2 * (pd + ph)) if ab == 2 else 0,
    }
    # the drafter's context (fc input cast, its output and norm, each layer's K/V before and after RoPE)
    kv = t.kv_heads * t.head_dim
    context = b * L * ((ab if ab != 4 else 0) * s.features + 12 * H + cfg.drafter.num_layers * 4 * 3 * kv)
    per_layer = tokens * layer_activation_bytes(replace(t, intermediate=cfg.drafter.intermediate_size or t.intermediate), ab)
    layers = cfg.drafter.num_layers
    saved = layers * tokens * 4 * H + per_layer if s.checkpointing else layers * per_layer + tokens * 4 * H
    c["activations"] = context + saved + 3 * tokens * 4 * H  # + the final norm and h
    unit = s.loss_chunk * P * V * 4
    c["loss_chunk"] = LOSS_UNITS[method] * unit
    if s.online_states:  # no_grad: every layer's output (for the features), the MLP, features cast, a logits chunk
        rows = b * L
        c["target_states"] = (rows * ((t.layers + 1) * H * tb + 3 * t.intermediate * tb + s.features * (tb + 4) + H * 6)
                              + s.state_chunk * V * (tb + 8))  # the logits, their float32 copy, logsumexp's exp
    else:
        c["target_states"] = 0
    largest = max(V * cfg.head.rank if method == "xpress" else V * cfg.head.markov_rank if method == "markov" else 0,
                  H * t.intermediate) * 4
    optimizer_temps = 4 * trained if s.cuda else 2 * largest  # foreach on CUDA: one temporary per parameter
    moments = 0 if first_step else c["adam_moments"]
    fixed = c["target_weights"] + c["master_weights"] + c["batch"] + moments
    phases = {
        "states": c["target_states"],
        "forward_backward": c["activations"] + c["autocast_copies"] + 4 * ph + c["loss_chunk"],
        "optimizer": c["gradients"] + (c["adam_moments"] if first_step else 0) + optimizer_temps,
    }
    peak = baseline + fixed + max(phases.values())
    return {"peak": peak, "baseline": baseline, "fixed": fixed, "components": c, "phases": phases,
            "binding_phase": max(phases, key=phases.get), "loss_chunk_unit": unit}


# ------------------------------------------------------------------------------------------ shrinking
def shrunk(cfg: Config, divisor: int, layers: int | None = None, drafter_layers: int | None = None,
           vocab: int | None = None) -> tuple[Config, Dims]:
    """``cfg`` and its target's shape with the widths divided by ``divisor``: hidden and MLP widths, query and
    key-value heads (at least 1 each; head width kept, so the attention kernels see the real head size);
    ``layers`` / ``drafter_layers``: fewer target / drafter layers; ``vocab``: another vocabulary (tests only;
    the bench keeps the preset's). Loss shapes (batch, anchors, block, max length) are kept."""
    t = target_dims(cfg)
    if divisor < 1:
        raise ValueError(f"--width-divisor {divisor} must be at least 1")
    heads = max(1, t.heads // divisor)
    kv = max(1, min(heads, t.kv_heads // divisor))
    small = Dims(hidden=heads * t.head_dim, layers=layers or t.layers, intermediate=max(8, t.intermediate // divisor),
                 heads=heads, kv_heads=kv, head_dim=t.head_dim, vocab=vocab or t.vocab, tied=t.tied)
    d = cfg.drafter
    dl = drafter_layers or d.num_layers
    if small.layers < d.num_target_features + 3 and small.layers != t.layers:
        raise ValueError(f"--layers {small.layers}: the drafter reads {d.num_target_features} target layers spread "
                         f"over 1 .. layers - 3; keep at least {d.num_target_features + 3}")
    out = replace(cfg, drafter=replace(d, num_layers=dl, intermediate_size=0, checkpoint=""))
    return out, small


def random_target(cfg: Config, t: Dims, device: str, dtype):
    """A :class:`xpress.targets.Target` over a randomly initialised Qwen3 of shape ``t`` (no hub, no tokenizer:
    a stand-in that reports Qwen3-8B's 151,669 tokens), on ``device`` in ``dtype``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..targets import Target, target_layer_ids

    config = Qwen3Config(vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.intermediate,
                         num_hidden_layers=t.layers, num_attention_heads=t.heads, num_key_value_heads=t.kv_heads,
                         head_dim=t.head_dim, max_position_embeddings=max(cfg.train.max_len, 4096),
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(dtype).eval().requires_grad_(False)

    class Tokens:  # what the drafter asks of a tokenizer: its length (the MASK row is the first past it)
        def __len__(self) -> int:
            return t.vocab - 267 if t.vocab == KNOWN_VOCAB else t.vocab - 1

    tc = replace(cfg.target, runtime="transformers", device=device)
    return Target(model=model, tokenizer=Tokens(), cfg=tc, hidden_size=t.hidden, vocab_size=t.vocab,
                  num_layers=t.layers, layer_ids=target_layer_ids(t.layers, cfg.drafter.num_target_features),
                  eos_token_ids=[t.vocab - 300], name=f"random Qwen3 {t}")


# ------------------------------------------------------------------------------------------ one step
MMAP_THRESHOLD = 65536  # bytes: glibc serves larger blocks by mmap and unmaps them on free (run_fresh)
PEAK = ("CPU: the resident-set high-water mark (VmHWM) of the fresh process that ran the step, nothing "
        "subtracted, with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so that a freed tensor "
        "leaves the resident set; its baseline (Python, torch, transformers, accelerate and xpress imported, before "
        "the step) is measured in that process and is part of the prediction. CUDA: "
        "torch.cuda.max_memory_allocated over the step (tensors only; baseline 0)")  # how the file's peaks were measured


def rss_bytes() -> int:
    """This process's peak resident set so far in bytes: ``VmHWM`` of /proc/self/status where Linux has it (its
    own address space's high-water mark; ``ru_maxrss`` survives exec, so a process started by a large parent
    would report the parent's peak), else ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_step(cfg: Config, method: str, t: Dims, seed: int = 0) -> dict[str, Any]:
    """ONE training step of ``method`` in this process, as :class:`xpress.train.loop._StageRun` takes it
    (online target states, the trainable module, AdamW, :func:`~xpress.train.loop.train_step`), over a random
    target of shape ``t`` and random token sequences of ``train.max_len`` tokens. Returns the measured peak
    (bytes), the baseline measured before anything is built, and the step's seconds."""
    import types

    import torch
    from accelerate import Accelerator

    from ..distributed import local_device
    from ..vocab import DraftVocab
    from ..proposer import new_drafter
    from ..runtime import resolve_dtype
    from .loop import make_batch, resolve_mixed_precision, step_generator, train_step, trainable_module

    device = local_device(cfg.target.device)
    cuda = device.startswith("cuda")
    baseline = 0 if cuda else rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dtype = resolve_dtype(cfg.target.dtype)
    if not cuda:  # the loss's PyTorch operations, the GPU's path (the C++ row terms exist on CPUs only)
        cfg = replace(cfg, train=replace(cfg.train, loss_kernel="torch"))
    target = random_target(cfg, t, device, dtype)
    vocab = DraftVocab.full(t.vocab)
    module = trainable_module(cfg, new_drafter(method, cfg, target, vocab, seed=seed), method)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg.train.mixed_precision), cpu=not cuda)
    g = torch.Generator().manual_seed(seed)
    L, prompt = cfg.train.max_len, cfg.train.max_len // 6
    ids = [torch.randint(0, t.vocab - 300, (L,), generator=g).tolist() for _ in range(cfg.train.batch_size)]
    data = types.SimpleNamespace(input_ids=ids, prompt_len=[prompt] * len(ids), has_states=False, folder="random")
    readout = target.lm_head().weight.detach()[vocab.d2t.to(target.device)]
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch = make_batch(data, list(range(len(ids))), cfg, step_generator(seed, 0, 0), target=target).to(device)
    logs, grad_norm = train_step(module, optimizer, accelerator, params, batch, vocab, readout, cfg, 0,
                                 cfg.train.steps, cfg.train.consistency_weight > 0 and method != "dflash")
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else rss_bytes()
    return {"method": method, "device": device, "peak_bytes": int(peak), "baseline_bytes": int(baseline),
            "peak_measure": "torch.cuda.max_memory_allocated" if cuda else (
                "VmHWM (resident-set high-water mark) of this fresh process"
                + (f", glibc's mmap threshold fixed at {os.environ['MALLOC_MMAP_THRESHOLD_']} bytes"
                   if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "")),
            "step_seconds": seconds, "loss": logs["loss"], "grad_norm": float(grad_norm),
            "target_dtype": str(dtype).removeprefix("torch."), "mixed_precision": accelerator.mixed_precision}


def _child(argv: Sequence[str]) -> int:
    """``python -m xpress.train.memory PRESET METHOD DIVISOR LAYERS DRAFTER_LAYERS VOCAB OVERRIDES_JSON``: one
    step, its record as JSON on the last stdout line."""
    import torch  # noqa: F401  (the baseline includes torch, transformers, accelerate and the training code)
    import transformers  # noqa: F401
    import accelerate  # noqa: F401

    from . import loop  # noqa: F401

    preset, method, divisor, layers, dlayers, vocab, overrides = argv
    cfg = load_config(preset, json.loads(overrides))
    cfg, t = shrunk(cfg, int(divisor), int(layers) or None, int(dlayers) or None, int(vocab) or None)
    print(json.dumps(one_step(cfg, method, t)), flush=True)
    return 0


def run_fresh(preset: str, method: str, divisor: int, layers: int = 0, drafter_layers: int = 0, vocab: int = 0,
              overrides: Sequence[str] = (), timeout: float = 3600) -> dict[str, Any]:
    """:func:`one_step` in a fresh Python process (so that its peak is this step's alone)."""
    # glibc's mmap threshold fixed at 64 KiB: every tensor's pages go back to the system when it is freed, so the
    # resident set follows the live tensors (as CUDA's allocated bytes do) instead of keeping freed heap pages
    # (at 512 anchors the dynamic threshold left ~0.8 GB of freed activations resident: 1.28x the live peak)
    env = {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    cmd = [sys.executable, "-m", "xpress.train.memory", preset, method, str(divisor), str(layers),
           str(drafter_layers), str(vocab), json.dumps(list(overrides))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=paths.REPO_ROOT)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"the {method} step failed in its process (exit {done.returncode}): {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(preset: str = "qwen3-8b", methods: Sequence[str] = ("dflash", "markov", "xpress"), divisor: int = 32,
            layers: int = 8, drafter_layers: int = 0, vocab: int = 0, overrides: Sequence[str] = (),
            out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """One step per method, each in a fresh process, at the preset's loss shapes with the widths divided:
    measured peak, the model's prediction for the shapes that ran (first step, the measured baseline added)
    and for the preset at full width (steady state), and whether that fits :data:`FITS_GB` per GPU. Writes
    ``<out_dir>/train_memory.{json,csv}`` (default ``results/<preset>/``)."""
    from tqdm.auto import tqdm

    from ..utils import write_result

    cfg = load_config(preset, list(overrides))
    small_cfg, t = shrunk(cfg, divisor, layers or None, drafter_layers or None, vocab or None)
    # the full-width prediction: the preset's own shapes on a GPU, with only its memory settings overridden
    full_cfg = load_config(preset, [o for o in overrides if o.split("=")[0] in MEMORY_KEYS] + ["target.device=cuda"])
    folder = Path(out_dir) if out_dir else paths.RESULTS / preset
    shapes_record = _shapes(divisor, t, small_cfg, cfg)
    kept = _kept(folder / "train_memory.json", shapes_record, overrides)
    rows, per, result = [], {}, {}
    for method in tqdm(list(methods), desc="train-memory", unit="method", disable=not progress):
        got = kept.get(method) or run_fresh(preset, method, divisor, layers, drafter_layers, vocab, overrides)
        cuda = got["device"].startswith("cuda")
        shapes = StepShapes.of(small_cfg, t, cuda=cuda)
        shapes = replace(shapes, target_bytes=_bytes(got["target_dtype"]),
                         compute_bytes=2 if got["mixed_precision"] == "bf16" else 4)
        model = step_memory(small_cfg, method, shapes, baseline=got["baseline_bytes"], first_step=True)
        full = step_memory(full_cfg, method, StepShapes.of(full_cfg, cuda=True))
        ratio = got["peak_bytes"] / model["peak"]
        per[method] = {**got, "predicted_bytes": int(model["peak"]), "measured_over_predicted": ratio,
                       "within_25_percent": abs(ratio - 1) <= 0.25, "model": model,
                       "full_width_predicted_bytes": int(full["peak"]), "full_width_model": full,
                       "full_width_fits_80gb": full["peak"] <= FITS_GB * GB}
        rows.append({"method": method, "device": got["device"], "peak_measure": got["peak_measure"],
                     "measured_peak_gb": got["peak_bytes"] / GB, "baseline_gb": got["baseline_bytes"] / GB,
                     "predicted_peak_gb": model["peak"] / GB, "measured_over_predicted": ratio,
                     "step_seconds": got["step_seconds"], "full_width_predicted_gb": full["peak"] / GB,
                     "full_width_fits_80gb": full["peak"] <= FITS_GB * GB})
        result = _record(preset, per, shapes_record, overrides, done=len(per) == len(methods))
        write_result(folder, "train_memory", result, rows)
    return result


MEMORY_KEYS = ("train.loss_chunk_blocks", "train.state_chunk_tokens", "train.gradient_checkpointing",
               "train.mixed_precision", "target.dtype")
MEASURED = ("method", "device", "peak_bytes", "baseline_bytes", "peak_measure", "step_seconds", "loss", "grad_norm",
            "target_dtype", "mixed_precision")


def _shapes(divisor: int, t: Dims, small_cfg: Config, cfg: Config) -> dict[str, Any]:
    return {"width_divisor": divisor, "target": asdict(t), "drafter_layers": small_cfg.drafter.num_layers,
            "batch": cfg.train.batch_size, "anchors_per_seq": cfg.train.anchors_per_seq,
            "block_size": cfg.drafter.block_size, "max_len": cfg.train.max_len, "vocab": t.vocab,
            "loss_chunk_blocks": cfg.train.loss_chunk_blocks, "state_chunk_tokens": cfg.train.state_chunk_tokens,
            "gradient_checkpointing": cfg.train.gradient_checkpointing}


def _kept(path: Path, shapes: dict[str, Any], overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The measurements of an earlier run of the same shapes and overrides (an interrupted run resumes; the
    predictions are recomputed by today's model), by method; none when the file is absent or of other shapes."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if (old.get("shapes") != json.loads(json.dumps(shapes)) or old.get("overrides") != list(overrides)
            or old.get("peak") != PEAK):  # measured another way: measure again
        return {}
    prov = old.get("provenance", {})
    first = {"git_revision": prov.get("git_revision"), "git_dirty_files": prov.get("git_dirty_files"),
             "date": prov.get("date")}
    return {m: {**{k: r[k] for k in MEASURED}, "measured_by": r.get("measured_by") or first}
            for m, r in old.get("methods", {}).items() if all(k in r for k in MEASURED)}


def _record(preset: str, per: dict, shapes: dict[str, Any], overrides: Sequence[str], done: bool) -> dict[str, Any]:
    """The ``train_memory.json`` payload; written after each method (``complete`` once all ran)."""
    from ..utils import provenance

    return {"preset": preset, "complete": done, "methods": per, "shapes": shapes,
            "resumed": "a method with measured_by was measured by that earlier run of the same shapes; its "
                       "predictions are this run's",
            "peak": PEAK,
            "full_width": ("the preset at full width and its own loss shapes on a GPU (only its memory settings "
                             "overridden), steady state (AdamW's moments held through the step)"),
            "fits_gb": FITS_GB, "overrides": list(overrides),
            "provenance": provenance(preset, command=f"python -m xpress bench train-memory --preset {preset} --shrink "
                                                       f"--width-divisor {shapes['width_divisor']} {' '.join(overrides)}".strip())}


def stage_peaks(cfg: Config, world: int = 1) -> dict[str, float]:
    """Predicted peak bytes per GPU of each stage ``python -m xpress gpu-hours`` lists: ``train <method>`` from
    :func:`step_memory` (steady state); regeneration and decoding: the target's weights, its KV cache for the
    batch at the longest context, and one forward's widest activations and logits."""
    t = target_dims(cfg)
    tb = 2 if cfg.target.dtype in ("auto", "bfloat16", "float16") else 4
    out = {f"train {m}": step_memory(cfg, m, StepShapes.of(cfg, t, cuda=True))["peak"] for m in cfg.eval.methods}
    if cfg.train.warm_start_steps > 0 and not cfg.drafter.checkpoint:
        out["train warmstart"] = out.get("train dflash") or step_memory(cfg, "dflash", StepShapes.of(cfg, t, cuda=True))["peak"]

    def decode(batch: int, context: int, rows: int, drafter: bool) -> float:
        weights = tb * t.params() + (tb * (drafter_params(cfg, t) + head_params("xpress", cfg, t.vocab, t.hidden))
                                     if drafter else 0)
        kv = batch * context * t.kv_bytes_per_token() * tb // 2
        return weights + kv + batch * (t.vocab * 4 + rows * 4 * t.intermediate * tb)  # logits of the last row

    d, e = cfg.data, cfg.eval
    out["regenerate"] = decode(d.regen_batch_size, d.regen_max_prompt_tokens + d.regen_max_new_tokens,
                               d.regen_max_prompt_tokens, False)
    out["decode"] = decode(max(e.batch_sizes or [1]), d.regen_max_prompt_tokens + e.max_new_tokens,
                           max(d.regen_max_prompt_tokens, cfg.drafter.block_size), True)
    return out


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
