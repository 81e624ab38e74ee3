"""Command line: ``python -m xpress <command> ...``.

Commands:
  run      run the notebooks in order with papermill on a preset (the main job of ``make reproduce``)
  data     list the benchmarks (``python -m xpress data --list``; same as ``python -m xpress.data``)
  config   print a preset after overrides, e.g. ``python -m xpress config --preset cpu drafter.block_size=8``
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _cmd_run(args: argparse.Namespace) -> int:
    from .pipeline import run_notebooks

    run_notebooks(args.preset, only=args.only, overrides=args.overrides)
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from .data import main as data_main

    return data_main(["--list"]) or 0


def _cmd_config(args: argparse.Namespace) -> int:
    from .config import load_config

    print(json.dumps(load_config(args.preset, args.overrides).to_dict(), indent=2))
    return 0


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
