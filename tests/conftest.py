"""Shared fixtures. Real components only: real harness processes, MLflow on SQLite,
Prefect's own test server."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before any Triton kernel is defined: on a CPU, kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# The gauntlet suite (gauntlet/<op>/) doubles as the tests' planted candidates.
CANDIDATES = Path(__file__).resolve().parent.parent / "gauntlet"


@pytest.fixture(scope="session")
def tracking_home(tmp_path_factory):
    """MLflow on a fresh SQLite file for the whole session."""
    home = tmp_path_factory.mktemp("infersmith-home")
    old = {k: os.environ.get(k) for k in ("INFERSMITH_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["INFERSMITH_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def sam3_checkpoint(tmp_path_factory) -> Path:
    """The sam3-tiny preset's random checkpoint, drawn on the CPU once a test session."""
    from engine_templates.engine.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("sam3") / "sam3-tiny"
    write_random_checkpoint("sam3-tiny", out, device="cpu", log=lambda _: None)
    return out


def last_flow_log() -> str:
    """The lines the latest flow run logged (its prints), as Prefect's server holds them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort, LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the flow's last lines may still wait in this process's batch
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), sort=LogSort.TIMESTAMP_ASC)
    return "\n".join(log.message for log in logs)


def pytest_configure(config):
    """Bytecode for the harness's trees before any test runs: a stage's integrity gate takes
    a .pyc that appears under contract/, harness/ or engine_templates/ while its candidate runs for the
    candidate's, and with pytest-xdist another worker's first import could write one then.
    Once, in the controlling process (xdist workers carry `workerinput`)."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = CANDIDATES.parent
    for tree in ("contract", "harness", "engine_templates"):
        compileall.compile_dir(root / tree, quiet=2)


def pytest_addoption(parser):
    parser.addoption("--gauntlet-all", action="store_true",
                     help="run every gauntlet case, also those the manifest marks ci = false")


def pytest_terminal_summary(terminalreporter):
    """A count of the skips at the end of every run (CI's included: -ra gives their reasons above),
    those that need a GPU (marked `gpu`, or skipped for a reason naming one) listed: they skip where
    there is none, as in CI. A test that needs a service of the machine fails in CI instead of
    skipping (tests/services.py)."""
    skipped = terminalreporter.stats.get("skipped", [])
    gpu = sorted(r.nodeid for r in skipped if "gpu" in r.keywords or "GPU" in str(r.longrepr))
    terminalreporter.write_sep("-", f"{len(skipped)} skipped: {len(gpu)} need a GPU, {len(skipped) - len(gpu)} "
                                    "for other reasons (listed by -ra)")
    for nodeid in gpu:
        terminalreporter.write_line(f"needs a GPU: {nodeid}")
