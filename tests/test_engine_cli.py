"""`infersmith engine generate|serve`: a real generation on the tiny checkpoint, one-line
usage errors (exit 2) for a missing or malformed model directory or kernels file."""
from __future__ import annotations

import json
import re

import pytest
from counted_kernels import calls, counting_kernels
from tiny_checkpoints import checkpoint

from cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_the_engine_s_greedy_answer(capsys, tmp_path):
    from engine_templates.engine.config import EngineConfig
    from engine_templates.engine.engine import LLMEngine
    from engine_templates.engine.sequence import SamplingParams

    kernels = tmp_path / "k.json"  # silu_mul by a kernel that counts its calls (eager's work)
    kernels.write_text(json.dumps(counting_kernels(tmp_path, ["silu_mul"])))
    code, out, err = run(capsys, "engine", "generate", "--model-dir", str(checkpoint("dense")),
                         "--prompt", "Hello world!", "--prompt", "The quick", "--max-tokens", "6",
                         "--ignore-eos", "--dtype", "fp32", "--json", "--kernels", str(kernels))
    assert code == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    engine = LLMEngine(EngineConfig(model_dir=checkpoint("dense"), dtype="fp32", device="cpu", max_num_seqs=2))
    expected = engine.generate(["Hello world!", "The quick"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [a["token_ids"] for a in answers] == [s.completion_token_ids for s in expected]
    assert answers[0]["kernels"]["fused_moe"] == {"impl": "eager"} and len(answers[0]["logprobs"]) == 6
    assert answers[0]["kernels"]["silu_mul"] == {"impl": "free", "path": str(tmp_path / "silu_mul.py")}
    # what the answer says it ran, it ran: each of 2 layers, a prefill step and 5 decode steps at least
    assert calls(tmp_path, "silu_mul") >= 2 * 6


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_missing_model_dir_is_one_line(capsys, tmp_path, command):
    extra = ["--prompt", "x"] if command == "generate" else []
    code, out, err = run(capsys, "engine", command, "--model-dir", str(tmp_path / "absent"), *extra)
    assert code == 2 and err.strip() == f"infersmith: no such model directory: {tmp_path / 'absent'}"


def test_malformed_model_dir_and_kernels_file_are_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')
    code, _, err = run(capsys, "engine", "generate", "--model-dir", str(tmp_path), "--prompt", "x")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not valid JSON" in err
    kernels = tmp_path / "k.json"
    kernels.write_text('{"rmsnorm": {"impl": "magic"}}')
    dense = checkpoint("dense")  # drawn now if no test before drew it: its progress bar is not the command's
    capsys.readouterr()
    code, _, err = run(capsys, "engine", "serve", "--model-dir", str(dense), "--kernels", str(kernels))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "expected {\"impl\"" in err


def test_profile_bad_input_is_one_line(capsys):
    for argv, says in ((["--presets", "tiny,nonesuch"], "--presets: 'nonesuch' is neither a model preset"),
                       (["--batches", "1,0"], "--batches must be comma-separated positive integers"),
                       (["--batches", "x"], "--batches must be comma-separated positive integers"),
                       (["--steps", "0"], "--steps must be at least 1")):
        code, _, err = run(capsys, "engine", "profile", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_profile_runs_on_a_gpu_and_needs_one(capsys):
    """In this process: the report goes to the sys.stdout of the call (capsys's), not of the import."""
    import torch

    code, out, err = run(capsys, "engine", "profile", "--presets", "tiny", "--context", "16", "--steps", "3",
                         "--top", "4")
    if not torch.cuda.is_available():
        assert code == 2 and "needs a CUDA GPU" in err
        return
    assert code == 0, err
    assert re.search(r"^## tiny: .*, kernels eager, context 16, ", out, re.M), out
    step = re.search(r"### batch 1: step (\d+) us with graphs .*device busy (\d+) us .*eager step (\d+) us", out)
    assert step and all(int(x) > 0 for x in step.groups()), out
    rows = re.findall(r"^\| `(.+)` \| (\d+) \| ([\d.]+) \| ([\d.]+)% \|$", out, re.M)
    # the eager step's 4 costliest kernels, costliest first, then the rest in one line
    assert len(rows) == 4 and int(rows[0][1]) >= 1 and float(rows[0][2]) > 0, out
    assert [float(us) for _, _, us, _ in rows] == sorted((float(us) for _, _, us, _ in rows), reverse=True)
    assert re.search(r"^\| \d+ others \| ", out, re.M), out


def test_no_async_decode_reaches_the_engine_config_the_bench_and_the_profile():
    import argparse

    from engine_templates.engine.cli import add_commands, engine_config

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    for base in (["serve", "--model-dir", str(checkpoint("dense"))],
                 ["generate", "--model-dir", str(checkpoint("dense")), "--prompt", "x"]):
        assert engine_config(parser.parse_args(base)).async_decode is True
        assert engine_config(parser.parse_args(base + ["--no-async-decode"])).async_decode is False
    for base in (["bench", "--out", "x"], ["profile"]):
        assert parser.parse_args(base).async_decode is True
        assert parser.parse_args(base + ["--no-async-decode"]).async_decode is False


@pytest.mark.parametrize("body, says", [
    (b"\xff\xfe\x00{}", "not a text file (not UTF-8)"),
    (b'{"rmsnorm": {"impl": "template", "template": "rows", "point": 5}}',
     'rmsnorm: point must be an object of the template\'s parameters, e.g. {"block_n": 0}, not 5'),
    (b'{"rmsnorm": {"impl": "free", "path": 5}}', "rmsnorm: path must be a file path (a string), not 5"),
    (b'{"rmsnorm": {"impl": "template", "template": ["rows"]}}', 'rmsnorm: template must be a template\'s name, '
                                                                 'not ["rows"]'),
])
def test_a_kernels_file_of_the_wrong_kind_is_one_line(capsys, tmp_path, body, says):
    kernels = tmp_path / "k.json"
    kernels.write_bytes(body)
    for command in (["generate", "--prompt", "x"], ["serve"]):
        code, _, err = run(capsys, "engine", *command, "--model-dir", str(checkpoint("dense")),
                           "--kernels", str(kernels))
        assert code == 2 and err.strip() == f"infersmith: {kernels}: {says}", err


@pytest.mark.parametrize("option, says", [
    (["--max-model-len", "0"], "--max-model-len must be at least 1, not 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, not 0"),
    (["--block-size", "0"], "--block-size must be at least 1, not 0"),
    (["--num-kv-blocks", "-1"], "--num-kv-blocks must be at least 0, not -1"),
    (["--cuda-graph-batch-sizes", "0,-1"], "--cuda-graph-batch-sizes must all be at least 1, not 0,-1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1, not 0"),
    (["--device", "bogus"], "--device: expected cuda or cpu, got 'bogus'"),
    (["--device", "mps"], "--device: expected cuda or cpu, got 'mps'"),
    (["--port", "70000"], "argument --port: expected a port number 0-65535, got '70000'"),
    (["--host", "256.1.1.1"], "cannot listen on 256.1.1.1:8000: "),
])
def test_engine_options_out_of_range_are_one_line_naming_the_option(capsys, option, says):
    serve_only = option[0] in ("--port", "--host")
    for command in (["serve"],) if serve_only else (["generate", "--prompt", "x"], ["serve"]):
        code, out, err = run(capsys, "engine", *command, "--model-dir", str(checkpoint("dense")), *option)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"infersmith: {says}"), err


def test_device_cuda_without_cuda_is_one_line_everywhere(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for argv in (["generate", "--model-dir", str(checkpoint("dense")), "--prompt", "x"],
                 ["serve-reference", "--model-dir", str(checkpoint("dense"))],
                 ["bench", "--out", str(tmp_path / "out"), "--presets", "tiny"]):
        code, _, err = run(capsys, "engine", *argv, "--device", "cuda")
        assert code == 2 and err.strip() == "infersmith: --device cuda: CUDA is not available on this machine", argv
    assert not (tmp_path / "out").exists()


def test_a_port_in_use_is_one_line_for_both_servers(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for command in ("serve", "serve-reference"):
            code, out, err = run(capsys, "engine", command, "--model-dir", str(checkpoint("dense")), "--device", "cpu",
                                 "--port", port)
            assert code == 2 and out == "", err
            assert err.strip() == f"infersmith: cannot listen on 127.0.0.1:{port}: Address already in use", err
    code, _, err = run(capsys, "engine", "serve-reference", "--model-dir", str(checkpoint("dense")), "--port", "-1")
    assert code == 2 and "argument --port: expected a port number 0-65535, got '-1'" in err


def test_bench_options_are_checked_before_it_runs(capsys, tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("not a directory")
    for argv, says in ((["--out", str(a_file)], f"--out {a_file}: cannot make the directory: File exists"),
                       (["--out", str(tmp_path / "o"), "--tolerance", "-1"], "--tolerance must be more than 0 nats, not -1.0"),
                       (["--out", str(tmp_path / "o"), "--tolerance", "0"], "--tolerance must be more than 0 nats, not 0.0"),
                       (["--out", str(tmp_path / "o"), "--concurrency", "0"], "--concurrency must be at least 1, not 0"),
                       (["--out", str(tmp_path / "o"), "--phase-seconds", "0"], "--phase-seconds must be more than 0, not 0.0"),
                       (["--out", str(tmp_path / "o"), "--device", "bogus"], "--device: expected cuda or cpu, got 'bogus'")):
        code, _, err = run(capsys, "engine", "bench", "--presets", "tiny", *argv)
        assert code == 2 and err.strip() == f"infersmith: {says}", err
    assert not (tmp_path / "o").exists()


def test_python_m_engine_usage_errors_are_one_line():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "engine_templates.engine", "serve", "--model-dir", "x", "--port",
                           "70000"], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "infersmith: argument --port: expected a port number 0-65535, got '70000' "
        "(see `python -m engine_templates.engine serve --help`)"), done.stderr


def test_a_port_taken_after_the_early_check_is_still_one_line():
    """serve_app refuses the bind itself too: the port can be taken while the model loads."""
    import asyncio
    import socket

    from aiohttp import web

    from engine_templates.engine.config import EngineSetupError
    from engine_templates.engine.server import serve_app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineSetupError, match=f"^cannot listen on 127.0.0.1:{port}: Address already in use$"):
            asyncio.run(serve_app(web.Application(), "127.0.0.1", port, lambda p: f"serving on {p}"))
