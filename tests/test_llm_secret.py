"""The LLM proposer's key for a run launched from a deployment's form: the form names a Prefect
Secret block, never the key; the process worker resolves it when the flow asks the model; and the
key is nowhere in MLflow, Prefect's logs, its artifacts, the run's parameters or the worker's
output. A base URL that holds credentials is refused in one line, from the command line and from a
form (where Prefect's server refuses the run before it exists). Prefect's test server, a real process worker, the real `openai`
client against the scripted provider (tests/scripted_llm.py)."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest
from conftest import CANDIDATES

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from scripted_llm import ScriptedLLM, Turn
from test_llm_proposer import assert_key_nowhere, fenced, prefect_logs

from cli.main import main

BLOCK = "infersmith-test-llm-key"
WORK_POOL = "infersmith-secret-test"
HONEST = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text().replace("import torch", "import torch  # secret")


def llm_form(url: str, **over) -> dict:
    """What a person fills in the deployment's form: the block's name, not the key."""
    return {"provider": "openai", "model": "scripted-coder", "base_url": url, "api_key_secret": BLOCK,
            "max_retries": 0, "timeout_s": 120} | over


@pytest.fixture
def worker(prefect_server, tmp_path, monkeypatch):
    """The deployments on a work pool of their own, and a process worker for it; the worker's
    environment holds no key. Yields the tracking home and the worker's output file."""
    from prefect.settings import PREFECT_API_URL

    from flows.deployments import DeploySettings, register
    from flows.sweep import SweepPlan

    home = tmp_path / "home"
    monkeypatch.setenv("INFERSMITH_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    register(DeploySettings(plan=SweepPlan(ops=["rmsnorm"], targets=[{"model": "tiny"}]), work_pool=WORK_POOL,
                            cron="0 3 * * *", timezone="UTC", active=False))
    env = {k: v for k, v in os.environ.items() if "KEY" not in k} | {
        "PREFECT_API_URL": PREFECT_API_URL.value(), "INFERSMITH_HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    out = tmp_path / "worker.log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL,
                                 "--type", "process", "--name", "secret-test"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield home, out
    finally:
        proc.terminate()  # Prefect's worker: a first SIGTERM asks it to stop gracefully (half a second)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:  # its graceful stop hangs at times on two loaded cores, after
            proc.kill()  # the test has passed: the worker is Prefect's, and only cleaned up here
            proc.wait()


def run(name: str, parameters: dict):
    from prefect.deployments import run_deployment

    return run_deployment(f"optimize-op/{name}", parameters=parameters, timeout=900, poll_interval=2)


def test_a_run_from_the_form_reads_its_key_from_a_secret_block_and_keeps_it_nowhere(worker):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client

    from tracking.history import search
    from tracking.schema import T, Tracker
    from tracking.store import TrackingConfig

    home, worker_log = worker
    key = "sk-block-" + secrets.token_hex(16)
    Secret(value=key).save(BLOCK, overwrite=True)
    name = f"optimize-op-{WORK_POOL.removeprefix('infersmith-')}"
    with ScriptedLLM([Turn(fenced(HONEST), 900, 0, 100)]) as llm:
        done = run(name, {"op": "rmsnorm", "target": {"model": "tiny", "budget": {"candidates": 1}},
                          "proposer": "llm", "llm": llm_form(llm.url + "/v1")})
        requests = llm.requests
    assert done.state.is_completed(), (done.state, worker_log.read_text()[-3000:])
    assert [r["headers"]["authorization"] for r in requests] == [f"Bearer {key}"]  # resolved on the worker

    tracker = Tracker(TrackingConfig.from_env())
    [child] = [r for r in search(tracker, "rmsnorm") if r.data.tags[f"{T}proposer"] == "llm:scripted-coder"]
    assert child.data.tags[f"{T}status"] == "pass"
    parent = tracker.client.get_run(child.data.tags["mlflow.parentRunId"])
    assert parent.data.params["llm.api_key_secret"] == BLOCK  # the block is named, the key never

    with get_client(sync_client=True) as client:
        artifacts = [json.dumps(a.data) for a in client.read_artifacts()]
        parameters = json.dumps(client.read_flow_run(done.id).parameters)
    assert artifacts and BLOCK in parameters
    time.sleep(3)  # the worker's process sends its last log lines in batches
    assert_key_nowhere(key, home, prefect_logs(), worker_log.read_text(), parameters, *artifacts)

    # a URL holding a key, typed into the form: the server refuses the run before it exists, naming
    # the field; no run, log line or tracking param holds the URL
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    for leaky in (f"http://user:{key}@127.0.0.1:9/v1", f"http://127.0.0.1:9/v1?api_key={key}"):
        with pytest.raises(PrefectHTTPStatusError) as e:
            run_deployment(f"optimize-op/{name}", timeout=0, parameters={
                "op": "rmsnorm", "target": {"model": "tiny"}, "proposer": "llm", "llm": llm_form(leaky)})
        assert e.value.response.status_code == 409
        assert "Validation failed for field 'llm.base_url'" in e.value.response.json()["detail"]
    with get_client(sync_client=True) as client:
        runs = json.dumps([r.parameters for r in client.read_flow_runs()])
    time.sleep(3)
    assert key not in runs and key not in prefect_logs() and key not in worker_log.read_text()


@pytest.mark.parametrize("url, says", [
    ("https://me:{key}@llm.example.com/v1", "the URL holds credentials (user:password@)"),
    ("https://llm.example.com/v1?api_key={key}", "the URL's query holds a key"),
    ("https://llm.example.com/v1?token={key}&api-version=2", "the URL's query holds a key"),
])
def test_a_base_url_with_credentials_is_one_line_that_does_not_show_them(url, says, capsys, monkeypatch):
    key = "sk-url-" + secrets.token_hex(8)
    monkeypatch.setenv("INFERSMITH_TEST_LLM_KEY", "sk-other")
    code = main(["optimize", "--op", "rmsnorm", "--model", "tiny", "--proposer", "llm", "--llm-api-key-env",
                 "INFERSMITH_TEST_LLM_KEY", "--llm-base-url", url.format(key=key)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (code, out, err)
    assert says in err and "api_key_secret" in err and key not in err


def test_a_missing_secret_block_is_one_line(prefect_server):
    from proposers.llm import LLMSettings, SettingsError

    with pytest.raises(SettingsError, match="^the Prefect Secret block no-such-block cannot be read: "):
        LLMSettings(api_key_secret="no-such-block").api_key()
    with pytest.raises(ValueError, match="lowercase letters, digits and dashes"):
        LLMSettings(api_key_secret="My Key")
