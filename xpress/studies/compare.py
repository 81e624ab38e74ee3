"""The one measurement path of the method comparisons: held-out benchmark prompts decoded by AR and by
each method, interleaved per prompt, with the machine's load recorded.

Acceptance is measured by decoding, never by training accuracy: the trained checkpoints
(``checkpoints/<preset>/<method>/``) draft for the real target, and tau counts the tokens committed per
verification (bonus included). Timing is interleaved: for every prompt, AR and then each method run back
to back (``repeats`` times), so a slow phase of a shared machine hits every method alike. At T = 0 every
speculative output is checked against AR's, token for token.

Used by :mod:`xpress.studies.table1` (Table 1) and :mod:`xpress.studies.batched` (the batched table)::

    prompts = benchmark_prompts(cfg, target, 4)                  # [{"bench", "id", "ids"}]
    rows = decode_interleaved(target, {"ar": None, "xpress": d}, prompts, 96)   # one row per decode
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..config import Config

AR = "ar"


def benchmark_prompts(cfg: Config, target, per_benchmark: int) -> list[dict]:
    """The first ``per_benchmark`` prompts of each of ``cfg.data.benchmarks`` (first user turn, chat
    template, thinking off): records ``{"bench", "id", "ids"}``."""
    from ..data import load_benchmark
    from ..targets import encode_chat

    out = []
    for name in cfg.data.benchmarks:
        for rec in load_benchmark(name, limit=per_benchmark):
            out.append({"bench": name, "id": rec["id"], "ids": encode_chat(target.tokenizer, rec["turns"][:1])})
    return out


def make_drafters(cfg: Config, target, methods: Sequence[str], untrained_ok: bool = False) -> dict[str, Any]:
    """``{"ar": None, method: drafter, ...}``, AR first (every other output is checked against it). A
    missing checkpoint raises (with the command that trains it) unless ``untrained_ok``."""
    from ..methods import make_drafter

    drafters: dict[str, Any] = {AR: None}
    for m in methods:
        if m != AR:
            drafters[m] = make_drafter(m, cfg, target, seed=cfg.seed, untrained_ok=untrained_ok)
    return drafters


def weights_of(drafters: Mapping[str, Any]) -> dict[str, str]:
    """``{method: "none" (AR) | "trained" | "untrained" | "reference"}``."""
    from ..methods import drafter_weights

    return {m: ("none" if d is None else drafter_weights(d)) for m, d in drafters.items()}


def fingerprints_of(drafters: Mapping[str, Any]) -> dict[str, str]:
    """``{method: fingerprint}`` of the drafters loaded from a checkpoint folder
    (:func:`xpress.proposer.checkpoint_fingerprint`, the same as ``train_<method>.json``'s ``fingerprint`` when
    they are the weights that stage saved); the others (AR, reference, untrained, released) are left out."""
    return {m: d.fingerprint for m, d in drafters.items() if getattr(d, "fingerprint", None)}


# ===================================================================================== machine load
@dataclass
class LoadRecord:
    """The machine's load before and after a measurement (:func:`xpress.utils.load_check`): the 1-minute
    load average, and the CPUs other processes use at each end (:func:`xpress.utils.other_cpu_use`),
    which decides: busy when other work takes more than half the CPUs at either end. Also the memory read
    rate at each end (``memory_read_gb_per_s``, :func:`xpress.kernels.memory_read_gb_per_s`; None without
    the kernels): on a VM it moves between runs, and a one-token step's time with it."""

    before: float | None
    own_load: float
    others_before: float | None = None
    memory_before: float | None = None
    check: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls) -> "LoadRecord":
        import torch

        from ..kernels import memory_read_gb_per_s
        from ..utils import load_average, other_cpu_use

        return cls(before=load_average(), own_load=float(torch.get_num_threads()), others_before=other_cpu_use(),
                   memory_before=memory_read_gb_per_s())

    def stop(self, after: float | None = None) -> list[str]:
        """Take the load at the end; returns (and prints) the warning as a list, [] on a quiet machine."""
        from ..kernels import memory_read_gb_per_s
        from ..utils import load_average, load_check, other_cpu_use

        self.check = load_check(self.before, load_average() if after is None else after, self.own_load,
                                others=(self.others_before, other_cpu_use()))
        self.check["memory_read_gb_per_s"] = [self.memory_before, memory_read_gb_per_s()]
        if self.check["load_warning"]:
            print(f"WARNING: {self.check['load_warning']}")
        return [self.check["load_warning"]] if self.check["load_warning"] else []

    def provenance(self) -> dict[str, Any]:
        return dict(self.check)


# ======================================================================================= decoding
def _flat(values: Sequence) -> list:
    return [i for s in values for i in (s if isinstance(s, list) else [s])]


def generation_row(g, seconds: float) -> dict[str, Any]:
    """The numbers of one :class:`~xpress.decoding.Generation` that the tables use: tokens, target steps
    (tau = tokens / steps), wall ``seconds`` of the call, seconds per stage summed over its timed steps
    (AR: ``forward``, ``bookkeeping``; speculative: ``draft``, ``refine``, ``verify``, ``bookkeeping``),
    ``timed_steps`` (steps with a stage record: AR's first token comes out of the prefill), the mean
    Jacobi iterations where the drafter reports them and, for ``decode.draft_tokens=auto``, the mean drafts
    a round verified (``mean_draft_k``)."""
    stages = g.stage_totals()
    iters = _flat(g.stats.get("iters", []))
    ks = _flat(g.stats.get("draft_k", []))  # decode.draft_tokens=auto: the drafts each round verified
    return {"tokens": len(g.token_ids), "steps": g.n_steps, "seconds": seconds, "prefill_s": g.prefill_s,
            **{f"{k}_s": stages.get(k, 0.0) for k in ("forward", "draft", "refine", "verify", "bookkeeping")},
            "timed_steps": len(next(iter(g.step_times.values()), [])),
            "mean_iters": sum(iters) / len(iters) if iters else None,
            **({"mean_draft_k": sum(ks) / len(ks)} if ks else {})}


def prompt_generator(device, seed: int, index: int):
    """The generator for prompt ``index`` under ``seed`` (T > 0): every method and every repeat of a
    prompt starts from the same state, so repeats decode the same tokens and only the clock differs."""
    import torch

    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


def warm_up(target, drafters: Mapping[str, Any], prompt_ids: Sequence[int], temperature: float = 0.0) -> None:
    """Decode a few tokens with every method (allocator, kernels) before anything is timed."""
    from ..decoding import generate_batch

    for d in drafters.values():
        generate_batch(target, d, [list(prompt_ids)], 4, temperature, prompt_generator(target.device, 0, 0))


def decode_interleaved(target, drafters: Mapping[str, Any], prompts: Sequence[dict], max_new_tokens: int,
                       temperature: float = 0.0, seed: int = 0, repeats: int = 1, progress: bool = True,
                       desc: str = "decode", indices: Sequence[int] | None = None) -> list[dict]:
    """Decode every prompt (batch 1) with every method of ``drafters`` (``"ar"``: None, first), in the
    order prompt -> repeat -> method, so that a slow phase of the machine hits all methods alike.
    ``indices``: each prompt's place in the full list (its T > 0 generator, :func:`prompt_generator`),
    when ``prompts`` is one process's share of it (default ``0, 1, ...``).

    Returns one row per (prompt, repeat, method): ``{"temperature", "seed", "repeat", "bench", "id",
    "method", "lossless", **generation_row}``. ``lossless``: at T = 0 whether the output equals AR's token
    for token; None at T > 0 (losslessness is then distributional; notebook 04 tests it).
    """
    from tqdm.auto import tqdm

    from ..decoding import generate_batch

    if next(iter(drafters), None) != AR:
        raise ValueError(f"drafters must start with {AR!r} (the reference every output is checked against); "
                         f"got {list(drafters)}")
    rows: list[dict] = []
    indices = range(len(prompts)) if indices is None else indices
    bar = tqdm(total=len(prompts) * repeats * len(drafters), desc=desc, unit="run", disable=not progress)
    for i, p in zip(indices, prompts):
        for r in range(repeats):
            ar_tokens = None
            for m, d in drafters.items():
                gen = prompt_generator(target.device, seed, i) if temperature > 0 else None
                t0 = time.perf_counter()
                g = generate_batch(target, d, [p["ids"]], max_new_tokens, temperature, gen)[0]
                seconds = time.perf_counter() - t0
                ar_tokens = g.token_ids if m == AR else ar_tokens
                lossless = (g.token_ids == ar_tokens) if temperature == 0 else None
                rows.append({"temperature": temperature, "seed": seed, "repeat": r, "bench": p["bench"],
                             "id": p["id"], "method": m, "lossless": lossless, **generation_row(g, seconds)})
                bar.update(1)
                bar.set_postfix(bench=p["bench"], method=m, tau=f"{g.tau:.2f}")
    bar.close()
    return rows


def prompt_order(prompts: Sequence[dict]) -> dict[tuple[str, str], int]:
    """``{(bench, id): place}`` of each prompt in ``prompts``: the key that merges the rows of several
    processes back into the one-process order (:func:`xpress.distributed.gather_ordered`)."""
    return {(p["bench"], p["id"]): i for i, p in enumerate(prompts)}


def agree_on_study(cfg: Config, prompts: Sequence[dict], **settings: Any) -> None:
    """Several processes: stop every rank with one line unless all hold the same config, study settings
    and prompts (:func:`xpress.distributed.agree`); nothing for one process."""
    from .. import distributed

    distributed.agree("config hash", {"config": cfg.to_dict(), **settings},
                      "launch every rank with the same --preset and overrides")
    distributed.agree("prompts hash", [[p["bench"], p["id"], p["ids"]] for p in prompts],
                      "give every rank the same data/ and tokenizer (XPRESS_DATA, the same package versions)")


def study_main(argv: Sequence[str] | None, prog: str, doc: str, example: str, body, add_args=None) -> int:
    """A study's command line: :func:`study_cli`, inside the launcher's process group when started by
    ``torchrun`` / ``accelerate launch`` (:func:`xpress.distributed.session`); ``body(cfg, target, args)``
    returns the exit code (it prints on rank 0 only). Ranks that disagree or die: one line, exit 2.
    ``add_args(parser)``: the study's own options."""
    import sys

    from .. import distributed

    try:
        with distributed.session():
            cfg, target, args = study_cli(argv, prog, doc, example, add_args)
            return body(cfg, target, args)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def study_cli(argv: Sequence[str] | None, prog: str, doc: str, example: str, add_args=None):
    """The shared command line of the studies (``--preset``, ``--no-progress``, config overrides, and what
    ``add_args(parser)`` adds): parses ``argv``, seeds, loads the target -> (cfg, target, args)."""
    import argparse

    from ..config import load_config
    from ..targets import load_target
    from ..utils import seed_everything

    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help=f"config overrides key=value ({example}, ...)")
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.preset, args.overrides)
    seed_everything(cfg.seed)
    return cfg, load_target(cfg), args
