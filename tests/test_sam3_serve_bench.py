"""`infersmith serve-bench` on a vision target: the image stage (SAM 3's engine against its
reference, AIPerf on loopback) on this machine's pool slot, logged to MLflow as the text stage's
runs are; a kernels file reaches the engine (a planted one fails the accuracy gate); the text
stage's options are one line and exit 2."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from cli.main import main
from engine_templates.engine.random_checkpoint import write_random_checkpoint

CANDIDATES = Path(__file__).parent / "sam3_candidates"
# One small pattern: AIPerf's own start-up dominates; margin -99%: a CPU's speed is not judged here.
SERVING = {"traffic": [{"name": "c2", "concurrency": 2, "request_count": 6, "warmup_requests": 1,
                        "prompts_per_image": 2, "image_size": 64}],
           "accuracy": {"held_out": 2, "prompts_per_image": 2}, "margin": -0.99}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sam3") / "sam3-tiny"
    write_random_checkpoint("sam3-tiny", out, device="cpu", log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def serving(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serving") / "serving-sam3.json"
    path.write_text(json.dumps(SERVING))
    return path


def bench(checkpoint, serving, *extra) -> tuple[int, str]:
    # stdout only: Prefect's log handler keeps the stderr it first saw
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["serve-bench", "--model-dir", str(checkpoint), "--model", "sam3-tiny", "--dtype", "fp32",
                     "--serving", str(serving), "--json", *extra])
    return code, out.getvalue()


def test_serve_bench_runs_the_image_stage_and_logs_it_to_mlflow(prefect_server, tracking_home, checkpoint, serving,
                                                                 tmp_path):
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    code, out = bench(checkpoint, serving)
    result = json.loads(out)
    assert [g["name"] for g in result["gates"]] == ["accuracy", "all_metrics"], result["gates"]
    assert all(g["passed"] for g in result["gates"]) and result["verdict"] == "pass" and code == 0, result
    rows = {r["metric"]: r for r in result["table"]}
    assert set(rows) == {"images_per_s", "latency_p50_ms", "latency_p90_ms", "images_per_s_per_request_p50",
                         "images_per_s_per_request_p10"}
    assert all(r["pattern"] == "c2" and r["candidate"] > 0 and r["baseline"] > 0 for r in rows.values())

    client = Tracker(TrackingConfig.from_env()).client
    run = client.get_run(result["run_id"])
    m = run.data.metrics
    assert m["c2/images_per_s"] == rows["images_per_s"]["candidate"]
    assert m["c2/baseline_latency_p50_ms"] == rows["latency_p50_ms"]["baseline"] and "score" in m
    assert m["accuracy/masks_compared"] > 0 and m["accuracy/min_mask_iou"] >= 0.99
    assert run.data.tags["infersmith.status"] == "pass" and run.data.tags["infersmith.template"] == "engine-images"
    assert run.data.tags["mlflow.parentRunId"] == result["parent_run_id"]
    exported = client.download_artifacts(run.info.run_id, "serve/candidate/aiperf/c2/profile_export_aiperf.json")
    assert json.loads(Path(exported).read_text())["request_count"]["avg"] == 6
    verdict = json.loads(Path(client.download_artifacts(run.info.run_id, "verdict.json")).read_text())
    assert verdict["status"] == "pass"
    parent = client.get_run(result["parent_run_id"])
    assert parent.data.tags["infersmith.modality"] == "vision" and parent.data.metrics["passed"] == 1
    logged = json.loads(Path(client.download_artifacts(parent.info.run_id, "serving.json")).read_text())
    assert logged["traffic"][0]["concurrency"] == 2 and logged["accuracy"]["held_out"] == 2
    assert logged["margin"] == -0.99

    # the kernels file reaches the engine: an attention that drops a prompt fails before any load
    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"attention": {"impl": "free", "path": str(CANDIDATES / "dropped_prompt.py")}}))
    code, out = bench(checkpoint, serving, "--kernels", str(kernels))
    bad = json.loads(out)
    assert code == 1 and bad["verdict"] == "fail" and bad["gates"][-1]["name"] == "accuracy", bad
    bad_run = client.get_run(bad["run_id"])
    assert bad_run.data.tags["infersmith.status"] == "fail" and bad_run.data.params["kernels"] == "file"
    logged = client.download_artifacts(bad_run.info.run_id, "kernels.json")
    assert json.loads(Path(logged).read_text()) == json.loads(kernels.read_text())


@pytest.mark.parametrize("extra, says", [
    (["--candidate", "python -m x --port {port}"], "--candidate is an option of the text stage"),
    (["--spec-tokens", "4"], "--spec-tokens is an option of the text stage"),
    (["--baseline", "vllm"], "--baseline is an option of the text stage"),
    (["--reference-model-dir", "/m"], "--reference-model-dir is an option of the text stage"),
    (["--dtype", "fp8"], "--dtype fp8 is an option of the text stage"),
    (["--patterns", "c9"], "no traffic pattern c9; the image stage has c2"),
    (["--kernels", "/no/such/kernels.json"], "no kernels file /no/such/kernels.json"),
])
def test_text_stage_options_on_a_vision_target_are_one_line_and_exit_2(checkpoint, serving, capsys, extra, says):
    assert main(["serve-bench", "--model-dir", str(checkpoint), "--model", "sam3-tiny", "--serving", str(serving),
                 *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_a_text_checkpoint_for_a_vision_target_and_optimize_engine_on_one_are_one_line(tmp_path, checkpoint, capsys,
                                                                                      serving):
    from tiny_checkpoints import checkpoint as text_checkpoint

    assert main(["serve-bench", "--model-dir", str(text_checkpoint("dense")), "--model", "sam3-tiny"]) == 2
    assert "not SAM 3's (model_type sam3)" in capsys.readouterr().err
    # and the other way: the image stage's serving file for a text model
    assert main(["serve-bench", "--model-dir", str(text_checkpoint("dense")), "--model", "tiny",
                 "--serving", str(serving)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a serving file of the image stage; tiny is a text model" in err, err
    assert main(["optimize-engine", "--model-dir", str(checkpoint)]) == 2  # --model read from the checkpoint
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimize-engine searches the text engine" in err, err
