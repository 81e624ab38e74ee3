"""A co-training step, the path before against today's, in one run:
``python -m xpress.studies.train_speed --preset cpu``.

Two settings change how a co-training step computes, not what (each the same function to float32 rounding):

- ``train.loss_kernel``: ``auto`` computes the per-row terms of Eq. 14 and their gradient in one C++ call each
  where the kernels build (:func:`xpress.train.losses.row_terms`); ``torch``, the path before, runs PyTorch
  operations under autograd, a dozen passes through memory over [rows, draft vocabulary] tensors;
- ``train.attention_kernel``: ``auto`` computes the drafter's attention over the training blocks in C++, each row
  reading only the keys it attends (:class:`xpress.drafter.BlockLayout`); ``torch``, the path before,
  ``scaled_dot_product_attention`` over a dense mask of every key.

The study trains each stage's module in turn (``--methods``, from the preset's warm start where there is one) with
each arm in turn on the same batches: the path before (every key of :data:`xpress.train.loop.UNSIGNED_AT` at
its earlier value), each such key alone at the preset's value where several differ, and the preset. Arms
alternate step by step (the order rotating), so that the machine's phases fall on all of them; the first
``--warmup`` steps of each arm are not timed. Before any step, every arm computes the loss and its gradient
on the same batch at the same weights, under the run's autocast and in float32, and the relative differences to
the path before are kept (``same_*``: under autocast, in float32, and this arm under autocast against the path
before in float32, the size of autocast's own rounding).
Per arm: the median seconds a step (forward, loss, backward, optimizer), sequence tokens and supervised
block positions per second, and the ratio to the path before. Writes ``results/<preset>/train_speed.{json,csv}``.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

from .. import paths
from ..config import Config
from .compare import study_main


def arms(cfg: Config) -> dict[str, Config]:
    """The configs compared: ``before`` (every key of :data:`UNSIGNED_AT` at its earlier value), one arm per key
    whose preset value differs (that key alone at the preset's value), and ``preset``."""
    from ..train.loop import UNSIGNED_AT

    changed = {k: getattr(cfg.train, k) for k, v in UNSIGNED_AT.items() if getattr(cfg.train, k) != v}
    before = replace(cfg, train=replace(cfg.train, **UNSIGNED_AT))
    out = {"before": before}
    if len(changed) > 1:
        out.update({f"{k}={v}": replace(before, train=replace(before.train, **{k: v})) for k, v in changed.items()})
    out["preset"] = cfg
    return out


def _time_method(cfg: Config, target, data, accelerator, method: str, steps: int, warmup: int, progress: bool
                 ) -> tuple[list[dict], list[dict], str | None]:
    """One method's arms, interleaved step by step on the same batches: (table rows, timed rows, init)."""
    import torch
    from tqdm.auto import tqdm

    from ..train import loop
    from ..train.loop import UNSIGNED_AT

    vocab, _ = loop.build_vocab(cfg, target, data)
    warm = loop.checkpoint_dir(cfg, loop.WARM_START)
    state = loop.read_state(warm)
    init = str(warm) if state and state.get("complete") else None  # the warm start, or a fresh drafter
    drafter, _, _, _ = loop._starting_point(cfg, warm, None, method, target, vocab, init)
    module, model, optimizer, params = loop._trainable(cfg, drafter, method, None, accelerator)
    readout = target.lm_head().weight.detach()[vocab.d2t].to(accelerator.device)
    rows = loop.training_rows(cfg, data)
    consistency = cfg.train.consistency_weight > 0 and method != "dflash"
    configs = arms(cfg)
    names = list(configs)

    def batch_at(step: int):
        return loop.make_batch(data, loop.step_rows(rows, cfg, step, 0, 1), cfg,
                               loop.step_generator(cfg.seed, step, 0)).to(accelerator.device)

    def loss_and_grads(c: Config, batch, autocast: bool) -> tuple[float, torch.Tensor]:
        """The loss and the flat gradient at the current weights, under the run's autocast or in float32."""
        module.attention = c.train.attention_kernel
        with torch.autocast(accelerator.device.type, enabled=False) if not autocast else accelerator.autocast():
            forward = model if autocast else (lambda *a, **k: type(module).forward(module, *a, **k))
            loss, _ = loop.compute_loss(forward(batch, consistency=consistency), batch, vocab, readout, c,
                                        cfg.train.anchor_weight_start)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        grads = torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), grads

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    first = batch_at(0)
    ref_loss, ref_grad = loss_and_grads(configs["before"], first, True)
    _, ref32 = loss_and_grads(configs["before"], first, False)
    same = {}
    for name in names:
        loss, grad = loss_and_grads(configs[name], first, True)
        _, grad32 = loss_and_grads(configs[name], first, False)
        same[name] = {"loss": loss, "loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12),
                      "grad_rel_diff": rel(grad, ref_grad),  # both under the run's autocast
                      "grad_rel_diff_float32": rel(grad32, ref32),  # both in float32
                      "grad_rel_diff_to_float32_before": rel(grad, ref32)}  # the run's precision against float32
    timed: dict[str, list[dict]] = {n: [] for n in names}
    with tqdm(total=(steps + warmup) * len(names), desc=f"train step arms ({method})", disable=not progress) as bar:
        for step in range(steps + warmup):
            batch = batch_at(step + 1)
            tokens, positions = int(batch.valid.sum()), int(batch.label_valid.sum())
            for j in range(len(names)):
                name = names[(step + j) % len(names)]
                module.attention = configs[name].train.attention_kernel
                t0 = time.perf_counter()
                loop.train_step(model, optimizer, accelerator, params, batch, vocab, readout, configs[name], step,
                                steps + warmup, consistency)
                s = time.perf_counter() - t0
                if step >= warmup:
                    timed[name].append({"method": method, "arm": name, "step": step, "seconds": s, "tokens": tokens,
                                        "positions": positions})
                bar.update()
    module.attention = cfg.train.attention_kernel
    base = statistics.median(r["seconds"] for r in timed["before"])
    table = []
    for name in names:
        secs = [r["seconds"] for r in timed[name]]
        q = statistics.quantiles(secs, n=4) if len(secs) > 1 else [secs[0]] * 3
        med = statistics.median(secs)
        c = configs[name].train
        table.append({"method": method, "arm": name, **{k: getattr(c, k) for k in UNSIGNED_AT},
                      **{f"{k}_ran": v for k, v in loop.kernels_ran(c, accelerator.device).items()}, "step_s": med,
                      "step_s_q1": q[0], "step_s_q3": q[2],
                      "tokens_per_s": sum(r["tokens"] for r in timed[name]) / sum(secs),
                      "positions_per_s": sum(r["positions"] for r in timed[name]) / sum(secs),
                      "ratio_to_before": med / base, **{f"same_{k}": v for k, v in same[name].items()}})
    return table, [r for n in names for r in timed[n]], init


def run_train_speed(cfg: Config, target, methods: Sequence[str] = ("dflash", "xpress"), steps: int = 20,
                    warmup: int = 3, progress: bool = True, save: bool = True) -> dict[str, Any]:
    """Time the arms of each of ``methods`` (module docstring), one method after the other; returns the payload
    and, with ``save``, writes ``results/<preset>/train_speed.{json,csv}`` atomically with provenance."""
    import torch
    from accelerate import Accelerator

    from ..train import loop
    from ..train.regenerate import RegenData
    from ..utils import provenance, write_result
    from .compare import LoadRecord

    data = RegenData.load(cfg)
    accelerator = Accelerator(mixed_precision=loop.resolve_mixed_precision(cfg.train.mixed_precision),
                              cpu=str(target.device) == "cpu")
    prov = provenance(cfg.preset, torch_threads=torch.get_num_threads(), mixed_precision=accelerator.mixed_precision)
    load = LoadRecord.start()
    table, timed, init = [], [], None
    for method in methods:
        rows, times, init = _time_method(cfg, target, data, accelerator, method, steps, warmup, progress)
        table += rows
        timed += times
    command = (f"python -m xpress.studies.train_speed --preset {cfg.preset} --methods {','.join(methods)} "
               f"--steps {steps} --warmup {warmup}")
    result = {"what": "seconds of a co-training step (forward, loss, backward, optimizer), the path before against "
                      "the preset's, interleaved on the same batches in one process",
              "preset": cfg.preset, "methods": list(methods), "init": paths.portable(init) if init else None,
              "batch_size": cfg.train.batch_size, "anchors_per_seq": cfg.train.anchors_per_seq,
              "block_size": cfg.drafter.block_size, "draft_vocab_size": cfg.drafter.draft_vocab_size, "steps": steps,
              "warmup": warmup, "table": table, "warnings": load.stop(), "command": command, "rows": timed,
              "provenance": {**prov, **load.provenance()}}
    if save:
        write_result(paths.RESULTS / cfg.preset, "train_speed", result, table)
    return result


def _add_args(parser) -> None:
    import argparse

    from ..proposer import METHODS

    def methods(text: str) -> list[str]:
        names = text.split(",")
        bad = [m for m in names if m not in METHODS]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r}: give methods from {', '.join(METHODS)}, comma-separated")
        return names

    parser.add_argument("--methods", type=methods, default=["dflash", "xpress"], metavar="M,M,...",
                        help="stages to time, one after the other, comma-separated (default dflash,xpress)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per arm (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first (default 3)")


def main(argv: Sequence[str] | None = None) -> int:
    return study_main(argv, "python -m xpress.studies.train_speed", __doc__, "train.batch_size=2", _main, _add_args)


def _main(cfg: Config, target, args) -> int:
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2
    result = run_train_speed(cfg, target, args.methods, args.steps, args.warmup, progress=not args.no_progress)
    for r in result["table"]:
        print(f"{r['method']:>7} {r['arm']:>8}: {1e3 * r['step_s']:7.1f} ms a step ({r['ratio_to_before']:.3f}x before), "
              f"{r['tokens_per_s']:7.0f} tokens/s; from the path before: loss {r['same_loss_rel_diff']:.1e}, gradient "
              f"{r['same_grad_rel_diff']:.1e} ({r['same_grad_rel_diff_float32']:.1e} in float32; autocast's own "
              f"{r['same_grad_rel_diff_to_float32_before']:.1e})")
    print(f"wrote {paths.RESULTS / cfg.preset / 'train_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
