"""The `infersmith` command: exit codes, one-line errors, the verdict it prints."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CANDIDATES

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401

from cli.main import main

RMS = CANDIDATES / "rmsnorm"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ops_lists_signatures(capsys):
    code, out, _ = run(capsys, "ops")
    assert code == 0
    assert "rmsnorm(x, weight, eps)" in out and "silu_mul(gate, up)" in out and "tiny" in out


@pytest.mark.parametrize("argv, message", [
    (["evaluate", "--op", "nope", "--model", "tiny", "--candidate", str(RMS / "honest_torch.py")], "unknown op 'nope'"),
    (["evaluate", "--op", "rmsnorm", "--model", "qwen9", "--candidate", str(RMS / "honest_torch.py")], "is neither a model preset"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", "/no/such/file.py"], "cannot read candidate"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "syntax_error.py")], "syntax error at line 2"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "wrong_signature.py")], "does not match"),
    (["evaluate", "--op", "silu_mul", "--model", "tiny", "--candidate", str(RMS / "honest_torch.py")], "no top-level function `silu_mul`"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--budget", "0"], "--budget must be at least 1"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--decode-batches", "1,x"], "comma-separated integers"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--template", "nope"], "no template 'nope'"),
    (["optimize", "--op", "rmsnorm", "--proposer", "genius"], "invalid choice"),
    (["optimize-engine", "--model-dir", ".", "--proposer", "genius"], "invalid choice"),
    (["leaderboard", "--op", "rmsnorm", "--model", "qwen9"], "is neither a model preset"),
    (["revalidate", "--model", "qwen9"], "is neither a model preset"),
    (["optimize", "--op", "fused_moe", "--model", "qwen3-8b"], "needs a mixture-of-experts preset"),
    (["gauntlet", "--op", "rmsnorm", "--jobs", "0"], "--jobs must be at least 1"),
    (["gauntlet", "--op", "silu_mul", "--case", "no_such_case"], "no gauntlet case of silu_mul has 'no_such_case'"),
    # this machine is the pool: a CPU host; a100 is a class a pool file may give a host, so it is
    # refused for the pool's lack, as h100 is, before any flow starts
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "honest_torch.py"),
      "--gpu-class", "h100"], "the pool has no host of GPU class h100 (its hosts' classes: cpu)"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "honest_torch.py"),
      "--gpu-class", "a100"], "the pool has no host of GPU class a100"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--gpu-class", "h200"], "the pool has no host of GPU class h200"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--gpu-class", "h999"], "gpu_class: Input should be 'any'"),
    (["gauntlet", "--op", "rmsnorm", "--gpu-class", "l40s"], "the pool has no host of GPU class l40s"),
    (["gauntlet", "--op", "rmsnorm", "--model", "nope"], "'nope' is neither a model preset"),
    (["gauntlet", "--op", "rmsnorm", "--stage-timeout", "0"], "stage_timeout_s: Input should be greater than 0"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--stage-limit", "bench=5"],
     "expected compile=SECONDS or check=SECONDS, got 'bench=5'"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--stage-limit", "compile=soon"],
     "expected a number of seconds after compile=, got 'soon'"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--stage-limit", "check=0"],
     "check_timeout_s: Input should be greater than 0"),
    (["leaderboard", "--op", "rmsnorm", "--limit", "0"], "--limit must be at least 1, not 0"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--rtol", "1e-3", "--approval-rtol", "1e-4"],
     "bad target: approval_rtol 0.0001 must be looser than the tolerance 0.001, not tighter"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--dtype", "bf16", "--approval-rtol", "1e-3"],
     "approval_rtol 0.001 must be looser than the tolerance 0.01"),
    (["kb", "publish", "rmsnorm-decode-h100-nope-1"], "no knowledge entry 'rmsnorm-decode-h100-nope-1'"),
    (["kb", "export", "out", "--state", "final"], "unknown state final; known: draft, published, retired"),
    (["leaderboard", "--op", "rmsnorm", "--limit", "-1"], "--limit must be at least 1, not -1"),
    (["pool", "check", "--stage-timeout", "-5"], "--stage-timeout must be more than 0 seconds, not -5.0"),
    (["optimize-engine", "--model-dir", ".", "--kernels-per-op", "-1"], "--kernels-per-op must be at least 0"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--max-gpu-hours", "0"],
     "bad target: budget.max_gpu_hours: Input should be greater than 0"),
    (["optimize-engine", "--model-dir", ".", "--max-gpu-hours", "-1"], "budget.max_gpu_hours: Input should be greater"),
    (["optimize-engine", "--model-dir", ".", "--plateau", "0"], "budget.plateau: Input should be greater than 0"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--usd-per-gpu-hour", "-2"],
     "--usd-per-gpu-hour must be at least 0, not -2"),
    (["sweep", str(CANDIDATES.parent / "infra" / "sweep.yaml"), "--max-gpu-hours", "0"], "--max-gpu-hours must be more than 0, not 0"),
    (["mcp", "--max-candidates", "0"], "--max-candidates must be at least 1, not 0"),
    # the end-to-end commands take no option of the kernel stages
    (["serve-bench", "--model-dir", ".", "--rtol", "0.5"], "unrecognized arguments: --rtol 0.5"),
    (["optimize-engine", "--model-dir", ".", "--decode-batches", "1"], "unrecognized arguments: --decode-batches 1"),
    # a server command is filled in and split before anything runs
    (["serve-bench", "--model-dir", "/absent", "--model", "tiny", "--baseline", "python3 -m http.server {prot}"],
     "--baseline: unknown placeholder {prot} in 'python3 -m http.server {prot}'; known: {port}, {model_dir}, "
     "{name}, {replica}, {python}, {max_model_len}"),
    (["serve-bench", "--model-dir", "/absent", "--model", "tiny", "--candidate", "srv --port {port"],
     "--candidate: cannot fill in 'srv --port {port' (expected '}' before end of string)"),
    (["optimize-engine", "--model-dir", "/absent", "--model", "tiny", "--baseline", "srv '{port}"],
     "cannot be split like a shell line: No closing quotation"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_evaluate_pass_and_fail_exit_codes_and_json(capsys, prefect_server, tracking_home):
    code, out, _ = run(capsys, "evaluate", "--op", "rmsnorm", "--model", "tiny",
                       "--candidate", str(RMS / "honest_torch.py"), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["verdict"]["status"] == "pass" and result["run_id"] and result["gpu_seconds"] > 0
    code, out, _ = run(capsys, "evaluate", "--op", "rmsnorm", "--model", "tiny",
                       "--candidate", str(RMS / "wrong_values.py"))
    assert code == 1 and "status: fail" in out and "FAIL accuracy" in out
    code, out, _ = run(capsys, "leaderboard", "--op", "rmsnorm", "--model", "tiny")
    assert code == 0 and "free:" in out and "interpreter timing" in out


def test_the_installed_command_refuses_bad_input_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "cli", "optimize", "--op", "rmsnorm", "--model", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "'nope' is neither a model preset" in proc.stderr and "Traceback" not in proc.stderr


def test_the_installed_command_ends_with_its_output_flushed_and_its_exit_code():
    """The command ends without tearing its interpreter down (cli.main.exit_now): what it printed
    into a pipe (block-buffered) still arrives, and its exit code is the command's."""
    proc = subprocess.run([sys.executable, "-m", "cli", "ops"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "rmsnorm(x, weight, eps)" in proc.stdout and proc.stdout.endswith("\n")


def test_a_tracking_store_from_another_mlflow_is_one_line_not_a_traceback(tmp_path):
    # What a GPU host's store looks like here when its wheels had a newer mlflow-skinny, and a
    # store from an older MLflow. `optimize` opens the store inside a Prefect flow, which would
    # log a traceback first; it runs in a subprocess, as a user runs it.
    import os
    import shutil
    import sqlite3

    import mlflow

    from tracking.errors import TrackingStoreError
    from tracking.store import TrackingConfig, client

    def store(name, revision):
        """A store made by this MLflow, then marked as at `revision`; a new file each time (MLflow
        keeps a store it opened for the process's life)."""
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "made" / "mlflow.db", tmp_path / name / "mlflow.db")
        with sqlite3.connect(tmp_path / name / "mlflow.db") as db:
            db.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        return tmp_path / name

    before = mlflow.get_tracking_uri()
    try:
        client(TrackingConfig(uri=f"sqlite:///{tmp_path / 'made' / 'mlflow.db'}", artifact_root=None))
        older = store("older", "0a8213491aaa")  # one of this MLflow's own earlier revisions
        with pytest.raises(TrackingStoreError, match="an older MLflow wrote it.*mlflow db upgrade"):
            client(TrackingConfig(uri=f"sqlite:///{older / 'mlflow.db'}", artifact_root=None))
    finally:
        mlflow.set_tracking_uri(before)

    newer = store("newer", "zzzzzzzzzzzz")  # not hex: no migration of any MLflow has that revision
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"INFERSMITH_HOME": str(newer)}
    done = subprocess.run([sys.executable, "-m", "cli", "optimize", "--op", "rmsnorm", "--model", "tiny",
                           "--budget", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "has database schema zzzzzzzzzzzz" in done.stderr and "a newer MLflow wrote it" in done.stderr
    assert "controller_wheels.sh" in done.stderr


def test_a_store_that_refuses_to_create_an_experiment_is_one_line_naming_why(tmp_path, monkeypatch, capsys):
    """Only a lost race to create the experiment (it exists now) is taken as one: a store that
    cannot write (here a SQLite file opened read-only) is one line with MLflow's reason."""
    import mlflow
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()  # a store, made
    monkeypatch.chdir(tmp_path)  # MLflow reads the read-only URI as a path too, and makes a `file:` folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///file:{tmp_path / 'mlflow.db'}?mode=ro&uri=true")
    before = mlflow.get_tracking_uri()
    try:
        code, out, err = run(capsys, "leaderboard", "--op", "rmsnorm")
    finally:
        mlflow.set_tracking_uri(before)
    # (MLflow's SQL store logs the database error itself first, traceback included)
    ours = err.strip().splitlines()[-1]
    assert code == 1 and out == "" and "AttributeError" not in err
    assert ours.startswith("infersmith: cannot create the experiment infersmith-rmsnorm in the tracking store")
    assert ours.endswith("attempt to write a readonly database")


def test_a_well_formed_server_command_passes_to_the_next_check(capsys):
    """The command checks refuse only what the stage cannot fill in: here the model directory is next."""
    code, _, err = run(capsys, "serve-bench", "--model-dir", "/absent", "--model", "tiny",
                       "--baseline", "srv --port {port} --model {model_dir} --name {name} --copy {replica} '{{x}}'",
                       "--candidate", "other --port={port}")
    assert code == 2 and err.strip() == "infersmith: not a model directory (config.json and tokenizer.json): /absent"


def test_a_file_that_is_not_text_is_one_line(capsys, tmp_path):
    binary = tmp_path / "serving.yaml"
    binary.write_bytes(b"\xff\xfe\x00traffic")
    code, _, err = run(capsys, "serve-bench", "--model-dir", "/absent", "--model", "tiny", "--serving", str(binary))
    assert code == 2 and err.strip() == f"infersmith: {binary}: not a text file (not UTF-8)"
    binary.write_text('baseline: "srv {prot}"')
    code, _, err = run(capsys, "serve-bench", "--model-dir", "/absent", "--model", "tiny", "--serving", str(binary))
    assert code == 2 and err.strip().startswith(f"infersmith: {binary}: baseline: unknown placeholder {{prot}}")


def test_shape_options_of_a_tiny_preset_fill_in_from_its_tiny_workload():
    from cli.args import target_of
    from cli.main import build_parser

    for model in ("tiny", "tiny-moe"):
        args = build_parser().parse_args(["optimize", "--op", "fused_moe", "--model", model, "--decode-batches", "2"])
        w = target_of(args).workload
        assert (w.decode_batches, w.prefill_tokens, w.contexts) == ([2], [40], [48]), model
    args = build_parser().parse_args(["optimize", "--op", "fused_moe", "--model", "qwen3-30b-a3b", "--contexts", "64"])
    w = target_of(args).workload
    assert (w.decode_batches, w.prefill_tokens, w.contexts) == ([1, 8, 32, 128], [2048, 16384], [64])


def test_every_gpu_class_of_a_pool_file_is_a_target_class():
    from typing import get_args

    from targets import GPUClass, GPUClassName, Target

    assert set(get_args(GPUClass)) == {"any"} | set(get_args(GPUClassName))
    assert Target(gpu_class="a100").gpu_class == "a100"


@pytest.mark.parametrize("argv", [["pool", "release"],
                                  ["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate",
                                   str(RMS / "honest_torch.py")]])
def test_an_unreachable_prefect_server_is_one_line(argv, tmp_path):
    import os
    import socket

    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/api"
        env = os.environ | {"PREFECT_API_URL": url, "INFERSMITH_HOME": str(tmp_path)}
        env.pop("MLFLOW_TRACKING_URI", None)
        done = subprocess.run([sys.executable, "-m", "cli", *argv], env=env, capture_output=True, text=True,
                              timeout=180)
    # (evaluate opens the tracking store first, and MLflow logs its creation)
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"infersmith: the Prefect server at {url} is unreachable: start it (`prefect server start`), "
        "or unset PREFECT_API_URL to run on an ephemeral one"), done.stderr


def test_a_server_command_may_name_the_hosts_python_and_the_model_length():
    """What the end-to-end stage fills in (harness/serve/stage.py command_argv) is what the CLI accepts."""
    from cli.serve import _check_command

    _check_command("{python} -m my_server --port {port} --model {model_dir} --max-len {max_model_len}", "--candidate")


EPHEMERAL_FLOW = """
import os
from prefect import flow, get_client
from prefect.settings import get_current_settings
from cli.args import prefect_early
from flows import api_server

wait = prefect_early()

@flow
def probe():
    with get_client(sync_client=True) as client:
        client.api_healthcheck()
        url = str(client.api_url)
    children = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            children |= {int(pid) for pid in f.read().split()}
    servers = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\\0")
        if b"flows.api_server" in argv or any(b"create_app" in a for a in argv):  # ours, or Prefect's own
            servers.append(pid)
    s = get_current_settings()
    return servers, url, api_server.is_own(s.api.url), bool(s.ui_url), s.flows.heartbeat_frequency

with wait():
    servers, url, own, ui, heartbeat = probe()
with prefect_early()():  # a second command in this process: the same server
    again = probe()
assert again == (servers, url, own, ui, heartbeat), again
assert get_current_settings().api.url is None  # set for the command's flows alone
import time
import httpx
with httpx.Client() as client:  # a request is answered at once (no 40 ms wait on Nagle's algorithm)
    client.get(url + "health")
    start = time.perf_counter()
    for _ in range(20):
        client.get(url + "health").raise_for_status()
    assert (time.perf_counter() - start) / 20 < 0.03, (time.perf_counter() - start) / 20
print(servers, api_server._server.proc.pid, api_server._server.port, url, own, ui, heartbeat)
"""


def test_the_command_s_own_prefect_server_is_the_one_flow_runs_use_and_stops_at_exit(tmp_path):
    """prefect_early starts the command's own Prefect API server in the background; the flow's
    client uses that one (no second server), it counts as no one's (a held candidate is rejected
    as on Prefect's ephemeral API), its flows send no heartbeats and print no link to a UI it does
    not serve, a second command in the process uses it too, and its process ends with the command."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"PREFECT_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", EPHEMERAL_FLOW], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    servers, pid, port, url, own, ui, heartbeat = done.stdout.strip().rsplit("\n", 1)[-1].rsplit(" ", 6)
    assert servers == f"[{pid}]" and url == f"http://127.0.0.1:{port}/api/", done.stdout
    assert (own, ui, heartbeat) == ("True", "False", "None")
    assert "View at" not in done.stderr and (tmp_path / "prefect.db").is_file()  # Prefect's own database
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped at exit


def test_a_server_that_does_not_start_is_one_error_with_what_it_said(tmp_path):
    """A command server whose application cannot start (a database it cannot open) ends at once
    with its own exit code, and the wait raises one line that names the cause."""
    import time

    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    from flows.api_server import STARTUP_FAILED, APIServerError, CommandServer

    with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db"}):
        server = CommandServer()
    start = time.monotonic()
    with pytest.raises(APIServerError, match="^Prefect's API server for this command did not start") as e:
        server.ready(timeout_s=120)
    assert time.monotonic() - start < 60  # the connection was reset when it ended, not timed out
    assert len(str(e.value).splitlines()) == 1 and "unable to open database file" in str(e.value), e.value
    assert server.proc.returncode == STARTUP_FAILED  # it ended by itself: stop() found it gone

    # through the command: that line, exit 1, no traceback
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "INFERSMITH_HOME": str(tmp_path / "home"),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db"}
    done = subprocess.run([sys.executable, "-m", "cli", "evaluate", "--op", "rmsnorm", "--model", "tiny",
                           "--candidate", str(RMS / "honest_torch.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(
        "infersmith: Prefect's API server for this command did not start"), done.stderr
    assert "Traceback" not in done.stderr and "unable to open database file" in done.stderr


def test_the_server_ends_with_a_command_killed_outright(tmp_path):
    """Killed with SIGKILL, the command runs no exit handler: its server ends all the same, when
    the pipe only the command held reaches its end."""
    import os
    import time
    from pathlib import Path

    script = ("import sys, time\nfrom flows import api_server\ns = api_server.start()\ns.ready()\n"
              "print(s.proc.pid, flush=True)\ntime.sleep(300)\n")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        server = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{server}").exists() and Path(f"/proc/{server}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the server outlived the command killed outright"
        time.sleep(0.1)


def test_a_refused_evaluate_starts_no_prefect_server(tmp_path):
    """A candidate refused by its signature is one line before Prefect's server starts."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "INFERSMITH_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "cli", "evaluate", "--op", "rmsnorm", "--model", "tiny",
                           "--candidate", str(RMS / "wrong_signature.py")], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "prefect").exists()  # Prefect's server would have made its database there
