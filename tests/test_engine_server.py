"""The OpenAI-compatible server, started for real (`python -m engine_templates.engine serve`
on a free loopback port) on the tiny dense checkpoint: streaming, usage counts, concurrent
requests batched with each answer its own, OpenAI-style errors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from counted_kernels import calls, counting_kernels
from tiny_checkpoints import checkpoint

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Hello world!", "The quick brown fox", "Continuous batching lets", "Numbers 0 1 2",
           "A small engine", "Paged attention keeps the cache in blocks; " * 4]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def counted(server_log) -> Path:
    """Where the server's rmsnorm kernel (counted_kernels.py: eager's work) counts its calls."""
    return server_log.parent / "counted"


@pytest.fixture(scope="module")
def server(server_log, counted):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kernels = server_log.parent / "kernels.json"
    kernels.write_text(json.dumps(counting_kernels(counted, ["rmsnorm"])))
    with open(server_log, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine_templates.engine", "serve", "--model-dir",
                                 str(checkpoint("dense")), "--dtype", "fp32", "--port", "0",
                                 "--max-model-len", "256", "--max-num-batched-tokens", "64",
                                 "--served-model-name", "tiny", "--request-log", "--kernels", str(kernels)],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith("serving tiny on "):
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {server_log.read_text()[-2000:]}")
    url = line.split()[3]
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def call(url: str, path: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers.get("Content-Type"), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def complete(url: str, prompt: str, **extra) -> dict:
    status, _, text = call(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True, **extra})
    assert status == 200, text
    return json.loads(text)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


def test_health_and_models(server, counted):
    status, _, text = call(server, "/health")
    kernels = json.loads(text)["kernels"]
    assert status == 200 and kernels["rmsnorm"] == {"impl": "free", "path": str(counted / "rmsnorm.py")}
    assert kernels["silu_mul"] == {"impl": "eager"}
    before = calls(counted, "rmsnorm")
    complete(server, PROMPTS[0])  # a prefill step and 11 decode steps, each with one rmsnorm
    assert calls(counted, "rmsnorm") >= before + 12
    status, _, text = call(server, "/v1/models")
    models = json.loads(text)
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == "tiny"


def test_completion_counts_usage(server):
    out = complete(server, PROMPTS[0])
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] > 0
    assert out["usage"]["total_tokens"] == 12 + out["usage"]["prompt_tokens"]


def test_completion_streams_valid_sse_with_the_same_text(server):
    whole = complete(server, PROMPTS[1])["choices"][0]["text"]
    status, kind, text = call(server, "/v1/completions", {
        "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and kind.startswith("text/event-stream")
    events = sse_events(text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_request_log_says_where_a_request_spent_its_time(server, server_log):
    prompt = "A request log line for this one " * 3
    status, _, text = call(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                                       "temperature": 0, "ignore_eos": True, "stream": True})
    assert status == 200
    usage_prompt = complete(server, prompt, max_tokens=1)["usage"]["prompt_tokens"]
    lines = [ln for ln in server_log.read_text().splitlines()
             if ln.startswith("request ") and f": {usage_prompt} prompt tokens, 5 generated (length)" in ln]
    assert lines, server_log.read_text()[-2000:]
    m = re.search(r"handed to the engine ([\d.]+), taken ([\d.]+), first token ([\d.]+), done ([\d.]+)", lines[-1])
    assert m, lines[-1]
    handed, taken, first, done = map(float, m.groups())
    assert 0 <= handed <= taken <= first <= done, lines[-1]


def test_chat_streams_role_then_content(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    status, _, text = call(server, "/v1/chat/completions", body)
    whole = json.loads(text)
    assert status == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant" and whole["usage"]["completion_tokens"] == 8
    status, _, text = call(server, "/v1/chat/completions", {**body, "stream": True})
    events = sse_events(text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_each_get_their_own_answer(server):
    alone = [complete(server, p)["choices"][0]["text"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], PROMPTS * 2))
    assert together == alone * 2
    assert json.loads(call(server, "/health")[2])["largest_batch"] > 1
    assert len(set(alone)) == len(alone)


def test_logprobs_of_the_chosen_tokens_on_whole_completions(server):
    out = complete(server, PROMPTS[0], logprobs=0, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 12 and all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(x <= 0 for x in lp["token_logprobs"]) and lp["top_logprobs"] is None
    named = complete(server, PROMPTS[0], logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert "".join(named) == out["choices"][0]["text"]  # ignore_eos: no stop token in the text


def test_stop_string_ends_the_text(server):
    text = complete(server, PROMPTS[0])["choices"][0]["text"]
    stop = text[4:6]
    out = complete(server, PROMPTS[0], stop=stop)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == text[:text.find(stop)]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0, "stream": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    got, kind, text = call(server, path, body)
    error = json.loads(text)["error"]
    assert got == status and kind.startswith("application/json")
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_body_that_is_not_json_is_a_400(server):
    for body in (b"{not json", b"[1, 2"):  # the second bad body too: the first broke nothing
        got, kind, text = call(server, "/v1/completions", raw=body)
        assert got == 400 and kind.startswith("application/json"), (body, got, text)
        assert "not valid JSON" in json.loads(text)["error"]["message"], body
    status, _, _ = call(server, "/health")
    assert status == 200  # and the server is still fine
