"""Training levers, one at a time: plain-drafter runs from scratch that differ from the preset in one
config key, scored by teacher-forced acceptance on the held-out validation split, by tau by decoding the
validation prompts, and by the end-to-end speedup over AR on those prompts (measured, and implied by tau
with the run's own stage costs).

    python -m xpress.studies.levers --preset cpu --steps 400 base drafter.init_from_target=true ...
    python -m xpress.studies.levers --preset cpu --steps 2800 base train.train_sequences=300 ...  # data scaling
    python -m xpress.studies.levers --preset cpu --method xpress --from-warm-start base train.gamma=2 ...  # co-training
    python -m xpress.studies.levers --preset cpu --gap     # trained stages: training vs held-out acceptance
    python -m xpress.studies.levers --preset cpu --gap --against ../other-clone   # and both runs' splits, swapped

Each lever is ``name`` (the preset as is) or ``key=value`` (one override). A run trains the ``dflash``
drafter for ``--steps`` steps into ``checkpoints/<preset>/levers/<name>-<steps>steps/`` (never the real
stages' folders; a run of other steps keeps its own), then scores it with :func:`xpress.train.loop.teacher_forced_val`, whose fixed anchors make the runs
compare on the same ~700 blocks (a lever with another block size scores blocks of its own length). A
complete run of the same lever and steps is not retrained, only rescored: its row keeps the training time
and, as ``trained_command``, ``trained_git_revision`` and ``trained_date``, where the training ran. Rows
append to ``results/<preset>/levers.{json,csv}`` (one row per lever; a rerun of the same lever and steps
replaces its row).

With ``--from-warm-start`` a lever is a co-training run instead: ``--method`` (dflash, markov or xpress)
starts from the preset's trained warm start (``checkpoints/<preset>/warmstart/``, complete) as the real
stages do, for ``--steps`` steps (default ``train.steps``), into
``checkpoints/<preset>/levers/<method>/<name>-<steps>steps/``; the head's levers (``head.rank``,
``train.gamma``, ``train.consistency_weight``, the loss mix, longer co-training) are measured this way. Rows
carry ``method`` and ``init`` (``warmstart``; from-scratch rows have none) and are kept apart from the
from-scratch rows in the figures.

Teacher-forced acceptance over random anchors runs higher than tau by decoding (decoding rounds start
where the previous draft failed, which are harder positions), so the rows rank levers; they are not a tau.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .. import paths, plots
from ..config import Config, ConfigError, load_config


def lever_config(preset: str, lever: str, steps: int) -> Config:
    """The preset with one override (``lever`` of the form ``key=value``; ``base`` for none), evaluation by
    decoding off and checkpoints only at the end."""
    overrides = [] if lever == "base" else [lever]
    return load_config(preset, ["train.eval_prompts=0", f"train.checkpoint_every={steps + 1}", *overrides])


def warm_start_folder(preset: str) -> Path:
    """The preset's trained warm start (``checkpoints/<preset>/warmstart/``), which co-training levers start
    from; a missing or unfinished one is a :class:`xpress.train.loop.TrainingError` naming the command."""
    from ..train.loop import WARM_START, TrainingError, checkpoint_dir, read_state

    folder = checkpoint_dir(load_config(preset), WARM_START)
    state = read_state(folder)
    if not (state and state.get("complete")):
        raise TrainingError(f"no complete warm start at {folder}: co-training levers start from it; train it with "
                            f"`python -m xpress train --preset {preset} --method dflash` (or make reproduce)")
    return folder


def run_lever(preset: str, lever: str, steps: int, target=None, data=None, progress: bool = True,
              decode_prompts: int = 8, method: str = "dflash", from_warm_start: bool = False) -> dict[str, Any]:
    """Train and score one lever; returns its row (lever, steps, seconds, s_per_step, val_tf_tau, blocks,
    the training data it saw, and :func:`decode_score` on ``decode_prompts`` validation prompts). A
    ``from_warm_start`` lever co-trains ``method`` from the preset's warm start (module docstring); its row
    adds ``method`` and ``init``."""
    from ..proposer import load_drafter
    from ..train.loop import CoTrainer, checkpoint_dir, run_stage, teacher_forced_val, training_rows
    from ..train.regenerate import RegenData

    if method != "dflash" and not from_warm_start:
        raise ValueError(f"method={method!r} levers co-train a head: pass from_warm_start (--from-warm-start)")
    cfg = lever_config(preset, lever, steps)
    data = data or RegenData.load(cfg)
    init = str(warm_start_folder(preset)) if from_warm_start else None
    name = lever.replace("=", "-").replace("/", "_")
    # under checkpoints/<preset>/; the folder names the steps, so that runs of other lengths keep their own
    stage = (f"levers/{method}/" if from_warm_start else "levers/") + f"{name}-{steps}steps"
    t0 = time.perf_counter()
    summary = run_stage(cfg, stage, method, steps, target=target, data=data, init=init, progress=progress,
                        overwrite=True, write_log=False)
    seconds = None if summary["skipped"] else time.perf_counter() - t0  # a complete run is only rescored
    rows = training_rows(cfg, data)  # what the stage trained on (a skipped stage's summary does not say)
    md = load_drafter(checkpoint_dir(cfg, stage), method, cfg, target)
    val = teacher_forced_val(CoTrainer(md.drafter, md.head, md.vocab), data, cfg)
    prompts = data.prompts("val")[:decode_prompts]
    score = decode_score(target, md, prompts, cfg.train.eval_max_new_tokens) if prompts else {}
    return {"lever": lever, "steps": steps, "block_size": cfg.drafter.block_size,  # "base" follows the preset
            "anchors_per_seq": cfg.train.anchors_per_seq, "on_bf16": cfg.on_bf16,  # ... and its on_bf16 overrides
            **({"method": method, "init": "warmstart"} if from_warm_start else {}),
            "seconds": seconds, "s_per_step": seconds and seconds / steps, "val_tf_tau": val["tf_tau"],
            "val_tf_tau_base": val.get("tf_tau_base"), "blocks": val["blocks"], "train_sequences": len(rows),
            "train_response_tokens": data.answer_tokens(rows), **score}


def row_key(row: dict) -> tuple:
    """Rows of the same lever, steps, method and starting point replace each other in ``levers.json``."""
    return row["lever"], row["steps"], row.get("method", "dflash"), row.get("init")


def decode_score(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy decoding of ``prompts`` by AR and by ``drafter``, interleaved per prompt (batch 1): ``val_tau``
    (tokens per verification), ``measured_speedup`` (AR seconds / speculative seconds, prefill included)
    and ``implied_speedup`` = tau x AR step / speculative round, from this run's own stage timings (what
    tau buys at these costs, prefill aside). Lossless decoding is asserted (T = 0: same tokens as AR)."""
    from ..decoding import generate_ar, generate_speculative

    tokens = steps = 0
    ar_s = spec_s = ar_step = ar_steps = round_s = rounds = 0.0
    for p in prompts:
        a = generate_ar(target, p, max_new_tokens)
        g = generate_speculative(target, drafter, p, max_new_tokens)
        if g.token_ids != a.token_ids:
            raise AssertionError("a lever's drafter changed the greedy output: the engine is not lossless")
        tokens, steps = tokens + len(g.token_ids), steps + g.n_steps
        ar_s, spec_s = ar_s + a.total_s, spec_s + g.total_s
        ar_step += sum(sum(v) for v in a.step_times.values())
        ar_steps += max((len(v) for v in a.step_times.values()), default=0)
        round_s += sum(sum(v) for v in g.step_times.values())
        rounds += max((len(v) for v in g.step_times.values()), default=0)
    tau = tokens / max(1, steps)
    per_step, per_round = ar_step / max(1, ar_steps), round_s / max(1, rounds)
    return {"val_tau": tau, "decode_prompts": len(prompts), "measured_speedup": ar_s / spec_s if spec_s else None,
            "implied_speedup": tau * per_step / per_round if per_round else None,
            "ar_step_ms": 1e3 * per_step, "round_ms": 1e3 * per_round}


def scaling_fit(rows: Sequence[dict], key: str = "val_tf_tau", goal: float = 2.5) -> dict[str, Any] | None:
    """Least-squares line ``tau = a + b log10(tokens)`` through the data-scaling rows
    (:func:`xpress.plots.data_scaling_rows`) and the training tokens at which it reaches ``goal``
    (None where tau does not grow with data). A log-linear extrapolation: a number to test, not a law."""
    import numpy as np

    pts = [(r["train_response_tokens"], r[key]) for r in rows if r.get(key) is not None]
    if len({t for t, _ in pts}) < 2:
        return None
    x = np.log10([t for t, _ in pts])
    y = np.array([v for _, v in pts])
    b, a = np.polyfit(x, y, 1)
    return {"key": key, "intercept": float(a), "per_decade": float(b), "goal": goal, "points": len(pts),
            "tokens_for_goal": float(10 ** ((goal - a) / b)) if b > 0 else None}


def row_provenance(preset: str, command: str) -> dict[str, Any]:
    """Where one lever row comes from, flat so that it fits the CSV: the command, git revision, date, CPU and
    the target's compute dtype (the file's ``provenance`` block only describes the latest write, and rows
    of several runs share the file). A rescored row gets the rescoring run's; its training seconds stay
    those of the run that trained it."""
    from ..utils import cpu_class, provenance

    p = provenance(preset)
    return {"command": command, "git_revision": p["git_revision"][:12] + ("+dirty" if p["git_dirty"] else ""),
            "date": p["date"], "cpu": p["machine"]["cpu_model"], "cpu_class": cpu_class(p),
            "target_dtype": p["target_runtime"].get("dtype", "")}


def record(preset: str, rows: Sequence[dict]) -> None:
    """Merge ``rows`` into ``results/<preset>/levers.{json,csv}`` (same :func:`row_key`: replaced)."""
    import json

    import pandas as pd

    from ..utils import atomic_write_json, atomic_write_text, provenance

    out = paths.RESULTS / preset / "levers.json"
    before = json.loads(out.read_text()) if out.is_file() else {}
    old = before.get("rows", [])
    # rows written before rows carried their own provenance are described by the file's block of that time:
    # it is kept (``legacy_provenance``) when the file's ``provenance`` moves on to the latest write
    legacy = before.get("legacy_provenance") or (before.get("provenance") if any("git_revision" not in r for r in old)
                                                 else None)
    keep = {row_key(r): r for r in old}
    for r in rows:
        prev = keep.get(row_key(r), {})
        keep[row_key(r)] = {**r, **(trained_by(prev) if r["seconds"] is None else {})}
    merged = sorted(keep.values(), key=lambda r: (bool(r.get("init")), r["steps"], -r["val_tf_tau"]))
    atomic_write_json(out, {"rows": merged, "provenance": provenance(preset),
                            **({"legacy_provenance": legacy} if legacy and any("git_revision" not in r for r in merged)
                               else {})})
    atomic_write_text(out.with_suffix(".csv"), pd.DataFrame(merged).to_csv(index=False))


def trained_by(row: dict) -> dict[str, Any]:
    """What a rescored row (``seconds`` None: the checkpoint was complete, only scored again) keeps of the
    row of the run that trained it: its training time and, as ``trained_command``, ``trained_git_revision``
    and ``trained_date``, where that training ran (the row's own provenance then describes the scoring)."""
    kept = {k: row[k] for k in ("seconds", "s_per_step") if k in row}
    for k in ("command", "git_revision", "date"):
        if f"trained_{k}" in row or k in row:
            kept[f"trained_{k}"] = row.get(f"trained_{k}", row.get(k))
    return kept


def generalisation_gap(preset: str, stages: Sequence[str] = ("warmstart", "dflash", "markov", "xpress"),
                       target=None, against: Path | None = None) -> dict[str, Any]:
    """Teacher-forced acceptance of the trained stages on the validation split and on as many TRAINING
    sequences (the first ones), with the same fixed anchors: the gap says how much of the training accuracy
    is memorised. Writes ``results/<preset>/generalisation.json``; stages without a checkpoint are left out.

    ``against``: another run's root (e.g. a clone after ``make reproduce``, with its ``data/`` and
    ``checkpoints/``). The result then also has ``swap`` rows: each run's stages scored on both runs'
    validation splits, which tells a change of the drafters (rows of one ``data``) from a change of the
    validation answers themselves (rows of one ``checkpoints``) when two runs regenerated different data."""
    from ..targets import load_target
    from ..train.loop import read_state, teacher_forced_val
    from ..train.regenerate import RegenData
    from ..utils import atomic_write_json, provenance

    cfg = load_config(preset)
    data = RegenData.load(cfg)
    target = target or load_target(cfg)
    seen = data.indices("train")[:len(data.indices("val"))]
    runs = {"this": (paths.CHECKPOINTS, data)}
    if against is not None:
        against = Path(against).expanduser().resolve()
        runs["other"] = (against / "checkpoints", RegenData.load(cfg, data_root=against / "data"))
    rows, swap = [], []
    for stage in stages:
        for name, (checkpoints, _) in runs.items():
            folder = checkpoints / preset / stage
            state = read_state(folder)
            if not (state and state.get("complete")):
                continue
            module = _trained_module(folder, state["method"], cfg, target)
            scores = {on: teacher_forced_val(module, split, cfg) for on, (_, split) in runs.items()}
            swap += [{"stage": stage, "checkpoints": name, "data": on, "val_tf_tau": v["tf_tau"],
                      "val_tf_tau_base": v["tf_tau_base"], "val_blocks": v["blocks"]} for on, v in scores.items()]
            if name == "this":
                val, train = scores["this"], teacher_forced_val(module, data, cfg, rows=seen)
                rows.append({"stage": stage, "method": state["method"], "steps": state["step"],
                             "val_tf_tau": val["tf_tau"], "train_tf_tau": train["tf_tau"],
                             "val_tf_tau_base": val["tf_tau_base"], "train_tf_tau_base": train["tf_tau_base"],
                             "val_blocks": val["blocks"], "train_blocks": train["blocks"]})
    result = {"what": "teacher-forced acceptance (fixed anchors) on held-out vs training sequences",
              "train_sequences": len(seen), "rows": rows, "provenance": provenance(preset)}
    if against is not None:
        result["swap"] = swap
        result["regenerated_at"] = {name: (split.manifest or {}).get("provenance", {}).get("git_revision")
                                    for name, (_, split) in runs.items()}
    atomic_write_json(paths.RESULTS / preset / "generalisation.json", result)
    return result


def _trained_module(folder: Path, method: str, cfg: Config, target):
    """A trained stage's drafter and head as the :class:`xpress.train.loop.CoTrainer` that scores them."""
    from ..proposer import load_drafter
    from ..train.loop import CoTrainer

    md = load_drafter(folder, method, cfg, target)
    return CoTrainer(md.drafter, md.head, md.vocab)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xpress.studies.levers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="training steps per lever (default 400 from scratch, "
                    "train.steps from the warm start)")
    ap.add_argument("--method", choices=("dflash", "markov", "xpress"), default="dflash",
                    help="what a lever trains (markov and xpress need --from-warm-start)")
    ap.add_argument("--from-warm-start", action="store_true", help="co-train from the preset's trained warm start")
    ap.add_argument("--decode-prompts", type=int, default=8, help="validation prompts decoded per lever (0: none)")
    ap.add_argument("--gap", action="store_true", help="also score the trained stages on training vs "
                    "validation sequences (results/<preset>/generalisation.json)")
    ap.add_argument("--against", type=Path, default=None, metavar="ROOT",
                    help="with --gap: also score this run's and another run's stages (ROOT/checkpoints, ROOT/data, "
                    "e.g. another clone after make reproduce) on both runs' validation splits")
    ap.add_argument("levers", nargs="*", help="base, or key=value overrides, one lever each")
    args = ap.parse_args(argv)
    if args.levers and args.method != "dflash" and not args.from_warm_start:
        ap.error(f"--method {args.method} co-trains a head from the warm start: add --from-warm-start")
    if args.against is not None and not args.gap:
        ap.error("--against compares the trained stages' validation scores: add --gap")
    if args.against is not None:
        root = args.against.expanduser()
        missing = [f for f in (root / "data" / args.preset / "regen" / "manifest.json",
                               root / "checkpoints" / args.preset) if not f.exists()]
        if missing:
            ap.error(f"--against {root}: no {missing[0]}; pass the root of a clone where `make reproduce` (or "
                     f"regenerate and train) ran for --preset {args.preset}")
    from ..targets import TargetError
    from ..train.loop import TrainingError
    from ..train.regenerate import RegenerationError

    try:
        return _run(args, argv)
    except (ConfigError, TrainingError, RegenerationError, TargetError) as e:
        # a bad key, no warm start, no regenerated data, no target: the message names the fix; rows of
        # levers that finished before it are already in levers.json
        ap.exit(2, f"{ap.prog}: error: {e}\n")


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """:func:`main` after its arguments were checked: the gap, then each lever in turn."""
    from ..targets import load_target

    if args.gap:
        gap = generalisation_gap(args.preset, against=args.against)
        for r in gap["rows"]:
            print(f"{r['stage']}: teacher-forced tau {r['train_tf_tau']:.2f} on training sequences, "
                  f"{r['val_tf_tau']:.2f} on held-out ones", flush=True)
        for r in gap.get("swap", []):
            whose = {"this": "this run's", "other": "the other run's"}
            print(f"{r['stage']}: {whose[r['checkpoints']]} checkpoint on {whose[r['data']]} validation split, "
                  f"teacher-forced tau {r['val_tf_tau']:.3f}", flush=True)
    if not args.levers:
        return 0
    steps = args.steps or (load_config(args.preset).train.steps if args.from_warm_start else 400)
    cfgs = [lever_config(args.preset, lever, steps) for lever in args.levers]  # bad keys fail first
    if args.from_warm_start:
        warm_start_folder(args.preset)  # a missing warm start fails before any training
    target = load_target(cfgs[0])
    command = " ".join(["python -m xpress.studies.levers", *(argv if argv is not None else sys.argv[1:])])
    for lever in args.levers:
        row = run_lever(args.preset, lever, steps, target=target, decode_prompts=args.decode_prompts,
                        method=args.method, from_warm_start=args.from_warm_start)
        record(args.preset, [{**row, **row_provenance(args.preset, command)}])
        decoded = (f", tau by decoding {row['val_tau']:.2f}, {row['measured_speedup']:.2f}x AR measured, "
                   f"{row['implied_speedup']:.2f}x implied" if "val_tau" in row else "")
        what = f"{args.method} from the warm start, " if args.from_warm_start else ""
        print(f"{lever}: {what}val teacher-forced tau {row['val_tf_tau']:.3f} after {row['steps']} steps{decoded}",
              flush=True)
    for draw in (plots.draw_levers, plots.draw_data_scaling):
        drawn = draw(args.preset)
        if drawn is not None:
            print("figure:", *plots.save_fig(drawn.fig, drawn.name, args.preset), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
