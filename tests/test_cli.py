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
