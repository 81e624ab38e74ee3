"""``python -m xpress decode`` on the smoke preset: output format and clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xpress import paths
from xpress.__main__ import main

RECORDS = [{"id": "chat", "turns": ["Name a colour.", "And another one?"]},
           {"id": "math", "turns": ["What is 2 + 3?"]}]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def decode(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xpress", "decode", "--preset", "smoke", "--no-progress",
                           *args], capture_output=True, text=True, cwd=paths.REPO_ROOT, env=ENV, timeout=300)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_decode_oracle_output_format(prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = decode("--method", "oracle", "--prompts", str(prompts_file), "--max-new-tokens", "6",
                  "--seed", "0", "--temperature", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["chat", "math"]
    for rec, src in zip(lines, RECORDS):
        assert rec["method"] == "oracle" and rec["n_turns"] == len(src["turns"]) == len(rec["turns"])
        assert rec["token_ids"] == [t for turn in rec["turns"] for t in turn["token_ids"]]
        assert sum(rec["accept_lengths"]) == len(rec["token_ids"]) > 0
        assert isinstance(rec["text"], str)
        assert {"draft", "refine", "verify", "bookkeeping", "prefill", "total"} <= set(rec["timings"])
        for turn in rec["turns"]:
            assert len(turn["token_ids"]) <= 6 and isinstance(turn["text"], str)
            assert len(turn["timings"]["steps"]["verify"]) == len(turn["accept_lengths"])
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["prompts"] == 2 and summary["tau"] > 1

    # the autoregressive baseline gives the same tokens (T = 0), in-process this time
    out_ar = tmp_path / "ar.jsonl"
    assert main(["decode", "--preset", "smoke", "--method", "ar", "--prompts", str(prompts_file),
                 "--max-new-tokens", "6", "--out", str(out_ar), "--no-progress"]) == 0
    ar = [json.loads(x) for x in out_ar.read_text().splitlines()]
    assert [r["token_ids"] for r in ar] == [r["token_ids"] for r in lines]


def test_decode_missing_checkpoint_says_how_to_train(prompts_file, tmp_path):
    pytest.importorskip("xpress.proposer")
    proc = decode("--method", "xpress", "--prompts", str(prompts_file), "--out", str(tmp_path / "o.jsonl"),
                  "--checkpoint", str(tmp_path / "no-such-checkpoint"))
    assert proc.returncode == 2
    assert "checkpoint" in proc.stderr and "train" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_decode_bad_inputs(prompts_file, tmp_path, capsys):
    out = str(tmp_path / "o.jsonl")
    assert main(["decode", "--preset", "smoke", "--method", "oracle", "--prompts",
                 str(tmp_path / "missing.jsonl"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err

    assert main(["decode", "--preset", "smoke", "--method", "ar", "--bench", "no-such-bench", "--out", out]) == 2
    assert "unknown benchmark" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "no turns"}\n')
    assert main(["decode", "--preset", "smoke", "--method", "oracle", "--prompts", str(bad), "--out", out]) == 2
    assert "turns" in capsys.readouterr().err

    with pytest.raises(SystemExit) as e:
        main(["decode", "--preset", "smoke", "--method", "nope", "--prompts", str(prompts_file), "--out", out])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err

    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "turns": ["word " * 3000]}) + "\n")
    assert main(["decode", "--preset", "smoke", "--method", "oracle", "--prompts", str(long), "--out", out,
                 "--no-progress"]) == 2
    assert "exceeds the context" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_decode_input_checks_before_any_work(prompts_file, tmp_path, capsys):
    """--limit 0, an --out directory and a --prompts directory are one-line errors, before decoding."""
    out = str(tmp_path / "o.jsonl")
    args = ["decode", "--preset", "smoke", "--method", "ar", "--no-progress"]
    assert main([*args, "--prompts", str(prompts_file), "--limit", "0", "--out", out]) == 2
    assert "--limit 0" in capsys.readouterr().err
    assert main([*args, "--prompts", str(prompts_file), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main([*args, "--prompts", str(tmp_path), "--out", out]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_prompts_file_is_decoded_whole(tmp_path):
    """A prompts file is not cut to the preset's data.limit (4 on smoke)."""
    from xpress.bench import load_prompts

    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"id": f"p{i}", "turns": ["Hi"]}) + "\n" for i in range(7)))
    assert main(["decode", "--preset", "smoke", "--method", "ar", "--prompts", str(many), "--max-new-tokens", "1",
                 "--out", str(tmp_path / "o.jsonl"), "--no-progress"]) == 0
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 7 == len(load_prompts(prompts_file=many))


def test_output_reader_gone_exits_quietly():
    """`python -m xpress config | head`: the reader closes the pipe before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "xpress", "config", "--preset", "smoke"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=paths.REPO_ROOT, env=ENV)
    proc.stdout.close()  # before the child has imported anything, let alone printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err


# ------------------------------------------------------------------------------------ interrupt, resume
def without_timings(path) -> list[dict]:
    """The records of a decode output with the wall-clock fields removed (they differ between runs)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec.pop("timings")
        for turn in rec["turns"]:
            turn.pop("timings")
        out.append(rec)
    return out


def test_decode_interrupt_keeps_finished_prompts_and_resumes(tmp_path, capsys, monkeypatch):
    """Ctrl-C after 2 of 4 prompts: exit 130 with one line, the 2 kept; the same command then decodes only
    the other 2 and writes what an uninterrupted run writes (T = 1 with the random drafter: the sampling
    of every prompt must not depend on where the run was interrupted)."""
    import xpress.bench as bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"Count to {i + 2}."] + ["Again?"] * (i % 2)})
                               + "\n" for i in range(4)))
    args = ["decode", "--preset", "smoke", "--method", "random", "--prompts", str(prompts), "--temperature", "1",
            "--max-new-tokens", "5", "--no-progress"]
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert main([*args, "--out", str(whole)]) == 0
    capsys.readouterr()

    real, made = bench.conversation_record, []

    def interrupted_after_two(*a, **k):
        if len(made) == 2:
            raise KeyboardInterrupt
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(bench, "conversation_record", interrupted_after_two)
    assert main([*args, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: 2 of 4 prompts finished") and "rerun the same command" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and len(bench.partial_path(out).read_text().splitlines()) == 1 + 2  # header + 2

    made.clear()
    monkeypatch.setattr(bench, "conversation_record", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    assert main([*args, "--out", str(out)]) == 0
    assert "resuming, 2 of 4 prompts" in capsys.readouterr().err
    assert len(made) == 2  # only the unfinished prompts were decoded
    assert without_timings(out) == without_timings(whole)
    assert not bench.partial_path(out).exists()


def test_decode_ignores_the_partial_output_of_another_run(tmp_path, capsys):
    import xpress.bench as bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "out.jsonl"
    bench.partial_path(out).write_text(json.dumps({"resume": {"method": "other"}}) + "\n"
                                       + json.dumps({"id": "chat", "token_ids": [1]}) + "\n")
    assert main(["decode", "--preset", "smoke", "--method", "ar", "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--out", str(out), "--no-progress"]) == 0
    assert "another run" in capsys.readouterr().err
    assert [len(r["token_ids"]) for r in without_timings(out)] != [1, 4]
    assert all(len(r["turns"][0]["token_ids"]) > 0 for r in without_timings(out))


def test_decode_prepares_the_oracle_outside_the_timed_run(tmp_path, monkeypatch):
    """The oracle's greedy continuations are computed before decoding: while prompts are decoded (and
    timed), the oracle runs no target forward of its own."""
    import xpress.bench as bench
    import xpress.reference_drafters as ref

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"Say {i}."]}) + "\n" for i in range(3)))
    calls = {"oracle": 0, "during_decode": None}
    real_logits, real_decode = ref.lm_logits, bench.decode_records

    def counted(*a, **k):
        calls["oracle"] += 1
        return real_logits(*a, **k)

    def decode(*a, **k):
        before = calls["oracle"]
        out = real_decode(*a, **k)
        calls["during_decode"] = calls["oracle"] - before
        return out

    monkeypatch.setattr(ref, "lm_logits", counted)
    monkeypatch.setattr(bench, "decode_records", decode)
    assert main(["decode", "--preset", "smoke", "--method", "oracle", "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--out", str(tmp_path / "o.jsonl"), "--no-progress"]) == 0
    assert calls["oracle"] > 0 and calls["during_decode"] == 0


# ------------------------------------------------------------------------------ unusable checkpoints
def saved_checkpoint(folder, method: str, overrides=()):
    """A checkpoint written by the project's own save function, for the smoke preset (with overrides)."""
    from xpress.config import load_config
    from xpress.proposer import new_drafter, save_drafter
    from xpress.targets import load_target

    cfg = load_config("smoke", list(overrides))
    target = load_target(cfg)
    d = new_drafter(method, cfg, target, seed=0)
    return save_drafter(folder, d.drafter, d.head, d.vocab, method)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def random_bytes(path):
    path.write_bytes(os.urandom(4096))


def broken_json(path):
    path.write_text('{"hidden_size": 64, "num_attention')


CORRUPTIONS = {  # name: (method saved, method asked, file, how it is spoiled, overrides at save time)
    "truncated drafter weights": ("xpress", "xpress", "model.safetensors", truncate, ()),
    "random-bytes drafter weights": ("dflash", "dflash", "model.safetensors", random_bytes, ()),
    "broken config.json": ("xpress", "xpress", "config.json", broken_json, ()),
    "truncated head weights": ("markov", "markov", "head.safetensors", truncate, ()),
    "broken head.json": ("xpress", "xpress", "head.json", broken_json, ()),
    "another method": ("markov", "xpress", None, None, ()),
    "another method's drafter": ("xpress", "dflash", None, None, ()),
    "another block size": ("xpress", "xpress", None, None, ("drafter.block_size=4",)),
    "another target (hidden size)": ("dflash", "dflash", None, None, ("target.random_hidden=32",)),
    "another target (layers)": ("xpress", "xpress", None, None, ("target.random_layers=4",)),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_decode_unusable_checkpoint_is_one_line(case, prompts_file, tmp_path, capsys):
    saved, asked, name, spoil, overrides = CORRUPTIONS[case]
    folder = saved_checkpoint(tmp_path / "ckpt", saved, overrides)
    if spoil:
        spoil(folder / name)
    out = tmp_path / "o.jsonl"
    rc = main(["decode", "--preset", "smoke", "--method", asked, "--prompts", str(prompts_file), "--checkpoint",
               str(folder), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(folder) in err and f"python -m xpress train --preset smoke --method {asked}" in err
    if name:
        assert name in err
    assert not out.exists() and not (tmp_path / "o.jsonl.partial").exists()  # nothing half-written
