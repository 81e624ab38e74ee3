"""Teacher forcing against decoding, at the same anchors: ``python -m xpress.studies.anchor_bias --preset cpu``.

Training scores a drafter teacher-forced at random anchors (``val_tf_tau``: blocks of ``B - 1`` drafts);
decoding scores it by what the verify accepts. On the cpu preset the two differ by far (2.2 against 1.8
held out), and a gap that size could hide a mismatch between the two paths (the context a round sees,
the positions, the refiner's inputs). This study separates the parts. For each method and each drafted
length ``k`` it decodes the first ``n`` validation prompts at T = 0 (batch 1) for as many tokens as their
regenerated answers hold, which makes the output those answers (the regenerated text is the target's own
greedy decode; checked), and records each round's anchor and its accepted drafts. Then, on the same
sequences:

- ``tf_tau_decode_anchors``: teacher-forced acceptance (:func:`xpress.train.loop.accepted_at`) at the anchors
  decoding used; ``agreement``, the fraction of rounds where it equals decoding's count. Equal (up to
  reduced-precision near-ties) is the check that training and inference compute the same thing;
- ``tf_tau_every_anchor``: the same at every position of the answers, which is what random anchors estimate.
  The difference to the line above is where decoding puts its anchors: right after a rejected draft, which
  is where drafting is hard.

So ``val_tf_tau`` = (the cap at ``k`` drafts) + (the anchors' selection) + ``tau`` by decoding, each part
measured. Rounds whose ``k`` drafts would pass the end of the answer are left out of both. Writes
``results/<preset>/anchor_bias.{json,csv}``.

    from xpress.studies.anchor_bias import run_anchor_bias
    result = run_anchor_bias(cfg, target, ks=(3, 7), n_prompts=16)
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from .. import paths
from ..config import Config
from .compare import AR, LoadRecord, fingerprints_of, make_drafters, study_main
from .draft_length import at_lengths


def decode_anchors(target, drafter, prompt: Sequence[int], answer: Sequence[int]) -> tuple[list[int], list[int], bool]:
    """Greedy speculative decoding of ``prompt`` for ``len(answer)`` tokens -> (each round's anchor position
    in prompt + answer, each round's accepted drafts before truncation, whether the output equals ``answer``).
    A round's anchor is the last committed token: the prompt's last, then each round's correction."""
    from ..decoding import generate_speculative

    g = generate_speculative(target, drafter, list(prompt), len(answer))
    anchors, pos = [], len(prompt) - 1
    for committed in g.accept_lengths:
        anchors.append(pos)
        pos += committed
    return anchors, [a - 1 for a in g.draft_accepts], g.token_ids == list(answer)


def run_anchor_bias(cfg: Config, target, methods: Sequence[str] | None = None, ks: Sequence[int] = (0,),
                    n_prompts: int = 16, progress: bool = True, save: bool = True, untrained_ok: bool = False,
                    split: str = "val") -> dict[str, Any]:
    """Per (method, k): decoding's tau against teacher forcing at its anchors and at every anchor (module
    docstring); ``k = 0`` means ``B - 1``; ``split``: the first ``n_prompts`` sequences of the validation
    split, or of ``"train"`` (sequences the drafters were trained on). Writes
    ``results/<preset>/anchor_bias.{json,csv}`` when ``save``."""
    import torch
    from tqdm.auto import tqdm

    from ..train.loop import CoTrainer, accepted_at
    from ..train.regenerate import RegenData
    from ..utils import provenance, write_result

    methods = [m for m in (methods or cfg.eval.methods) if m != AR]
    prov = provenance(cfg.preset, torch_threads=torch.get_num_threads())
    load = LoadRecord.start()
    t0 = time.perf_counter()
    data = RegenData.load(cfg)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: use 'val' (held-out answers) or 'train'")
    rows = data.indices(split)[:n_prompts]
    if not rows:
        raise ValueError(f"no {split} sequences in {data.folder}: regenerate with data.n_{split}_prompts > 0")
    loaded = make_drafters(cfg, target, methods, untrained_ok)
    drafters = {name: d for name, d in at_lengths(loaded, ks).items() if d is not None}
    states = None if data.has_states else target
    by_method: dict[str, list] = {}  # a method's drafters at each k share one network
    for name, d in drafters.items():
        by_method.setdefault(name.split(" k=")[0], []).append(d)
    table = []
    bar = tqdm(total=len(drafters) * len(rows), desc="anchor bias", disable=not progress)
    for method, at_k in by_method.items():
        module = CoTrainer(at_k[0].drafter, at_k[0].head, at_k[0].vocab)
        most = max(d.draft_tokens for d in at_k)
        runs = {d.draft_tokens: ([], [], [], []) for d in at_k}  # k -> decoded, teacher-forced, every anchor, same
        for i in rows:
            seq, p = data.input_ids[i], data.prompt_len[i]
            end = min(len(seq), cfg.train.max_len)  # training's window
            # one teacher-forced pass for every k: anchor p - 1 + j at index j; accepted drafts of the first k
            # are min(accepted of the first `most`, k), the labels being valid through a + k < end
            forced = accepted_at(module, data, cfg, i, list(range(p - 1, end - 1)), most, states)
            for d in at_k:
                k = d.draft_tokens
                dec, tf, every, same = runs[k]
                anchors, counts, same_text = decode_anchors(target, d, seq[:p], seq[p:end])
                kept = [(a, c) for a, c in zip(anchors, counts) if a + k < end]
                dec += [c for _, c in kept]
                tf += [min(int(forced[a - p + 1]), k) for a, _ in kept]
                every += forced[:end - k - p + 1].clamp_max(k).tolist()
                same.append(same_text)
                bar.update()
        for k, (dec, tf, every, same) in runs.items():
            n = max(1, len(dec))
            table.append({"method": method, "k": k, "prompts": len(rows), "rounds": len(dec),
                          "decode_tau": 1 + sum(dec) / n, "tf_tau_decode_anchors": 1 + sum(tf) / n,
                          "agreement": sum(a == b for a, b in zip(dec, tf)) / n,
                          "tf_tau_every_anchor": 1 + sum(every) / max(1, len(every)), "anchors": len(every),
                          "output_is_regenerated": all(same)})
    bar.close()
    result = {"what": "tau by decoding (T = 0, batch 1, the validation prompts' regenerated answers) against "
                      "teacher-forced acceptance at decoding's own anchors and at every anchor, per method and k",
              "preset": cfg.preset, "target": target.name, "block_size": cfg.drafter.block_size,
              "methods": methods, "fingerprints": fingerprints_of(loaded), "split": split, "n_prompts": len(rows),
              "table": table, "warnings": load.stop(),
              "seconds": time.perf_counter() - t0,
              "command": f"python -m xpress.studies.anchor_bias --preset {cfg.preset} --prompts {n_prompts} "
                         f"--draft-tokens {' '.join(str(k) for k in ks)}",
              "provenance": {**prov, **load.provenance()}}
    if save:
        write_result(paths.RESULTS / cfg.preset, "anchor_bias", result, table)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    def options(parser) -> None:
        parser.add_argument("--prompts", type=int, default=16, help="validation prompts decoded (default 16)")
        parser.add_argument("--draft-tokens", type=int, nargs="+", default=[0],
                            help="drafted tokens a round verifies, each a row (0: B - 1; default 0)")

    return study_main(argv, "python -m xpress.studies.anchor_bias", __doc__, "eval.methods=[xpress]", _main, options)


def _main(cfg: Config, target, args) -> int:
    if args.prompts < 1 or any(not 0 <= k < cfg.drafter.block_size for k in args.draft_tokens):
        print(f"error: --prompts must be at least 1 and each --draft-tokens in 0..{cfg.drafter.block_size - 1} "
              f"(0: all {cfg.drafter.block_size - 1})", file=sys.stderr)
        return 2
    result = run_anchor_bias(cfg, target, ks=args.draft_tokens, n_prompts=args.prompts,
                             untrained_ok=cfg.target.source == "random", progress=not args.no_progress)
    for r in result["table"]:
        print(f"{r['method']:>7} k={r['k']}: tau by decoding {r['decode_tau']:.3f} over {r['rounds']} rounds; "
              f"teacher-forced at those anchors {r['tf_tau_decode_anchors']:.3f} (agreement {r['agreement']:.3f}), "
              f"at every anchor {r['tf_tau_every_anchor']:.3f}")
    print(f"wrote {paths.RESULTS / cfg.preset / 'anchor_bias.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
