"""Benchmarks and decoding runs: the ``decode`` command's engine and the oracle-ceiling record.

    python -m xpress.bench oracle-ceiling --preset cpu     # writes results/<preset>/oracle_ceiling.{json,csv}
    python -m xpress bench oracle-ceiling --preset cpu     # the same through the main CLI

``oracle-ceiling`` runs, in one process and on the same prompts, autoregressive greedy decoding and
speculative decoding with :class:`~xpress.reference_drafters.OracleDrafter` (whose greedy continuations
are computed before the timed runs, so its drafting is ~free): the speedup a perfect drafter would give
this target on this machine, with tau = B. It also measures the cost of one B-token verify forward
relative to a 1-token decoding step, the ratio that caps that speedup (speedup ~ tau / ratio).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import sys
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


def decode_records(target: Target, records: Sequence[dict], drafter: Drafter | None, method: str,
                   max_new_tokens: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                   batch_size: int = 1, progress: bool = True) -> list[dict]:
    """Decode every conversation (multi-turn: each turn after the model's own previous answers).

    First turns are checked against the context before anything runs (``ContextTooLongError``).
    """
    from .decoding import generate_conversations
    from .targets import encode_chat

    for rec in records:
        target.check_fits(len(encode_chat(target.tokenizer, rec["turns"][:1])), max_new_tokens)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(records), desc=f"decode {method}", unit="prompt", disable=not progress,
               file=sys.stderr)
    try:
        gens = generate_conversations(target, [r["turns"] for r in records], drafter, max_new_tokens,
                                      temperature, generator, batch_size=batch_size,
                                      on_done=lambda i: bar.update(1))
    finally:
        bar.close()
    return [conversation_record(target, r, method, g) for r, g in zip(records, gens)]


def decode_main(preset: str, method: str, bench: str | None, prompts_file: str | None, out: str,
                temperature: float | None = None, seed: int | None = None, max_new_tokens: int | None = None,
                limit: int | None = None, overrides: Sequence[str] = (), checkpoint: str | None = None,
                progress: bool = True) -> dict[str, float]:
    """What ``python -m xpress decode`` does; returns the run's summary (tau, tokens/s, ...)."""
    from .config import load_config
    from .targets import load_target
    from .utils import atomic_write_jsonl, seed_everything

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
    generator = seed_everything(seed)
    target = load_target(cfg)
    drafter = make_drafter(method, cfg, target, seed=seed, checkpoint=checkpoint)
    results = decode_records(target, records, drafter, method, max_new_tokens, temperature, generator,
                             batch_size=cfg.decode.batch_size, progress=progress)
    atomic_write_jsonl(paths.resolve(out), results)
    tokens = sum(len(r["token_ids"]) for r in results)
    steps = sum(len(r["accept_lengths"]) for r in results)
    seconds = sum(r["timings"]["total"] for r in results)
    return {"prompts": len(results), "tokens": tokens, "steps": steps, "tau": tokens / max(1, steps),
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}


# ===================================================================================== oracle ceiling
def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    from .utils import now

    times = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return statistics.median(times)


def verify_cost_ratio(target: Target, context_ids: Sequence[int], block_size: int,
                      repeats: int = 30) -> dict[str, float]:
    """Seconds of one ``block_size``-token forward vs one 1-token forward after ``context_ids``.

    ``loop_ratio``: the two forwards as the decoding loops run them (speculative verify through
    ``target_forward`` with all B logits and the drafter features; autoregressive step through the lean
    forward keeping 1 logit). ``same_call_ratio``: both through the lean forward, keeping every logit.
    The cache is cropped back after each call, so every call sees the same context.
    """
    import torch

    from .targets import lm_logits, target_forward

    dev = target.device
    ctx = torch.tensor([list(context_ids)], dtype=torch.long, device=dev)
    with torch.inference_mode():
        _, cache = lm_logits(target, ctx, None, torch.arange(ctx.shape[1], device=dev)[None], None)
    L = ctx.shape[1]

    def run(n: int, lean: bool, keep: int) -> float:
        ids = torch.randint(target.vocab_size, (1, n), device=dev)
        pos = torch.arange(L, L + n, device=dev)[None]

        @torch.inference_mode()
        def call():
            if lean:
                lm_logits(target, ids, cache, pos, None, logits_to_keep=keep)
            else:
                target_forward(target, ids, cache, pos, None, logits_to_keep=keep)
            cache.crop(-n)
        call()  # warm-up
        return _median_time(call, repeats, dev)

    step1 = run(1, True, 1)
    verify_loop = run(block_size, False, 0)
    verify_lean = run(block_size, True, block_size)
    return {"context_tokens": L, "block_size": block_size, "step_1_s": step1,
            "verify_B_loop_s": verify_loop, "verify_B_lean_s": verify_lean,
            "loop_ratio": verify_loop / step1, "same_call_ratio": verify_lean / step1, "repeats": repeats}


def _benchmark_prompts(target: Target, benchmarks: Sequence[str], n_prompts: int) -> list[tuple[str, list[int]]]:
    from .data import load_benchmark
    from .targets import encode_chat

    per = -(-n_prompts // len(benchmarks))
    out = []
    for name in benchmarks:
        for rec in load_benchmark(name, limit=per):
            out.append((rec["id"], encode_chat(target.tokenizer, rec["turns"][:1])))
    return out[:n_prompts]


def oracle_ceiling(preset: str = "cpu", n_prompts: int = 8, max_new_tokens: int = 128, repeats: int = 3,
                   benchmarks: Sequence[str] = ("gsm8k", "mt-bench"), out_dir: str | Path | None = None,
                   overrides: Sequence[str] = (), verify_repeats: int = 30) -> dict[str, Any]:
    """AR vs speculative decoding with the oracle drafter, same prompts, same run, T = 0.

    ``n_prompts`` first user turns split over ``benchmarks`` (MT-Bench: turn 1 only). Each repeat
    decodes every prompt (batch 1) with AR, then with the oracle; tokens/s = tokens / seconds summed over
    prompts (prefill included); the reported numbers are medians over repeats. The oracle's greedy
    continuations (``max_new_tokens + B + 1`` tokens) are computed once before timing. Writes
    ``results/<preset>/oracle_ceiling.json`` and ``.csv`` (atomically, with provenance) and returns the
    JSON payload. Timings are only meaningful on an otherwise idle machine: the load average before and
    after is stored with the provenance.
    """
    import torch

    from .config import load_config
    from .decoding import generate_ar, generate_speculative, speedup, summarize
    from .reference_drafters import OracleDrafter
    from .targets import load_target
    from .utils import atomic_write_json, atomic_write_text, now, provenance, seed_everything

    load_before = os.getloadavg()
    cfg = load_config(preset, list(overrides))
    seed_everything(cfg.seed)
    target = load_target(cfg)
    B = cfg.drafter.block_size
    prompts = _benchmark_prompts(target, benchmarks, n_prompts)
    ids = [p for _, p in prompts]
    oracle = OracleDrafter(target, cfg)
    t0 = now(target.device)
    oracle.prepare(ids, max_new_tokens + B + 1)
    prepare_s = now(target.device) - t0
    generate_ar(target, ids[0], 8)  # warm-up (allocator, kernels)
    generate_speculative(target, oracle, ids[0], 8)

    rows, per_repeat = [], []
    mismatches: set[str] = set()
    for r in range(repeats):
        ar = [generate_ar(target, p, max_new_tokens) for p in ids]
        sd = [generate_speculative(target, oracle, p, max_new_tokens) for p in ids]
        mismatches |= {pid for (pid, _), a, s in zip(prompts, ar, sd) if a.token_ids != s.token_ids}
        s_ar, s_sd = summarize(ar), summarize(sd)
        per_repeat.append({"repeat": r, "ar": s_ar, "oracle": s_sd, "speedup": speedup(s_ar, s_sd)})
        for name, s in (("ar", s_ar), ("oracle", s_sd)):
            rows.append({"method": name, "repeat": r, **{k: s[k] for k in
                         ("tokens", "steps", "tau", "seconds", "tokens_per_s")}})

    def med(method: str, key: str) -> float:
        return statistics.median(p[method][key] for p in per_repeat)

    context = ids[0][:max(1, min(len(ids[0]), target.cfg.max_context - B - 1))]
    ratio = verify_cost_ratio(target, context, B, repeats=verify_repeats)
    oracle_sd = per_repeat[-1]["oracle"]
    result = {
        "what": "AR vs speculative decoding with the oracle drafter (tau = B ceiling), T=0, batch 1",
        "preset": preset, "target": target.name, "block_size": B, "n_prompts": len(ids),
        "prompt_ids": [pid for pid, _ in prompts], "max_new_tokens": max_new_tokens, "repeats": repeats,
        "ar_tokens_per_s": med("ar", "tokens_per_s"),
        "oracle_tokens_per_s": med("oracle", "tokens_per_s"),
        "speedup": statistics.median(p["speedup"] for p in per_repeat),
        "tau": med("oracle", "tau"),
        "tokens": per_repeat[-1]["ar"]["tokens"],
        "lossless": not mismatches, "mismatched_prompts": sorted(mismatches),
        "oracle_stage_seconds_last_repeat": {k: oracle_sd[k] for k in oracle_sd
                                             if k.endswith("_s") and k != "tokens_per_s"},
        "oracle_prepare_s": prepare_s,
        "verify_cost": ratio,
        "per_repeat": per_repeat,
        "provenance": provenance(preset, torch_threads=torch.get_num_threads(),
                                 load_average_before=load_before, load_average_after=os.getloadavg()),
    }
    folder = Path(out_dir) if out_dir else paths.RESULTS / preset
    atomic_write_json(folder / "oracle_ceiling.json", result)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(folder / "oracle_ceiling.csv", buf.getvalue())
    return result


# ================================================================================================ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's arguments (shared by ``python -m xpress bench`` and this module)."""
    parser.add_argument("study", choices=["oracle-ceiling"], help="which benchmark to run")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--benchmarks", default="gsm8k,mt-bench", help="comma-separated benchmark names")
    parser.add_argument("--out-dir", default=None, help="default: results/<preset>/")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")


def run(args: argparse.Namespace) -> int:
    result = oracle_ceiling(args.preset, args.n_prompts, args.max_new_tokens, args.repeats,
                            [b.strip() for b in args.benchmarks.split(",") if b.strip()], args.out_dir,
                            args.overrides)
    keys = ("ar_tokens_per_s", "oracle_tokens_per_s", "speedup", "tau", "lossless")
    print(json.dumps({**{k: result[k] for k in keys},
                      "verify_ratio": result["verify_cost"]["loop_ratio"]}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xpress.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
