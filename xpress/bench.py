"""Benchmarks and decoding runs: the ``decode`` command's engine and the oracle-ceiling record.

    python -m xpress.bench oracle-ceiling --preset cpu     # writes results/<preset>/oracle_ceiling.{json,csv}
    python -m xpress bench oracle-ceiling --preset cpu     # the same through the main CLI
    python -m xpress bench train-memory --preset qwen3-8b --shrink   # results/qwen3-8b/train_memory.{json,csv}
    python -m xpress bench compiled-eager --preset qwen3-8b --frame-rows 0,64   # the compiled harness vs eager

``oracle-ceiling`` runs, in one process and on the same prompts, autoregressive greedy decoding and
speculative decoding with :class:`~xpress.reference_drafters.OracleDrafter` (whose greedy continuations
are computed before the timed runs, so its drafting is ~free), interleaved per prompt: the speedup a
perfect drafter would give this target on this machine, with tau = B, as the median over repeats with
its spread. B is :data:`CEILING_BLOCK` (16, the paper's block size) unless ``--block-size`` says otherwise:
the ceiling is a property of the target and the machine, not of the block size a preset trains (the cpu
preset's drafters use 8, whose ceiling cannot pass 8x; Table 1's stage costs give its own verify cost).
It also measures the cost of one B-token verify forward relative to a 1-token decoding step, the ratio
that caps that speedup (speedup <= tau / ratio); a speedup above that is flagged, not reported.

``train-memory`` runs one training step per method, each in a fresh process, and compares its measured peak
with the memory model (:mod:`xpress.train.memory`). Its options: ``--shrink`` (required: random weights with
the widths divided by ``--width-divisor``, default 32), ``--layers T[,D]`` (target and drafter layers kept),
``--methods``, ``--out-dir`` and config overrides (``target.device=cuda``); without a GPU (and without
``target.device``) the step runs on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import paths
from .methods import METHODS, MODEL_METHODS, make_drafter  # noqa: F401  (importable from here too)

if TYPE_CHECKING:  # heavy imports (torch) happen inside the functions: the CLI parser stays fast
    import torch

    from .protocol import Drafter
    from .targets import Target


class DecodeInputError(ValueError):
    """Bad input to a decoding run (missing prompts file, malformed record); the message says what."""


# ============================================================================================ prompts
def load_prompts(bench: str | None = None, prompts_file: str | Path | None = None,
                 limit: int | None = None) -> list[dict]:
    """Records ``{"id", "turns": [user messages]}`` from a benchmark or a JSONL file (one record a line)."""

    if (bench is None) == (prompts_file is None):
        raise DecodeInputError("give exactly one of a benchmark name or a prompts file")
    if bench is not None:
        from .data import DataError, load_benchmark

        try:
            return load_benchmark(bench, limit=limit or None)
        except DataError as e:
            raise DecodeInputError(str(e)) from None
    path = Path(prompts_file)
    if path.is_dir():
        raise DecodeInputError(f"--prompts {str(path)!r} is a directory; give a JSONL file of "
                               f'{{"id": ..., "turns": [...]}} records')
    if not path.is_file():
        raise DecodeInputError(f"prompts file {str(path)!r} does not exist")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DecodeInputError(f"{path}:{n}: not JSON ({e.msg})") from None
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise DecodeInputError(f'{path}:{n}: a record must be {{"id": ..., "turns": ["user message", ...]}}')
        records.append({"id": rec.get("id", f"{path.stem}-{len(records)}"), "turns": turns})
    return records[:limit] if limit else records


# ========================================================================================= decode runs
class DecodeInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``decode``: the finished prompts are kept; the message says where and how to resume."""


def conversation_record(target: Target, rec: dict, method: str, gens: list) -> dict[str, Any]:
    """One output line of ``decode``.

    Top-level fields cover the whole conversation, concatenated over turns: ``token_ids`` (generated ids
    of every turn, one after another), ``accept_lengths`` (every verification step), ``timings`` (seconds
    per stage summed over turns) and ``text`` (the turns' decoded answers joined by a blank line, for
    reading). ``turns`` holds the exact per-turn detail: token_ids, text, accept_lengths, draft_accepts,
    finish_reason, prompt_len, timings (stage totals + per-step lists) and stats.
    """
    turns = []
    for g in gens:
        turns.append({**g.to_record(), "text": target.tokenizer.decode(g.token_ids, skip_special_tokens=True)})
    totals: dict[str, float] = {}
    for g in gens:
        for k, v in g.stage_totals().items():
            totals[k] = totals.get(k, 0.0) + v
    return {"id": rec["id"], "method": method, "n_turns": len(gens),
            "token_ids": [t for g in gens for t in g.token_ids],
            "text": "\n\n".join(t["text"] for t in turns),
            "accept_lengths": [a for g in gens for a in g.accept_lengths],
            "timings": totals, "finish_reason": gens[-1].finish_reason if gens else "", "turns": turns}


class DecodeProgress:
    """A bar over prompts whose postfix follows the tokens inside long generations: tokens so far,
    tokens/s and tau, refreshed at most every ``interval`` seconds from the engine's ``on_round`` calls."""

    def __init__(self, total: int, done: int = 0, desc: str = "decode", enabled: bool = True,
                 interval: float = 0.5) -> None:
        from tqdm.auto import tqdm

        self.enabled, self.interval = enabled, interval
        self.bar = tqdm(total=total, initial=done, desc=desc, unit="prompt", disable=not enabled, file=sys.stderr)
        self.tokens = self.steps = 0
        self.t0 = self.shown = time.perf_counter()

    def round(self, tokens: int, steps: int) -> None:
        """``on_round`` of the decoding engine: ``tokens`` committed over ``steps`` row-steps."""
        self.tokens += tokens
        self.steps += steps
        t = time.perf_counter()
        if self.enabled and t - self.shown >= self.interval:
            self.shown = t
            self.bar.set_postfix_str(self.postfix(t), refresh=True)

    def postfix(self, t: float | None = None) -> str:
        seconds = (t or time.perf_counter()) - self.t0
        return (f"{self.tokens} tok, {self.tokens / seconds if seconds > 0 else 0.0:.1f} tok/s, "
                f"tau {self.tokens / max(1, self.steps):.2f}")

    def prompt_done(self, n: int = 1) -> None:
        if self.enabled:
            self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def group_generator(seed: int, index: int) -> torch.Generator:
    """The sampling generator of the batch that starts at prompt ``index``: seeded by (seed, index), so a
    resumed run samples every remaining prompt as an uninterrupted one would."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def decode_records(target: Target, records: Sequence[dict], drafter: Drafter | None, method: str,
                   max_new_tokens: int, temperature: float = 0.0, seed: int = 0, batch_size: int = 1,
                   progress: bool = True, start: int = 0, total: int | None = None,
                   on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Decode every conversation (multi-turn: each turn after the model's own previous answers),
    ``batch_size`` conversations at a time; the batch starting at prompt ``start + i`` samples with
    :func:`group_generator` ``(seed, start + i)``. ``on_record(record)`` receives each finished record
    (in order) as soon as its batch is done. ``start`` / ``total``: prompts already finished before these
    and in the whole run (a resumed run), for the progress bar.

    First turns are checked against the context before anything runs (``ContextTooLongError``).
    """
    from .decoding import generate_conversations
    from .targets import encode_chat

    for rec in records:
        target.check_fits(len(encode_chat(target.tokenizer, rec["turns"][:1])), max_new_tokens)
    bar = DecodeProgress(total or start + len(records), start, f"decode {method}", progress)
    out: list[dict] = []
    try:
        for i in range(0, len(records), batch_size):
            group = records[i:i + batch_size]
            gens = generate_conversations(target, [r["turns"] for r in group], drafter, max_new_tokens,
                                          temperature, group_generator(seed, start + i), batch_size=batch_size,
                                          on_round=bar.round)
            for r, g in zip(group, gens):
                out.append(conversation_record(target, r, method, g))
                if on_record:
                    on_record(out[-1])
                bar.prompt_done()
    finally:
        bar.close()
    return out


def prepare_oracle(drafter: Any, records: Sequence[dict], target: Target, max_new_tokens: int,
                   progress: bool = True) -> float:
    """The oracle's own preparation, outside every timed region: its greedy continuation of each first
    turn (``max_new_tokens + B + 1`` tokens), so that decoding times the speculative loop, not the
    oracle's precomputation. Returns the seconds it took (0 for any other drafter)."""
    from tqdm.auto import tqdm

    from .reference_drafters import OracleDrafter
    from .targets import encode_chat
    from .utils import now

    if not isinstance(drafter, OracleDrafter):
        return 0.0
    t0 = now(target.device)
    for rec in tqdm(records, desc="oracle: greedy continuations (untimed)", unit="prompt", disable=not progress,
                    file=sys.stderr):
        drafter.prepare([encode_chat(target.tokenizer, rec["turns"][:1])], max_new_tokens + drafter.block_size + 1)
    return now(target.device) - t0


# ------------------------------------------------------------------------------- resumable output
def partial_path(out: Path) -> Path:
    """Where ``decode`` keeps the finished prompts of a run until it completes: ``<out>.partial``."""
    return out.with_name(out.name + ".partial")


def run_key(cfg: Any, method: str, records: Sequence[dict], temperature: float, seed: int, max_new_tokens: int,
            checkpoint: str | None) -> dict[str, Any]:
    """What identifies a decoding run: a resumed run must have the same key (as JSON reads it back)."""
    import hashlib

    prompts = hashlib.sha256(json.dumps([[r["id"], r["turns"]] for r in records]).encode()).hexdigest()
    key = {"method": method, "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens,
           "checkpoint": str(paths.resolve(checkpoint)) if checkpoint else None, "prompts": prompts,
           "config": cfg.to_dict()}
    return json.loads(json.dumps(key, default=str))


def read_partial(path: Path, key: dict[str, Any]) -> list[dict]:
    """The finished records an interrupted run with this ``key`` left at ``path`` (a header line, then one
    record a line; a last line cut by a hard kill is dropped); [] when there are none or they belong to
    another run."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        if not lines or json.loads(lines[0]) != {"resume": key}:
            return []
    except json.JSONDecodeError:
        return []
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class PartialOutput:
    """The ``<out>.partial`` file of a decoding run: rewritten atomically with the kept records when the run
    starts, then one record appended (flushed and synced) as each prompt finishes."""

    def __init__(self, path: Path, key: dict[str, Any], kept: Sequence[dict]) -> None:
        from .utils import atomic_write_jsonl

        self.path = path
        atomic_write_jsonl(path, [{"resume": key}, *kept])

    def append(self, record: dict) -> None:
        from .utils import DeferredInterrupt

        with DeferredInterrupt() as stop:  # a Ctrl-C waits for the line to be complete
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if stop.requested:
            raise KeyboardInterrupt


def decode_main(preset: str, method: str, bench: str | None, prompts_file: str | None, out: str,
                temperature: float | None = None, seed: int | None = None, max_new_tokens: int | None = None,
                limit: int | None = None, overrides: Sequence[str] = (), checkpoint: str | None = None,
                progress: bool = True) -> dict[str, Any]:
    """What ``python -m xpress decode`` does; returns the run's summary (tau, tokens/s, ...).

    Finished prompts go to ``<out>.partial`` as they finish; ``out`` is written (atomically) when every
    prompt is done and the partial file removed. A Ctrl-C raises :class:`DecodeInterrupted` with the
    finished prompts kept; the same command then resumes with the prompts still to do, and the file it
    writes holds what an uninterrupted run would (timings aside).
    """
    from .config import load_config
    from .targets import load_target
    from .utils import atomic_write_jsonl, load_average, load_check, other_cpu_use, seed_everything

    cfg = load_config(preset, list(overrides))
    temperature = cfg.decode.temperature if temperature is None else temperature
    max_new_tokens = cfg.decode.max_new_tokens if max_new_tokens is None else max_new_tokens
    seed = cfg.seed if seed is None else seed
    if temperature < 0 or max_new_tokens < 1:
        raise DecodeInputError("--temperature must be >= 0 and --max-new-tokens >= 1")
    if limit is not None and limit < 1:
        raise DecodeInputError(f"--limit {limit}: give a positive number of prompts, or leave --limit out "
                               f"(a prompts file: all of it; a benchmark: the preset's data.limit, 0 = all)")
    out_path = paths.resolve(out)
    if out_path.is_dir():
        raise DecodeInputError(f"--out {str(out_path)!r} is a directory; give a file path such as out.jsonl")
    if not out_path.parent.is_dir():
        raise DecodeInputError(f"--out {str(out_path)!r}: the folder {str(out_path.parent)!r} does not exist")
    if limit is None and bench is not None:  # the benchmark default; a prompts file is decoded whole
        limit = cfg.data.limit or None
    records = load_prompts(bench, prompts_file, limit)
    if not records:
        raise DecodeInputError("no prompts to decode")
    key = run_key(cfg, method, records, temperature, seed, max_new_tokens, checkpoint)
    part = partial_path(out_path)
    kept = read_partial(part, key)
    if kept:
        print(f"decode: resuming, {len(kept)} of {len(records)} prompts already finished in {part}", file=sys.stderr)
    elif part.is_file():
        print(f"decode: {part} holds another run (other settings or prompts); starting over", file=sys.stderr)
    seed_everything(seed)
    target = load_target(cfg)
    drafter = make_drafter(method, cfg, target, seed=seed, checkpoint=checkpoint)
    todo = records[len(kept):]
    prepare_s = prepare_oracle(drafter, todo, target, max_new_tokens, progress)
    load_start, others_start = load_average(), other_cpu_use()
    partial = PartialOutput(part, key, kept)
    try:
        results = kept + decode_records(target, todo, drafter, method, max_new_tokens, temperature, seed,
                                        batch_size=cfg.decode.batch_size, progress=progress, start=len(kept),
                                        total=len(records), on_record=partial.append)
    except KeyboardInterrupt:
        done = len(read_partial(part, key))
        raise DecodeInterrupted(f"{done} of {len(records)} prompts finished, kept in {part}; rerun the same "
                                f"command to continue") from None
    atomic_write_jsonl(out_path, results)
    part.unlink(missing_ok=True)
    return {**decode_summary(results), "oracle_prepare_s": prepare_s,
            "load_warning": load_check(load_start, load_average(), own_load=_threads(),
                                       others=(others_start, other_cpu_use()))["load_warning"]}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def decode_summary(results: Sequence[dict]) -> dict[str, float]:
    """Totals over ``decode`` records: prompts, tokens, steps, tau, seconds (decoding only), tokens/s."""
    tokens = sum(len(r["token_ids"]) for r in results)
    steps = sum(len(r["accept_lengths"]) for r in results)
    seconds = sum(r["timings"]["total"] for r in results)
    return {"prompts": len(results), "tokens": tokens, "steps": steps, "tau": tokens / max(1, steps),
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}


# ===================================================================================== oracle ceiling
def verify_cost_ratio(target: Target, context_ids: Sequence[int], block_size: int,
                      repeats: int = 30) -> dict[str, float]:
    """Seconds of one ``block_size``-token forward vs one 1-token forward after ``context_ids``, timed in
    interleaved sweeps (:func:`xpress.timing.time_calls`), medians over ``repeats``.

    ``loop_ratio``: the two forwards as the decoding loops run them (speculative verify through
    ``target_forward`` with all B logits and the drafter features; autoregressive step through the lean
    forward keeping 1 logit). ``same_call_ratio``: both through the lean forward, keeping every logit.
    The cache is cropped back after each call, so every call sees the same context.
    """
    import torch

    from .targets import lm_logits, target_forward
    from .timing import time_calls

    dev = target.device
    ctx = torch.tensor([list(context_ids)], dtype=torch.long, device=dev)
    with torch.inference_mode():
        _, cache = lm_logits(target, ctx, None, torch.arange(ctx.shape[1], device=dev)[None], None)
    L = ctx.shape[1]

    def call(n: int, lean: bool, keep: int) -> Callable[[], None]:
        ids = torch.randint(target.vocab_size, (1, n), device=dev)
        pos = torch.arange(L, L + n, device=dev)[None]

        @torch.inference_mode()
        def fn():
            if lean:
                lm_logits(target, ids, cache, pos, None, logits_to_keep=keep)
            else:
                target_forward(target, ids, cache, pos, None, logits_to_keep=keep)
            cache.crop(-n)
        return fn

    t = time_calls({"step": call(1, True, 1), "loop": call(block_size, False, 0),
                    "lean": call(block_size, True, block_size)}, repeats, 1, dev)
    step1, verify_loop, verify_lean = (t[k]["median_ms"] / 1e3 for k in ("step", "loop", "lean"))
    return {"context_tokens": L, "block_size": block_size, "step_1_s": step1,
            "verify_B_loop_s": verify_loop, "verify_B_lean_s": verify_lean,
            "loop_ratio": verify_loop / step1, "same_call_ratio": verify_lean / step1, "repeats": repeats,
            "order": "interleaved sweeps (step, loop verify, lean verify), medians"}


def roofline(target: Target, verify: dict[str, float], repeats: int = 3) -> dict[str, Any] | None:
    """The floor of a one-token step and of a verify on this machine (None off the CPU or without the fused
    kernels), from three measurements and the target's size:

    - memory: bytes per second all threads read from a buffer far larger than the caches (:func:`read_rate`
      of the C++ module, 256 MB or twice the weights, the best of ``repeats``); every forward reads each
      weight once, so ``memory_floor_s`` = the weights' bytes in the products' dtype / that rate;
    - arithmetic: multiply-adds per second of the product kernel itself at the verify's ``rows`` rows on a
      weight that stays in cache (``product_macs_per_s``: what the kernel can do with no memory traffic), and
      the instruction's own peak on chains held in registers (``peak_macs_per_s``: :func:`bf16_dot_rate`,
      VDPBF16PS, for bf16 products without AMX tiles; :func:`fma_rate`, 8-lane FMAs, for float32 products;
      None on AMX tiles), so ``compute_floor_s`` = rows x multiply-adds per token / the kernel's rate;
    - ``verify_floor_s`` = the larger of the two, and ``floor_ratio`` = it over the measured 1-token step
      (``verify``: :func:`verify_cost_ratio`'s result). Attention, norms and dispatch are left out, so the
      floor is below what any verify of this kernel can reach; ``step_over_memory_floor`` says how close the
      step itself runs to reading the weights at the machine's rate.

    Multiply-adds per token: every ``nn.Linear`` weight, the LM head included."""
    import torch

    from . import kernels

    if target.device.type != "cpu":
        return None
    mod = kernels.fused_cpu()
    if mod is None:
        return None
    bf16 = target.compute_dtype == torch.bfloat16 and mod.bf16_ready()  # the target's own (not the last loaded's)
    weights = [m.weight for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    macs = sum(w.numel() for w in weights)
    weight_bytes = macs * (2 if bf16 else 4)
    rate = max(mod.fma_rate(20_000_000) for _ in range(repeats))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one thread alone: half of two where each core has its own FMA units (1.0x: SMT siblings, or no OpenMP)
        one = max(mod.fma_rate(20_000_000) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    read = kernels.memory_read_gb_per_s(max(256 << 20, 2 * weight_bytes), repeats) * 1e9
    rows = int(verify["block_size"])
    product = product_rate(mod, rows, weights[0].shape[1], bf16, threads, repeats)
    peak = (None if mod.amx_ready() else max(mod.bf16_dot_rate(20_000_000) for _ in range(repeats))) if bf16 else rate
    memory_floor = weight_bytes / read
    compute_floor = rows * macs / product
    floor = max(memory_floor, compute_floor)
    step = verify["step_1_s"]
    return {"threads": threads, "openmp": kernels.status()["openmp"], "rows": rows, "macs_per_token": macs,
            "product_dtype": "bfloat16" if bf16 else "float32", "weight_bytes": weight_bytes,
            "read_gb_per_s": read / 1e9, "memory_floor_s": memory_floor,
            "product_macs_per_s": product, "peak_macs_per_s": peak, "compute_floor_s": compute_floor,
            "verify_floor_s": floor, "step_1_s": step, "floor_ratio": floor / step,
            "step_over_memory_floor": step / memory_floor, "step_weight_gb_per_s": weight_bytes / step / 1e9,
            "fma_per_s": rate, "fma_per_s_one_thread": one,
            "what": "least seconds of a verify of `rows` tokens: the larger of reading the weights at the measured "
                    "memory rate and their multiply-adds at the product kernel's rate on cached weights, over the "
                    "measured 1-token step; step_weight_gb_per_s: weight bytes that step reads per second"}


def product_rate(mod, rows: int, K: int, bf16: bool, threads: int, repeats: int = 3) -> float:
    """Multiply-adds per second of the fused kernel's product (``mod.linear``) of ``rows`` rows by a random
    [N, K] weight small enough to stay in each core's L2 cache (about 0.5 MB per thread), packed as the
    target's products are (bf16 or float32): the kernel's arithmetic rate without memory traffic, per-call
    overhead included; the best of ``repeats`` runs of at least 0.1 s each."""
    import torch

    per_value = 2 if bf16 else 4
    N = max(32, (512 * 1024 * threads // (K * per_value)) // 32 * 32)  # [N, K] packed: ~0.5 MB per thread
    w = (mod.pack_bf16 if bf16 else mod.pack)(torch.randn(N, K) * 0.02)
    x = torch.randn(rows, K)
    best = 0.0
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < 0.1 or calls < 10:
            mod.linear(x, w)
            calls += 1
        best = max(best, calls * rows * N * K / elapsed)
    return best


def _benchmark_prompts(target: Target, benchmarks: Sequence[str], n_prompts: int) -> list[tuple[str, list[int]]]:
    from .data import load_benchmark
    from .targets import encode_chat

    per = -(-n_prompts // len(benchmarks))
    out = []
    for name in benchmarks:
        for rec in load_benchmark(name, limit=per):
            out.append((rec["id"], encode_chat(target.tokenizer, rec["turns"][:1])))
    return out[:n_prompts]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method) and range of repeated measurements."""
    v = sorted(values)
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1], "n": len(v)}


def speedup_flag(speedup: float, tau: float, verify_ratio: float, tolerance: float = 0.15) -> str | None:
    """Why a measured speedup contradicts its own tau, or None when it does not.

    A speculative round commits ``tau`` tokens for one B-token verify, which costs ``verify_ratio``
    1-token steps; with free drafting the speedup over AR is at most ``tau / verify_ratio`` (prefill, the
    same for both, only pulls it towards 1), and never above ``tau``. A speedup more than ``tolerance``
    above either bound means the AR and speculative timings were not taken under the same conditions.
    """
    bound = tau / max(verify_ratio, 1e-12)
    if speedup > tau * (1 + tolerance):
        return (f"speedup {speedup:.2f}x exceeds tau {tau:.2f}, which no speculative decoder can do: the AR and "
                f"speculative timings were taken under different conditions (a busy machine?); rerun on an idle one")
    if speedup > bound * (1 + tolerance):
        return (f"speedup {speedup:.2f}x exceeds tau / verify-cost ratio = {tau:.2f} / {verify_ratio:.2f} = "
                f"{bound:.2f}x, the ceiling with free drafting: the timings are not consistent (a busy "
                f"machine?); rerun on an idle one")
    return None


Runner = Callable[[Sequence[int]], Any]  # one prompt's token ids -> its Generation (batch 1, T = 0)


def interleaved_runs(runners: dict[str, Runner], prompts: Sequence[Sequence[int]], repeats: int,
                     progress: bool = False) -> list[dict[str, list]]:
    """Per repeat, per runner, the :class:`~xpress.decoding.Generation` of every prompt, the runners
    interleaved per prompt (A B A B ...: prompt 1 with each runner, then prompt 2, ...), so slow drifts of
    the machine hit every runner alike."""
    from tqdm.auto import tqdm

    runs = [{name: [] for name in runners} for _ in range(repeats)]
    with tqdm(total=repeats * len(prompts) * len(runners), desc="oracle ceiling", unit="run",
              disable=not progress, file=sys.stderr) as bar:
        for run in runs:
            for p in prompts:
                for name, runner in runners.items():
                    run[name].append(runner(list(p)))
                    bar.update(1)
    return runs


def decode_runner(target: Target, drafter: Drafter | None, max_new_tokens: int) -> Runner:
    """The project's engine as a runner: :func:`~xpress.decoding.generate_batch` at T = 0, batch 1."""
    from . import decoding

    return lambda p: decoding.generate_batch(target, drafter, [list(p)], max_new_tokens)[0]


def generate_runner(model: Any, eos_token_ids: Sequence[int], max_new_tokens: int, cache: str | None) -> Runner:
    """transformers' own ``model.generate()`` (greedy) as a runner, with its ``static`` cache or its
    default dynamic one (``cache=None``); the Generation holds its tokens (EOS kept) and its wall time."""
    import torch

    from .decoding import Generation
    from .utils import now

    eos = list(eos_token_ids)
    extra = {"cache_implementation": cache} if cache else {}

    @torch.inference_mode()
    def run(p: Sequence[int]) -> Generation:
        ids = torch.tensor([list(p)], device=model.device)
        t0 = now(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
        seconds = now(model.device) - t0
        tokens = out[0, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        return Generation(token_ids=tokens[:cut], prompt_len=ids.shape[1], accept_lengths=[1] * cut,
                          total_s=seconds)
    return run


OLD_PATH = ("target.runtime=transformers", "target.dtype=float32")  # the path before the lean runtime


def divergence(target: Target, prompt: Sequence[int], reference: Sequence[int], other: Sequence[int]
               ) -> dict[str, Any] | None:
    """Where two T = 0 outputs for one prompt part (None if one is a prefix of the other): the position,
    both tokens, and the gap between the target's two largest logits there after the reference's prefix
    (a near-tie that reduction order decided has a tiny gap; a real bug has a large one)."""
    import torch

    from .targets import lm_logits

    k = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if k is None:
        return None
    ids = torch.tensor([list(prompt) + list(reference[:k])], device=target.device)
    with torch.inference_mode():
        logits, _ = lm_logits(target, ids, None, torch.arange(ids.shape[1], device=target.device)[None], None)
    top = logits[0, -1].topk(2).values
    return {"position": k, "reference_token": int(reference[k]), "other_token": int(other[k]),
            "top2_margin": float(top[0] - top[1])}


CEILING_BLOCK = 16  # the oracle ceiling's default block size: the paper's B, tau = 16
LONG_CONTEXT = 300  # the second context of the ceiling's verify cost: a verify's attention grows with the context


def _ceiling_runners(target, oracle, old, max_new_tokens: int) -> dict[str, Runner]:
    """:func:`oracle_ceiling`'s runners in their order: ``ar``; with ``old`` (the target loaded the path before
    the lean runtime) ``ar_old`` on it and transformers' ``generate()`` with its dynamic and static cache on
    its model in ``target``'s compute dtype; then ``oracle``."""
    import copy

    runners: dict[str, Runner] = {"ar": decode_runner(target, None, max_new_tokens)}
    if old is not None:
        model = old.model if old.model.dtype == target.compute_dtype else copy.deepcopy(old.model).to(target.compute_dtype)
        runners.update(ar_old=decode_runner(old, None, max_new_tokens),
                       generate=generate_runner(model, target.eos_token_ids, max_new_tokens, None),
                       generate_static=generate_runner(model, target.eos_token_ids, max_new_tokens, "static"))
    runners["oracle"] = decode_runner(target, oracle, max_new_tokens)
    return runners


def _ceiling_repeats(runs: list[dict], prompts: list, target, compare: bool
                     ) -> tuple[list[dict], list[dict], dict[str, dict | None]]:
    """:func:`oracle_ceiling`'s repeats tallied: (CSV rows, one per runner and repeat; per repeat the runners'
    sums, the oracle's speedup and, with ``compare``, AR over the path before and over the faster
    ``generate()``; the prompts whose oracle output differs from AR's, with where (:func:`divergence`))."""
    from .decoding import speedup, summarize

    rows, per_repeat = [], []
    mismatches: dict[str, dict | None] = {}
    for r, run in enumerate(runs):
        for (pid, p), a, sd in zip(prompts, run["ar"], run["oracle"]):
            if a.token_ids != sd.token_ids and pid not in mismatches:
                mismatches[pid] = divergence(target, p, a.token_ids, sd.token_ids)
        sums = {name: summarize(gens) for name, gens in run.items()}
        rep = {"repeat": r, **sums, "speedup": speedup(sums["ar"], sums["oracle"])}
        if compare:
            rep["ar_over_old"] = sums["ar"]["tokens_per_s"] / sums["ar_old"]["tokens_per_s"]
            rep["ar_over_generate"] = sums["ar"]["tokens_per_s"] / max(sums["generate"]["tokens_per_s"],
                                                                       sums["generate_static"]["tokens_per_s"])
        per_repeat.append(rep)
        for name, s in sums.items():
            rows.append({"method": name, "repeat": r, **{k: s[k] for k in
                         ("tokens", "steps", "tau", "seconds", "tokens_per_s")}})
    return rows, per_repeat, mismatches


def _comparison(spreads: dict[str, dict], model_dtype: str) -> dict[str, Any]:
    """``oracle_ceiling.json``'s ``compare``: what each AR runner is and its median tokens/s, and the ratios."""
    return {
        "ar_old": {"what": "the project's AR on the transformers forward (DynamicCache) in float32: the path "
                           "before the lean runtime (target.runtime=transformers target.dtype=float32)",
                   "tokens_per_s": spreads["ar_old_tokens_per_s"]["median"]},
        "generate": {"what": f"transformers' model.generate(), greedy, dynamic cache, {model_dtype}",
                     "tokens_per_s": spreads["generate_tokens_per_s"]["median"]},
        "generate_static": {"what": f"transformers' model.generate(), greedy, static cache, {model_dtype}",
                            "tokens_per_s": spreads["generate_static_tokens_per_s"]["median"]},
        "ar_over_old": spreads["ar_over_old"]["median"],
        "ar_over_generate": spreads["ar_over_generate"]["median"],
    }


def oracle_ceiling(preset: str = "cpu", n_prompts: int = 8, max_new_tokens: int = 128, repeats: int = 3,
                   benchmarks: Sequence[str] = ("gsm8k", "mt-bench"), out_dir: str | Path | None = None,
                   overrides: Sequence[str] = (), verify_repeats: int = 30, progress: bool = False,
                   compare: bool = True, block_size: int | None = CEILING_BLOCK) -> dict[str, Any]:
    """AR vs speculative decoding with the oracle drafter, same prompts, same run, T = 0; and the
    project's AR against the path before the lean runtime and against transformers' ``generate()``.
    ``block_size``: the oracle's B (None: the preset's ``drafter.block_size``).

    ``n_prompts`` first user turns split over ``benchmarks`` (MT-Bench: turn 1 only). Each repeat
    decodes every prompt (batch 1) with each runner, interleaved per prompt (:func:`interleaved_runs`):
    ``ar`` (the project's AR on the preset's target), ``oracle`` (speculative with the oracle drafter)
    and, with ``compare``, ``ar_old`` (the project's AR on the transformers forward in float32, the path
    before the lean runtime), ``generate`` and ``generate_static`` (transformers' ``model.generate()``,
    greedy, in the target's compute dtype, with its dynamic and its static cache). tokens/s = tokens /
    seconds summed over prompts (prefill included). The reported numbers are medians over repeats, with
    their spread (``spread``: quartiles and range); ratios are taken per repeat, then the median. The
    oracle's greedy continuations (``max_new_tokens + B + 1`` tokens) are computed once before any timing
    (``oracle_prepare_s``, never counted as drafting). A speedup that contradicts its own tau
    (:func:`speedup_flag`) is not reported: ``speedup`` is then None, ``speedup_measured`` holds the number
    and ``flag`` says why. ``verify_cost`` is :func:`verify_cost_ratio` after the first prompt,
    ``verify_cost_long`` after :data:`LONG_CONTEXT` tokens of the prompts' text end to end (the attention of a
    verify grows with the context, a step's much less). The load average before and after goes with the
    provenance, and ``load_warning`` says when the machine was busy. Writes ``results/<preset>/oracle_ceiling.json`` and ``.csv``
    (atomically) and returns the JSON payload.
    """
    from .config import load_config
    from .reference_drafters import OracleDrafter
    from .targets import load_target
    from .utils import load_average, load_check, now, other_cpu_use, provenance, seed_everything, write_result

    load_start, others_start = load_average(), other_cpu_use()
    cfg = load_config(preset, list(overrides))
    B = int(block_size or cfg.drafter.block_size)
    if B < 2:
        raise DecodeInputError(f"--block-size {B}: the oracle drafts B - 1 tokens a round; use 2 or more "
                               "(16, the default, is the paper's; 0 takes the preset's)")
    seed_everything(cfg.seed)
    target = load_target(cfg)
    choice = dict(target.meta)  # the runtime and dtype chosen (a later load replaces the provenance record)
    prompts = _benchmark_prompts(target, benchmarks, n_prompts)
    ids = [p for _, p in prompts]
    oracle = OracleDrafter(target, B)
    t0 = now(target.device)
    oracle.prepare(ids, max_new_tokens + B + 1)  # untimed: the oracle's own preparation
    prepare_s = now(target.device) - t0
    old = load_target(load_config(preset, [*overrides, *OLD_PATH])) if compare else None
    runners = _ceiling_runners(target, oracle, old, max_new_tokens)
    for runner in runners.values():  # warm-up (allocator, kernels, caches): one untimed decode each
        runner(ids[0])

    runs = interleaved_runs(runners, ids, repeats, progress)
    rows, per_repeat, mismatches = _ceiling_repeats(runs, prompts, target, compare)

    context = ids[0][:max(1, min(len(ids[0]), target.cfg.max_context - B - 1))]
    ratio = verify_cost_ratio(target, context, B, repeats=verify_repeats)
    longer = list(itertools.islice(itertools.cycle([t for p in ids for t in p]), LONG_CONTEXT))  # the prompts end to end
    ratio_long = (verify_cost_ratio(target, longer, B, repeats=verify_repeats)
                  if LONG_CONTEXT + B < target.cfg.max_context else None)
    load = load_check(load_start, load_average(), own_load=_threads(), others=(others_start, other_cpu_use()))
    spreads = {f"{name}_tokens_per_s": spread([p[name]["tokens_per_s"] for p in per_repeat]) for name in runners}
    spreads["speedup"] = spread([p["speedup"] for p in per_repeat])
    for key in ("ar_over_old", "ar_over_generate"):
        if compare:
            spreads[key] = spread([p[key] for p in per_repeat])
    tau = statistics.median(p["oracle"]["tau"] for p in per_repeat)
    measured = spreads["speedup"]["median"]
    flag = speedup_flag(measured, tau, ratio["loop_ratio"])
    oracle_sd = per_repeat[-1]["oracle"]
    result = {
        "what": "AR vs speculative decoding with the oracle drafter (tau = B ceiling), T=0, batch 1; the project's "
                "AR vs the path before the lean runtime and vs transformers' generate()",
        "preset": preset, "target": target.name, "block_size": B, "preset_block_size": cfg.drafter.block_size,
        "n_prompts": len(ids),
        "prompt_ids": [pid for pid, _ in prompts], "max_new_tokens": max_new_tokens, "repeats": repeats,
        "order": f"interleaved per prompt: {', '.join(runners)}, ... (each repeat)",
        "runtime": {k: choice.get(k) for k in ("runtime", "dtype", "dtype_setting", "runtime_setting", "kernels",
                                               "kernels_reason", "attention", "row_invariance", "cpu_features",
                                               "frame_rows")},
        "ar_tokens_per_s": spreads["ar_tokens_per_s"]["median"],
        "oracle_tokens_per_s": spreads["oracle_tokens_per_s"]["median"],
        "speedup": None if flag else measured,
        "speedup_measured": measured,
        "speedup_bound": tau / ratio["loop_ratio"],
        "flag": flag,
        "tau": tau,
        "spread": spreads,
        "tokens": per_repeat[-1]["ar"]["tokens"],
        "lossless": not mismatches, "mismatched_prompts": sorted(mismatches),
        "mismatch_fraction": len(mismatches) / len(ids),
        "divergences": [{"prompt": pid, **(d or {"position": None})} for pid, d in sorted(mismatches.items())],
        "oracle_stage_seconds_last_repeat": {k: oracle_sd[k] for k in oracle_sd
                                             if k.endswith("_s") and k != "tokens_per_s"},
        "oracle_prepare_s": prepare_s,
        "verify_cost": ratio,  # after the first prompt
        "verify_cost_long": ratio_long,  # after LONG_CONTEXT tokens of the prompts' text (None past max_context)
        "roofline": roofline(target, ratio),
        "load_warning": load["load_warning"],
        "per_repeat": per_repeat,
        "provenance": provenance(preset, **load),
    }
    if compare:
        result["compare"] = {**_comparison(spreads, str(target.compute_dtype).removeprefix("torch.")),
                             "verify_cost_old": verify_cost_ratio(old, context, B, repeats=verify_repeats)}
        result["provenance"]["target_runtime"] = {k: choice.get(k) for k in ("runtime", "dtype", "dtype_setting",
                                                                             "runtime_setting", "kernels")}
    write_result(Path(out_dir) if out_dir else paths.RESULTS / preset, "oracle_ceiling", result, rows)
    return result


# ==================================================================================== compiled vs eager
HARNESSES = ("eager", "compiled")
FRAMES_BUDGET = 0.05  # frames are kept on the GPU path where they cost AR under 5% of its speed (docs/gpu.md)


def _per_generation(g: Any) -> dict[str, Any]:
    """One decode's counts and times: tokens, steps, seconds (total, prefill included) and per stage."""
    stages = {k: float(sum(v)) for k, v in g.step_times.items()}
    return {"tokens": len(g.token_ids), "steps": g.n_steps, "seconds": g.total_s, "prefill_s": g.prefill_s,
            "round_s": sum(stages.values()), **{f"{k}_s": v for k, v in stages.items()}}


def _summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Totals over a method's prompts on one harness: tau, seconds per token (prefill included) and per round
    (the rounds' stages, prefill excluded)."""
    tokens, steps = sum(r["tokens"] for r in rows), sum(r["steps"] for r in rows)
    seconds, rounds = sum(r["seconds"] for r in rows), sum(r["round_s"] for r in rows)
    return {"tokens": tokens, "steps": steps, "tau": tokens / max(1, steps), "seconds": seconds,
            "ms_per_token": 1e3 * seconds / max(1, tokens), "ms_per_round": 1e3 * rounds / max(1, steps),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def frames_cost(methods_by_frames: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """What frames cost AR, per harness: AR's seconds per token with ``frame_rows`` F over without (0), minus 1,
    for each F > 0 measured beside 0; ``keep`` says whether that is under :data:`FRAMES_BUDGET`. None without
    both a run at 0 and one at F > 0, or without AR."""
    if 0 not in methods_by_frames or "ar" not in methods_by_frames[0]["methods"]:
        return None
    out = {}
    for F, res in methods_by_frames.items():
        if F == 0 or "ar" not in res["methods"]:
            continue
        for h in HARNESSES:
            base = methods_by_frames[0]["methods"]["ar"][h]["ms_per_token"]
            cost = res["methods"]["ar"][h]["ms_per_token"] / base - 1 if base > 0 else None
            out[f"F={F} {h}"] = {"frame_rows": F, "harness": h, "ar_ms_per_token_frames": res["methods"]["ar"][h]["ms_per_token"],
                                 "ar_ms_per_token_no_frames": base, "cost": cost,
                                 "keep": cost is not None and cost < FRAMES_BUDGET}
    return out or None


def compiled_eager(preset: str, methods: Sequence[str] = ("ar", "dflash", "markov", "xpress"), n_prompts: int = 4,
                   max_new_tokens: int = 64, out_dir: str | Path | None = None, overrides: Sequence[str] = (),
                   frame_rows: Sequence[int] | None = None, benchmarks: Sequence[str] = ("gsm8k", "mt-bench"),
                   progress: bool = False) -> dict[str, Any]:
    """The compiled harness against the eager one (``bench compiled-eager``): the same prompts and weights,
    every method in ``methods``, T = 0, batch 1; ``overrides`` must give the transformers runtime (on a CPU:
    ``target.runtime=transformers``).

    The target is loaded once; the eager harness runs its transformers forward on a growing ``DynamicCache``
    (``decode.compile=false``), the compiled one the same model through :class:`xpress.compiled.CompiledForward`
    (a static cache, ``torch.compile``, CUDA graphs on CUDA) with the drafters' refinement compiled too
    (:meth:`xpress.proposer.ModelDrafter.compile`). Each method is built twice from the same weights: the preset's
    trained checkpoints where they exist, else fresh seeded ones (the file says which: ``weights``). Per frame
    setting (``frame_rows``, ``target.frame_rows``; default the preset's), per method: one untimed decode of the
    first prompt on each harness (the compiler's graphs are made there), then every prompt on the eager harness
    and on the compiled one, one after the other. Recorded per method: whether the two harnesses' greedy tokens
    are equal and, where not, the first divergence with the target's top-2 logit margin there
    (:func:`divergence`); whether each equals AR on its own harness (T = 0 exactness); tokens, target steps,
    tau, seconds per token (prefill included) and per round (CUDA events on CUDA, ``perf_counter`` on a CPU: the
    decoding engine's own stage clocks) and the compiled-over-eager speed ratio. With frame settings 0 and
    F > 0, AR's seconds per token on each harness give what frames cost (``frames``, :func:`frames_cost`):
    docs/gpu.md keeps frames on the GPU path only where they cost under 5% of AR's speed. Writes
    ``<out_dir>/compiled_eager.json`` and ``.csv`` (default ``results/<preset>/``) with provenance and returns
    the JSON payload."""
    from tqdm.auto import tqdm

    from . import decoding
    from .config import ConfigError, load_config
    from .methods import METHODS, drafter_weights, make_drafter
    from .targets import compiled_forward, load_target
    from .utils import load_average, load_check, other_cpu_use, provenance, seed_everything, write_result

    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise DecodeInputError(f"--methods {','.join(methods)}: use some of {', '.join(METHODS)}")
    if n_prompts < 1 or max_new_tokens < 1:
        raise DecodeInputError("--n-prompts and --max-new-tokens must be at least 1")
    load_start, others_start = load_average(), other_cpu_use()
    try:
        cfg_e = load_config(preset, [*overrides, "decode.compile=false"])
        cfg_c = load_config(preset, [*overrides, "decode.compile=true"])
    except ConfigError as e:
        raise DecodeInputError(f"{e}; the compiled harness runs the transformers runtime: add "
                               "target.runtime=transformers for a CPU preset") from None
    frames = [cfg_e.target.frame_rows] if frame_rows is None else list(dict.fromkeys(frame_rows))
    bad = [F for F in frames if F < 0 or 0 < F < cfg_e.drafter.block_size]
    if bad:
        raise DecodeInputError(f"--frame-rows {bad}: use 0 (no frames) or at least drafter.block_size "
                               f"({cfg_e.drafter.block_size})")
    seed_everything(cfg_e.seed)
    eager = load_target(cfg_e)
    compiled = dataclasses.replace(eager, compiled=compiled_forward(cfg_c, eager.model))  # the same model
    compiled.compiled.rows.update(F for F in frames if F)
    prompts = _benchmark_prompts(eager, benchmarks, n_prompts)
    drafters = {m: (make_drafter(m, cfg_e, eager, seed=cfg_e.seed, untrained_ok=True),
                    make_drafter(m, cfg_c, compiled, seed=cfg_e.seed, untrained_ok=True)) for m in methods}
    weights = {m: ("none (autoregressive)" if m == "ar" else
                   "trained (the preset's checkpoint)" if drafter_weights(d[0]) == "trained" else
                   "untrained: no checkpoint of this preset was found, so a fresh seeded drafter and head "
                   "(untrained heads are the identity correction); tau and speed are not the trained method's")
               for m, d in drafters.items()}

    rows: list[dict] = []
    by_frames: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(frames) * len(methods) * (len(prompts) + 1) * 2, desc="compiled vs eager", unit="decode",
               disable=not progress, file=sys.stderr)
    for F in frames:
        for t in (eager, compiled):
            t.cfg = dataclasses.replace(t.cfg, frame_rows=F)
        outputs: dict[str, dict[str, list]] = {}
        per_method: dict[str, Any] = {}
        for m in methods:
            targets = dict(zip(HARNESSES, (eager, compiled)))
            run = {h: (lambda p, h=h: decoding.generate_batch(targets[h], drafters[m][HARNESSES.index(h)], [list(p)],
                                                               max_new_tokens)[0]) for h in HARNESSES}
            for h in HARNESSES:  # untimed: allocations, and the compiler's graphs
                run[h](prompts[0][1])
                bar.update(1)
            gens: dict[str, list] = {h: [] for h in HARNESSES}
            for pid, p in prompts:
                for h in HARNESSES:
                    gens[h].append(run[h](p))
                    bar.update(1)
            outputs[m] = {h: [g.token_ids for g in gens[h]] for h in HARNESSES}
            diverged = []
            for (pid, p), a, b in zip(prompts, gens["eager"], gens["compiled"]):
                d = divergence(eager, p, a.token_ids, b.token_ids)
                if d is not None:
                    diverged.append({"prompt": pid, **d})
            per_method[m] = {"equal": not diverged, "divergences": diverged, "weights": weights[m]}
            for h in HARNESSES:
                recs = [_per_generation(g) for g in gens[h]]
                per_method[m][h] = _summary(recs)
                for (pid, _), r, a, b in zip(prompts, recs, gens["eager"], gens["compiled"]):
                    rows.append({"frame_rows": F, "method": m, "harness": h, "prompt": pid, **r,
                                 "harnesses_equal": a.token_ids == b.token_ids})
            e, c = per_method[m]["eager"], per_method[m]["compiled"]
            per_method[m]["compiled_speedup"] = e["ms_per_token"] / c["ms_per_token"] if c["ms_per_token"] > 0 else None
        if "ar" in outputs:  # T = 0 exactness on each harness: every method's tokens against AR's
            for m in methods:
                if m == "ar":
                    continue
                for h in HARNESSES:
                    off = [{"prompt": pid, **d} for (pid, p), ref, out in
                           zip(prompts, outputs["ar"][h], outputs[m][h])
                           if (d := divergence(eager if h == "eager" else compiled, p, ref, out)) is not None]
                    per_method[m][f"equals_ar_{h}"] = not off
                    per_method[m][f"divergences_from_ar_{h}"] = off
                    if per_method["ar"][h]["ms_per_token"] and per_method[m][h]["ms_per_token"]:
                        per_method[m][h]["speedup_over_ar"] = (per_method["ar"][h]["ms_per_token"]
                                                              / per_method[m][h]["ms_per_token"])
        by_frames[F] = {"frame_rows": F, "methods": per_method}
    bar.close()
    load = load_check(load_start, load_average(), others=(others_start, other_cpu_use()))
    result = {
        "what": "the compiled Table 1 harness (static KV cache, torch.compile, CUDA graphs on CUDA) against the "
                "eager one (transformers forward, DynamicCache): equal greedy outputs per method, seconds per token "
                "and per round, and what frames cost AR",
        "preset": preset, "target": eager.name, "methods": list(methods), "n_prompts": len(prompts),
        "prompt_ids": [pid for pid, _ in prompts], "max_new_tokens": max_new_tokens, "temperature": 0.0,
        "device": str(eager.device), "dtype": str(eager.compute_dtype).removeprefix("torch."),
        "timing": "CUDA events, read back once per generation" if eager.device.type == "cuda" else "perf_counter",
        "compiled": compiled.compiled.describe(), "weights": weights,
        "equal": all(r["methods"][m]["equal"] for r in by_frames.values() for m in methods),
        "frames": frames_cost(by_frames), "frames_budget": FRAMES_BUDGET,
        "by_frame_rows": {str(F): r for F, r in by_frames.items()},
        "load_warning": load["load_warning"],
        "provenance": provenance(preset, **load, overrides=list(overrides)),
    }
    write_result(Path(out_dir) if out_dir else paths.RESULTS / preset, "compiled_eager", result, rows)
    return result


# ================================================================================================ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's arguments (shared by ``python -m xpress bench`` and this module)."""
    parser.add_argument("study", choices=["oracle-ceiling", "target-cost", "train-memory", "compiled-eager"],
                        help="oracle-ceiling: AR vs a perfect drafter, and AR vs transformers' generate(); "
                             "target-cost: the target's forward per component (xpress.studies.target_cost); "
                             "train-memory: one training step per method, measured peak against the memory model "
                             "(xpress.train.memory); "
                             "compiled-eager: the compiled Table 1 harness vs the eager one (compiled_eager)")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=CEILING_BLOCK,
                        help=f"oracle-ceiling: the oracle's block size B = its tau (default {CEILING_BLOCK}, the paper's; "
                             "0: the preset's drafter.block_size)")
    parser.add_argument("--benchmarks", default="gsm8k,mt-bench", help="comma-separated benchmark names")
    parser.add_argument("--shrink", action="store_true",
                        help="train-memory: random weights with the target's widths divided (--width-divisor)")
    parser.add_argument("--width-divisor", type=int, default=32,
                        help="train-memory --shrink: divide hidden, MLP and head counts by this (default 32)")
    parser.add_argument("--layers", default="8",
                        help="train-memory: target layers kept, or TARGET,DRAFTER (default 8; the drafter keeps the preset's)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated methods (train-memory: default dflash,markov,xpress; compiled-eager: "
                             "default ar,dflash,markov,xpress)")
    parser.add_argument("--out-dir", default=None, help="default: results/<preset>/")
    parser.add_argument("--frame-rows", default=None,
                        help="compiled-eager: comma-separated target.frame_rows settings to run, e.g. 0,64 "
                             "(default: the preset's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DecodeInputError(f"{flag} {text!r}: give comma-separated integers, e.g. 0,64") from None


def run(args: argparse.Namespace) -> int:
    if args.study == "train-memory":
        return _train_memory(args)
    if args.study == "compiled-eager":
        methods = args.methods or "ar,dflash,markov,xpress"
        result = compiled_eager(args.preset, [m.strip() for m in methods.split(",") if m.strip()],
                                args.n_prompts, args.max_new_tokens, args.out_dir, args.overrides,
                                None if args.frame_rows is None else _int_list(args.frame_rows, "--frame-rows"),
                                [b.strip() for b in args.benchmarks.split(",") if b.strip()],
                                progress=not args.no_progress)
        print(json.dumps({"equal": result["equal"], "frames": result["frames"],
                          "methods": {F: {m: {"equal": v["equal"], **{h: round(v[h]["ms_per_token"], 3)
                                                                      for h in ("eager", "compiled")}}
                                          for m, v in r["methods"].items()}
                                      for F, r in result["by_frame_rows"].items()}}, indent=2))
        if result["load_warning"]:
            print(f"warning: {result['load_warning']}", file=sys.stderr)
        return 0
    if args.study == "target-cost":
        from .studies.target_cost import run_target_cost

        result = run_target_cost(args.preset, out_dir=args.out_dir, overrides=args.overrides,
                                 progress=not args.no_progress)
        print(json.dumps(result["break_even"], indent=2))
        if result["load_warning"]:
            print(f"warning: {result['load_warning']}", file=sys.stderr)
        return 0
    result = oracle_ceiling(args.preset, args.n_prompts, args.max_new_tokens, args.repeats,
                            [b.strip() for b in args.benchmarks.split(",") if b.strip()], args.out_dir,
                            args.overrides, progress=not args.no_progress, block_size=args.block_size or None)
    keys = ("ar_tokens_per_s", "oracle_tokens_per_s", "speedup", "speedup_measured", "tau", "lossless", "flag")
    print(json.dumps({**{k: result[k] for k in keys},
                      "verify_ratio": result["verify_cost"]["loop_ratio"]}, indent=2))
    for warning in (result["flag"], result["load_warning"]):
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    return 0


def _train_memory(args: argparse.Namespace) -> int:
    """``bench train-memory``: :func:`xpress.train.memory.measure`; a CPU target where no GPU is visible."""
    import torch

    from .train.memory import measure

    if not args.shrink:
        raise DecodeInputError("train-memory runs random weights at divided widths: pass --shrink "
                               "(and --width-divisor 1 for the full widths on a GPU that holds them)")
    try:
        layers = [int(x) for x in str(args.layers).split(",") if x.strip()]
        if not 1 <= len(layers) <= 2 or min(layers) < 1:
            raise ValueError
    except ValueError:
        raise DecodeInputError(f"--layers {args.layers!r}: give the target's layer count, or TARGET,DRAFTER "
                               f"(e.g. 8 or 8,5)") from None
    methods = [m.strip() for m in (args.methods or "dflash,markov,xpress").split(",") if m.strip()]
    bad = [m for m in methods if m not in ("dflash", "markov", "xpress")]
    if bad or not methods:
        raise DecodeInputError(f"--methods {args.methods!r}: use a comma-separated subset of dflash,markov,xpress")
    overrides = list(args.overrides)
    if not any(o.startswith("target.device=") for o in overrides) and not torch.cuda.is_available():
        overrides.append("target.device=cpu")  # no GPU here: the step runs on the CPU
    try:
        result = measure(args.preset, methods, args.width_divisor, layers[0], layers[1] if len(layers) > 1 else 0,
                         overrides=overrides, out_dir=args.out_dir, progress=not args.no_progress)
    except (ValueError, RuntimeError) as e:
        raise DecodeInputError(str(e)) from None
    print(json.dumps({m: {k: r[k] for k in ("peak_bytes", "predicted_bytes", "measured_over_predicted",
                                             "full_width_predicted_bytes", "full_width_fits_80gb")}
                      for m, r in result["methods"].items()}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xpress.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
