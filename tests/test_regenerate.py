"""Regeneration (``python -m xpress regenerate``, :mod:`xpress.train.regenerate`) on the smoke preset:
the captured target states are the target's own, the splits and manifest are right, and a killed run
resumes to exactly what an uninterrupted run writes."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xpress import continuous, paths
from xpress.__main__ import main
from xpress.config import load_config
from xpress.targets import target_forward
from xpress.train.regenerate import (RegenData, RegenerationError, check_sequence, config_hash, regen_signature,
                                     regenerate)

# 10 prompts in 5 shards of 2: a kill after the first shard leaves most of the run to resume
SMALL = ["data.n_train_prompts=8", "data.n_val_prompts=2", "data.regen_max_new_tokens=16",
         "data.regen_shard_size=2"]
N_SHARDS = 5
ARRAYS = ("features", "hidden", "lse")


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "XPRESS_DATA": str(root / "data"), "XPRESS_CHECKPOINTS": str(root / "checkpoints"),
            "XPRESS_RESULTS": str(root / "results"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "xpress", "regenerate", "--preset", "smoke", "--no-progress", *extra, *SMALL]


def _regen(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*extra), capture_output=True, text=True, cwd=paths.REPO_ROOT, env=_env(root),
                          timeout=600)


def _folder(root: Path) -> Path:
    return root / "data" / "smoke" / "regen"


@pytest.fixture(scope="module")
def small_cfg():
    return load_config("smoke", SMALL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted ``python -m xpress regenerate`` run; returns its regen folder."""
    root = tmp_path_factory.mktemp("reference")
    proc = _regen(root)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] is False
    return _folder(root)


@pytest.fixture(scope="module")
def data(reference, small_cfg):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "DATA", reference.parents[1])
        yield RegenData.load(small_cfg)


def _assert_same_shards(folder, reference) -> None:
    """Every shard of ``folder`` equals ``reference``'s: rows, and the captured arrays bit for bit."""
    mine, ref = _shards(folder), _shards(reference)
    assert [s["name"] for s in mine] == [s["name"] for s in ref] == [f"shard-{i:05d}" for i in range(N_SHARDS)]
    for a, b in zip(mine, ref):
        assert a["rows"] == b["rows"], a["name"]
        for k in ARRAYS:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True), (a["name"], k)


def _shards(folder: Path) -> list[dict]:
    """Every shard's rows and arrays, in order."""
    from datasets import load_from_disk

    out = []
    for shard in sorted(folder.glob("shard-*")):
        out.append({"name": shard.name, "rows": load_from_disk(str(shard / "rows")).to_dict(),
                    **{k: np.load(shard / f"{k}.npy") for k in ARRAYS}})
    return out


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(f.relative_to(folder)): f.stat().st_mtime_ns for f in folder.rglob("*")}


# ------------------------------------------------------------------------------------------- capture
def test_captured_states_are_the_targets(data, target):
    """features rows 0..T-2 are target_forward's features; hidden and lse give the target's log-probs
    at the response positions; the last row is zero; the responses are the target's greedy choices."""
    W = target.lm_head().weight.float()  # [V, H]
    for i in [0, 3, len(data) - 1]:  # different shards, the last one a val sequence
        ids = torch.tensor(data.input_ids[i])
        T, p = len(ids), data.prompt_len[i]
        assert 0 < p < T
        st = data.states(i)
        assert st["features"].dtype == np.float16 and st["hidden"].dtype == np.float16
        assert st["features"].shape == (T, target.feature_size) and st["hidden"].shape == (T, target.hidden_size)
        with torch.no_grad():
            step = target_forward(target, ids[None])
        feats = torch.from_numpy(np.asarray(st["features"], dtype=np.float32))
        ref = step.features[0].float()
        # fp16 storage (rel. 2^-11) of values up to ~5, computed by a ragged batch instead of one sequence
        torch.testing.assert_close(feats[:T - 1], ref[:T - 1], atol=5e-3, rtol=2e-3)
        assert not feats[T - 1].any() and not np.asarray(st["hidden"][T - 1]).any()

        hidden = torch.from_numpy(np.asarray(st["hidden"], dtype=np.float32))
        lse = torch.from_numpy(np.array(st["lse"], dtype=np.float32))
        assert torch.isnan(lse[:p - 1]).all(), "lse must be NaN inside the prompt"
        resp = slice(p - 1, T - 1)  # rows whose next token is a response token
        assert torch.isfinite(lse[resp]).all()
        logp_ref = torch.log_softmax(step.logits[0], dim=-1)
        logp = hidden @ W.T - lse[:, None]
        torch.testing.assert_close(logp[resp], logp_ref[resp], atol=5e-3, rtol=0)
        # the stored responses are greedy: each response token has the maximal log-prob (up to fp rounding)
        chosen = logp_ref[resp].gather(1, ids[p:, None]).squeeze(1)
        assert (logp_ref[resp].max(-1).values - chosen).max() < 1e-4


def test_check_sequence_with_and_without_captured_states(data, target):
    """The notebook's check: greedy agreement always, captured-state errors only where states exist; an answer
    that is not the target's greedy continuation fails."""
    got = check_sequence(data, target, 0)
    assert got["ok"] and got["has_states"] and got["greedy_agreement"] >= 0.9
    assert got["feature_error"] <= 2e-3 * got["feature_scale"] + 1e-3 and got["logp_error"] < got["logp_tolerance"]
    bare = copy.copy(data)
    bare._arrays = [{} for _ in data._arrays]  # as written with data.cache_features=false
    got = check_sequence(bare, target, 0)
    assert got["ok"] and not got["has_states"] and "feature_error" not in got
    p = data.prompt_len[0]
    bare.input_ids = list(data.input_ids)
    bare.input_ids[0] = data.input_ids[0][:p] + [(t + 1) % target.vocab_size for t in data.input_ids[0][p:]]
    assert not check_sequence(bare, target, 0)["ok"]


def test_masks_splits_and_manifest(data, small_cfg, reference, target):
    from datasets import load_from_disk

    assert len(data) == 10 and data.has_states

    rows = {}
    for shard in sorted(reference.glob("shard-*")):
        cols = load_from_disk(str(shard / "rows")).to_dict()
        for j, rid in enumerate(cols["id"]):
            rows[rid] = {k: v[j] for k, v in cols.items()}
    assert len(rows) == 10
    for r in rows.values():
        p, T = r["prompt_len"], len(r["input_ids"])
        assert r["loss_mask"] == [0] * p + [1] * (T - p), "loss_mask: 0 on the prompt, 1 on the response"
        assert 0 < T - p <= 16 and isinstance(r["finish_reason"], str)

    train, val = data.indices("train"), data.indices("val")
    assert len(train) == 8 and len(val) == 2
    assert val == [8, 9], "the last n_val_prompts prompts form the validation split"
    assert not {data.ids[i] for i in train} & {data.ids[i] for i in val}
    assert len(set(data.ids)) == 10
    assert not {tuple(x) for x in data.prompts("train")} & {tuple(x) for x in data.prompts("val")}

    m = json.loads((reference / "manifest.json").read_text())
    assert m["config_hash"] == config_hash(regen_signature(small_cfg))
    assert m["signature"] == json.loads(json.dumps(regen_signature(small_cfg)))
    assert m["sequences"] == {"train": 8, "val": 2}
    assert m["response_tokens"] == {s: data.response_tokens(s) for s in ("train", "val")}
    assert m["response_tokens"]["train"] == sum(len(data.input_ids[i]) - data.prompt_len[i] for i in train)
    assert m["feature_bytes_per_token"] == 2 * target.feature_size + 2 * target.hidden_size + 4
    assert m["shards"] == N_SHARDS and m["this_run"]["shards_generated"] == N_SHARDS
    assert m["this_run"]["engine"] == ("continuous" if continuous.available(target) else "batched")
    assert sum(m["finish_reasons"].values()) == 10
    assert {"preset", "git_revision", "date", "machine", "torch"} <= set(m["provenance"])
    assert m["provenance"]["preset"] == "smoke"
    assert json.loads((reference.parents[2] / "results" / "smoke" / "regen_manifest.json").read_text()) == m


# -------------------------------------------------------------------------------------------- resume
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, reference, kill_after_first_shard):
    folder = _folder(tmp_path)
    proc = kill_after_first_shard(_command(), folder, _env(tmp_path))
    assert proc.returncode == -signal.SIGKILL
    done = sorted(p.name for p in folder.glob("shard-*"))
    assert not (folder / "manifest.json").exists() and 1 <= len(done) < N_SHARDS, done
    # what a kill during a shard's (or a file's) write leaves behind: must be cleaned up on resume
    (folder / ".shard-00004.stale").mkdir(exist_ok=True)
    (folder / ".shard-00004.stale" / "junk").write_text("x")
    (folder / ".manifest.json.stale.tmp").write_text("{")
    before = _mtimes(folder / done[0])

    proc = _regen(tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["skipped"] is False and out["sequences"] == {"train": 8, "val": 2}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["this_run"]["shards_generated"] == N_SHARDS - len(done)
    assert _mtimes(folder / done[0]) == before, "a finished shard was rewritten"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "temporary entries left"

    _assert_same_shards(folder, reference)

    # a complete run rerun does nothing, but the results' copy of the manifest is this data's again
    stamp = _mtimes(folder)
    recorded = tmp_path / "results" / "smoke" / "regen_manifest.json"
    assert json.loads(recorded.read_text()) == manifest
    recorded.write_text("{}")  # an earlier run's copy
    proc = _regen(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] is True
    assert "nothing to do" in proc.stderr
    assert _mtimes(folder) == stamp
    assert json.loads(recorded.read_text()) == manifest


def test_other_config_is_refused_unless_overwrite(tmp_path, reference, capsys, monkeypatch):
    import shutil

    shutil.copytree(reference, _folder(tmp_path))
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    other = [*SMALL, "data.regen_max_new_tokens=4", "data.n_train_prompts=2", "data.n_val_prompts=1"]
    before = _mtimes(_folder(tmp_path))
    assert main(["regenerate", "--preset", "smoke", "--no-progress", *other]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--overwrite" in err[0], err
    assert _mtimes(_folder(tmp_path)) == before, "refused, yet the data changed"

    # also with the manifest gone (an interrupted run of another config): the config_hash stamp decides
    (_folder(tmp_path) / "manifest.json").unlink()
    assert main(["regenerate", "--preset", "smoke", "--no-progress", *other]) == 2
    capsys.readouterr()

    assert main(["regenerate", "--preset", "smoke", "--no-progress", "--overwrite", *other]) == 0
    m = json.loads((_folder(tmp_path) / "manifest.json").read_text())
    assert m["config_hash"] == config_hash(regen_signature(load_config("smoke", other)))
    assert m["sequences"] == {"train": 2, "val": 1} and m["shards"] == 2
    assert len(list(_folder(tmp_path).glob("shard-*"))) == 2, "old shards must be gone"


def test_data_are_stamped_with_the_dtype_that_wrote_them(tmp_path, reference, small_cfg, target, monkeypatch):
    """Greedy answers depend on the target's compute dtype: the same data read under a bf16 config are stale,
    and a target that computes in another dtype than the config resolves to is refused before anything is
    written."""
    assert regen_signature(small_cfg)["target"]["compute_dtype"] == "float32"
    bf16 = load_config("smoke", [*SMALL, "target.dtype=bfloat16"])
    assert regen_signature(bf16)["target"]["compute_dtype"] == "bfloat16"
    monkeypatch.setattr(paths, "DATA", reference.parents[1])
    RegenData.load(small_cfg)
    with pytest.raises(RegenerationError, match="another config"):
        RegenData.load(bf16)

    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    assert str(target.compute_dtype) == "torch.float32"
    with pytest.raises(RegenerationError, match="computes in float32.*target.dtype=float32"):
        regenerate(bf16, target=target, progress=False)
    assert not list(_folder(tmp_path).glob("shard-*"))


def test_prompt_limit_is_met_by_drawing_more(small_cfg, target):
    """A prompt limit that skips more than the first draw's spare prompts (the smoke preset's short windows
    against the code prompts' docstrings) draws a larger pool: the requested count, each prompt within the
    limit, train before val."""
    from xpress.train.regenerate import _prompts, max_prompt_tokens

    kept, skipped = _prompts(small_cfg, target.tokenizer)
    assert len(kept) == 10 and skipped > 0.25 * 10 + 8
    assert all(len(r["prompt_ids"]) <= max_prompt_tokens(small_cfg) for r in kept)
    assert [r["split"] for r in kept] == ["train"] * 8 + ["val"] * 2


def test_data_are_stamped_with_their_prompt_mixture(small_cfg):
    """Another mixture is other data: data.train_sources is in the signature, so the hash changes."""
    three = load_config("smoke", [*SMALL, 'data.train_sources=["gsm8k-train", "math-train", "sharegpt"]'])
    assert regen_signature(small_cfg)["train_sources"] == ["gsm8k-train", "math-train", "sharegpt", "code"]
    assert config_hash(regen_signature(three)) != config_hash(regen_signature(small_cfg))


def test_data_are_stamped_with_the_forward_that_wrote_them(tmp_path, small_cfg, target, monkeypatch):
    """The lean and the transformers forward differ in the last bits: the data hash names the planned one, and
    a target that runs the other (a lean runtime that could not run the model) is refused."""
    tf = load_config("smoke", [*SMALL, "target.runtime=transformers"])
    assert regen_signature(small_cfg)["target"]["runtime"] == "lean"
    assert regen_signature(tf)["target"]["runtime"] == "transformers"
    assert config_hash(regen_signature(tf)) != config_hash(regen_signature(small_cfg))
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    assert target.runtime is not None
    with pytest.raises(RegenerationError, match="runs the lean forward.*target.runtime=lean"):
        regenerate(tf, target=target, progress=False)
    assert not list(_folder(tmp_path).glob("shard-*"))


def test_both_engines_answer_greedily(tmp_path, reference, small_cfg, target, monkeypatch):
    """``data.regen_engine``: the continuous engine's answers are each prompt's batch-1 greedy decode exactly;
    the ragged batches (the old engine, kept reachable) write complete data the same checks accept, and the
    manifest says which engine ran."""
    from xpress.decoding import generate_ar

    monkeypatch.setattr(paths, "DATA", reference.parents[1])
    data = RegenData.load(small_cfg)
    if continuous.available(target):
        for i in range(len(data)):
            p = data.prompt_len[i]
            ref = generate_ar(target, data.input_ids[i][:p], small_cfg.data.regen_max_new_tokens)
            assert data.input_ids[i][p:] == ref.token_ids, i
    batched = load_config("smoke", [*SMALL, "data.regen_engine=batched"])
    assert config_hash(regen_signature(batched)) == config_hash(regen_signature(small_cfg))
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    m = regenerate(batched, target=target, progress=False)
    assert m["this_run"]["engine"] == "batched" and m["sequences"] == {"train": 8, "val": 2}
    other = RegenData.load(batched)
    assert other.ids == data.ids and other.prompt_len == data.prompt_len
    assert all(check_sequence(other, target, i)["ok"] for i in (0, 5, 9))


# ------------------------------------------------------------------------------------ several processes
def test_two_processes_equal_one(tmp_path, reference, torchrun):
    """torchrun, 2 gloo CPU processes resume an interrupted run (shards 0 and 3 done, a temporary left):
    each regenerates its share of the missing shards; every shard (rows and captured states) is the
    one-process run's bit for bit, the finished ones untouched, and rank 0 alone writes the manifest."""
    import shutil

    folder = _folder(tmp_path)
    for name in ("shard-00000", "shard-00003"):
        shutil.copytree(reference / name, folder / name)
    shutil.copy(reference / "config_hash", folder / "config_hash")
    (folder / ".shard-00001.stale").mkdir()  # what a kill during a shard's write leaves
    before = _mtimes(folder / "shard-00003")
    proc = torchrun(*_command()[1:], env=_env(tmp_path))  # -m xpress regenerate ...
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["skipped"] is False, "one report, by rank 0"
    folder = _folder(tmp_path)
    _assert_same_shards(folder, reference)
    m, r = (json.loads((f / "manifest.json").read_text()) for f in (folder, reference))
    for k in ("config_hash", "shards", "sequences", "response_tokens", "total_tokens", "finish_reasons"):
        assert m[k] == r[k], k
    assert m["this_run"]["shards_generated"] == N_SHARDS - 2 and m["this_run"]["processes"] == 2
    assert _mtimes(folder / "shard-00003") == before, "a finished shard was rewritten"
    assert m["provenance"]["world_size"] == 2 and m["provenance"]["devices"] == ["cpu", "cpu"]
    assert r["provenance"]["world_size"] == 1 and r["this_run"]["processes"] == 1
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "temporary entries left"


def test_representative_answer_skips_loops_and_takes_the_median_length():
    from xpress.train.regenerate import repetition, representative_answer

    loop = [5, 6, 7, 8] * 10                       # a greedy decode stuck in a loop
    assert repetition(loop) > 0.8 and repetition(list(range(40))) == 0.0 and repetition([1, 2]) == 0.0
    answers = [loop, list(range(10)), list(range(100, 130)), list(range(200, 260)), list(range(300, 335))]
    # non-degenerate lengths 10, 30, 60, 35: median 32.5, nearest 30 (index 2; 35 is farther)
    assert representative_answer(answers) == 2
    assert representative_answer([loop, loop[:20]]) == 0      # all degenerate: the median of all (40, 20 -> 30: tie -> first)
    with pytest.raises(ValueError, match="regenerate the data first"):
        representative_answer([])
