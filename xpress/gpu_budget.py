"""GPU-hours per stage at a preset's sizes, from counted FLOPs and bytes (``python -m xpress gpu-hours``).

A roofline estimate, not a measurement. Every stage is a workload of target and drafter forwards whose
sizes come from the preset (prompts, tokens, batch sizes, steps, methods, benchmarks); its time on one GPU
is ``compute + max(decode compute, decode memory traffic)`` with

- FLOPs: ``2 x parameters`` per token for a forward, ``6 x parameters`` for a trained forward + backward
  (``4 x`` for a frozen readout that only passes gradients to its input), plus attention
  ``4 x layers x heads x head_dim x context`` per token (``3 x`` that when trained);
- bytes: every decoding forward streams the bf16 weights once for its whole batch and reads each
  sequence's bf16 KV cache (``2 x layers x kv_heads x head_dim x 2`` bytes per context token);
- a GPU sustaining ``utilization`` (a documented parameter, :data:`DEFAULT_UTILIZATION`) of its dense
  bf16 peak and of its memory bandwidth (:data:`GPUS`, from NVIDIA's datasheets).

Measured constants replace the model where a GPU measured them (:func:`load_measured`, from
``results/<gpu>/``, the folder the device check ``scripts/device_check.sh`` writes for that GPU):

- decoding: the seconds of one batch-1 forward at the paper's shapes from ``latency.json``
  (``scripts/gpu_latency.py``: the target's step and verify, the drafter's block, each head; a CUDA-graph
  timing of a head where one was recorded, else the eager one) are a floor under every decoding pass of the
  stage: a pass over a batch takes the longer of its roofline time and the measured batch-1 time (launches
  and synchronisations do not shrink with the batch);
- training: the seconds of one step per method from ``train_memory.json`` (the device check's
  ``bench train-memory``), scaled from the shapes it ran (``shapes``) to the preset's by the FLOPs this
  module counts for each, replace the step's roofline time.

Every row says which it used (:func:`format_table` lists each stage's source: a file and its fields, or
``model``).

Upper bounds by construction: every prompt is ``data.regen_max_prompt_tokens`` long, every answer runs to
its ``max_new_tokens`` and, unless ``tau`` is given, each target forward of a speculative method commits
one token (tau = 1: the drafter never helps). Training GPU-hours count every process of a ``world``-GPU
run (``train.batch_size`` is per process), idle ones during the rank-0 evaluations included.

Model shapes: the target's come from :data:`KNOWN_TARGETS` for a hub id (the hub is not reachable from
here) or from ``target.random_*`` for the smoke and rehearsal targets; the drafter's from
``cfg.drafter`` and the target (:class:`xpress.drafter.DFlashDraftModel`'s layout).

Nothing heavy is imported at module level (the command-line parser imports this module).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .config import Config

DEFAULT_UTILIZATION = 0.4  # sustained fraction of peak FLOP/s and of peak bandwidth (typical MFU of bf16 training)
DEFAULT_GPU = "H200"  # the paper measured on H200s (its Table 3)
DEFAULT_WORLD = 8  # training processes (one node of 8 GPUs)
BF16_BYTES = 2
SMOLLM2_TOKENIZER = 49152  # tokens of SmolLM2's tokenizer, which the smoke and rehearsal targets use


@dataclass(frozen=True)
class GPU:
    """Peak dense bf16 tensor-core throughput (no sparsity) and HBM bandwidth of one GPU."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float


# NVIDIA datasheets: H100 SXM5 989 TFLOP/s bf16 dense, 3.35 TB/s; H200 SXM 989 TFLOP/s, 4.8 TB/s;
# A100 80GB SXM 312 TFLOP/s, 2.039 TB/s
GPUS = {"H100-SXM": GPU("H100 SXM", 989.0, 3.35), "H200": GPU("H200 SXM", 989.0, 4.8),
        "A100-80GB": GPU("A100 80GB SXM", 312.0, 2.039)}


def device_slug(name: str) -> str:
    """The results folder of a device: its model number in lower case (``torch.cuda.get_device_name()``
    ``"NVIDIA H200"`` and :data:`GPUS`' ``"H200 SXM"`` -> ``h200``; ``"NVIDIA H100 80GB HBM3"`` -> ``h100``;
    ``"NVIDIA A100-SXM4-80GB"`` -> ``a100``), else its words joined by ``-``; ``cpu`` for the CPU."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla")]
    if not words:
        raise ValueError(f"device name {name!r} has no letters or digits to name a results folder")
    model = next((w for w in words if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", w)), None)
    return model or "-".join(words)


@dataclass(frozen=True)
class Dims:
    """A Qwen3/Llama-style decoder: its parameter count and per-token costs."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False  # input embedding shared with lm_head

    def layer_params(self) -> int:
        """q, k, v, o projections, SwiGLU MLP, two RMSNorms and the per-head q/k norms of one layer."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    def body_params(self) -> int:
        """Every parameter a token's forward multiplies by, except the vocabulary readout."""
        return self.layers * self.layer_params() + self.hidden  # + the final norm

    def params(self) -> int:
        """All parameters, embeddings included (one matrix when tied)."""
        return self.body_params() + self.vocab * self.hidden * (1 if self.tied else 2)

    def attention_flops(self, context: float) -> float:
        """QK^T and AV of one query token over ``context`` keys, every layer."""
        return 4.0 * self.layers * self.heads * self.head_dim * context

    def forward_flops(self, context: float, readout: bool = True) -> float:
        """One token's forward at mean ``context``; ``readout``: its lm_head row too."""
        return 2.0 * (self.body_params() + (self.vocab * self.hidden if readout else 0)) + self.attention_flops(context)

    def weight_bytes(self) -> int:
        """bf16 weights one decoding forward streams (the embedding lookup reads a few rows only)."""
        return BF16_BYTES * (self.body_params() + self.vocab * self.hidden)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


# Qwen/Qwen3-8B config.json (model card: 8.2B parameters, 6.95B non-embedding): hidden 4096, 36 layers,
# intermediate 12288, 32 query heads, 8 key-value heads, head_dim 128, vocab 151936, untied embeddings
QWEN3_8B = Dims(hidden=4096, layers=36, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936)
KNOWN_TARGETS = {"Qwen/Qwen3-8B": QWEN3_8B}


def target_dims(cfg: Config) -> Dims:
    """The preset's target shape: :data:`KNOWN_TARGETS` for a hub id, else ``target.random_*`` (smoke's
    random Llama, tied; the rehearsal Qwen3, untied with a padded vocabulary)."""
    t = cfg.target
    if t.model in KNOWN_TARGETS:
        return KNOWN_TARGETS[t.model]
    from .paths import is_rehearsal_path
    from .rehearsal import padded_vocab

    rehearsal = t.source == "hub" and is_rehearsal_path(t.model)
    if t.source != "random" and not rehearsal:
        raise ValueError(f"no shape known for target.model={t.model!r}; add it to xpress.gpu_budget.KNOWN_TARGETS "
                         f"from its config.json")
    return Dims(hidden=t.random_hidden, layers=t.random_layers, intermediate=t.random_intermediate,
                heads=t.random_heads, kv_heads=t.random_kv_heads, head_dim=t.random_hidden // t.random_heads,
                vocab=padded_vocab(SMOLLM2_TOKENIZER) if rehearsal else SMOLLM2_TOKENIZER, tied=not rehearsal)


@dataclass(frozen=True)
class DrafterDims:
    """The dFlash drafter on a target: ``body`` (its layers, context ``fc`` excluded), ``fc`` [H, F] and the
    borrowed readout over ``draft_vocab`` rows; ``block`` = B."""

    body: Dims
    fc_params: int
    draft_vocab: int
    block: int

    def block_flops(self, context: float) -> float:
        """One block at inference: B tokens through the layers, B - 1 readout rows (the context's fc and K/V
        are computed once per committed token and counted in :meth:`context_flops`)."""
        return self.block * self.body.forward_flops(context, readout=False) + \
            2.0 * (self.block - 1) * self.draft_vocab * self.body.hidden

    def context_flops(self) -> float:
        """One committed token's context: ``fc`` and each layer's k/v projections."""
        h, kv = self.body.hidden, self.body.kv_heads * self.body.head_dim
        return 2.0 * (self.fc_params + self.body.layers * 2 * h * kv)

    def block_bytes(self) -> int:
        return BF16_BYTES * (self.body.body_params() + self.fc_params + self.draft_vocab * self.body.hidden)


def drafter_dims(cfg: Config, target: Dims) -> DrafterDims:
    d = cfg.drafter
    body = Dims(hidden=target.hidden, layers=d.num_layers, intermediate=d.intermediate_size or target.intermediate,
                heads=target.heads, kv_heads=target.kv_heads, head_dim=target.head_dim, vocab=0)
    return DrafterDims(body=body, fc_params=d.num_target_features * target.hidden * target.hidden,
                       draft_vocab=d.draft_vocab_size or target.vocab, block=d.block_size)


def head_flops_per_row(method: str, cfg: Config, draft_vocab: int, hidden: int, iters: int | None = None) -> float:
    """A head's inference FLOPs per drafted position (:func:`xpress.heads.count_flops` over a block / P);
    0 for ``dflash``."""
    if method == "dflash":
        return 0.0
    from .heads import count_flops

    rank = cfg.head.rank if method == "xpress" else cfg.head.markov_rank
    c = count_flops(method, draft_vocab, hidden, rank, cfg.drafter.block_size,
                    iters=(iters or cfg.head.max_iters) if method == "xpress" else None)
    return c["total"] / (cfg.drafter.block_size - 1)


# ------------------------------------------------------------------------------------------- workloads
@dataclass
class Cost:
    """FLOPs that run at full batch (compute-bound) and the decode part, whose time is the larger of its
    FLOPs, its bytes and its measured floor (``floor_s``: the measured batch-1 seconds of its passes); and
    work whose seconds were measured (``measured_s``, its FLOPs in ``measured_flops``). ``floor_from`` and
    ``measured_from`` name where the measured seconds were read."""

    flops: float = 0.0
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    tokens: float = 0.0  # tokens generated or trained on
    floor_s: float = 0.0
    measured_flops: float = 0.0
    measured_s: float = 0.0
    floor_from: tuple[str, ...] = ()
    measured_from: tuple[str, ...] = ()

    def __iadd__(self, o: "Cost") -> "Cost":
        self.flops += o.flops
        self.decode_flops += o.decode_flops
        self.decode_bytes += o.decode_bytes
        self.tokens += o.tokens
        self.floor_s += o.floor_s
        self.measured_flops += o.measured_flops
        self.measured_s += o.measured_s
        self.floor_from = tuple(dict.fromkeys(self.floor_from + o.floor_from))
        self.measured_from = tuple(dict.fromkeys(self.measured_from + o.measured_from))
        return self

    def _parts(self, gpu: GPU, utilization: float) -> tuple[float, float, float]:
        """Seconds of the full-batch FLOPs, the decode's FLOPs and the decode's bytes at ``utilization``."""
        flops_s, bytes_s = gpu.bf16_tflops * 1e12 * utilization, gpu.hbm_tb_s * 1e12 * utilization
        return self.flops / flops_s, self.decode_flops / flops_s, self.decode_bytes / bytes_s

    def floor_decides(self, gpu: GPU, utilization: float) -> bool:
        """Whether the measured floor is longer than the decode's roofline time."""
        _, decode_compute, decode_memory = self._parts(gpu, utilization)
        return self.floor_s > max(decode_compute, decode_memory)

    def seconds(self, gpu: GPU, utilization: float) -> float:
        compute, decode_compute, decode_memory = self._parts(gpu, utilization)
        return self.measured_s + compute + max(decode_compute, decode_memory, self.floor_s)

    def bound(self, gpu: GPU, utilization: float = DEFAULT_UTILIZATION) -> str:
        """What limits the stage on ``gpu``: ``measured`` when measured seconds make up most of its time, else
        ``memory`` when streaming the decode's bytes takes longer than all of its FLOPs, else ``compute``."""
        measured = self.measured_s + (self.floor_s if self.floor_decides(gpu, utilization) else 0.0)
        if measured > self.seconds(gpu, utilization) / 2:
            return "measured"
        flops = self.flops + self.decode_flops
        return "memory" if self.decode_bytes / (gpu.hbm_tb_s * 1e12) > flops / (gpu.bf16_tflops * 1e12) else "compute"

    def sources(self, gpu: GPU, utilization: float) -> list[str]:
        """Where the measured seconds that count came from; empty: the model alone."""
        return list(dict.fromkeys(self.measured_from + (self.floor_from if self.floor_decides(gpu, utilization)
                                                        else ())))


def decode_cost(target: Dims, *, sequences: int, batch: int, prompt: int, new_tokens: int,
                drafter: DrafterDims | None = None, head_row_flops: float = 0.0, tau: float = 1.0,
                pass_time: "Timing | None" = None) -> Cost:
    """``sequences`` prompts of ``prompt`` tokens decoded ``batch`` at a time to ``new_tokens`` each.

    AR (``drafter`` None): one target forward of 1 token per new token. Speculative: ``new_tokens / tau``
    rounds, each a drafter block (+ the head on B - 1 rows) and a target verify of B tokens. Each round
    streams the weights once per batch and every sequence's KV cache at the mean context
    ``prompt + new_tokens / 2``. ``pass_time``: the measured seconds of one such pass (a step or a round) at
    batch 1, the floor of every pass over a batch."""
    rounds = math.ceil(new_tokens / tau) if drafter else new_tokens
    verify = drafter.block if drafter else 1
    ctx = prompt + new_tokens / 2
    passes = math.ceil(sequences / batch) * rounds  # forwards over the whole batch
    c = Cost(tokens=sequences * new_tokens)
    c.flops = sequences * prompt * target.forward_flops(prompt / 2, readout=False)  # prefill
    c.decode_flops = sequences * rounds * verify * target.forward_flops(ctx)
    c.decode_bytes = passes * target.weight_bytes() + sequences * rounds * ctx * target.kv_bytes_per_token()
    if drafter:
        c.flops += sequences * prompt * drafter.context_flops()
        c.decode_flops += sequences * rounds * (drafter.block_flops(ctx) + (drafter.block - 1) * head_row_flops
                                                + verify * drafter.context_flops())
        c.decode_bytes += passes * drafter.block_bytes()
    if pass_time is not None:
        c.floor_s, c.floor_from = passes * pass_time.seconds, pass_time.sources
    return c


def train_step_cost(cfg: Config, method: str, target: Dims, drafter: DrafterDims) -> Cost:
    """One optimizer step on ONE process: ``train.batch_size`` sequences of ``train.max_len`` tokens with
    ``train.anchors_per_seq`` blocks each.

    Target (frozen, ``data.cache_features: false``): forward over every token, and its readout at the
    B - 1 label rows of every block (the target distribution). Drafter (trained unless
    ``train.refiner_only`` for a head method): the context ``fc`` over every token, B tokens per block
    through its layers with attention over half the window, and its frozen readout on the B - 1 rows
    (forward + input gradient). Head: trained, on the same rows, teacher-forced plus the consistency pass
    when ``train.consistency_weight`` > 0."""
    t = cfg.train
    tokens = t.batch_size * t.max_len
    blocks = t.batch_size * t.anchors_per_seq
    rows = blocks * (drafter.block - 1)
    ctx = t.max_len / 2
    frozen_drafter = t.refiner_only and method != "dflash"
    grad = 2.0 if frozen_drafter else 6.0  # per parameter and token: forward only, or forward + backward
    flops = tokens * target.forward_flops(ctx, readout=False) + rows * 2.0 * target.vocab * target.hidden
    flops += tokens * grad * drafter.fc_params
    flops += blocks * drafter.block * (grad * drafter.body.body_params() + grad / 2 * drafter.body.attention_flops(ctx))
    flops += rows * 4.0 * drafter.draft_vocab * drafter.body.hidden
    passes = 2 if cfg.train.consistency_weight > 0 else 1
    flops += rows * passes * 3.0 * head_flops_per_row(method, cfg, drafter.draft_vocab, target.hidden, iters=1)
    return Cost(flops=flops, tokens=tokens)


# ---------------------------------------------------------------------------------------- measured constants
@dataclass(frozen=True)
class Timing:
    """Measured seconds and where each part was read (``"results/h200/latency.json:
    timings['target step (1 token)'].median_ms"``)."""

    seconds: float
    sources: tuple[str, ...]

    def __add__(self, o: "Timing") -> "Timing":
        return Timing(self.seconds + o.seconds, self.sources + o.sources)


@dataclass
class Measured:
    """What a GPU measured for a preset (:func:`load_measured`): ``decode`` the batch-1 seconds of one
    ``step`` (the target's 1-token forward), ``verify`` (its B-token forward), ``drafter`` (a block and its
    readout), ``markov`` and ``xpress`` (the heads); ``train_step`` one training step per method at the
    preset's shapes; ``about`` the measuring runs (GPU, git revision, date); ``notes`` what was looked for
    and not used, and why."""

    folder: str
    decode: dict[str, Timing] = field(default_factory=dict)
    train_step: dict[str, Timing] = field(default_factory=dict)
    about: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def pass_time(self, method: str, batch: int = 1) -> Timing | None:
        """One decoding pass, as measured at batch 1: AR's step, else a round (drafter block, the method's head,
        verify); at ``batch`` 1 the target's forwards on frames where those were timed (``target.frame_rows``
        frames batch-1 forwards only). None where a part was not measured."""
        d = self.decode
        framed = batch == 1 and "step_frames" in d and "verify_frames" in d
        step, verify = ("step_frames", "verify_frames") if framed else ("step", "verify")
        if method == "ar":
            return d.get(step)
        parts = ["drafter", verify] + ([] if method == "dflash" else [method])
        if not all(p in d for p in parts):
            return None
        total = d[parts[0]]
        for p in parts[1:]:
            total = total + d[p]
        return total


# train_memory.json's ``shapes`` keys -> (config section or "target" for the target's Dims, field)
TRAIN_SHAPE_KEYS = {"hidden": ("target", "hidden"), "target_layers": ("target", "layers"),
                    "intermediate": ("target", "intermediate"), "heads": ("target", "heads"),
                    "kv_heads": ("target", "kv_heads"), "head_dim": ("target", "head_dim"),
                    "vocab": ("target", "vocab"), "drafter_layers": ("drafter", "num_layers"),
                    "block_size": ("drafter", "block_size"), "batch_size": ("train", "batch_size"),
                    "max_len": ("train", "max_len"), "anchors_per_seq": ("train", "anchors_per_seq")}


def measured_dir(gpu: GPU | str = DEFAULT_GPU) -> Path:
    """Where the repository keeps what ``gpu`` measured: ``results/<device_slug>/`` of the repository (the
    committed measurements, wherever ``$XPRESS_RESULTS`` sends new results)."""
    from . import paths

    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    return paths.REPO_ROOT / "results" / device_slug(gpu.name)


def _read_json(path: Path, notes: list[str], shown: str) -> dict[str, Any] | None:
    if not path.is_file():
        notes.append(f"{shown}: not found")
        return None
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        notes.append(f"{shown}: unreadable ({e})")
        return None
    if not isinstance(payload, dict):
        notes.append(f"{shown}: not a JSON object")
        return None
    return payload


def _about(payload: dict[str, Any]) -> str:
    prov = payload.get("provenance") or {}
    gpu = (prov.get("machine") or {}).get("gpu") or "no GPU named"
    return f"{gpu}, git {str(prov.get('git_revision', 'unknown'))[:7]}, {str(prov.get('date', 'undated'))[:10]}"


def _latency_constants(cfg: Config, tg: Dims, payload: dict[str, Any], shown: str, m: Measured) -> None:
    """The batch-1 decoding constants from a ``latency.json`` shape set at the preset's shapes."""
    d = cfg.drafter
    want = {"hidden": tg.hidden, "target_layers": tg.layers, "target_vocab": tg.vocab, "block_size": d.block_size,
            "drafter_layers": d.num_layers, "rank": cfg.head.rank, "markov_rank": cfg.head.markov_rank}
    for name, sset in (payload.get("shape_sets") or {}).items():
        shapes = sset.get("shapes") or {}
        if all(shapes.get(k) == v for k, v in want.items()):
            break
    else:
        m.notes.append(f"{shown}: no shape set at the preset's shapes ({', '.join(f'{k} {v}' for k, v in want.items())})")
        return
    timings = sset.get("timings") or {}

    def first(*names: str) -> Timing | None:
        for n in names:
            if isinstance(timings.get(n), dict) and timings[n].get("median_ms") is not None:
                return Timing(timings[n]["median_ms"] / 1000,
                              (f"{shown}: shape_sets.{name}.timings[{n!r}].median_ms",))
        return None

    B, k, frames = d.block_size, cfg.head.max_iters, cfg.target.frame_rows
    found = {"step": first("target step (1 token)"), "verify": first(f"target verify ({B} tokens)"),
             "markov": first("markov graph", "markov"),  # a CUDA graph, as the paper's harness, where recorded
             "xpress": first(f"xpress graph K={k}", f"xpress K={k}")}
    forward, readout = first("drafter forward"), first("base readout")
    found["drafter"] = forward + readout if forward and readout else None
    if frames:  # batch-1 forwards run on frames (target.frame_rows): their timings where recorded
        found["step_frames"] = first(f"target step (1 token, frames of {frames})")
        found["verify_frames"] = first(f"target verify ({B} tokens, frames of {frames})")
    for key, timing in found.items():
        if timing is None:
            m.notes.append(f"{shown}: no {DECODE_NAMES[key]} timing in shape set {name!r}")
        else:
            m.decode[key] = timing
    m.about[shown] = _about(payload)


def _run_shapes(cfg: Config, tg: Dims, shapes: dict[str, Any]) -> tuple[Config, Dims]:
    """The config and target of a training step run at ``shapes`` (train_memory.json's; missing keys: the
    preset's)."""
    changes: dict[str, dict[str, int]] = {"target": {}, "drafter": {}, "train": {}}
    for key, (section, name) in TRAIN_SHAPE_KEYS.items():
        if key in shapes:
            changes[section][name] = int(shapes[key])
    run = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, **changes["drafter"]),
                              train=dataclasses.replace(cfg.train, **changes["train"]))
    return run, dataclasses.replace(tg, **changes["target"])


def _train_constants(cfg: Config, tg: Dims, payload: dict[str, Any], shown: str, m: Measured) -> None:
    """One training step per method at the preset's shapes from ``train_memory.json``: ``methods.<m>.
    step_seconds`` measured at ``shapes`` (top level or the method's), times the model's FLOPs at the preset's
    shapes over its FLOPs at those."""
    methods = payload.get("methods")
    if not isinstance(methods, dict):
        m.notes.append(f"{shown}: no methods object")
        return
    wanted = list(dict.fromkeys((["dflash"] if cfg.train.warm_start_steps > 0 else []) + list(cfg.eval.methods)))
    for method in wanted:
        entry = methods.get(method)
        seconds = entry.get("step_seconds") if isinstance(entry, dict) else None
        shapes = (entry.get("shapes") if isinstance(entry, dict) else None) or payload.get("shapes")
        if not isinstance(seconds, (int, float)) or seconds <= 0:
            m.notes.append(f"{shown}: no methods.{method}.step_seconds")
            continue
        if not isinstance(shapes, dict) or not set(shapes) & set(TRAIN_SHAPE_KEYS):
            m.notes.append(f"{shown}: no shapes for the step of {method} (keys {', '.join(TRAIN_SHAPE_KEYS)})")
            continue
        run_cfg, run_tg = _run_shapes(cfg, tg, shapes)
        full = train_step_cost(cfg, method, tg, drafter_dims(cfg, tg)).flops
        ran = train_step_cost(run_cfg, method, run_tg, drafter_dims(run_cfg, run_tg)).flops
        shown_shapes = ", ".join(f"{k} {shapes[k]}" for k in TRAIN_SHAPE_KEYS if k in shapes)
        m.train_step[method] = Timing(seconds * full / ran, (
            f"{shown}: methods.{method}.step_seconds ({seconds:.3g} s at {shown_shapes}; x {full / ran:.3g}, the "
            f"model's FLOPs at the preset's shapes over those)",))
    m.about[shown] = _about(payload)


def load_measured(cfg: Config, folder: str | Path | None = None, gpu: GPU | str = DEFAULT_GPU,
                  target: Dims | None = None) -> Measured:
    """What ``folder`` (default :func:`measured_dir` of ``gpu``) holds for ``cfg``: the decoding constants of
    its ``latency.json`` (``scripts/gpu_latency.py``; a shape set at the preset's target, drafter and head
    shapes) and the training steps of its ``train_memory.json`` (``python -m xpress bench train-memory``).
    What is missing or at other shapes is listed in ``notes`` and left to the model."""
    from . import paths

    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"measured constants folder {str(folder)!r} does not exist; give the folder the device check "
                         f"wrote (results/<gpu>/), or none for the model alone")
    folder = Path(folder) if folder is not None else measured_dir(gpu)
    tg = target or target_dims(cfg)
    m = Measured(folder=paths.portable(folder.resolve()))
    for name, read in (("latency.json", _latency_constants), ("train_memory.json", _train_constants)):
        shown = f"{m.folder}/{name}"
        payload = _read_json(folder / name, m.notes, shown)
        if payload is not None:
            read(cfg, tg, payload, shown, m)
    return m


# ------------------------------------------------------------------------------------------------ stages
def estimate_gpu_hours(cfg: Config, gpu: GPU | str = DEFAULT_GPU, utilization: float = DEFAULT_UTILIZATION,
                       world: int = DEFAULT_WORLD, tau: float = 1.0, target: Dims | None = None,
                       measured: Measured | None = None) -> list[dict[str, Any]]:
    """One row per stage of the pipeline at ``cfg``'s sizes: ``{"stage", "command", "workload", "tokens",
    "pflop", "bound", "gpu_hours", "source"}`` and a final ``total`` row. ``target`` overrides
    :func:`target_dims`; ``tau``: tokens committed per target forward assumed for the speculative methods
    (1 = an upper bound); ``measured`` (:func:`load_measured`): measured constants in place of the model where
    it has them (None: the model alone); ``source`` lists the measured ones a row used, or says ``model``."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization={utilization}: give a fraction of the peak in (0, 1]")
    if tau < 1 or tau > cfg.drafter.block_size:
        raise ValueError(f"tau={tau}: give a value between 1 and drafter.block_size={cfg.drafter.block_size}")
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    tg = target or target_dims(cfg)
    dr = drafter_dims(cfg, tg)
    d, e, t = cfg.data, cfg.eval, cfg.train
    prompt = d.regen_max_prompt_tokens
    benches = len(d.benchmarks)
    p = cfg.preset
    meas = measured or Measured(folder="")

    def spec(method: str, **kw: Any) -> Cost:
        if method == "ar":
            return decode_cost(tg, pass_time=meas.pass_time("ar", kw["batch"]), **kw)
        return decode_cost(tg, drafter=dr, head_row_flops=head_flops_per_row(method, cfg, dr.draft_vocab, tg.hidden),
                           tau=tau, pass_time=meas.pass_time(method, kw["batch"]), **kw)

    rows: list[dict[str, Any]] = []

    def source(cost: Cost) -> str:
        return _shorten(cost.sources(gpu, utilization)) or "model"

    def add(stage: str, command: str, workload: str, cost: Cost, processes: int = 1, parts: str = "") -> None:
        rows.append({"stage": stage, "command": command, "workload": workload, "tokens": cost.tokens * processes,
                     "pflop": (cost.flops + cost.decode_flops + cost.measured_flops) * processes / 1e15,
                     "bound": cost.bound(gpu, utilization), "gpu_hours": cost.seconds(gpu, utilization) * processes / 3600,
                     "source": parts or source(cost)})

    n_seq = d.n_train_prompts + d.n_val_prompts
    add("regenerate", f"torchrun --nproc_per_node 8 -m xpress regenerate --preset {p}",
        f"{n_seq} prompts x {d.regen_max_new_tokens} tokens, batch {d.regen_batch_size}",
        spec("ar", sequences=n_seq, batch=d.regen_batch_size, prompt=prompt, new_tokens=d.regen_max_new_tokens))

    stages = ([("warmstart", "dflash", t.warm_start_steps)] if t.warm_start_steps > 0 and not cfg.drafter.checkpoint
              else []) + [(m, m, t.steps) for m in e.methods]
    for stage, method, steps in stages:
        step = train_step_cost(cfg, method, tg, dr)
        timed = meas.train_step.get(method)
        cost = (Cost(measured_flops=step.flops * steps, measured_s=timed.seconds * steps, tokens=step.tokens * steps,
                     measured_from=timed.sources) if timed else Cost(flops=step.flops * steps, tokens=step.tokens * steps))
        evals = (steps // t.eval_every if t.eval_every else 0) + 1
        parts = f"steps: {source(cost)}"
        if t.eval_prompts:  # rank 0 decodes the validation prompts; the other processes wait
            ev = spec(method, sequences=evals * t.eval_prompts, batch=1, prompt=prompt, new_tokens=t.eval_max_new_tokens)
            ev.tokens = 0  # the row counts trained tokens
            parts += f"; evaluations: {source(ev)}"
            cost += ev
        only = " train.refiner_only=true" if t.refiner_only and method != "dflash" else ""
        add(f"train {stage}", f"accelerate launch -m xpress train --preset {p} --method {method}{only}",
            f"{world} GPUs x {steps} steps x {t.batch_size} x {t.max_len} tokens, {t.anchors_per_seq} blocks/seq",
            cost, processes=world, parts=parts)

    methods = ["ar", *e.methods]
    runs = e.repeats + len(e.sampling_seeds)
    cost = Cost()
    for m in methods:
        cost += spec(m, sequences=benches * e.prompts_per_benchmark * runs, batch=1, prompt=prompt,
                     new_tokens=e.max_new_tokens)
    add("table 1", f"python -m xpress.studies.table1 --preset {p}",
        f"{len(methods)} methods x {benches} benchmarks x {e.prompts_per_benchmark} prompts x {runs} runs x "
        f"{e.max_new_tokens} tokens, batch 1", cost)

    temps = 2 if e.sampling_seeds else 1
    cost = Cost()
    for m in e.methods:
        cost += spec(m, sequences=benches * e.resolution_prompts * temps, batch=e.resolution_batch_size,
                     prompt=prompt, new_tokens=e.max_new_tokens)
    add("resolution", f"python -m xpress.studies.resolution --preset {p}",
        f"{len(e.methods)} methods x {benches} benchmarks x {e.resolution_prompts} prompts x {temps} temperatures, "
        f"batch {e.resolution_batch_size}", cost)

    n_k = len(e.methods) + cfg.drafter.block_size  # dflash, markov, xpress at K = 1 .. B-1 and sequential
    replay = spec("ar", sequences=benches * e.prompts_per_benchmark, batch=1, prompt=prompt,
                  new_tokens=e.max_new_tokens)
    blocks = benches * e.prompts_per_benchmark * e.max_new_tokens  # one drafter block per replayed position
    replay.decode_flops += blocks * (len(e.methods) * dr.block_flops(prompt + e.max_new_tokens / 2)
                                     + n_k * (dr.block - 1) * head_flops_per_row("xpress", cfg, dr.draft_vocab, tg.hidden))
    replay.decode_bytes += blocks * len(e.methods) * dr.block_bytes()
    if replay.floor_from and "drafter" in meas.decode and "xpress" in meas.decode:  # the blocks, measured as the steps
        per_block = Timing(len(e.methods) * meas.decode["drafter"].seconds + n_k * meas.decode["xpress"].seconds,
                           meas.decode["drafter"].sources + meas.decode["xpress"].sources)
        replay += Cost(floor_s=blocks * per_block.seconds, floor_from=per_block.sources)
    add("tau vs K (notebook 05)", f"papermill notebooks/05_jacobi_and_latency.ipynb - -p PRESET {p}",
        f"AR replay of {benches} x {e.prompts_per_benchmark} prompts x {e.max_new_tokens} tokens, drafter blocks "
        f"at every position", replay)

    cost = Cost()
    for b in e.batch_sizes:
        for m in ["ar", *e.batched_methods]:
            cost += spec(m, sequences=e.batched_prompts, batch=b, prompt=prompt, new_tokens=e.batched_max_new_tokens)
    add("batched", f"python -m xpress.studies.batched --preset {p}",
        f"{1 + len(e.batched_methods)} methods x {e.batched_prompts} prompts x {e.batched_max_new_tokens} tokens at "
        f"batch {', '.join(map(str, e.batch_sizes))}", cost)

    rows.append({"stage": "total", "command": "", "workload": "", "tokens": sum(r["tokens"] for r in rows),
                 "pflop": sum(r["pflop"] for r in rows), "bound": "",
                 "gpu_hours": sum(r["gpu_hours"] for r in rows), "source": ""})
    return rows


def format_table(rows: list[dict[str, Any]], cfg: Config, gpu: GPU | str = DEFAULT_GPU,
                 utilization: float = DEFAULT_UTILIZATION, world: int = DEFAULT_WORLD, tau: float = 1.0,
                 measured: Measured | None = None, memory: dict[str, float] | None = None) -> str:
    """The rows as a Markdown table with a one-line header naming the assumptions; ``memory``: predicted peak
    bytes per GPU by stage (``train <method>``, ``regenerate``, ``decode`` for every decoding stage), a column;
    then (``measured``) the measured constants and each stage's source (:func:`format_sources`)."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    tg, dr = target_dims(cfg), drafter_dims(cfg, target_dims(cfg))
    head = (f"Preset `{cfg.preset}` on {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s bf16 dense, {gpu.hbm_tb_s:g} TB/s) at "
            f"{utilization:.0%} of peak; target {tg.params() / 1e9:.2f}B parameters, drafter "
            f"{(dr.body.body_params() + dr.fc_params) / 1e9:.2f}B; training on {world} GPUs; assumed tau {tau:g} (1: "
            f"the drafter never helps); every prompt {cfg.data.regen_max_prompt_tokens} tokens, every answer at its "
            f"cap: upper bounds.")
    if memory is None:
        lines = [head, "", "| stage | workload | tokens | PFLOP | bound | GPU-hours |", "|---|---|---|---|---|---|"]
    else:
        head += (" Peak GB per GPU: the memory model of xpress.train.memory (training: one step's peak, steady "
                 "state; decoding: weights, KV cache and one forward at the stage's largest batch).")
        lines = [head, "", "| stage | workload | tokens | PFLOP | bound | GPU-hours | peak GB/GPU |",
                 "|---|---|---|---|---|---|---|"]
    for r in rows:
        line = (f"| {r['stage']} | {r['workload']} | {r['tokens']:.3g} | {r['pflop']:.3g} | {r['bound']} | "
                f"{r['gpu_hours']:.3g} |")
        if memory is not None:
            peak = memory.get(r["stage"], memory["decode"] if r["stage"] != "total" else None)
            line += f" {peak / 1e9:.1f} |" if peak is not None else f" max {max(memory.values()) / 1e9:.1f} |"
        lines.append(line)
    if measured is not None:
        lines += ["", format_sources(rows, measured)]
    return "\n".join(lines)


DECODE_NAMES = {"step": "target step", "verify": "target verify", "step_frames": "target step on frames",
                "verify_frames": "target verify on frames", "drafter": "drafter block + readout",
                "markov": "Markov head", "xpress": "xPress head"}


def _shorten(sources: Sequence[str]) -> str:
    """Sources grouped by file and shape set: ``results/h200/latency.json shape_sets.paper.timings[...]
    median_ms: 'target step (1 token)', 'drafter forward'``."""
    groups: dict[str, list[str]] = {}
    for src in sources:
        hit = re.fullmatch(r"(.*?): (shape_sets\.[^.]+\.timings)\[(.*)\]\.median_ms", src)
        key, item = ((f"{hit[1]} {hit[2]}[...].median_ms", hit[3]) if hit else (src, ""))
        groups.setdefault(key, [])
        if item and item not in groups[key]:
            groups[key].append(item)
    return "; ".join(f"{k}: {', '.join(v)}" if v else k for k, v in groups.items())


def format_sources(rows: list[dict[str, Any]], measured: Measured) -> str:
    """The measured constants (value, file, measuring run) and, per stage, what its hours came from."""
    lines = [f"Measured constants from `{measured.folder}/` "
             f"({'; '.join(f'{Path(f).name}: {a}' for f, a in measured.about.items()) or 'none there'}); a "
             f"decoding pass over a batch takes at least its batch-1 time there, a training step its measured "
             f"time; `bound` says `measured` where these decide:"]
    for key, t in measured.decode.items():
        lines.append(f"- {DECODE_NAMES.get(key, key)}: {t.seconds * 1e3:.3g} ms ({_shorten(t.sources)})")
    for method, t in measured.train_step.items():
        lines.append(f"- training step, {method}: {t.seconds:.3g} s ({_shorten(t.sources)})")
    lines.append("")
    lines.append("Each stage's source:")
    for r in rows:
        if r["stage"] != "total":
            lines.append(f"- {r['stage']}: {r['source']}")
    if measured.notes:
        lines += ["", "Not used: " + "; ".join(measured.notes) + "."]
    return "\n".join(lines)
