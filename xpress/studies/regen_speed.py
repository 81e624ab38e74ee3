"""Regeneration's throughput, engine against engine, in one run:
``python -m xpress.studies.regen_speed --preset cpu``.

Regeneration (notebook 01) is where the cpu preset spends its data budget: every answer is a greedy decode
of the target with its states captured. Two engines do it (``data.regen_engine``):

- ``batched``: left-padded ragged batches of ``data.regen_batch_size`` prompts of similar length through
  :func:`xpress.decoding.generate_ar_batch` (the PyTorch layer with the C++ products); a batch runs until
  its longest answer ends, its finished rows still fed;
- ``continuous``: :func:`xpress.continuous.generate_greedy`, each sequence in its own cache row, one C++
  call per layer for all of them (``layer_rows``), a finished row refilled at once.

Both run regeneration's own shard path (:func:`xpress.train.regenerate._shard_results`) on the first
``--prompts`` regeneration prompts (the train split's first, as notebook 01 sees them)
with ``data.regen_max_new_tokens`` and the states captured as regeneration stores them, the engines (and
the continuous engine at each of ``--batches``) interleaved in every repeat. Per engine: response tokens per
second (medians over repeats; wall time from the first prefill to the last answer), the ratio to
``batched``, and whether the answers agree: the continuous engine's must equal across its batch sizes and,
on ``--check`` prompts, batch-1 :func:`xpress.decoding.generate_ar` token for token; the ragged batches' may
differ from them at near-ties (the count is reported). Writes ``results/<preset>/regen_speed.{json,csv}``.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Sequence

from .. import paths
from ..config import Config


def _answers(target, cfg: Config, records: list[dict], engine: str, batch: int) -> list[list[int]]:
    """Each record's answer, regenerated as ``python -m xpress regenerate`` does (one shard of all of them,
    states captured, shard table built) by ``engine`` at ``batch`` sequences."""
    import dataclasses

    from ..train.regenerate import _shard_results

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, regen_engine=engine, regen_batch_size=batch,
                                                            cache_features=True))
    [(_, table, _)] = list(_shard_results(target, cfg, {0: records}))
    return [ids[p:] for ids, p in zip(table["input_ids"], table["prompt_len"])]


def run_regen_speed(cfg: Config, target, n_prompts: int = 64, repeats: int = 2, batches: Sequence[int] = (16, 32, 64),
                    check: int = 4, progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Time both engines on the same prompts (module docstring); returns the payload and, with ``save``,
    writes ``results/<preset>/regen_speed.{json,csv}`` atomically with provenance."""
    import torch
    from tqdm.auto import tqdm

    from ..continuous import available
    from ..decoding import generate_ar
    from ..train.regenerate import _prompts
    from ..utils import provenance, write_result
    from .compare import LoadRecord

    if not available(target):
        raise ValueError("the continuous engine needs the fused CPU kernels (a float32 Llama target on an AVX2 "
                         "CPU): on this machine regeneration runs the ragged batches only")
    prov = provenance(cfg.preset, torch_threads=torch.get_num_threads())
    records = _prompts(cfg, target.tokenizer)[0][:n_prompts]
    prompts = [r["prompt_ids"] for r in records]
    runs = [("batched", cfg.data.regen_batch_size)] + [("continuous", b) for b in batches]
    load = LoadRecord.start()
    t_start = time.perf_counter()
    rows, answers = [], {}
    with tqdm(total=repeats * len(runs), desc="regeneration engines", disable=not progress) as bar:
        for rep in range(repeats):
            for engine, batch in runs:
                t0 = time.perf_counter()
                got = _answers(target, cfg, records, engine, batch)
                s = time.perf_counter() - t0
                answers[(engine, batch)] = got
                tokens = sum(len(a) for a in got)
                rows.append({"engine": engine, "batch_size": batch, "repeat": rep, "response_tokens": tokens,
                             "seconds": s, "tokens_per_s": tokens / s})
                bar.update()
    ref = [generate_ar(target, p, cfg.data.regen_max_new_tokens).token_ids for p in prompts[:check]]
    warnings = load.stop()
    cont = [answers[("continuous", b)] for b in batches]
    base = answers[("batched", cfg.data.regen_batch_size)]
    old = statistics.median(r["tokens_per_s"] for r in rows if r["engine"] == "batched")
    table = []
    for engine, batch in runs:
        tps = [r["tokens_per_s"] for r in rows if (r["engine"], r["batch_size"]) == (engine, batch)]
        got = answers[(engine, batch)]
        table.append({"engine": engine, "batch_size": batch, "tokens_per_s": statistics.median(tps),
                      "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                      "ratio_to_batched": statistics.median(tps) / old,
                      "answers_equal_to_continuous": sum(a == b for a, b in zip(got, cont[0])),
                      "answers_equal_to_batch1_ar": sum(a == b for a, b in zip(got, ref))})
    result = {"what": "regeneration throughput (response tokens per second, states captured) of the ragged-batch "
                      "engine and the continuous engine at several batch sizes, interleaved, on the same prompts",
              "preset": cfg.preset, "target": target.name, "prompts": len(prompts),
              "prompt_tokens": sum(len(p) for p in prompts), "max_new_tokens": cfg.data.regen_max_new_tokens,
              "repeats": repeats, "checked_against_ar": check, "table": table,
              "continuous_equal_across_batch_sizes": all(c == cont[0] for c in cont),
              "continuous_equals_batch1_ar": all(a == b for a, b in zip(cont[0], ref)),
              "warnings": warnings, "seconds": time.perf_counter() - t_start,
              "command": f"python -m xpress.studies.regen_speed --preset {cfg.preset} --prompts {n_prompts} "
                         f"--repeats {repeats} --batches {' '.join(map(str, batches))}",
              "rows": rows, "provenance": {**prov, **load.provenance()}}
    if save:
        write_result(paths.RESULTS / cfg.preset, "regen_speed", result, table)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from ..config import load_config
    from ..targets import load_target

    parser = argparse.ArgumentParser(prog="python -m xpress.studies.regen_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--prompts", type=int, default=64, help="regeneration prompts to answer (default 64)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64],
                        help="batch sizes of the continuous engine (default 16 32 64)")
    parser.add_argument("--check", type=int, default=4, help="prompts also decoded by batch-1 AR (default 4)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.repeats < 1 or min(args.batches) < 1 or args.check < 0:
        parser.error("--prompts, --repeats and --batches must be at least 1, --check at least 0")
    from ..continuous import available

    cfg = load_config(args.preset, args.overrides)
    target = load_target(cfg)
    if not available(target):  # a machine without the fused kernels has one engine: nothing to compare
        print("skipped: the continuous engine needs the fused CPU kernels (a Llama target; float32 on AVX2, bf16 "
              "with AMX or AVX512-BF16); regeneration runs the ragged batches on this machine")
        return 0
    result = run_regen_speed(cfg, target, args.prompts, args.repeats, args.batches, min(args.check, args.prompts),
                             progress=not args.no_progress)
    for r in result["table"]:
        print(f"{r['engine']:>10} batch {r['batch_size']:3d}: {r['tokens_per_s']:6.1f} tokens/s "
              f"({r['ratio_to_batched']:.2f}x batched), answers equal to continuous {r['answers_equal_to_continuous']}"
              f"/{result['prompts']}, to batch-1 AR {r['answers_equal_to_batch1_ar']}/{result['checked_against_ar']}")
    print(f"continuous equal across batch sizes: {result['continuous_equal_across_batch_sizes']}, equal to batch-1 "
          f"AR: {result['continuous_equals_batch1_ar']}")
    print(f"wrote {paths.RESULTS / cfg.preset / 'regen_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
