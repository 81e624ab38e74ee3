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

import math
from dataclasses import dataclass
from typing import Any

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
    from .rehearsal import is_rehearsal_path, padded_vocab

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
    FLOPs and its bytes."""

    flops: float = 0.0
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    tokens: float = 0.0  # tokens generated or trained on

    def __iadd__(self, o: "Cost") -> "Cost":
        self.flops += o.flops
        self.decode_flops += o.decode_flops
        self.decode_bytes += o.decode_bytes
        self.tokens += o.tokens
        return self

    def seconds(self, gpu: GPU, utilization: float) -> float:
        flops_s, bytes_s = gpu.bf16_tflops * 1e12 * utilization, gpu.hbm_tb_s * 1e12 * utilization
        return self.flops / flops_s + max(self.decode_flops / flops_s, self.decode_bytes / bytes_s)

    def bound(self, gpu: GPU) -> str:
        """What limits the stage on ``gpu``: ``memory`` when streaming the decode's bytes takes longer than all
        of its FLOPs, else ``compute``."""
        flops = self.flops + self.decode_flops
        return "memory" if self.decode_bytes / (gpu.hbm_tb_s * 1e12) > flops / (gpu.bf16_tflops * 1e12) else "compute"


def decode_cost(target: Dims, *, sequences: int, batch: int, prompt: int, new_tokens: int,
                drafter: DrafterDims | None = None, head_row_flops: float = 0.0, tau: float = 1.0) -> Cost:
    """``sequences`` prompts of ``prompt`` tokens decoded ``batch`` at a time to ``new_tokens`` each.

    AR (``drafter`` None): one target forward of 1 token per new token. Speculative: ``new_tokens / tau``
    rounds, each a drafter block (+ the head on B - 1 rows) and a target verify of B tokens. Each round
    streams the weights once per batch and every sequence's KV cache at the mean context
    ``prompt + new_tokens / 2``."""
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


# ------------------------------------------------------------------------------------------------ stages
def estimate_gpu_hours(cfg: Config, gpu: GPU | str = DEFAULT_GPU, utilization: float = DEFAULT_UTILIZATION,
                       world: int = DEFAULT_WORLD, tau: float = 1.0, target: Dims | None = None) -> list[dict[str, Any]]:
    """One row per stage of the pipeline at ``cfg``'s sizes: ``{"stage", "command", "workload", "tokens",
    "pflop", "bound", "gpu_hours"}`` and a final ``total`` row. ``target`` overrides :func:`target_dims`;
    ``tau``: tokens committed per target forward assumed for the speculative methods (1 = an upper bound)."""
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

    def spec(method: str, **kw: Any) -> Cost:
        if method == "ar":
            return decode_cost(tg, **kw)
        return decode_cost(tg, drafter=dr, head_row_flops=head_flops_per_row(method, cfg, dr.draft_vocab, tg.hidden),
                           tau=tau, **kw)

    rows: list[dict[str, Any]] = []

    def add(stage: str, command: str, workload: str, cost: Cost, processes: int = 1) -> None:
        rows.append({"stage": stage, "command": command, "workload": workload, "tokens": cost.tokens * processes,
                     "pflop": (cost.flops + cost.decode_flops) * processes / 1e15, "bound": cost.bound(gpu),
                     "gpu_hours": cost.seconds(gpu, utilization) * processes / 3600})

    n_seq = d.n_train_prompts + d.n_val_prompts
    add("regenerate", f"torchrun --nproc_per_node 8 -m xpress regenerate --preset {p}",
        f"{n_seq} prompts x {d.regen_max_new_tokens} tokens, batch {d.regen_batch_size}",
        decode_cost(tg, sequences=n_seq, batch=d.regen_batch_size, prompt=prompt, new_tokens=d.regen_max_new_tokens))

    stages = ([("warmstart", "dflash", t.warm_start_steps)] if t.warm_start_steps > 0 and not cfg.drafter.checkpoint
              else []) + [(m, m, t.steps) for m in e.methods]
    for stage, method, steps in stages:
        step = train_step_cost(cfg, method, tg, dr)
        cost = Cost(flops=step.flops * steps, tokens=step.tokens * steps)
        evals = (steps // t.eval_every if t.eval_every else 0) + 1
        if t.eval_prompts:  # rank 0 decodes the validation prompts; the other processes wait
            ev = spec(method, sequences=evals * t.eval_prompts, batch=1, prompt=prompt, new_tokens=t.eval_max_new_tokens)
            ev.tokens = 0  # the row counts trained tokens
            cost += ev
        only = " train.refiner_only=true" if t.refiner_only and method != "dflash" else ""
        add(f"train {stage}", f"accelerate launch -m xpress train --preset {p} --method {method}{only}",
            f"{world} GPUs x {steps} steps x {t.batch_size} x {t.max_len} tokens, {t.anchors_per_seq} blocks/seq",
            cost, processes=world)

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
    replay = decode_cost(tg, sequences=benches * e.prompts_per_benchmark, batch=1, prompt=prompt,
                         new_tokens=e.max_new_tokens)
    blocks = benches * e.prompts_per_benchmark * e.max_new_tokens  # one drafter block per replayed position
    replay.decode_flops += blocks * (len(e.methods) * dr.block_flops(prompt + e.max_new_tokens / 2)
                                     + n_k * (dr.block - 1) * head_flops_per_row("xpress", cfg, dr.draft_vocab, tg.hidden))
    replay.decode_bytes += blocks * len(e.methods) * dr.block_bytes()
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
                 "gpu_hours": sum(r["gpu_hours"] for r in rows)})
    return rows


def format_table(rows: list[dict[str, Any]], cfg: Config, gpu: GPU | str = DEFAULT_GPU,
                 utilization: float = DEFAULT_UTILIZATION, world: int = DEFAULT_WORLD, tau: float = 1.0,
                 memory: dict[str, float] | None = None) -> str:
    """The rows as a Markdown table with a one-line header naming the assumptions; ``memory``: predicted peak
    bytes per GPU by stage (``train <method>``, ``regenerate``, ``decode`` for every decoding stage), a column."""
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
    return "\n".join(lines)
