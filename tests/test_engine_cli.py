"""`infersmith engine generate|serve`: a real generation on the tiny checkpoint, one-line
usage errors (exit 2) for a missing or malformed model directory or kernels file."""
from __future__ import annotations

import json
import re

import pytest
from counted_kernels import calls, counting_kernels
from tiny_checkpoints import checkpoint

from flows.cli import main


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
    code, _, err = run(capsys, "engine", "serve", "--model-dir", str(checkpoint("dense")),
                       "--kernels", str(kernels))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "expected {\"impl\"" in err


def test_profile_bad_input_is_one_line(capsys):
    for argv, says in ((["--presets", "tiny,nonesuch"], "unknown presets ['nonesuch']"),
                       (["--batches", "1,0"], "--batches must be comma-separated positive integers"),
                       (["--batches", "x"], "--batches must be comma-separated positive integers"),
                       (["--steps", "0"], "--steps must be at least 1")):
        code, _, err = run(capsys, "engine", "profile", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_profile_runs_on_a_gpu_and_needs_one():
    """In a process of its own: profile_preset prints to the sys.stdout of its import by default,
    not the one capsys puts in place for each test."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    done = subprocess.run([sys.executable, "-m", "engine_templates.engine", "profile", "--presets", "tiny",
                           "--context", "16", "--steps", "3", "--top", "4"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    code, out, err = done.returncode, done.stdout, done.stderr
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
