"""The `infersmith` command: exit codes, one-line errors, the verdict it prints."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import CANDIDATES
from flows.cli import main

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
    (["evaluate", "--op", "rmsnorm", "--model", "qwen9", "--candidate", str(RMS / "honest_torch.py")], "unknown model preset"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", "/no/such/file.py"], "cannot read candidate"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "syntax_error.py")], "syntax error at line 2"),
    (["evaluate", "--op", "rmsnorm", "--model", "tiny", "--candidate", str(RMS / "wrong_signature.py")], "does not match"),
    (["evaluate", "--op", "silu_mul", "--model", "tiny", "--candidate", str(RMS / "honest_torch.py")], "no top-level function `silu_mul`"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--budget", "0"], "--budget must be at least 1"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--decode-batches", "1,x"], "comma-separated integers"),
    (["optimize", "--op", "rmsnorm", "--model", "tiny", "--template", "nope"], "no template 'nope'"),
    (["optimize", "--op", "rmsnorm", "--proposer", "genius"], "invalid choice"),
    (["optimize-engine", "--model-dir", ".", "--proposer", "genius"], "invalid choice"),
    (["leaderboard", "--op", "rmsnorm", "--model", "qwen9"], "unknown model preset"),
    (["optimize", "--op", "fused_moe", "--model", "qwen3-8b"], "needs a mixture-of-experts preset"),
    (["gauntlet", "--op", "rmsnorm", "--jobs", "0"], "--jobs must be at least 1"),
    (["gauntlet", "--op", "silu_mul", "--case", "no_such_case"], "no gauntlet case of silu_mul has 'no_such_case'"),
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
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "optimize", "--op", "rmsnorm", "--model", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown model preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


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

    newer = store("newer", "f4a9b2c7d1e6")  # no migration of this MLflow's leads there
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"INFERSMITH_HOME": str(newer)}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "optimize", "--op", "rmsnorm", "--model", "tiny",
                           "--budget", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "has database schema f4a9b2c7d1e6" in done.stderr and "a newer MLflow wrote it" in done.stderr
    assert "controller_wheels.sh" in done.stderr


def test_a_store_that_refuses_to_create_an_experiment_is_one_line_naming_why(tmp_path, monkeypatch, capsys):
    """Only a lost race to create the experiment (it exists now) is taken as one: a store that
    cannot write (here a SQLite file opened read-only) is one line with MLflow's reason."""
    import mlflow
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()  # a store, made
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
