"""Results archives on S3 through boto3, against moto's standalone S3 server on loopback."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest
from loopback_sshd import free_port
from moto_s3 import CREDENTIALS, s3_server

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401

from object_store import ObjectStoreError
from tracking.artifacts import Results


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    """An empty tracking home and S3 settings in the environment, as a worker or the CLI has them."""
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("INFERSMITH_S3_URI", "s3://results-bucket/team")
    return monkeypatch


def test_a_results_archive_is_sent_to_s3_and_reads_back(s3_env, tmp_path):
    with s3_server(tmp_path / "moto.log", buckets=("results-bucket",)) as s3:
        s3_env.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        where = Results("infersmith-rmsnorm").publish("run123", {"verdicts.json": {"a": {"status": "pass"}},
                                                                   "note.txt": "hello"})
        assert where == "s3://results-bucket/team/results/infersmith-rmsnorm/run123.tar.gz"
        body = s3.client().get_object(Bucket="results-bucket",
                                      Key="team/results/infersmith-rmsnorm/run123.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["run123/note.txt", "run123/verdicts.json"]
        assert json.load(tar.extractfile("run123/verdicts.json")) == {"a": {"status": "pass"}}


def test_without_a_bucket_nothing_is_archived(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INFERSMITH_S3_URI", raising=False)
    assert Results("infersmith-rmsnorm").publish("run1", {"a.json": {}}) is None
    assert not (tmp_path / "home").exists()


def test_without_a_bucket_the_op_loop_and_the_pool_do_not_load_boto3_nor_the_llm_sdks(tmp_path):
    # A GPU host that runs op optimizations without uploading need not have boto3 (nor, with
    # another proposer, the LLM providers' SDKs), and no command's start pays their imports.
    code = (f"import os, sys; os.environ.pop('INFERSMITH_S3_URI', None); os.environ['INFERSMITH_HOME'] = "
            f"{str(tmp_path / 'home')!r}; os.environ.pop('MLFLOW_TRACKING_URI', None); "
            "import flows.optimize_op, flows.optimize_engine, gpu_pool.ssh, tracking.artifacts, cli.op; "
            "from cli.args import open_store; open_store(); "
            "from object_store import store_from_env; assert store_from_env() is None; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'boto3', 'botocore', 'anthropic', 'openai'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_an_unreachable_store_fails_before_anything_runs_and_names_no_secret(s3_env):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    s3_env.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ObjectStoreError) as e:
        Results("infersmith-rmsnorm")
    message = str(e.value)
    assert message.startswith(f"S3 unreachable: cannot reach bucket results-bucket at {endpoint}")
    assert "\n" not in message and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in message


def test_a_failed_upload_fails_saying_so_and_keeps_the_results_here(s3_env, tmp_path):
    with s3_server(tmp_path / "moto.log", buckets=("results-bucket",)) as s3:
        s3_env.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        results = Results("infersmith-rmsnorm")  # reachable when the flow starts ...
    with pytest.raises(ObjectStoreError) as e:  # ... and gone when it ends
        results.publish("run9", {"leaderboard.json": [{"score": 1.5}]})
    kept = tmp_path / "home" / "results" / "infersmith-rmsnorm" / "run9.tar.gz"
    assert str(e.value).startswith("S3 unreachable: cannot upload results/infersmith-rmsnorm/run9.tar.gz")
    assert str(e.value).endswith(f"the results are kept at {kept}")
    with tarfile.open(kept) as tar:
        assert json.load(tar.extractfile("run9/leaderboard.json")) == [{"score": 1.5}]


def test_optimize_with_the_store_unreachable_is_one_line_and_runs_nothing(s3_env, prefect_server, capsys):
    from cli.main import main
    from tracking.history import search
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    s3_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    code = main(["optimize", "--op", "silu_mul", "--model", "tiny", "--budget", "1"])
    err = capsys.readouterr().err
    assert code == 1
    # (MLflow logs the creation of a new tracking store's tables before that)
    assert err.splitlines()[-1].startswith("infersmith: S3 unreachable: cannot reach bucket results-bucket at ")
    assert "Traceback" not in err and "Flow run" not in err
    assert search(Tracker(TrackingConfig.from_env()), "silu_mul") == []
