"""The team platform for real: `infersmith up` on PostgreSQL (a Prefect server, an MLflow server
with its artifacts on moto's S3 server, a process worker), a deployment run triggered through the
Prefect API and picked up by the worker, the UIs in headless Chromium, and `infersmith down`.

One stack, one test: each check is a subtest of it, so that pytest-xdist never spreads the checks —
and a stack each — over its workers. PostgreSQL comes from INFERSMITH_TEST_POSTGRES, a URL whose
role may create databases (.ci/run starts Debian's server and sets it); Chromium and chromedriver
from Debian's packages."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from loopback_sshd import free_port
from moto_s3 import s3_server

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from services import missing

from cli.processes import Started, family

ROOT = Path(__file__).resolve().parent.parent
PG = os.environ.get("INFERSMITH_TEST_POSTGRES")
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
BUCKET = "team-artifacts"
CRON, TIMEZONE = "30 1 * * *", "Europe/Paris"
TINY_RUN = {"op": "silu_mul", "proposer": "random",
            "target": {"model": "tiny", "dtype": "fp32", "budget": {"candidates": 2}}}


def infersmith(*argv: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, **kw)


def test_up_with_a_port_in_use_says_which_and_exits_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = infersmith("up", "--prefect-port", str(free_port()), "--mlflow-port", str(port),
                          env={**os.environ, "INFERSMITH_HOME": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr == f"infersmith: port {port} on 127.0.0.1 (for the MLflow server) is in use: " \
                          "Address already in use\n"
    assert not (tmp_path / "stack.json").exists()


@pytest.fixture
def databases():
    """Two fresh databases, one for Prefect and one for MLflow, dropped afterwards."""
    if not PG:
        missing("needs PostgreSQL: set INFERSMITH_TEST_POSTGRES=postgresql://user:password@host:port/db "
                "(.ci/run starts Debian's PostgreSQL and sets it)")
    import psycopg

    try:
        admin = psycopg.connect(PG, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as e:
        missing(f"PostgreSQL of INFERSMITH_TEST_POSTGRES does not answer: {str(e).splitlines()[0]}")
    names = [f"infersmith_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("prefect", "mlflow")]
    for name in names:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG.rsplit("/", 1)[0]
    yield [f"{base}/{name}" for name in names]
    for name in names:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


class Stack:
    def __init__(self, proc: subprocess.Popen, home: Path, prefect: str, mlflow: str, s3, env: dict):
        self.proc, self.home, self.prefect, self.mlflow, self.s3, self.env = proc, home, prefect, mlflow, s3, env
        self.api = f"{prefect}/api"

    def record(self) -> dict:
        return json.loads((self.home / "stack.json").read_text())

    @contextmanager
    def client(self):
        """A Prefect client of the stack's server."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api}), get_client(sync_client=True) as client:
            yield client


def _read_lines(stream, lines: list[str], ready: threading.Event) -> None:
    for line in stream:
        lines.append(line)
        if line.startswith("MLflow UI:"):
            ready.set()
    ready.set()  # the stream ended: `up` exited


@pytest.fixture
def stack(databases, tmp_path):
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("ops: [rmsnorm]\ntargets: [{model: tiny, budget: {candidates: 1}}]\nproposer: random\n")
    prefect_port, mlflow_port = free_port(), free_port()
    with s3_server(tmp_path / "moto.log", buckets=(BUCKET,)) as s3:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        env |= s3.env() | {"INFERSMITH_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        argv = ["up", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port),
                "--prefect-database", databases[0], "--mlflow-database", databases[1],
                "--artifacts", f"s3://{BUCKET}/team", "--sweep", str(sweep_file), "--cron", CRON,
                "--timezone", TIMEZONE]
        with open(tmp_path / "up.err", "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=err)
        lines: list[str] = []
        ready = threading.Event()
        threading.Thread(target=_read_lines, args=(proc.stdout, lines, ready), daemon=True).start()
        try:
            ready.wait(600)
            assert any(line.startswith("MLflow UI:") for line in lines), \
                f"`infersmith up` did not come up:\n{''.join(lines)}{(tmp_path / 'up.err').read_text()[-3000:]}"
            yield Stack(proc, tmp_path / "home", f"http://127.0.0.1:{prefect_port}",
                        f"http://127.0.0.1:{mlflow_port}", s3, env)
        finally:
            if proc.poll() is None:  # the down check did not run or failed: stop it as Ctrl-C does
                proc.send_signal(signal.SIGINT)
                proc.wait(120)


@pytest.fixture
def browser(tmp_path):
    """Debian's headless Chromium through selenium; None where it is not installed."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        yield None
        return
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                "--window-size=1400,1800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.shots = tmp_path / "screenshots"  # kept: pytest keeps its last three runs' folders
    driver.shots.mkdir()
    yield driver
    driver.quit()


def test_the_platform_on_one_machine(stack, browser, subtests, monkeypatch, capsys, tmp_path):
    with subtests.test("up registers the deployments, the sweep's schedule and a worker"):
        registered(stack)
    with subtests.test("a bad parameter is refused, naming the field"):
        refused(stack)
    with subtests.test("a second up for the same home is refused"):
        second_up_refused(stack, monkeypatch, capsys)
    with subtests.test("deploy keeps a schedule edited in the UI; a GPU class's pool gets its own deployments"):
        deployed(stack, monkeypatch, capsys, tmp_path)
    run = None
    with subtests.test("a deployment run completes on the worker, its candidates in MLflow and S3"):
        run = completed_run(stack, tmp_path)
    with subtests.test("the Prefect UI shows the deployment's form with the target's fields"):
        if browser is None:
            missing("needs Debian's chromium and chromium-driver (.ci/run installs them)")
        prefect_form(stack, browser)
    with subtests.test("MLflow's compare view shows two candidates side by side"):
        if browser is None:
            missing("needs Debian's chromium and chromium-driver (.ci/run installs them)")
        assert run is not None, "no completed run to compare"
        compare_view(stack, browser, run)
    with subtests.test("down stops what up started and nothing else"):
        down(stack)


def registered(stack: Stack) -> None:
    with stack.client() as client:
        names = {f"{client.read_flow(d.flow_id).name}/{d.name}" for d in client.read_deployments()}
        assert names == {"optimize-op/optimize-op", "optimize-engine/optimize-engine", "sweep/sweep",
                         "revalidate/revalidate"}
        sweep = client.read_deployment_by_name("sweep/sweep")
        [nightly] = sweep.schedules
        assert (nightly.schedule.cron, nightly.schedule.timezone, nightly.active) == (CRON, TIMEZONE, True)
        [beside] = client.read_deployment_by_name("revalidate/revalidate").schedules  # the same night
        assert (beside.schedule.cron, beside.schedule.timezone, beside.active) == (CRON, TIMEZONE, True)
        assert sweep.parameters["plan"]["ops"] == ["rmsnorm"]
        assert sweep.parameters["plan"]["targets"][0]["model"] == "tiny"
        assert client.read_work_pool("infersmith").type == "process"
        assert client.read_workers_for_work_pool("infersmith")
    assert [p["name"] for p in stack.record()["processes"]] == ["prefect-server", "mlflow-server", "worker"]


FIELD = "Validation failed for field '{}'"
UNEXPECTED = "Additional properties are not allowed ('{}' was unexpected)"
BAD_PARAMETERS = [  # (deployment, parameters, what the refusal says: the field named)
    ("optimize-op/optimize-op", {"op": "nope"}, FIELD.format("op")),
    ("optimize-op/optimize-op", {"op": "rmsnorm", "target": {"model": "qwen9"}}, FIELD.format("target.model")),
    ("optimize-op/optimize-op", {"op": "rmsnorm", "target": {"model": "tiny", "budget": {"candidates": 0}}},
     FIELD.format("target.budget.candidates")),
    # an unknown field inside a parameter, and an unknown parameter: each named
    ("optimize-op/optimize-op", {"op": "rmsnorm", "target": {"model": "tiny", "flavour": "x"}},
     f"{FIELD.format('target')}. Failure reason: {UNEXPECTED.format('flavour')}"),
    ("optimize-op/optimize-op", {"op": "rmsnorm", "targett": {"model": "tiny"}}, UNEXPECTED.format("targett")),
    ("sweep/sweep", {"plan": {"ops": ["rmsnorm", "nope"], "targets": [{"model": "tiny"}]}}, FIELD.format("plan.ops[1]")),
    ("sweep/sweep", {"plan": {"ops": ["rmsnorm"], "targets": [{"model": "tiny"}]}, "pools": None},
     UNEXPECTED.format("pools")),
]


def refused(stack: Stack) -> None:
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api}):
        for deployment, parameters, named in BAD_PARAMETERS:
            with pytest.raises(PrefectHTTPStatusError) as e:
                run_deployment(deployment, parameters=parameters, timeout=0)
            assert e.value.response.status_code == 409
            assert named in e.value.response.json()["detail"], (parameters, e.value.response.json()["detail"])


def second_up_refused(stack: Stack, monkeypatch, capsys) -> None:
    from cli.main import main

    monkeypatch.setenv("INFERSMITH_HOME", str(stack.home))
    assert main(["up", "--prefect-port", str(free_port()), "--mlflow-port", str(free_port())]) == 2
    assert capsys.readouterr().err == (f"infersmith: a stack already runs for {stack.home} (its record: "
                                       f"{stack.home / 'stack.json'}): `infersmith down` first\n")


def deployed(stack: Stack, monkeypatch, capsys, tmp_path) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    from cli.main import main

    with stack.client() as client:  # a person moves the nightly sweep and pauses it
        sweep = client.read_deployment_by_name("sweep/sweep")
        client.update_deployment_schedule(sweep.id, sweep.schedules[0].id, active=False,
                                          schedule=CronSchedule(cron="0 4 * * 6", timezone="UTC"))
    # no PREFECT_API_URL: the command finds the stack that `up` runs for its tracking home
    monkeypatch.setenv("INFERSMITH_HOME", str(stack.home))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    capsys.readouterr()
    assert main(["deploy"]) == 0
    out = capsys.readouterr().out
    assert "deployment sweep/sweep on work pool infersmith" in out
    assert "sweep schedule: 0 4 * * 6 (UTC), paused" in out
    assert f"launch them from {stack.prefect}/deployments" in out

    pool = tmp_path / "pool.yaml"
    pool.write_text("hosts: [{name: h100-a, address: 10.0.0.5, gpus: [0, 1], gpu_class: h100}]\n")
    assert main(["deploy", "--work-pool", "infersmith-h100", "--pool", str(pool)]) == 0
    with stack.client() as client:
        op = client.read_deployment_by_name("optimize-op/optimize-op-h100")
        assert op.work_pool_name == "infersmith-h100" and op.parameters["pool"]["hosts"][0]["name"] == "h100-a"
        [nightly] = client.read_deployment_by_name("sweep/sweep-h100").schedules
        assert (nightly.schedule.cron, nightly.active) == ("0 2 * * *", False)  # the example plan: paused
        assert client.read_deployment_by_name("sweep/sweep").schedules[0].schedule.cron == "0 4 * * 6"
        assert client.read_deployment_by_name("revalidate/revalidate").schedules[0].schedule.cron == CRON
        assert client.read_work_pool("infersmith-h100").type == "process"


def completed_run(stack: Stack, tmp_path):
    """A run of optimize-op triggered through the API with parameters, as the UI's form does: its
    optimization's MLflow parent run and candidates."""
    from mlflow.tracking import MlflowClient
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api}):
        run = run_deployment("optimize-op/optimize-op", parameters=TINY_RUN, timeout=900, poll_interval=2)
    assert run.state.is_completed(), (run.state, (stack.home / "logs" / "worker.log").read_text()[-3000:])
    mlflow = MlflowClient(stack.mlflow)
    exp = mlflow.get_experiment_by_name("infersmith-silu_mul")
    [parent] = mlflow.search_runs([exp.experiment_id], "tags.`infersmith.kind` = 'optimization'")
    assert parent.data.params["target.model"] == "tiny" and parent.data.params["proposer"] == "random"
    children = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 2 and {c.data.tags["infersmith.status"] for c in children} == {"pass"}

    # MLflow's artifacts went to S3 through the server, and come back through the MLflow client
    verdict = json.loads(Path(mlflow.download_artifacts(children[0].info.run_id, "verdict.json",
                                                        str(tmp_path))).read_text())
    assert verdict["status"] == "pass" and verdict["op"] == "silu_mul"
    keys = [o["Key"] for o in stack.s3.client().list_objects_v2(Bucket=BUCKET, Prefix="team/")["Contents"]]
    assert any(k.startswith("team/mlflow/") and k.endswith(f"{children[0].info.run_id}/artifacts/verdict.json")
               for k in keys), keys

    # the results archive the flow sent itself, through boto3
    key = f"team/results/infersmith-silu_mul/{parent.info.run_id}.tar.gz"
    body = stack.s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        verdicts = json.load(tar.extractfile(f"{parent.info.run_id}/verdicts.json"))
    assert set(verdicts) == {c.info.run_id for c in children}
    return exp, children


def page_text(driver, *wanted: str, timeout: float = 90.0) -> str:
    """The page's text once every `wanted` string shows (the UIs render after their API calls)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while True:
        text = driver.find_element(By.TAG_NAME, "body").text
        if all(w in text for w in wanted) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def prefect_form(stack: Stack, browser) -> None:
    with stack.client() as client:
        deployment = client.read_deployment_by_name("optimize-op/optimize-op")
    browser.get(f"{stack.prefect}/deployments/deployment/{deployment.id}/run")
    text = page_text(browser, "Parameters", "Gpu Class")
    browser.save_screenshot(str(browser.shots / "prefect-optimize-op-form.png"))
    for field in ("optimize-op", "op (Optional)", "target (Optional)", "Model (Optional)", "qwen3-8b", "tiny",
                  "Dtype (Optional)", "Workload (Optional)", "Gpu Class (Optional)", "Budget (Optional)",
                  "Candidates (Optional)"):
        assert field in text, field


def compare_view(stack: Stack, browser, run) -> None:
    exp, children = run
    ids = [c.info.run_id for c in children]
    browser.get(f"{stack.mlflow}/#/compare-runs?runs={json.dumps(ids)}&experiments={json.dumps([exp.experiment_id])}")
    text = page_text(browser, "Comparing 2 Runs", *ids)
    browser.save_screenshot(str(browser.shots / "mlflow-compare.png"))
    assert "Comparing 2 Runs" in text and "infersmith-silu_mul" in text
    for c in children:
        assert c.info.run_id in text and c.info.run_name in text
    assert "point.block" in text


def down(stack: Stack) -> None:
    # a bystander that looks like one of the stack's processes: down goes by its record, not by names
    bystander = subprocess.Popen(["bash", "-c", 'exec -a "prefect worker start --pool infersmith" sleep 300'],
                                 start_new_session=True)
    try:
        recorded = stack.record()["processes"]
        done = infersmith("down", env=stack.env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "stopped prefect-server, mlflow-server, worker\n"
        assert stack.proc.wait(60) == 0  # `up` stopped its stack itself and ended well
        started = [Started(**p) for p in recorded]
        deadline = time.monotonic() + 10  # the exited ones' last zombies are reaped by init
        while any(family(s) for s in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [family(s) for s in started] == [[], [], []]
        assert not (stack.home / "stack.json").exists()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
