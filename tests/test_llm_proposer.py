"""`optimize --proposer llm` with the real `openai` and `anthropic` clients against a scripted
provider on loopback (tests/scripted_llm.py): the gates decide every module's verdict, a reply
with no code is `malformed`, the SDK retries a 429, tokens and dollars add up on child and parent
runs, the $ budget and an endpoint that stops answering end the flow, and the API key appears
nowhere in MLflow, artifacts or output. Bad settings are one line and exit 2 before any flow."""
from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

import pytest
from conftest import CANDIDATES

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from scripted_llm import ScriptedLLM, Turn

from cli.main import main
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

KEY_ENV = "INFERSMITH_TEST_LLM_KEY"
HONEST = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text()
PRICES = {"input": 3.0, "cached_input": 0.3, "output": 15.0}


def fenced(code: str, words: str = "Here is the module.") -> str:
    return f"{words}\n\n```python\n{code}```\n"


@pytest.fixture
def tracking_home(tmp_path, monkeypatch) -> Path:
    """A store of this test's own: the prompt's history is then this flow's candidates only, not
    the better-scoring rmsnorm candidates other tests of the session left for the same target."""
    home = tmp_path / "home"
    monkeypatch.setenv("INFERSMITH_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture
def key(monkeypatch) -> str:
    value = "sk-test-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_ENV, value)
    return value


@pytest.fixture
def prices(tmp_path) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(f"scripted-coder: {json.dumps(PRICES)}\n")
    return path


def optimize(capsys, url: str, prices: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["optimize", "--op", "rmsnorm", "--model", "tiny", "--proposer", "llm", "--llm-model",
                 "scripted-coder", "--llm-base-url", url, "--llm-api-key-env", KEY_ENV, "--llm-prices",
                 str(prices), "--llm-max-retries", "1", "--llm-timeout", "2", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def runs_of(parent_id: str) -> tuple[Tracker, object, list]:
    tracker = Tracker(TrackingConfig.from_env())
    children = [r for r in search(tracker, "rmsnorm") if r.data.tags.get("mlflow.parentRunId") == parent_id]
    return tracker, tracker.client.get_run(parent_id), children


def last_parent(op: str = "rmsnorm") -> str:
    tracker = Tracker(TrackingConfig.from_env())
    where = f"tags.`{T}kind` = 'optimization' AND tags.`{T}op` = '{op}'"
    return tracker.client.search_runs([tracker.experiment(op)], where, max_results=1,
                                      order_by=["attributes.start_time DESC"])[0].info.run_id


def usd(turn: Turn) -> float:
    return (turn.input_tokens * PRICES["input"] + turn.cached_tokens * PRICES["cached_input"]
            + turn.output_tokens * PRICES["output"]) / 1e6


def prefect_logs() -> str:
    """Every log line the Prefect server holds: the flows' prints and the tasks' records."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the flow's last lines may still wait in this process's batch
    lines, offset = [], 0
    with get_client(sync_client=True) as client:  # in one order, so that no page skips a line
        while page := client.read_logs(limit=200, offset=offset, sort=LogSort.TIMESTAMP_ASC):
            lines += [log.message for log in page]
            offset += len(page)
    return "\n".join(lines)


def assert_key_nowhere(key: str, home: Path, *texts: str) -> None:
    for text in texts:
        assert key not in text
    for path in home.rglob("*"):  # the MLflow store and every artifact
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path


def test_openai_replies_are_judged_by_the_gates_and_a_silent_endpoint_ends_the_flow(
        prefect_server, tracking_home, capsys, key, prices):
    script = [Turn(fenced(HONEST), 1200, 300, 150),
              Turn(fenced((CANDIDATES / "rmsnorm" / "syntax_error.py").read_text()), 1300, 0, 40),
              Turn.error(429),
              Turn("I would fuse the reduction with the scaling, but I will not write code today.", 1400, 0, 20),
              Turn(fenced((CANDIDATES / "rmsnorm" / "mutates_input.py").read_text()), 1500, 100, 90)]
    with ScriptedLLM(script) as llm:
        code, out, err = optimize(capsys, llm.url + "/v1", prices, "--budget", "8", "--llm-provider", "openai")
        requests = llm.requests
    assert code == 1
    down = [line for line in err.splitlines() if line.startswith("infersmith:")]
    assert len(down) == 1 and "stopped answering" in down[0] and "4 candidates judged" in down[0], err

    # every request carried the key; the 429 was retried by the SDK, the silence too, then given up
    assert all(r["headers"]["authorization"] == f"Bearer {key}" for r in requests)
    # then silence: each proposal waiting on it asked once and once more (--llm-max-retries 1); the
    # flow proposes the next candidate while one runs, so one or two proposals were waiting
    assert len(requests) - len(script) in (2, 4) and all(r["path"] == "/v1/chat/completions" for r in requests)
    assert requests[0]["body"]["model"] == "scripted-coder"
    later = requests[-1]["body"]["messages"][1]["content"]  # the history came back in the prompt
    assert HONEST.strip() in later and "inputs_unchanged" in later and "malformed at gate `reply`" in later
    assert "seed" not in later  # the failure's detail named the seed of its inputs

    tracker, parent, children = runs_of(last_parent())
    assert len(children) == 4
    by_reply = {}
    for run in children:
        reply = Path(tracker.client.download_artifacts(run.info.run_id, "proposal/reply.md")).read_text()
        by_reply[reply] = run
        assert "rmsnorm(x, weight, eps)" in Path(tracker.client.download_artifacts(
            run.info.run_id, "proposal/prompt.md")).read_text()
    expected = {0: ("pass", ""), 1: ("fail", "load"), 3: ("malformed", "reply"), 4: ("fail", "inputs_unchanged")}
    for i, (status, gate) in expected.items():
        turn = script[i]
        run = by_reply[turn.text]
        tags, m = run.data.tags, run.data.metrics
        assert (tags[f"{T}status"], tags[f"{T}failing_gate"]) == (status, gate), (i, tags.get(f"{T}failing_detail"))
        assert tags[f"{T}proposer"] == "llm:scripted-coder"
        assert (m["proposer_input_tokens"], m["proposer_cached_input_tokens"], m["proposer_output_tokens"]) == (
            turn.input_tokens, turn.cached_tokens, turn.output_tokens)
        assert m["proposer_tokens"] == turn.input_tokens + turn.cached_tokens + turn.output_tokens
        assert m["proposer_usd"] == pytest.approx(usd(turn))
    assert by_reply[script[3].text].data.metrics["gpu_seconds"] == 0  # never sent to the pool
    pm = parent.data.metrics
    answered = [script[i] for i in expected]
    assert pm["candidates"] == 4 and pm["passed"] == 1
    assert pm["proposer_tokens"] == sum(t.input_tokens + t.cached_tokens + t.output_tokens for t in answered)
    assert pm["proposer_usd"] == pytest.approx(sum(usd(t) for t in answered))
    assert parent.data.params["llm.api_key_env"] == KEY_ENV
    logs = prefect_logs()
    assert "proposing stopped: the openai endpoint" in logs and "malformed  [reply]" in logs
    assert_key_nowhere(key, tracking_home, out, err, logs)


def test_anthropic_replies_stop_at_the_dollar_budget(prefect_server, tracking_home, capsys, key, prices):
    # Each reply costs $0.0105 at the price file's rates: after two, a third would pass $0.025.
    # (A module the store holds already, from any flow of this target, would be a repeat: malformed.)
    mine = HONEST.replace("import torch", "import torch  # written for the $ budget")
    script = [Turn(fenced(mine), 1000, 0, 500), Turn.error(429),
              Turn("The kernel above is as fast as this op gets.", 1000, 0, 500),
              Turn(fenced(HONEST + "\n# never asked for\n"), 1000, 0, 500)]
    with ScriptedLLM(script) as llm:
        code, out, err = optimize(capsys, llm.url, prices, "--budget", "6", "--max-usd", "0.025")
        requests = llm.requests
    assert code == 0, err
    assert len(requests) == 3 and all(r["path"] == "/v1/messages" for r in requests)
    sent = requests[0]["headers"]  # the SDK sends the key as a bearer token or as x-api-key
    assert key in (sent.get("x-api-key"), sent.get("authorization", "").removeprefix("Bearer "))
    tracker, parent, children = runs_of(last_parent())
    statuses = sorted((r.data.tags[f"{T}status"], r.data.tags[f"{T}failing_gate"]) for r in children)
    assert statuses == [("malformed", "reply"), ("pass", "")]
    assert parent.data.metrics["proposer_usd"] == pytest.approx(2 * usd(script[0]))
    assert parent.data.metrics["proposer_output_tokens"] == 1000
    reason = json.loads(Path(tracker.client.download_artifacts(parent.info.run_id, "stop_reason.json")).read_text())
    assert reason["reason"].startswith("$ budget of 0.025")
    assert_key_nowhere(key, tracking_home, out, err, prefect_logs())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_llm_settings_are_one_line_and_exit_2_before_any_flow(capsys, key, tmp_path):
    def refused(url: str, *argv: str) -> str:
        code = main(["optimize", "--op", "rmsnorm", "--model", "tiny", "--proposer", "llm",
                     "--llm-api-key-env", KEY_ENV, "--llm-base-url", url, *argv])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (code, out, err)
        return err

    bad = tmp_path / "bad.yaml"
    bad.write_text("scripted-coder: {input: 1.0, output: -2}\n")
    with ScriptedLLM([]) as llm:
        assert "INFERSMITH_NO_SUCH_KEY is not set" in refused(llm.url, "--llm-api-key-env", "INFERSMITH_NO_SUCH_KEY")
        assert f"price file {bad}: scripted-coder." in refused(llm.url, "--llm-prices", str(bad))
        assert "provider" in refused(llm.url, "--llm-provider", "mistral")
        assert "--max-usd needs a price for model unpriced" in refused(llm.url, "--llm-model", "unpriced",
                                                                        "--max-usd", "1")
        assert llm.requests == []  # no request reached the endpoint
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "unreachable" in refused(f"http://127.0.0.1:{port}/v1")
