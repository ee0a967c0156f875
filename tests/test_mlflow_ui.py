"""MLflow as a person meets it after an optimization: the op's experiment is marked as model
development and, on the UI's model-training side that every printed link asks for, opens on its
runs table, not the GenAI overview; the end of `optimize`, the flow's summary artifact in Prefect
and `leaderboard` link to MLflow's comparison of the best candidates, which lists their per-shape
times and speed-ups, % of roofline, GPU-hours, dollars and tokens side by side. A real MLflow
server (on SQLite) and Prefect's test server; the UI in Debian's headless Chromium."""
from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request

import pytest
from conftest import last_flow_log
from loopback_sshd import free_port

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from services import missing
from test_platform import browser, page_text  # noqa: F401  (browser: a fixture)

from cli.main import main
from cli.stack import _python_tool
from tracking.mlflow_ui import TRAINING
from tracking.store import KIND_TAG, MODEL_DEVELOPMENT

LINK = re.compile(r"(http://127\.0\.0\.1:\d+/#/compare-runs\?runs=\S+)")


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a SQLite file of this test, as `infersmith up` starts it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "mlflow.log", "w") as log:
        proc = subprocess.Popen([_python_tool("mlflow"), "server", "--backend-store-uri",
                                 f"sqlite:///{tmp_path / 'mlflow.db'}", "--artifacts-destination",
                                 str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_mlflow_opens_on_the_runs_and_every_summary_links_the_comparison(
        prefect_server, mlflow_server, browser, tmp_path, monkeypatch, capsys):  # noqa: F811
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    assert main(["optimize", "--op", "silu_mul", "--model", "tiny", "--dtype", "fp32", "--budget", "2",
                 "--proposer", "random"]) == 0
    log = last_flow_log()
    printed = [line for line in log.splitlines() if "compare the best candidates in MLflow: " in line]
    assert len(printed) == 1, log
    link = LINK.search(printed[0])[1]

    mlflow = MlflowClient(mlflow_server)
    exp = mlflow.get_experiment_by_name("infersmith-silu_mul")
    assert exp.tags[KIND_TAG] == MODEL_DEVELOPMENT
    children = mlflow.search_runs([exp.experiment_id], "tags.`infersmith.kind` = 'candidate'",
                                  order_by=["metrics.score DESC"])
    ids = [c.info.run_id for c in children]
    assert len(ids) == 2 and link.startswith(f"{mlflow_server}/#/compare-runs?runs=")
    assert all(i in link for i in ids) and exp.experiment_id in link

    with get_client(sync_client=True) as client:
        summaries = [a for a in client.read_artifacts() if a.key == "summary-silu-mul"]
    assert any(f"[Compare the best candidates in MLflow]({link})" in a.data for a in summaries)

    assert main(["leaderboard", "--op", "silu_mul"]) == 0
    board = capsys.readouterr().out
    assert f"compare the best 2 side by side in MLflow: {link}" in board

    if browser is None:
        missing("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    [parent] = mlflow.search_runs([exp.experiment_id], "tags.`infersmith.kind` = 'optimization'")
    browser.get(f"{mlflow_server}/#/experiments/{exp.experiment_id}?{TRAINING}")
    text = page_text(browser, parent.info.run_name, "matching runs")
    browser.save_screenshot(str(browser.shots / "mlflow-experiment.png"))
    assert parent.info.run_name in text and "3 matching runs" in text and "No data available" not in text, text

    browser.get(link)
    text = page_text(browser, "Comparing 2 Runs", *ids)
    browser.save_screenshot(str(browser.shots / "mlflow-compare-best.png"))
    assert "Comparing 2 Runs" in text and all(i in text for i in ids), text
    shown = metric_names(browser)
    # (the CPU interpreter times no torch.compile baseline: on a GPU, <shape>/compile_us and
    # <shape>/speedup_vs_compile are there too)
    for name in ("score", "decode_b1/latency_us", "decode_b1/eager_us", "decode_b1/speedup_vs_eager",
                 "decode_b1/pct_roofline", "prefill_40/speedup_vs_eager", "gpu_hours", "total_usd", "cost_usd",
                 "proposer_tokens"):
        assert name in shown, (name, sorted(shown))


def metric_names(driver) -> set[str]:
    """The metrics the compare view lists: its table draws only the rows in sight, so it is scrolled
    through (each name links to the metric's chart)."""
    from selenium.webdriver.common.by import By

    names: set[str] = set()
    grids = driver.find_elements(By.CSS_SELECTOR, "div.ReactVirtualized__Grid")
    for top in range(0, 12000, 200):
        for grid in grids:
            driver.execute_script("arguments[0].scrollTop = arguments[1]", grid, top)
        time.sleep(0.1)
        names |= {a.text for a in driver.find_elements(By.CSS_SELECTOR, 'a[title="Plot chart"]') if a.text}
    return names
