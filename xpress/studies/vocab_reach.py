"""How much of the target's answers a draft vocabulary can reach:
``python -m xpress.studies.vocab_reach --preset cpu``.

The drafter reads out over the ``drafter.draft_vocab_size`` most frequent tokens of the regenerated training
answers (:meth:`xpress.vocab.DraftVocab.from_counts`, EOS always in; 0 = the whole target vocabulary). A token
outside it can never be drafted, so each one in an answer ends a decoding round: at tau tokens a round, a share
``outside x tau`` of the rounds end on one. For each size this study counts, on the regenerated answers (no
target forward):

- ``val_coverage`` / ``train_coverage``: the share of the validation / training answer tokens inside it;
- of the validation tokens outside it, ``outside_seen_before``: the share that already occurs earlier in its
  own sequence (prompt or answer so far: a name, a number, an identifier that a drafter reading the target's
  states could copy) and ``outside_in_prompt``, the share in the prompt;
- ``outside_bigram`` / ``inside_bigram``: the share that the training answers' most frequent successor of the
  token before it predicts (what the data teach with one token of context), outside and inside.

Writes ``results/<preset>/vocab_reach.{json,csv}``.
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any, Sequence

import torch

from .. import paths
from ..train.regenerate import answer_token_counts
from ..vocab import DraftVocab

Sequences = Sequence[tuple[Sequence[int], int]]  # (token ids of prompt + answer, prompt length)


def _share(hits: int, n: int) -> float | None:
    return hits / n if n else None


def vocabulary_reach(train: Sequences, val: Sequences, vocab_size: int, sizes: Sequence[int],
                     always: Sequence[int] = ()) -> list[dict[str, Any]]:
    """One row per draft vocabulary size in ``sizes`` (0: the whole vocabulary), chosen from ``train``'s answer
    counts as training chooses it, scored on ``val``'s answers (module docstring)."""
    train_counts = answer_token_counts(train, vocab_size)
    successors: dict[int, Counter] = defaultdict(Counter)  # token -> its successors in the training answers
    for ids, p in train:
        for a, b in zip(ids[max(p, 1) - 1:-1], ids[max(p, 1):]):
            successors[a][b] += 1
    bigram = {a: c.most_common(1)[0][0] for a, c in successors.items()}
    tokens = []  # per validation answer token: (id, seen earlier in its sequence, in its prompt, bigram right)
    for ids, p in val:
        prompt, before = set(ids[:p]), set(ids[:max(p, 1)])
        for t in range(max(p, 1), len(ids)):
            tokens.append((ids[t], ids[t] in before, ids[t] in prompt, bigram.get(ids[t - 1]) == ids[t]))
            before.add(ids[t])
    rows = []
    for size in sizes:
        vocab = DraftVocab.full(vocab_size) if size == 0 else DraftVocab.from_counts(train_counts, size, always)
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[vocab.d2t] = True
        out = [x for x in tokens if not inside[x[0]]]
        ins = [x for x in tokens if inside[x[0]]]
        rows.append({"draft_vocab_size": vocab.size, "val_tokens": len(tokens), "val_outside": len(out),
                     "val_coverage": _share(len(ins), len(tokens)),
                     "train_coverage": _share(int(train_counts[inside].sum()), int(train_counts.sum())),
                     "outside_seen_before": _share(sum(x[1] for x in out), len(out)),
                     "outside_in_prompt": _share(sum(x[2] for x in out), len(out)),
                     "outside_bigram": _share(sum(x[3] for x in out), len(out)),
                     "inside_bigram": _share(sum(x[3] for x in ins), len(ins))})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from ..config import load_config
    from ..targets import load_target
    from ..train.regenerate import RegenData
    from ..utils import provenance, write_result

    parser = argparse.ArgumentParser(prog="python -m xpress.studies.vocab_reach", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 0],
                        help="draft vocabulary sizes, 0 = the whole target vocabulary (default 2048 4096 8192 16384 0)")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = parser.parse_args(argv)
    if min(args.sizes) < 0:
        parser.error("--sizes must be 0 (the whole vocabulary) or positive")
    cfg = load_config(args.preset, args.overrides)
    target = load_target(cfg)  # its vocabulary size and EOS ids only
    if max(args.sizes) > target.vocab_size:
        parser.error(f"--sizes: {target.name} has {target.vocab_size} tokens; pass sizes up to that, or 0")
    data = RegenData.load(cfg)
    split = {s: [(data.input_ids[i], data.prompt_len[i]) for i in data.indices(s)] for s in ("train", "val")}
    rows = vocabulary_reach(split["train"], split["val"], target.vocab_size, args.sizes, target.eos_token_ids)
    result = {"what": "the share of the regenerated answers' tokens each draft vocabulary reaches, and of the "
                      "validation tokens outside it, how many occur earlier in their sequence or follow from a "
                      "training bigram", "preset": cfg.preset, "target": target.name,
              "train_sequences": len(split["train"]), "val_sequences": len(split["val"]),
              "train_tokens": int(data.answer_tokens(data.indices("train"))), "table": rows,
              "command": " ".join(["python -m xpress.studies.vocab_reach",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "data_manifest": {k: (data.manifest or {}).get(k) for k in ("config_hash", "sequences", "response_tokens")},
              "provenance": provenance(cfg.preset)}
    write_result(paths.RESULTS / cfg.preset, "vocab_reach", result, rows)
    for r in rows:
        print(f"draft vocabulary {r['draft_vocab_size']:6d}: validation coverage {r['val_coverage']:.3f} "
              f"(training {r['train_coverage']:.3f}); of the {r['val_outside']} outside, "
              + ("-" if not r["val_outside"] else f"{r['outside_seen_before']:.2f} seen earlier in their sequence, "
                 f"{r['outside_bigram']:.2f} a training bigram's guess (inside: {r['inside_bigram']:.2f})"))
    print(f"wrote {paths.RESULTS / cfg.preset / 'vocab_reach.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
