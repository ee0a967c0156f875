"""The LLM proposer against this project's own OpenAI-compatible engine server, no double at all:
a tiny random-weight checkpoint (`engine random-checkpoint --preset tiny`) answers through the real
`openai` client. Its replies hold no module, so each is a `malformed` candidate; the tokens on
every run are the server's own usage counts, which the checkpoint's tokenizer confirms."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401

from cli.main import main
from engine_templates.engine.random_checkpoint import write_random_checkpoint
from engine_templates.engine.tokenizer import Tokenizer
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_coder(tmp_path_factory):
    """The engine serving random weights at the tiny preset's shape, with a context long enough
    for an op description."""
    model_dir = tmp_path_factory.mktemp("tiny-coder") / "model"
    write_random_checkpoint("tiny", model_dir, device="cpu", log=lambda _: None)
    log = model_dir.parent / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine_templates.engine", "serve", "--model-dir",
                                 str(model_dir), "--dtype", "fp32", "--port", "0", "--max-model-len", "16384",
                                 "--served-model-name", "tiny-coder"],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    if not line.startswith("serving tiny-coder on "):
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {log.read_text()[-2000:]}")
    yield line.split()[3], model_dir
    proc.terminate()
    proc.wait(timeout=30)


def test_random_weights_reply_malformed_with_the_servers_token_counts(prefect_server, tracking_home, capsys,
                                                                       monkeypatch, tiny_coder):
    url, model_dir = tiny_coder
    monkeypatch.setenv("INFERSMITH_TEST_ENGINE_KEY", "unused-by-the-engine")
    code = main(["optimize", "--op", "silu_mul", "--model", "tiny", "--budget", "2", "--proposer", "llm",
                 "--llm-provider", "openai", "--llm-base-url", f"{url}/v1", "--llm-model", "tiny-coder",
                 "--llm-api-key-env", "INFERSMITH_TEST_ENGINE_KEY", "--llm-temperature", "0",
                 "--llm-max-output-tokens", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    tracker = Tracker(TrackingConfig.from_env())
    parent_id = tracker.client.search_runs([tracker.experiment("silu_mul")], f"tags.`{T}kind` = 'optimization'",
                                           max_results=1, order_by=["attributes.start_time DESC"])[0].info.run_id
    children = [r for r in search(tracker, "silu_mul") if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert len(children) == 2
    tokenizer = Tokenizer(model_dir)
    for run in children:
        tags, m = run.data.tags, run.data.metrics
        assert (tags[f"{T}status"], tags[f"{T}failing_gate"]) == ("malformed", "reply")
        sent = Path(tracker.client.download_artifacts(run.info.run_id, "proposal/prompt.md")).read_text()
        system, user = sent.removeprefix("[system]\n").split("\n\n[user]\n", 1)
        chat = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert m["proposer_input_tokens"] == len(tokenizer.encode(chat)) > 1000
        assert 0 < m["proposer_output_tokens"] <= 24 and m["proposer_cached_input_tokens"] == 0
        assert m["proposer_usd"] == 0 and m["gpu_seconds"] == 0  # a model the price table lacks; no GPU held
        reply = Path(tracker.client.download_artifacts(run.info.run_id, "proposal/reply.md")).read_text()
        assert reply and Path(tracker.client.download_artifacts(run.info.run_id, "candidate/candidate.py")
                              ).read_text() == reply  # the candidate is the reply itself
    parent = tracker.client.get_run(parent_id).data.metrics
    assert parent["proposer_tokens"] == sum(r.data.metrics["proposer_tokens"] for r in children)
    assert parent["candidates"] == 2 and parent["passed"] == 0
