"""Regeneration: the target answers the training prompts itself, so the drafter learns the distribution
it must predict at inference (the dFlash / SpecForge recipe: greedy, T = 0, chat template, thinking off).

    python -m xpress regenerate --preset cpu       # data/cpu/regen/
    torchrun --nproc_per_node N -m xpress regenerate --preset cpu     # the shards split over N processes
    accelerate launch -m xpress regenerate --preset cpu               # the same under accelerate

Prompts come from :func:`xpress.data.training_prompts` (``data.train_sources``: GSM8K train, MATH train,
ShareGPT first turns and Python tasks in equal parts; benchmark questions excluded). The last
``data.n_val_prompts`` of them form the validation split, never trained on. Prompts longer than
``data.regen_max_prompt_tokens`` (at most ``train.max_len - data.regen_max_new_tokens``) tokens are skipped,
so that answers fit a training window; the manifest counts them.

Generation (``data.regen_engine``, :func:`regen_engine`) runs, where the target runs the fused CPU kernels,
with continuous batching (:func:`xpress.continuous.generate_greedy`: each sequence in its own cache row, a
finished row refilled at once, every answer bit for bit its batch-1 greedy decode whatever the batch), else
through the decoding engine's ragged batches (:func:`xpress.decoding.generate_ar_batch`). With
``data.cache_features`` the target's states are captured *during* that generation (the continuous engine
keeps them per sequence; for ragged batches forward hooks or the lean runtime's record,
:func:`capture_target_states`), so training never runs the target:

- ``features`` [T, F] float16: the drafter's context feature of every token (the selected layers'
  outputs, concatenated; :func:`xpress.targets.target_forward` computes the same);
- ``hidden`` [T, H] float16: the target's final-normed hidden state (what its ``lm_head`` reads), and
- ``lse`` [T] float32: ``logsumexp`` of the target's logits there (NaN inside the prompt),

so the target distribution of token ``t`` over any draft vocabulary is
``exp(lm_head.weight[d2t] @ hidden[t-1] - lse[t-1])``: exact, without storing [T, V] probabilities. The
final token's row is zero (it is never fed). Disk cost per token: ``2F + 2H + 4`` bytes (SmolLM2 with 5
feature layers: 6,916 bytes).

``data.regen_engine: server`` sends the prompts to an OpenAI-compatible server instead (vLLM, SGLang, or
llama.cpp's on a CPU; ``data.regen_url``, :mod:`xpress.serving`): greedy, the chat-templated prompt as token ids
to ``/v1/completions``, the answer's token ids back, ``data.regen_batch_size`` requests in flight. It stores no
states (``data.cache_features: false``: the trainer runs the target), and the same shards and manifest; each
row also holds the served model and how many of its answer tokens the target, teacher-forced over the served
sequence, chooses too (every ``data.regen_check_every``-th prompt): the manifest's ``served_agreement``, per
token and per answer, measures how far the server's weights and kernels (llama.cpp's Q4_1 file, say) are from
the target xPress trains against.

On disk, ``data/<preset>/regen/``: shards ``shard-00000/`` ... each written in one atomic rename, holding
``rows/`` (a ``datasets`` Arrow table: id, split, input_ids, loss_mask, prompt_len, finish_reason,
offset; the server engine's also served_model, served_agree) and ``features.npy``, ``hidden.npy``, ``lse.npy``
(rows of all its sequences, one after another, from ``offset``; none without ``data.cache_features``).
``manifest.json`` is written last: its presence with a matching config hash means the data are complete. An interrupted run (Ctrl-C, kill) keeps every finished shard; rerun, it regenerates
only the missing ones (deterministic: the same prompts in the same shards), so no record is lost or
duplicated; a complete run rerun does nothing. Under a launcher (:mod:`xpress.distributed`) each rank
generates its share of the missing shards and rank 0 writes the manifest when all exist; the shards are
the same whatever the number of processes (see :func:`regenerate`).
"""
from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from .. import paths
from ..config import Config

MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class RegenerationError(RuntimeError):
    """Regenerated data that are missing, incomplete or made for another config; the message says how
    to fix it."""


def regen_dir(cfg: Config) -> Path:
    """``data/<preset>/regen``."""
    return paths.DATA / cfg.preset / "regen"


def compute_dtype(cfg: Config) -> str:
    """The dtype the preset's target computes in on this machine (``target.dtype``, ``auto`` resolved by
    :func:`xpress.runtime.resolve_dtype`), e.g. ``"bfloat16"``. Greedy answers depend on it, so it is part
    of :func:`regen_signature`: data regenerated in bf16 on one CPU are stale on a CPU that runs the target
    in float32, as the benchmarks there verify with the float32 target."""
    from ..runtime import resolve_dtype

    return str(resolve_dtype(cfg.target.dtype)).removeprefix("torch.")


def regen_signature(cfg: Config) -> dict[str, Any]:
    """Everything that changes what regeneration writes (the config hash is taken over this)."""
    from ..targets import planned_runtime

    t, d = cfg.target, cfg.data
    return {"target": {"source": t.source, "model": t.model, "gguf_package": t.gguf_package, "dtype": t.dtype,
                       "compute_dtype": compute_dtype(cfg), "runtime": planned_runtime(t),
                       **({"random": [t.random_layers, t.random_hidden, t.random_heads, t.random_kv_heads,
                                      t.random_intermediate, t.random_init_std]} if t.source == "random" else {})},
            "seed": cfg.seed, "num_target_features": cfg.drafter.num_target_features,
            "n_train_prompts": d.n_train_prompts, "n_val_prompts": d.n_val_prompts,
            "train_sources": list(d.train_sources),
            "regen_max_new_tokens": d.regen_max_new_tokens, "max_prompt_tokens": max_prompt_tokens(cfg),
            "regen_shard_size": d.regen_shard_size, "cache_features": d.cache_features,
            # served answers are another engine's (the server's weights and kernels): other data
            **({"engine": "server"} if d.regen_engine == "server" else {})}


def config_hash(signature: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def max_prompt_tokens(cfg: Config) -> int:
    """Longer prompts are skipped: ``data.regen_max_prompt_tokens``, capped so that a prompt and its
    answer fit one training window (``train.max_len``)."""
    return max(1, min(cfg.data.regen_max_prompt_tokens, cfg.train.max_len - cfg.data.regen_max_new_tokens))


# ----------------------------------------------------------------------------------------------- capture
@dataclass
class _Call:
    features: torch.Tensor  # [b, n, F] float16
    hidden: torch.Tensor  # [b, n, H] float16
    lse: torch.Tensor  # [b] float32, at the last input position (the only logits the engine keeps)


@contextmanager
def capture_target_states(target) -> Iterator[list[_Call]]:
    """Record, for every forward of the target inside the block, the selected layers' outputs
    (the drafter features), the final-normed hidden state and the logsumexp of the kept logits.

    Yields the list the calls are appended to, one :class:`_Call` per forward (in order; with the lean
    runtime the list is filled when the block ends). Hooks on the transformers model, or the lean
    runtime's own record, not a second forward: the engine's generation forwards are observed, at no
    extra target cost.
    """
    calls: list[_Call] = []
    lean = getattr(target, "runtime", None)
    if lean is not None:  # the lean runtime records its own forwards (xpress.runtime.LeanModel.capture)
        lean.capture, lean.capture_layers = [], list(target.layer_ids)
        try:
            yield calls
        finally:
            records, lean.capture = lean.capture, None
            for feats, hidden, logits in records:
                calls.append(_Call(feats.to(torch.float16), hidden.to(torch.float16),
                                   torch.logsumexp(logits[:, -1].float(), dim=-1)))
        return
    decoder = target.model.get_decoder()
    layers = list(decoder.layers)
    wanted = {i: None for i in target.layer_ids}
    state: dict[str, Any] = {}

    def on_layer(i):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            state[i] = out.detach().to(torch.float16)
        return hook

    def on_norm(_module, _inputs, output):
        state["hidden"] = output.detach().to(torch.float16)

    def on_head(_module, _inputs, output):
        lse = torch.logsumexp(output[:, -1].float(), dim=-1)  # [b]
        feats = torch.cat([state.pop(i) for i in wanted], dim=-1)
        calls.append(_Call(feats, state.pop("hidden"), lse))

    handles = [layers[i].register_forward_hook(on_layer(i)) for i in wanted]
    handles.append(decoder.norm.register_forward_hook(on_norm))
    handles.append(target.model.get_output_embeddings().register_forward_hook(on_head))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def assemble_rows(calls: Sequence[_Call], prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]]
                  ) -> list[dict[str, np.ndarray]]:
    """Per sequence ``prompt + generated`` (T tokens), the captured ``features`` [T, F], ``hidden``
    [T, H] and ``lse`` [T] from the calls of one :func:`~xpress.decoding.generate_ar_batch` run: call 0
    is the left-padded prefill of the whole prompts, call ``1 + j`` feeds generated token ``j`` of every
    row (finished rows keep being fed). The last token of a sequence is never fed: its row is zero."""
    prefill = calls[0]
    L = prefill.features.shape[1]
    out = []
    for i, (p, g) in enumerate(zip(prompts, generated)):
        n_p, n_g = len(p), len(g)
        T = n_p + n_g
        steps = calls[1:n_g]  # generated tokens 0 .. n_g - 2 were fed
        feats = [prefill.features[i, L - n_p:]] + [c.features[i] for c in steps]
        hidden = [prefill.hidden[i, L - n_p:]] + [c.hidden[i] for c in steps]
        lse = np.full(T, np.nan, dtype=np.float32)
        lse[n_p - 1] = float(prefill.lse[i])
        for j, c in enumerate(steps):
            lse[n_p + j] = float(c.lse[i])
        f, h = torch.cat(feats).numpy(), torch.cat(hidden).numpy()
        out.append({"features": np.concatenate([f, np.zeros((1, f.shape[1]), f.dtype)]),
                    "hidden": np.concatenate([h, np.zeros((1, h.shape[1]), h.dtype)]), "lse": lse})
    return out


# ------------------------------------------------------------------------------------------ regeneration
def _prompts(cfg: Config, tokenizer) -> tuple[list[dict], int]:
    """The regeneration prompts (train, then val) with their token ids; and how many were too long."""
    from ..data import training_prompts
    from ..targets import encode_chat

    n_train, n_val = cfg.data.n_train_prompts, cfg.data.n_val_prompts
    limit = max_prompt_tokens(cfg)
    # draw more than needed so that skipped (too long) prompts are replaced, deterministically; where a short
    # prompt limit skips more than that (the code prompts' docstrings are long), draw twice as many, and so on
    want, factor = n_train + n_val, 1.25
    encoded: dict[str, list[int]] = {}  # prompt id -> token ids, kept across draws
    while True:
        size = int(want * factor) + 8
        pool = training_prompts(size, seed=cfg.seed, sources=cfg.data.train_sources)
        kept, skipped = [], 0
        for rec in pool:
            if rec["id"] not in encoded:
                encoded[rec["id"]] = encode_chat(tokenizer, rec["turns"][:1])
            ids = encoded[rec["id"]]
            if len(ids) > limit:
                skipped += 1
                continue
            kept.append({**rec, "prompt_ids": ids})
            if len(kept) == want:
                break
        if len(kept) == want or len(pool) < size:  # enough, or every prompt there is was drawn
            break
        factor *= 2
    for i, rec in enumerate(kept):
        rec["split"] = "train" if i < min(n_train, len(kept) - n_val) else "val"
    return kept, skipped


def regen_engine(cfg: Config, target) -> str:
    """The engine ``data.regen_engine`` resolves to for ``target``: ``continuous`` (:mod:`xpress.continuous`,
    where the target runs the fused CPU kernels), ``batched`` (left-padded ragged batches through
    :func:`~xpress.decoding.generate_ar_batch`) or ``server`` (an OpenAI-compatible server, :mod:`xpress.serving`;
    chosen only by name)."""
    from ..continuous import available

    engine = cfg.data.regen_engine
    if engine == "server":
        return engine
    if engine == "auto":
        return "continuous" if available(target) else "batched"
    if engine == "continuous" and not available(target):
        raise RegenerationError("data.regen_engine=continuous needs the lean runtime on the fused CPU kernels (a "
                                "Llama target; float32 on AVX2, bf16 with AMX or AVX512-BF16); set data.regen_engine=auto or batched")
    return engine


def _shard_results(target, cfg: Config, shards: dict[int, list[dict]], client=None
                   ) -> Iterator[tuple[int, dict[str, list], dict[str, np.ndarray]]]:
    """``(shard index, table, arrays)`` for each of ``shards`` (index -> records) as it is complete.

    ``batched``: shard by shard, in ragged batches of prompts of similar length. ``continuous``: the prompts
    of every shard in one stream (shard order), so that the batch stays full across shard boundaries; a
    shard is yielded once its last answer is in. ``server``: the same stream through ``client``
    (:func:`_served_shards`)."""
    engine = regen_engine(cfg, target)
    if engine == "server":
        yield from _served_shards(target, cfg, shards, client)
        return
    if engine == "batched":
        for i, records in shards.items():
            yield i, *_generate_shard(target, cfg, records)
        return
    from ..continuous import generate_greedy

    flat = [(i, j) for i, records in shards.items() for j in range(len(records))]
    results: dict[int, dict[int, tuple]] = {i: {} for i in shards}
    layers = list(target.layer_ids) if cfg.data.cache_features else None
    for f in generate_greedy(target, [shards[i][j]["prompt_ids"] for i, j in flat], cfg.data.regen_max_new_tokens,
                             cfg.data.regen_batch_size, capture_layers=layers):
        i, j = flat[f.index]
        states = {"features": f.features, "hidden": f.hidden, "lse": f.lse} if layers is not None else None
        results[i][j] = (f.token_ids, f.finish_reason, states)
        if len(results[i]) == len(shards[i]):
            yield i, *_shard_table(shards[i], results.pop(i))


def server_client(cfg: Config, target):
    """The :class:`xpress.serving.Client` of ``data.regen_url``, with the target's EOS ids as stop tokens and its
    tokenizer for a server that returns text (llama.cpp)."""
    from ..serving import Client

    tok = target.tokenizer
    return Client(cfg.data.regen_url, list(target.eos_token_ids),
                  lambda text: tok(text, add_special_tokens=False)["input_ids"])


def agreeing_tokens(target, ids: Sequence[int], prompt_len: int) -> int:
    """How many answer tokens of ``ids`` (prompt + answer) are the target's argmax teacher-forced over them:
    one forward of [1, T]."""
    from ..targets import target_forward

    x = torch.tensor([list(ids)])                                          # [1, T]
    with torch.inference_mode():
        logits = target_forward(target, x).logits[0, prompt_len - 1:-1]  # [T - P, V]: predicts ids[P:]
    return int((logits.argmax(-1) == x[0, prompt_len:]).sum())


def _served_shards(target, cfg: Config, shards: dict[int, list[dict]], client
                   ) -> Iterator[tuple[int, dict[str, list], dict[str, np.ndarray]]]:
    """The server engine: every shard's prompts (chat-templated ids, and the template's text for a server that
    takes text) in one stream of ``data.regen_batch_size`` concurrent requests; a shard is yielded once its last
    answer is in, its table holding, per row, the served model and ``served_agree``: the answer tokens where the
    target teacher-forced over the served sequence chooses the served token (:func:`agreeing_tokens`; every
    ``data.regen_check_every``-th prompt, -1 for the others)."""
    from ..serving import generate_served
    from ..targets import format_chat

    size, every = cfg.data.regen_shard_size, cfg.data.regen_check_every
    flat = [(i, j) for i, records in shards.items() for j in range(len(records))]
    prompts = [(shards[i][j]["prompt_ids"], format_chat(target.tokenizer, shards[i][j]["turns"][:1])) for i, j in flat]
    results: dict[int, dict[int, tuple]] = {i: {} for i in shards}
    for f in generate_served(client, prompts, cfg.data.regen_max_new_tokens, cfg.data.regen_batch_size):
        i, j = flat[f.index]
        results[i][j] = (f.token_ids, f.finish_reason, None)
        if len(results[i]) < len(shards[i]):
            continue
        table, arrays = _shard_table(shards[i], results.pop(i))
        table["served_model"] = [client.model] * len(shards[i])
        table["served_agree"] = [agreeing_tokens(target, ids, p) if every and (i * size + j) % every == 0 else -1
                                 for j, (ids, p) in enumerate(zip(table["input_ids"], table["prompt_len"]))]
        yield i, table, arrays


def served_agreement(data: "RegenData") -> dict[str, Any] | None:
    """The manifest's measure of how often the served answers agree with the target teacher-forced over them
    (the server computes on its own weights and kernels: llama.cpp on the Q4_1 file, vLLM on its kernels): per
    token and per answer that agrees fully, over the checked answers; None for data of another engine."""
    checked = [i for i, a in enumerate(data.served_agree) if a is not None and a >= 0]
    if not any(a is not None for a in data.served_agree):
        return None
    tokens = data.answer_tokens(checked)
    agree = sum(data.served_agree[i] for i in checked)
    full = sum(data.served_agree[i] == len(data.input_ids[i]) - data.prompt_len[i] for i in checked)
    return {"checked_answers": len(checked), "checked_tokens": tokens, "agreeing_tokens": agree,
            "per_token": agree / tokens if tokens else None, "answers_fully_agreeing": full,
            "per_answer": full / len(checked) if checked else None,
            "served_models": sorted({m for m in data.served_model if m is not None})}


def _generate_shard(target, cfg: Config, records: list[dict]) -> tuple[dict[str, list], dict[str, np.ndarray]]:
    """Regenerate one shard's prompts in ragged batches (prompts of similar length together)."""
    from ..decoding import generate_ar_batch

    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_ids"]))
    results: dict[int, tuple[list[int], str, dict | None]] = {}
    bs = cfg.data.regen_batch_size
    for start in range(0, len(order), bs):
        idx = order[start:start + bs]
        prompts = [records[i]["prompt_ids"] for i in idx]
        if cfg.data.cache_features:
            with capture_target_states(target) as calls:
                gens = generate_ar_batch(target, prompts, cfg.data.regen_max_new_tokens)
            rows = assemble_rows(calls, prompts, [g.token_ids for g in gens])
        else:
            gens = generate_ar_batch(target, prompts, cfg.data.regen_max_new_tokens)
            rows = [None] * len(gens)
        for i, g, r in zip(idx, gens, rows):
            results[i] = (g.token_ids, g.finish_reason, r)
    return _shard_table(records, results)


def _shard_table(records: list[dict], results: dict[int, tuple[list[int], str, dict | None]]
                 ) -> tuple[dict[str, list], dict[str, np.ndarray]]:
    """A shard's table (one row per record, in order) and its stacked captured states, from ``results``:
    record index -> (answer tokens, finish reason, captured states or None)."""
    table: dict[str, list] = {k: [] for k in ("id", "split", "input_ids", "loss_mask", "prompt_len",
                                              "finish_reason", "offset")}
    arrays: dict[str, list[np.ndarray]] = {"features": [], "hidden": [], "lse": []}
    offset = 0
    for i, rec in enumerate(records):
        gen, reason, r = results[i]
        p = rec["prompt_ids"]
        table["id"].append(rec["id"])
        table["split"].append(rec["split"])
        table["input_ids"].append(list(p) + list(gen))
        table["loss_mask"].append([0] * len(p) + [1] * len(gen))
        table["prompt_len"].append(len(p))
        table["finish_reason"].append(reason)
        table["offset"].append(offset)
        offset += len(p) + len(gen)
        if r is not None:
            for k in arrays:
                arrays[k].append(r[k])
    stacked = {k: np.concatenate(v) for k, v in arrays.items() if v}
    return table, stacked


def _write_shard(folder: Path, table: dict[str, list], arrays: dict[str, np.ndarray]) -> None:
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    from ..utils import atomic_dir

    with atomic_dir(folder) as tmp:
        Dataset.from_dict(table).save_to_disk(str(tmp / "rows"))
        for k, v in arrays.items():
            np.save(tmp / f"{k}.npy", v)


def _prepare(folder: Path, digest: str, overwrite: bool) -> dict[str, Any] | None:
    """Rank 0's look at the folder before anyone writes: the manifest of a complete run of this config
    (returned), or a folder made ready (stamped, temporaries of a killed run removed; None)."""
    import shutil

    manifest_file = folder / MANIFEST
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("config_hash") == digest:
            return manifest
    stamp = folder / "config_hash"
    if folder.exists() and any(folder.iterdir()):
        old = stamp.read_text().strip() if stamp.is_file() else "unknown"
        if old != digest:
            if not overwrite:
                raise RegenerationError(
                    f"{folder} holds data regenerated with another config (hash {old}, this config {digest}); "
                    f"remove that folder or pass --overwrite to regenerate")
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest + "\n")
    for stale in folder.glob(".*"):  # temporaries of a run killed mid-write (atomic_dir / atomic_write)
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    return None


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def regenerate(cfg: Config, target=None, progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Regenerate ``data/<preset>/regen`` (resuming an interrupted run); return the manifest.

    A folder holding a complete run of the same config is left alone (the manifest is returned with
    ``"skipped": True``). Shards of another config raise :class:`RegenerationError` unless ``overwrite``.

    Several processes (``torchrun`` / ``accelerate launch``, :mod:`xpress.distributed`): the ranks first
    check that they hold the same config and prompts, rank 0 prepares the folder, the missing shards are
    dealt out (:func:`xpress.distributed.split`: missing shard ``j`` to rank ``j mod N``), and rank 0
    writes the manifest once every rank is done and every shard exists. Each shard is the same whatever
    the number of processes; every rank returns the manifest.
    """
    from tqdm.auto import tqdm

    from .. import distributed
    from ..targets import load_target
    from ..utils import atomic_write_json, provenance

    distributed.setup()
    world = distributed.world_size()
    folder = regen_dir(cfg)
    signature = regen_signature(cfg)
    digest = config_hash(signature)
    distributed.agree("config hash", digest, "launch every rank with the same --preset and overrides")
    distributed.agree("regen folder", str(folder.resolve()), "give every rank the same XPRESS_DATA")
    done = distributed.on_main(lambda: _prepare(folder, digest, overwrite), "preparing the regen folder")
    if done is not None:
        _record(cfg, done)
        return {**done, "skipped": True}

    t_start = time.perf_counter()
    target = target or load_target(cfg)
    runtime = "lean" if target.runtime is not None else "transformers"
    if runtime != signature["target"]["runtime"]:
        raise RegenerationError(
            f"the target runs the {runtime} forward, but target.runtime={cfg.target.runtime!r} plans the "
            f"{signature['target']['runtime']} one here; set target.runtime={runtime} in the preset so that the "
            f"data say which forward wrote them")
    loaded = str(target.compute_dtype).removeprefix("torch.")
    if loaded != signature["target"]["compute_dtype"]:
        raise RegenerationError(
            f"the target computes in {loaded}, but the config resolves target.dtype={cfg.target.dtype!r} to "
            f"{signature['target']['compute_dtype']} on this machine (a bf16 row-invariance fallback?); set "
            f"target.dtype={loaded} in the preset so that the data say which target wrote them")
    records, skipped = _prompts(cfg, target.tokenizer)
    distributed.agree("prompts hash", [[r["id"], r["split"], r["prompt_ids"]] for r in records],
                      "give every rank the same data/ and tokenizer (XPRESS_DATA, the same package versions)")
    size = cfg.data.regen_shard_size
    shards = [records[s:s + size] for s in range(0, len(records), size)]
    todo = distributed.on_main(lambda: [i for i in range(len(shards))
                                        if not (folder / _shard_name(i) / "rows").is_dir()], "listing the shards")
    mine = distributed.split(todo)

    def on_disk() -> int:  # prompts in finished shards, every rank's
        return sum(len(s) for i, s in enumerate(shards) if (folder / _shard_name(i) / "rows").is_dir())

    main = distributed.is_main()
    bar = tqdm(total=len(records), initial=on_disk(), unit="prompt", dynamic_ncols=True,
               desc=f"regenerate {cfg.preset}" + (f" ({world} processes)" if world > 1 else ""),
               disable=not (progress and main))
    engine = regen_engine(cfg, target)
    client = server_client(cfg, target) if engine == "server" else None
    new_tokens, gen_s = 0, 0.0
    t0 = time.perf_counter()
    try:
        for i, table, arrays in _shard_results(target, cfg, {i: shards[i] for i in mine}, client):
            _write_shard(folder / _shard_name(i), table, arrays)
            gen_s = time.perf_counter() - t0
            new_tokens += sum(len(x) - p for x, p in zip(table["input_ids"], table["prompt_len"]))
            bar.update(on_disk() - bar.n)
            bar.set_postfix(tok_s=f"{new_tokens / max(gen_s, 1e-9):.0f}", shard=f"{i + 1}/{len(shards)}")
    finally:
        bar.close()
    ran = distributed.gather({"tokens": new_tokens, "seconds": gen_s}, "waiting for every rank's shards")
    machine = distributed.describe(target.device)

    def finish() -> dict[str, Any]:
        missing = [_shard_name(i) for i in range(len(shards)) if not (folder / _shard_name(i) / "rows").is_dir()]
        if missing:
            raise RegenerationError(
                f"{len(missing)} shard(s) missing in {folder} after every rank finished ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): every rank must write to the same folder (a shared "
                f"filesystem for data/); rerun to generate them")
        data = RegenData.load(cfg, require_complete=False)
        counts = {s: data.count(s) for s in SPLITS}
        tokens = {s: data.response_tokens(s) for s in SPLITS}
        disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        total_tokens = sum(len(r) for r in data.input_ids)
        tok = sum(r["tokens"] for r in ran)
        wall = max(r["seconds"] for r in ran)  # the ranks generate side by side
        manifest = {
            "what": "target-regenerated training data (greedy, chat template, thinking off)",
            "preset": cfg.preset, "target": target.name, "config_hash": digest, "signature": signature,
            "shards": len(shards), "sequences": counts, "response_tokens": tokens, "total_tokens": total_tokens,
            "skipped_long_prompts": skipped, "max_prompt_tokens": max_prompt_tokens(cfg),
            "finish_reasons": data.finish_reasons(),
            "cached_features": cfg.data.cache_features,
            "feature_bytes_per_token": ((2 * target.feature_size + 2 * target.hidden_size + 4)
                                        if cfg.data.cache_features else 0),
            "disk_bytes": disk,
            "this_run": {"new_response_tokens": tok, "seconds": time.perf_counter() - t_start,
                         "generation_seconds": wall, "tokens_per_s": tok / wall if wall else None,
                         "shards_generated": len(todo), "processes": len(ran), "engine": engine,
                         "batch_size": cfg.data.regen_batch_size,
                         **({"server": {"url": cfg.data.regen_url, "model": client.model or None,
                                        "prompt_sent_as": client.prompt_as or None,
                                        "answer_ids": client.answer_ids or None,
                                        "check_every": cfg.data.regen_check_every}} if client else {})},
            **({"served_agreement": served_agreement(data)} if engine == "server" else {}),
            "provenance": provenance(cfg.preset, **machine),
        }
        atomic_write_json(folder / MANIFEST, manifest)
        return manifest

    manifest = distributed.on_main(finish, "writing the manifest")
    _record(cfg, manifest)
    return {**manifest, "skipped": False}


def _record(cfg: Config, manifest: dict[str, Any]) -> None:
    """``results/<preset>/regen_manifest.json``: the data's manifest beside the results trained on them (main
    process), written whether this call regenerated or found the data complete, so that it is never an
    earlier run's."""
    from .. import distributed
    from ..utils import atomic_write_json

    if distributed.is_main():
        atomic_write_json(paths.RESULTS / cfg.preset / "regen_manifest.json", manifest)


# ------------------------------------------------------------------------------------------------ reading
def answer_token_counts(sequences: Iterable[tuple[Sequence[int], int]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs among the answer tokens of ``sequences`` ((prompt + answer ids, prompt length)
    pairs): [vocab_size] int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, prompt_len in sequences:
        np.add.at(counts, np.asarray(ids[prompt_len:], dtype=np.int64), 1)
    return torch.from_numpy(counts)


class RegenData:
    """Regenerated sequences of all shards, with memory-mapped captured states.

    ``input_ids[i]`` (list of ints), ``prompt_len[i]``, ``split[i]``; :meth:`states` gives
    ``features`` [T, F], ``hidden`` [T, H] (float16 memmaps) and ``lse`` [T] of sequence ``i``.
    """

    def __init__(self, folder: Path, manifest: dict | None):
        from datasets import load_from_disk

        self.folder, self.manifest = folder, manifest
        self.ids, self.split, self.input_ids, self.prompt_len, self.finish = [], [], [], [], []
        # server engine: the served model and the teacher-forced agreeing answer tokens (-1: unchecked) per row
        self.served_model: list[str | None] = []
        self.served_agree: list[int | None] = []
        self._where: list[tuple[int, int]] = []  # (shard, offset)
        self._arrays: list[dict[str, np.ndarray]] = []
        for s, shard in enumerate(sorted(folder.glob("shard-*"))):
            rows = load_from_disk(str(shard / "rows"))
            cols = rows.to_dict()
            self.ids += cols["id"]
            self.split += cols["split"]
            self.input_ids += cols["input_ids"]
            self.prompt_len += cols["prompt_len"]
            self.finish += cols["finish_reason"]
            self.served_model += cols.get("served_model", [None] * len(cols["id"]))
            self.served_agree += cols.get("served_agree", [None] * len(cols["id"]))
            self._where += [(s, o) for o in cols["offset"]]
            self._arrays.append({k: np.load(shard / f"{k}.npy", mmap_mode="r")
                                 for k in ("features", "hidden", "lse") if (shard / f"{k}.npy").is_file()})

    @classmethod
    def load(cls, cfg: Config, require_complete: bool = True, data_root: Path | None = None) -> "RegenData":
        """The preset's regenerated data; :class:`RegenerationError` when missing, incomplete or stale.
        ``data_root``: read ``<data_root>/<preset>/regen`` instead of :data:`xpress.paths.DATA`'s (another
        run's data, e.g. another clone's ``data/``)."""
        folder = regen_dir(cfg) if data_root is None else Path(data_root) / cfg.preset / "regen"
        manifest_file = folder / MANIFEST
        if require_complete:
            if not manifest_file.is_file():
                raise RegenerationError(
                    f"no complete regenerated data at {folder}: run `python -m xpress regenerate --preset "
                    f"{cfg.preset}` first (it resumes if it was interrupted)")
            manifest = json.loads(manifest_file.read_text())
            digest = config_hash(regen_signature(cfg))
            if manifest.get("config_hash") != digest:
                raise RegenerationError(
                    f"{folder} was regenerated with another config (hash {manifest.get('config_hash')}, this "
                    f"config {digest}); rerun `python -m xpress regenerate --preset {cfg.preset} --overwrite`")
        else:
            manifest = None
        return cls(folder, manifest)

    def __len__(self) -> int:
        return len(self.input_ids)

    def indices(self, split: str) -> list[int]:
        return [i for i, s in enumerate(self.split) if s == split]

    def count(self, split: str) -> int:
        return len(self.indices(split))

    def response_tokens(self, split: str) -> int:
        return self.answer_tokens(self.indices(split))

    def answer_tokens(self, rows: list[int]) -> int:
        """Regenerated answer tokens (after the prompt) of the sequences ``rows``."""
        return sum(len(self.input_ids[i]) - self.prompt_len[i] for i in rows)

    def finish_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.finish:
            out[r] = out.get(r, 0) + 1
        return out

    @property
    def has_states(self) -> bool:
        return bool(self._arrays) and all("features" in a for a in self._arrays)

    def states(self, i: int) -> dict[str, np.ndarray]:
        """Captured target states of sequence ``i``: features [T, F], hidden [T, H], lse [T]."""
        if not self.has_states:
            raise RegenerationError(f"{self.folder} holds no captured target states (data.cache_features "
                                    f"was off); regenerate with data.cache_features=true")
        s, o = self._where[i]
        T = len(self.input_ids[i])
        return {k: v[o:o + T] for k, v in self._arrays[s].items()}

    def token_counts(self, vocab_size: int, split: str = "train") -> torch.Tensor:
        """How often each target id occurs among the response tokens of ``split``: [V] int64."""
        return answer_token_counts([(self.input_ids[i], self.prompt_len[i]) for i in self.indices(split)], vocab_size)

    def prompts(self, split: str) -> list[list[int]]:
        """The chat-formatted prompt ids of ``split`` (for tau by decoding on held-out sequences)."""
        return [self.input_ids[i][:self.prompt_len[i]] for i in self.indices(split)]


# ------------------------------------------------------------------------------------------------ checking
REPETITION_N = 4          # n-gram length of the repetition measure
DEGENERATE_REPETITION = 0.25  # an answer with a larger share of repeated 4-grams loops rather than answers


def repetition(tokens: Sequence[int], n: int = REPETITION_N) -> float:
    """The share of an answer's token n-grams that repeat an earlier one: ``1 - distinct / total`` (0 for an
    answer shorter than ``n + 1`` tokens). A greedy decode stuck in a loop scores near 1."""
    grams = [tuple(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if len(grams) > 1 else 0.0


def representative_answer(answers: Sequence[Sequence[int]], max_repetition: float = DEGENERATE_REPETITION) -> int:
    """The index of a representative answer: among the non-degenerate ones (:func:`repetition` at most
    ``max_repetition``), the one whose length is nearest their median (the first such on ties); among all
    answers when every one is degenerate. ValueError for no answers."""
    if not answers:
        raise ValueError("no answers to choose from: regenerate the data first (notebook 01)")
    pool = [i for i, a in enumerate(answers) if repetition(a) <= max_repetition] or list(range(len(answers)))
    median = float(np.median([len(answers[i]) for i in pool]))
    return min(pool, key=lambda i: (abs(len(answers[i]) - median), i))


def representative_sequence(data: "RegenData", split: str = "train") -> int:
    """The row of ``data`` whose answer :func:`representative_answer` picks among the ``split`` rows."""
    rows = data.indices(split)
    return rows[representative_answer([data.input_ids[i][data.prompt_len[i]:] for i in rows])]


def check_sequence(data: RegenData, target, i: int) -> dict[str, Any]:
    """Check regenerated sequence ``i`` against one teacher-forced forward of ``target`` over it.

    Always: ``greedy_agreement``, the fraction of answer positions where the teacher-forced argmax is the
    token the target wrote (1.0 up to near-ties that a ragged bf16 batch rounds differently). With captured
    states (``data.cache_features``) also: ``feature_error`` (max |captured - teacher-forced| feature, beside
    ``feature_scale``, the largest feature), ``logp_error`` (max error of the answer log-probabilities rebuilt
    from the stored hidden state and lse, beside ``logp_tolerance``) and ``stored_argmax_agreement``.
    ``ok`` says whether every measured error is inside its tolerance.
    """
    from ..targets import target_forward

    ids = torch.tensor([data.input_ids[i]])                        # [1, T]
    T, P0 = ids.shape[1], data.prompt_len[i]
    with torch.inference_mode():
        ref = target_forward(target, ids)                          # logits [1, T, V], features [1, T, F]
    logp = torch.log_softmax(ref.logits[0, P0 - 1:T - 1].float(), -1)   # [T - P0, V]: predicts ids[P0:]
    greedy = (logp.argmax(-1) == ids[0, P0:]).float().mean().item()
    out: dict[str, Any] = {"sequence": data.ids[i], "answer_tokens": T - P0, "greedy_agreement": greedy,
                           "has_states": data.has_states}
    # A bf16 target's logits are bf16 (a step of 0.25 at |logit| ~ 40), and a ragged batch of 32 rounds
    # differently from one sequence: allow a few bf16 steps of the largest logit (float32: 0.05).
    out["logp_tolerance"] = 0.05 + 4 * torch.finfo(target.compute_dtype).eps * ref.logits.abs().max().item()
    ok = greedy >= 0.9
    if data.has_states:
        st = data.states(i)
        feats = torch.from_numpy(np.asarray(st["features"][:T - 1], dtype=np.float32))
        out["feature_error"] = (feats - ref.features[0, :T - 1].float()).abs().max().item()
        out["feature_scale"] = ref.features.abs().max().item()
        hidden = torch.from_numpy(np.asarray(st["hidden"][P0 - 1:T - 1], dtype=np.float32))
        lse = torch.from_numpy(np.array(st["lse"][P0 - 1:T - 1]))
        stored = hidden @ target.lm_head().weight.float().T - lse[:, None]
        out["logp_error"] = (stored - logp).abs().max().item()
        out["stored_argmax_agreement"] = (stored.argmax(-1) == logp.argmax(-1)).float().mean().item()
        ok = (ok and out["feature_error"] <= 2e-3 * out["feature_scale"] + 1e-3
              and out["logp_error"] < out["logp_tolerance"])
    out["ok"] = bool(ok)
    return out
