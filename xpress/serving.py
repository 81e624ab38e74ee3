"""Greedy answers from an OpenAI-compatible server: regeneration's ``server`` engine (``data.regen_engine:
server``, ``data.regen_url: http://HOST:PORT/v1``), as the public recipes regenerate (SpecForge through SGLang
servers; vLLM).

Each prompt goes, already rendered by the chat template (thinking off, :func:`xpress.targets.format_chat`), to
``POST /v1/completions`` (not chat completions: the server must not template it again), greedy (temperature 0,
no repetition penalty), at most ``max_new_tokens`` tokens, the target's EOS ids as stop tokens. Up to
``concurrency`` requests are in flight at once (stdlib threads and ``urllib``; the server batches them).

Token ids in and out, not text, wherever the server allows it; the first request finds out which
(:meth:`Client.probe`):

- **vLLM (>= 0.10.2) and SGLang** take the prompt as token ids and return the answer's ids
  (``return_token_ids``: ``choices[0].token_ids``);
- **older vLLM** returns them inside the log-probabilities (``logprobs`` with ``return_tokens_as_token_ids``:
  tokens written ``"token_id:N"``);
- **llama.cpp's server from llama-cpp-python** (``python -m llama_cpp.server``, checked in its 0.3 source) accepts
  neither: its request model types ``prompt`` as text only (a list of ids is refused, with HTTP 500), and its
  completion holds text (its log-probabilities list token *strings*, not ids). There the prompt is sent as the
  template's text (which the server tokenizes with special tokens and no added BOS, as the target's tokenizer
  does; the prompt token count it reports is checked against the ids) and the answer's ids are the target's tokenization of ``prompt text + answer text`` past the prompt's
  ids, that is the answer tokenized the way a training sequence would be. Its end-of-generation token is
  dropped from the answer and not named, so a ``stop`` answer gets the target's first EOS id appended (the
  in-process engines keep the stop token too).

The manifest names which way the ids came back (:attr:`Client.answer_ids`), and regeneration counts how often
the target, teacher-forced over the served answers, agrees with them (:mod:`xpress.train.regenerate`).
"""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlparse

# (method, url, JSON body or None) -> the decoded JSON answer; raises ServerError
Transport = Callable[[str, str, "dict[str, Any] | None"], "dict[str, Any]"]

TIMEOUT_S = 3600.0  # one request: a long answer behind a full batch takes minutes
RETRIES = 3  # a refused or dropped connection is retried after 1, 2, 4 s
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids


class ServerError(RuntimeError):
    """The server is unreachable, refused a request or answered something unusable; the message says what to
    do. ``status``: the HTTP status, where there was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a server's OpenAI-compatible base URL (``http://HOST:PORT/v1``), or None."""
    if not url:
        return "is empty"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "is not an http:// or https:// URL with a host"
    if parsed.query or parsed.fragment or url.strip() != url:
        return "holds a query, a fragment or spaces"
    if not parsed.path.endswith("/v1"):
        return "does not end in /v1 (the OpenAI-compatible routes' base, without a trailing slash)"
    return None


def http_json(method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One JSON request with :mod:`urllib`; an HTTP error or an unreachable server is a :class:`ServerError`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").replace("\n", " ")[:300]
        raise ServerError(f"{method} {url} answered HTTP {e.code}: {detail}", e.code) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"no answer from {url} ({reason}): start the server (docs/gpu.md, 'Regeneration through "
                          f"a serving engine') or fix data.regen_url") from None


@dataclass
class Served:
    """One served answer: its token ids (a stop token kept) and why it stopped (``stop`` or ``length``)."""

    index: int
    token_ids: list[int]
    finish_reason: str


@dataclass
class Client:
    """Greedy completions from the server at ``base_url`` (``http://HOST:PORT/v1``).

    ``tokenize(text) -> ids`` (the target's tokenizer, no special tokens added) is used only where the server
    returns text (llama.cpp); ``stop_ids``: the target's EOS ids. ``transport`` defaults to :func:`http_json`
    (tests inject their own)."""

    base_url: str
    stop_ids: Sequence[int]
    tokenize: Callable[[str], list[int]]
    transport: Transport = http_json
    model: str = ""  # the served model's id (GET /v1/models), set by probe
    prompt_as: str = ""  # "token ids" or "text", set by probe
    answer_ids: str = ""  # "returned" ("choices[].token_ids"), "logprobs" or "re-tokenized", set by probe
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # a fast tokenizer is not thread-safe (each call resets its truncation and padding)
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _call(self, method: str, route: str, body: dict | None = None) -> dict[str, Any]:
        for attempt in range(RETRIES + 1):
            try:
                return self.transport(method, self.base_url + route, body)
            except ServerError as e:
                if (e.status is not None and e.status != 503) or attempt == RETRIES:
                    raise
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def served_model(self) -> str:
        """The id of the model the server serves (the first of ``GET /v1/models``)."""
        models = self._call("GET", "/models").get("data") or []
        if not models or "id" not in models[0]:
            raise ServerError(f"{self.base_url}/models lists no model: is this an OpenAI-compatible server?")
        return str(models[0]["id"])

    def request(self, prompt_ids: Sequence[int], prompt_text: str, max_new_tokens: int) -> dict[str, Any]:
        """The ``/v1/completions`` body for one prompt, in the way :meth:`probe` chose."""
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0, "n": 1,
            "stream": False, "seed": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "repeat_penalty": 1.0,  # vLLM / SGLang; llama.cpp (its default is 1.1)
            "stop_token_ids": list(self.stop_ids), "ignore_eos": False, "skip_special_tokens": False,
        }
        if self.prompt_as == "text":
            body["prompt"] = prompt_text
        else:
            body["prompt"] = list(prompt_ids)
            body["return_token_ids"] = True
            if self.answer_ids == "logprobs":
                body.update(logprobs=1, return_tokens_as_token_ids=True)
        return body

    def complete(self, prompt_ids: Sequence[int], prompt_text: str, max_new_tokens: int) -> tuple[list[int], str]:
        """The greedy answer to one prompt: (token ids, finish reason)."""
        response = self._call("POST", "/completions", self.request(prompt_ids, prompt_text, max_new_tokens))
        return self.parse(response, prompt_ids, prompt_text)

    def probe(self, prompt_ids: Sequence[int], prompt_text: str, max_new_tokens: int) -> tuple[list[int], str]:
        """Find the served model and how this server takes prompts and gives ids back, by answering the first
        prompt (its answer is returned, not wasted): token ids both ways where the server allows it, else (a
        refused id prompt) text with the answer re-tokenized (module docstring)."""
        with self._lock:
            self.model = self.served_model()
            self.prompt_as, self.answer_ids = "token ids", "returned"
            try:
                response = self._call("POST", "/completions", self.request(prompt_ids, prompt_text, max_new_tokens))
            except ServerError as e:
                if e.status is None:  # unreachable: no use trying text
                    raise
                self.prompt_as, self.answer_ids = "text", "re-tokenized"  # llama.cpp refuses ids (HTTP 500 or 422)
                try:
                    return self.complete(prompt_ids, prompt_text, max_new_tokens)
                except ServerError as again:
                    raise ServerError(f"{again} (sent as token ids: {e})", again.status) from None
            if _choice(response).get("token_ids") is None:  # an older vLLM: ids inside the log-probabilities
                self.answer_ids = "logprobs"
                return self.complete(prompt_ids, prompt_text, max_new_tokens)
            return self.parse(response, prompt_ids, prompt_text)

    def parse(self, response: dict[str, Any], prompt_ids: Sequence[int], prompt_text: str) -> tuple[list[int], str]:
        """(answer ids, finish reason) of a ``/v1/completions`` response (module docstring)."""
        choice = _choice(response)
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise ServerError(f"the server ended an answer with finish_reason={reason!r} (not stop or length): "
                              f"see its log; the run resumes from the last finished shard")
        reported = (response.get("usage") or {}).get("prompt_tokens")
        if reported is not None and reported != len(prompt_ids):
            raise ServerError(f"the server read the prompt as {reported} tokens, not the {len(prompt_ids)} of the "
                              f"target's tokenizer: serve the target's own model and tokenizer (no added BOS)")
        if self.answer_ids == "returned":
            ids = choice.get("token_ids")
            if ids is None:
                raise ServerError("the server returned no token ids (choices[0].token_ids) although the first "
                                  "answer had them; serve every rank from the same server version")
        elif self.answer_ids == "logprobs":
            ids = _logprob_ids(choice)
        else:
            ids = self._retokenize(prompt_ids, prompt_text, choice.get("text") or "")
        ids = [int(t) for t in ids]
        stops = set(self.stop_ids)
        if reason == "stop" and (not ids or ids[-1] not in stops):
            matched = choice.get("matched_stop", choice.get("stop_reason"))  # SGLang / vLLM: the stop token id
            if isinstance(matched, str):
                raise ServerError(f"the server stopped at the text {matched!r}: regeneration sends no stop strings; "
                                  f"start the server without default stop strings")
            ids.append(int(matched) if isinstance(matched, int) and matched in stops else self.stop_ids[0])
        return ids, reason

    def _retokenize(self, prompt_ids: Sequence[int], prompt_text: str, answer: str) -> list[int]:
        """The answer's ids from its text: the target's tokenization of prompt + answer past the prompt's ids
        (the answer alone where the two merge across the boundary)."""
        with self._tokenizer_lock:
            whole = self.tokenize(prompt_text + answer)
            n = len(prompt_ids)
            return whole[n:] if whole[:n] == list(prompt_ids) else self.tokenize(answer)


def _choice(response: dict[str, Any]) -> dict[str, Any]:
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ServerError(f"the server answered {len(choices)} choices where one was asked for")
    return choices[0]


def _logprob_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids written ``"token_id:N"`` in ``logprobs.tokens`` (vLLM's ``return_tokens_as_token_ids``)."""
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        raise ServerError("the server returned neither choices[0].token_ids nor log-probabilities with token ids: "
                          "use vLLM (>= 0.10.2 best), SGLang, or llama-cpp-python's server")
    return [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]


def generate_served(client: Client, prompts: Sequence[tuple[Sequence[int], str]], max_new_tokens: int,
                    concurrency: int) -> Iterator[Served]:
    """Answer ``prompts`` ((token ids, template text) pairs) through ``client``, at most ``concurrency``
    requests in flight; yield a :class:`Served` as each ends (in order of completion; ``index`` says which).

    The first prompt is answered alone (:meth:`Client.probe`), then worker threads take the rest. The threads are
    daemons and stop taking prompts when the consumer stops (an error, Ctrl-C): an interrupted run loses only
    answers not yet yielded."""
    if concurrency < 1 or max_new_tokens < 1:
        raise ValueError(f"concurrency={concurrency} and max_new_tokens={max_new_tokens} must be at least 1")
    if not prompts:
        return
    ids, reason = client.probe(*prompts[0], max_new_tokens)
    yield Served(0, ids, reason)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(1, len(prompts)):
        todo.put(i)
    done: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, client.complete(*prompts[i], max_new_tokens), None))
            except BaseException as e:  # handed to the consumer, which raises it
                done.put((i, None, e))
                return

    threads = [threading.Thread(target=work, daemon=True, name=f"served-{k}")
               for k in range(min(concurrency, len(prompts) - 1))]
    for t in threads:
        t.start()
    try:
        for _ in range(len(prompts) - 1):
            i, result, error = done.get()
            if error is not None:
                raise error
            yield Served(i, *result)
    finally:
        stop.set()
