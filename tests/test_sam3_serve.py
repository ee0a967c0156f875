"""The SAM 3 servers over HTTP on loopback: bad input answered with a clear 400 while the other
requests of the same moment are answered; and the image serve stage end to end, AIPerf included."""
from __future__ import annotations

import base64
import io
import json
import random
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from contract.images import ImageAccuracyRules, ImagePattern, ImageServeJob
from harness.serve.images import draw_image, engine_argv, reference_side, serve_images
from harness.serve.server import ServerProcess, free_ports

CANDIDATES = Path(__file__).parent / "sam3_candidates"


def _job(sam3_checkpoint: Path, patterns=()) -> ImageServeJob:
    # float32 on both sides: 0.5% of the largest |logit|, not bf16's 4%, so that a dropped prompt of
    # the random checkpoint fails on whichever images are drawn (tests/test_sam3_serve_bench.py)
    return ImageServeJob(model_dir=sam3_checkpoint, dtype="fp32", device="cpu", env={"CUDA_VISIBLE_DEVICES": ""},
                         patterns=tuple(patterns), accuracy=ImageAccuracyRules(held_out=2, prompts_per_image=3, logit_rtol=0.005),
                         margin=-0.99, start_timeout_s=120, pattern_timeout_s=120, python=sys.executable)


def _post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/segment", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _huge_png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4097, 4097)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_bad_input_is_a_clear_400_and_nothing_else_is_lost(sam3_checkpoint, tmp_path):
    job = _job(sam3_checkpoint)
    port = free_ports(1)[0]
    with ServerProcess("engine", engine_argv(job, port), tmp_path / "server.log", job.env, port) as server:
        server.start(120)
        good = draw_image(random.Random(1), 64)
        bodies = {"good-1": {"image": good, "prompts": ["a cat", "a dog"]},
                  "not an image": {"image": base64.b64encode(b"GIF? no, text").decode(), "prompts": ["a cat"]},
                  "not base64": {"image": "%%%", "prompts": ["a cat"]},
                  "empty prompt": {"image": good, "prompts": ["a cat", "  "]},
                  "no prompts": {"image": good, "prompts": []},
                  "too large": {"image": _huge_png(), "prompts": ["a cat"]},
                  "not json": b"{not json",
                  "good-2": {"image": good, "prompts": ["a tree"]}}
        with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: the good ones share the engine's steps
            answers = dict(zip(bodies, pool.map(lambda b: _post(server.url, b), bodies.values())))
        words = {"not an image": "not an image", "not base64": "not valid base64", "empty prompt": "prompts[1] is empty",
                 "no prompts": "non-empty list", "too large": "image too large: 4097x4097",
                 "not json": "not valid JSON"}
        for name, expected in words.items():
            status, body = answers[name]
            assert status == 400 and expected in body["error"]["message"], (name, body)
        for name in ("good-1", "good-2"):
            status, body = answers[name]
            assert status == 200, body
            assert [r["prompt"] for r in body["results"]] == bodies[name]["prompts"]
            assert (body["width"], body["height"]) == (64, 64)
        assert server.alive
        with urllib.request.urlopen(server.url + "/stats") as r:
            assert json.loads(r.read())["requests"] == 2


def test_image_stage_end_to_end_with_aiperf(sam3_checkpoint, tmp_path):
    """Reference answers and baseline, the candidate engine judged and loaded by AIPerf on
    loopback, the all-metrics gate; a planted kernel fails the accuracy gate before any load."""
    job = _job(sam3_checkpoint, [ImagePattern("c2_prompts2", concurrency=2, request_count=8, warmup_requests=1,
                                         prompts_per_image=2, image_size=64)])
    images, expected, baseline = reference_side(job, tmp_path / "reference", random.Random(5))
    result = serve_images(job, "honest", lambda port: engine_argv(job, port), tmp_path / "honest", images, expected,
                          baseline)
    v = result.verdict
    assert [g.name for g in v.gates] == ["accuracy", "all_metrics"], v
    assert v.gates[0].passed, v.gates[0].detail
    run = result.runs["c2_prompts2"]
    assert run.errors == 0 and run.metrics["requests"] == 8
    for name in ("images_per_s", "latency_p50_ms", "latency_p90_ms", "images_per_s_per_request_p50",
                 "images_per_s_per_request_p10"):
        assert run.metrics[name] > 0 and f"c2_prompts2/baseline_{name}" in result.metrics
    assert v.status == "pass", v  # margin -99%: the gate runs; a CPU's speed is not what is judged here

    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"attention": {"impl": "free", "path": str(CANDIDATES / "dropped_prompt.py")}}))
    bad = serve_images(job, "dropped", lambda port: engine_argv(job, port, kernels), tmp_path / "dropped", images,
                       expected, baseline)
    assert bad.verdict.status == "fail" and bad.verdict.gates[-1].name == "accuracy"
    assert not bad.runs  # no load for a wrong engine


@pytest.mark.parametrize("case", ["unknown op", "bad impl", "no model dir", "a text model", "port taken"])
def test_setup_errors_are_one_line_and_exit_2(sam3_checkpoint, tmp_path, capsys, case):
    import socket

    from engine_templates.sam3_engine.__main__ import main

    kernels = tmp_path / "k.json"
    kernels.write_text(json.dumps({"rmsnorm": {"impl": "eager"}} if case == "unknown op" else
                                  {"gelu": {"impl": "magic"}}))
    text_model = tmp_path / "qwen"
    text_model.mkdir()
    (text_model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (text_model / "tokenizer.json").write_text("{}")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    argv = {"unknown op": ["serve", "--model-dir", str(sam3_checkpoint), "--device", "cpu", "--port", "0",
                           "--kernels", str(kernels)],
            "bad impl": ["serve", "--model-dir", str(sam3_checkpoint), "--device", "cpu", "--port", "0",
                         "--kernels", str(kernels)],
            "no model dir": ["serve", "--model-dir", str(tmp_path / "nothing"), "--device", "cpu"],
            "a text model": ["serve", "--model-dir", str(text_model), "--device", "cpu"],
            "port taken": ["serve-reference", "--model-dir", str(sam3_checkpoint), "--device", "cpu",
                           "--port", str(held.getsockname()[1])]}[case]
    try:
        assert main(argv) == 2
    finally:
        held.close()
    err = capsys.readouterr().err.strip()
    says = {"unknown op": "rmsnorm: not an op the engine uses (layernorm, gelu, vision_attention, vision_linear, attention)",
            "bad impl": "gelu: expected", "no model dir": "not a SAM 3 model directory",
            "a text model": 'model_type "qwen3" is not a SAM 3 config',
            "port taken": "cannot listen on"}[case]
    assert len(err.splitlines()) == 1 and says in err, err


def test_the_shipped_serving_file_reads_and_a_wrong_one_is_one_line(tmp_path, capsys):
    from harness.serve.images import main, serving_file

    patterns, rules, margin = serving_file(Path(__file__).parent.parent / "bench" / "serving-sam3.json")
    assert [p.name for p in patterns] == ["single", "c8", "c32", "c8_prompts4"]
    assert patterns[3].prompts_per_image == 4 and rules.held_out == 8 and margin == 0.0
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"traffic": [{"name": "x", "concurency": 8}]}))
    assert main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--serving", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "traffic[0]: expected an object of" in err, err
