"""Command line: ``python -m xpress <command> ...``.

Commands:
  run      run the notebooks in order with papermill on a preset (the main job of ``make reproduce``)
  data     list the benchmarks (``python -m xpress data --list``; same as ``python -m xpress.data``)
  config   print a preset after overrides, e.g. ``python -m xpress config --preset cpu drafter.block_size=8``
  decode   decode prompts with a method, e.g.
           ``python -m xpress decode --preset cpu --method oracle --bench gsm8k --limit 4 --out out.jsonl``
  bench    benchmark records, e.g. ``python -m xpress bench oracle-ceiling --preset cpu``
  latency  latency per block (Table 3 / Figure 4): ``python -m xpress latency --preset cpu --target``
  regenerate  the target answers the training prompts (resumable): ``python -m xpress regenerate --preset cpu``
           (several processes, each its share of the shards: ``torchrun --nproc_per_node N -m xpress regenerate
           ...`` or ``accelerate launch -m xpress regenerate ...``; the studies too, e.g. ``torchrun
           --nproc_per_node N -m xpress.studies.table1 --preset cpu``, and .resolution, .batched)
  report   the generated sections of README.md, results/<preset>/README.md and docs/ from the result files
  rehearsal-assets  write the qwen3-tiny stand-ins (target, released drafter) if missing:
           ``python -m xpress rehearsal-assets --preset qwen3-tiny`` (notebook 00 does it too;
           the target loader only reads them)
  gpu-hours  GPU-hours per stage at a preset's sizes: ``python -m xpress gpu-hours --preset qwen3-8b``
  train    co-train a drafter and its head: ``python -m xpress train --preset cpu --method xpress``
           (several processes: ``accelerate launch -m xpress train ...`` or ``torchrun --nproc_per_node N -m xpress train ...``)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence


def _cmd_run(args: argparse.Namespace) -> int:
    from .pipeline import NotebookFailed, run_notebooks

    try:
        run_notebooks(args.preset, only=args.only, overrides=args.overrides)
    except NotebookFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from .data import main as data_main

    return data_main(["--list"]) or 0


def _cmd_config(args: argparse.Namespace) -> int:
    from .config import load_config

    print(json.dumps(load_config(args.preset, args.overrides).to_dict(), indent=2))
    return 0


def _cmd_decode(args: argparse.Namespace) -> int:
    """Decode, write one JSON line per prompt; exit 2 with a message on bad input or a missing or unusable
    checkpoint, 130 on Ctrl-C (finished prompts kept; the same command resumes)."""
    from .bench import DecodeInputError, DecodeInterrupted, decode_main
    from .compiled import CompiledError
    from .drafter import DrafterMismatchError
    from .targets import ContextTooLongError, TargetError

    try:
        summary = decode_main(args.preset, args.method, args.bench, args.prompts, args.out,
                              temperature=args.temperature, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, limit=args.limit,
                              overrides=args.overrides, checkpoint=args.checkpoint,
                              progress=not args.no_progress)
    except (DecodeInputError, ContextTooLongError, TargetError, FileNotFoundError, DrafterMismatchError,
            CompiledError) as e:
        # FileNotFoundError: CheckpointNotFoundError, whose message says how to train the drafter;
        # DrafterMismatchError: a checkpoint for another target, block size or method, or an unreadable one
        # (proposer.CheckpointUnreadableError); the message names the problem and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: method {args.method!r} is not available ({e})", file=sys.stderr)
        return 2
    except DecodeInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before decoding started: this run wrote nothing
        print("interrupted before decoding started; nothing was written", file=sys.stderr)
        return 130
    if summary.get("load_warning"):
        print(f"warning: {summary['load_warning']}", file=sys.stderr)
    print(json.dumps({"out": args.out, "method": args.method, **summary}), file=sys.stderr)
    return 0


def _cmd_regenerate(args: argparse.Namespace) -> int:
    """Regenerate; under ``torchrun`` / ``accelerate launch`` every rank takes its share of the shards and
    rank 0 alone reports. Exit 2 with one line on bad input or ranks that disagree or die, 130 on Ctrl-C."""
    from . import distributed
    from .config import load_config
    from .train.regenerate import RegenerationError, regenerate
    from .targets import TargetError

    try:
        with distributed.session():
            m = regenerate(load_config(args.preset, args.overrides), progress=not args.no_progress,
                           overwrite=args.overwrite)
            main = distributed.is_main()
    except (RegenerationError, TargetError, distributed.DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every finished shard is kept; rerun the same command to continue", file=sys.stderr)
        return 130
    if not main:  # several processes: one report
        return 0
    if m.get("skipped"):
        print(f"regenerate: {m['sequences']} sequences already complete for this config; nothing to do", file=sys.stderr)
    print(json.dumps({k: m[k] for k in ("sequences", "response_tokens", "skipped_long_prompts", "disk_bytes",
                                        "feature_bytes_per_token", "skipped")}))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config
    from .distributed import DistributedError
    from .drafter import DrafterMismatchError
    from .targets import TargetError
    from .train.loop import TrainingError, train
    from .train.regenerate import RegenerationError

    try:
        out = train(load_config(args.preset, args.overrides), args.method, progress=not args.no_progress,
                    overwrite=args.overwrite, stop_after=args.stop_after)
    except (TrainingError, RegenerationError, TargetError, DrafterMismatchError, FileNotFoundError,
            DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: a checkpoint of the last finished step was written; rerun the same command to resume",
              file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") != "0":  # several processes: one report
        return 0
    for stage, s in out.items():
        state = "already complete, skipped" if s.get("skipped") else f"step {s['step']}/{s['steps']}"
        print(f"train {stage} ({s['method']}): {state}; checkpoint {s.get('checkpoint', '')}", file=sys.stderr)
    print(json.dumps({stage: {k: s.get(k) for k in ("method", "step", "steps", "complete", "skipped", "final_val")}
                      for stage, s in out.items()}))
    return 0


def _cmd_rehearsal_assets(args: argparse.Namespace) -> int:
    from .config import load_config
    from .rehearsal import ensure_rehearsal_assets
    from .targets import TargetError

    try:
        folders = ensure_rehearsal_assets(load_config(args.preset, args.overrides))
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not folders:
        print(f"error: preset {args.preset!r} names no rehearsal folder (target.model under .../rehearsal/)",
              file=sys.stderr)
        return 2
    print(json.dumps({k: str(v) for k, v in folders.items()}))
    return 0


def _cmd_gpu_hours(args: argparse.Namespace) -> int:
    from .config import load_config
    from .gpu_budget import estimate_gpu_hours, format_table, load_measured

    cfg = load_config(args.preset, args.overrides)
    try:
        measured = None if args.measured == "none" else load_measured(cfg, args.measured, args.gpu)
        rows = estimate_gpu_hours(cfg, gpu=args.gpu, utilization=args.utilization, world=args.world, tau=args.tau,
                                  measured=measured)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .train.memory import stage_peaks

    print(format_table(rows, cfg, args.gpu, args.utilization, args.world, args.tau, measured=measured,
                       memory=stage_peaks(cfg)))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import main as report_main

    return report_main(args.preset, check=args.check)


def _cmd_latency(args: argparse.Namespace) -> int:
    """The latency study (Table 3 / Figure 4): results/<preset or --name>/latency.{json,csv}."""
    from .studies.latency import LatencyConfig, run_latency

    try:
        lc = LatencyConfig(ks=tuple(range(1, args.max_k + 1)), repeats=args.repeats, device=args.device,
                           dtype=args.dtype, target=args.random_target, compile=args.compile)
        shape_sets = [s.strip() for s in args.shapes.split(",") if s.strip()]
        target = None
        if args.target and "preset" in shape_sets:
            from .config import load_config
            from .targets import load_target

            target = load_target(load_config(args.preset, args.overrides))
        result = run_latency(args.preset, shape_sets, lc, args.overrides, target=target, out_dir=args.out_dir,
                             results_name=args.name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({name: {"markov_over_xpress_k4": s["markov_over_xpress_k4"], "paired": s["paired"],
                             **{k: round(v["median_ms"], 3) for k, v in s["timings"].items()}}
                      for name, s in result["shape_sets"].items()}, indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import DecodeInputError, run
    from .compiled import CompiledError
    from .data import DataError
    from .targets import TargetError

    try:
        return run(args)
    except (TargetError, DataError, DecodeInputError, CompiledError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written (results are written once the benchmark completes)", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xpress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the notebooks in order on a preset")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--only", nargs="*", default=[], help="run only notebooks whose name contains these")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("data", help="list the benchmarks and whether they work offline")
    p.add_argument("--list", action="store_true", default=True)
    p.set_defaults(func=_cmd_data)

    p = sub.add_parser("config", help="print a preset after overrides")
    p.add_argument("--preset", default="cpu")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(func=_cmd_config)

    from .methods import METHODS, MODEL_METHODS

    p = sub.add_parser("decode", help="decode prompts with a method; one JSON line per prompt",
                       description="Each output line: id, method, token_ids (concatenated over turns), text, "
                                   "accept_lengths (tokens committed per verification step), timings "
                                   "(seconds per stage), finish_reason and per-turn detail under turns.")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--method", required=True, choices=METHODS)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bench", help="an offline benchmark: gsm8k, math500, humaneval, mt-bench, ...")
    src.add_argument("--prompts", help='a JSONL file of {"id": ..., "turns": ["user message", ...]}')
    p.add_argument("--temperature", type=float, default=None, help="default: the preset's decode.temperature")
    p.add_argument("--seed", type=int, default=None, help="default: the preset's seed")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn; default: the preset's")
    p.add_argument("--limit", type=int, default=None, help="first M prompts; default: the preset's data.limit")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint folder (dflash, markov, xpress)")
    p.add_argument("--out", required=True, help="output JSONL, written atomically once every prompt is done; "
                   "finished prompts are kept in <out>.partial meanwhile (after Ctrl-C the same command resumes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="config overrides key=value (decode.batch_size=4, ...)")
    p.set_defaults(func=_cmd_decode)

    from .bench import add_arguments

    def stage_parser(name: str, help: str, overwrite: str, func) -> argparse.ArgumentParser:
        """A long-running stage: --preset, --overwrite, --no-progress and config overrides."""
        p = sub.add_parser(name, help=help)
        p.add_argument("--preset", default="cpu")
        p.add_argument("--overwrite", action="store_true", help=overwrite)
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("overrides", nargs="*", help="config overrides key=value")
        p.set_defaults(func=func)
        return p

    stage_parser("regenerate", "the target answers the training prompts (data/<preset>/regen)",
                 "discard data regenerated with another config", _cmd_regenerate)
    p = stage_parser("train", "co-train a drafter and its head (checkpoints/<preset>/<method>)",
                     "discard a checkpoint of another config", _cmd_train)
    p.add_argument("--method", required=True, choices=MODEL_METHODS)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps in all, as an interruption would")

    p = sub.add_parser("rehearsal-assets", help="write a rehearsal preset's stand-in target and drafter if missing")
    p.add_argument("--preset", default="qwen3-tiny")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(func=_cmd_rehearsal_assets)

    from .gpu_budget import DEFAULT_GPU, DEFAULT_UTILIZATION, DEFAULT_WORLD, GPUS

    p = sub.add_parser("gpu-hours", help="GPU-hours per stage, computed from a preset's sizes (docs/gpu.md)")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPUS))
    p.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION,
                   help="sustained fraction of the GPU's dense bf16 peak and of its memory bandwidth")
    p.add_argument("--world", type=int, default=DEFAULT_WORLD, help="training processes (GPUs)")
    p.add_argument("--tau", type=float, default=1.0, help="tokens per target forward assumed for the speculative "
                                                          "methods (1: an upper bound)")
    p.add_argument("--measured", default=None, metavar="DIR",
                   help="a folder of the device check's files (latency.json, train_memory.json) whose measured "
                        "constants replace the model's; default: results/<the --gpu's name>/ of the repository; "
                        "none: the model alone")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(func=_cmd_gpu_hours)

    p = sub.add_parser("report", help="rewrite the generated sections of README.md, results/<preset>/README.md and docs/ from results/<preset>/")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--check", action="store_true", help="exit 1 if a generated section and the result files disagree")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("latency", help="latency per block: refiner at K, Markov head, drafter, target (Table 3)")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--shapes", default="preset,paper", help="comma-separated: preset, paper, tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--max-k", type=int, default=8, help="time the refiner at K = 1 .. max-k")
    p.add_argument("--target", action="store_true", help="also time the preset's target (loaded) at its shapes")
    p.add_argument("--random-target", action="store_true", help="also time a random Qwen3 target of each shape set")
    p.add_argument("--compile", action="store_true", help="torch.compile the Jacobi pass of the CUDA-graph variant")
    p.add_argument("--name", default=None, help="results/<name>/ instead of results/<preset>/ (e.g. h200)")
    p.add_argument("--out-dir", default=None, help="default: results/<name or preset>/")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.set_defaults(func=_cmd_latency)

    p = sub.add_parser("bench", help="benchmark records (oracle-ceiling, target-cost, train-memory) under results/<preset>/")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def _apply_threads(args: argparse.Namespace) -> None:
    """Torch threads from the preset's ``torch_threads`` as a measuring or training command starts."""
    if args.command in ("decode", "bench", "regenerate", "train"):
        from .config import load_config
        from .utils import apply_torch_threads

        apply_torch_threads(load_config(args.preset, args.overrides).torch_threads)


def main(argv: Sequence[str] | None = None) -> int:
    from .config import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides placed between options (argparse takes positionals in one run only)
        if not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        _apply_threads(args)
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `python -m xpress config | head`: the reader left, nothing is wrong
        try:  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
