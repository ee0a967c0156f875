"""The end-to-end stage judging an FP8 engine against the bf16 model, on the CPU: the tiny dense
checkpoint quantized by `engine quantize`, served by the real engine server, its greedy answers
compared with the real HF transformers reference server's on the bf16 original. The FP8 target's
thresholds pass it and bf16's fail it; a planted scale error fails it; a quantized reference is
refused. The same candidate with speculative decoding under real AIPerf load reports its drafts
and acceptance rate on the structured pattern."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_checkpoints import checkpoint

from contract.serve import EngineCandidate, Reference, ServeJob, ServerError
from contract.verdict import PASS
from engine_templates.engine.quantize import quantize_checkpoint
from gpu_pool.pool import local_pool
from harness.serve.stage import engine_argv, reference_answers, serve_candidate
from targets import Target
from tasks.serve import job_for

STRUCTURED = {"name": "structured", "dataset": "structured", "concurrency": 1, "input_tokens_mean": 64,
              "output_tokens_mean": 16, "request_count": 4, "warmup_requests": 0}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve-fp8") / "tiny-fp8"
    quantize_checkpoint(checkpoint("dense"), out, device="cpu", log=lambda _: None)  # Qwen's 128 x 128 blocks
    return out


def target(dtype: str) -> Target:
    # The baseline is never started here: the stage's comparison with it is tested elsewhere.
    return Target.model_validate({"model": "tiny", "dtype": dtype, "serving": {
        "traffic": [STRUCTURED], "accuracy": {"held_out_tokens": 16, "max_tokens": 8}, "baseline": "unused {port}",
        "reference_model_dir": str(checkpoint("dense"))}})


@pytest.fixture(scope="module")
def job(fp8_dir) -> ServeJob:
    return job_for(target("fp8"), fp8_dir, local_pool().slots()[:1])


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory) -> Reference:
    assert job.dtype == "fp8" and job.activation_dtype == "bf16" and job.reference_dir == checkpoint("dense")
    return reference_answers(job, tmp_path_factory.mktemp("reference"), random.Random(0))[0]


def serve(job: ServeJob, reference: Reference, out: Path, cand: EngineCandidate = EngineCandidate()):
    return serve_candidate(job, cand.id, lambda _, port: engine_argv(job, cand, out, port), reference, out)


def accuracy(served) -> tuple[bool, str]:
    gate = next(g for g in served.verdict.gates if g.name == "accuracy")
    return gate.passed, gate.detail


def test_fp8_passes_with_fp8_thresholds_and_reports_speculation_per_pattern(job, reference, tmp_path):
    assert job.accuracy.logprob_atol == 0.5  # the target's fp8 default
    served = serve(job, reference, tmp_path, EngineCandidate(spec_tokens=3))
    passed, detail = accuracy(served)
    assert passed and served.verdict.status == PASS, served.verdict.log_tail
    assert "8 prompts (4 held out)" in detail and 0.1 < served.metrics["accuracy/max_logprob_diff"] < 0.5
    assert served.runs["structured"].metrics["requests"] == 4
    m = served.metrics
    assert m["structured/spec_drafted_tokens"] > 0 and 0 <= m["structured/spec_accepted_tokens"]
    assert m["structured/spec_acceptance_rate"] == m["structured/spec_accepted_tokens"] / m["structured/spec_drafted_tokens"]


def test_fp8_fails_with_bf16_thresholds(job, reference, tmp_path):
    strict = dataclasses.replace(job, patterns=(), accuracy=target("bf16").accuracy_rules())
    assert strict.accuracy.logprob_atol == 0.1
    passed, detail = accuracy(serve(strict, reference, tmp_path))
    assert not passed and ("nats > 0.1" in detail or "nats less likely" in detail), detail


def test_a_planted_scale_error_fails_with_fp8_thresholds(job, reference, fp8_dir, tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    for f in fp8_dir.iterdir():
        (planted / f.name).write_bytes(f.read_bytes())
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] *= 2  # one matrix's scale off by a factor of 2
    save_file(tensors, str(planted / "model.safetensors"), metadata={"format": "pt"})
    passed, detail = accuracy(serve(dataclasses.replace(job, model_dir=planted, patterns=()), reference, tmp_path))
    assert not passed and "prompt 0 (shown)" in detail, detail


def test_a_quantized_reference_is_refused(job, fp8_dir, tmp_path):
    with pytest.raises(ServerError, match="the reference checkpoint .* is quantized"):
        reference_answers(dataclasses.replace(job, reference_model_dir=fp8_dir), tmp_path, random.Random(0))


def test_fp8_targets_have_looser_thresholds():
    fp8, bf16 = Target(model="tiny", dtype="fp8"), Target(model="tiny", dtype="bf16")
    assert fp8.activation_dtype == "bf16" and fp8.serve_key() != bf16.serve_key()
    assert fp8.accuracy_rules().logprob_atol == 0.5 > bf16.accuracy_rules().logprob_atol == 0.1
    # the op stages of an fp8 target (linear, fused_moe) judge at its own tolerance
    assert fp8.rules(on_gpu=False).dtype == "fp8" and fp8.rules(on_gpu=False).rtol == 0.15
    assert target("bf16").serve_key() != Target.model_validate(
        {"model": "tiny", "serving": target("bf16").serving.model_dump() | {"reference_model_dir": None}}).serve_key()


@pytest.mark.parametrize("args, says", [
    (["--dtype", "bf16"], "is an FP8 checkpoint: serve it with --dtype fp8"),
    (["--dtype", "fp8"], "is an FP8 checkpoint: name its bf16 original with --reference-model-dir"),
    (["--dtype", "fp8", "--reference-model-dir", "{fp8}"], "is a quantized checkpoint; the reference must be bf16"),
    (["--dtype", "fp8", "--reference-model-dir", "/nowhere"], "not a model directory"),
    (["--dtype", "fp8", "--spec-tokens", "-1"], "--spec-tokens must be at least 0"),
])
def test_serve_bench_refuses_an_fp8_setup_that_cannot_be_judged(fp8_dir, capsys, args, says):
    from cli.main import main

    code = main(["serve-bench", "--model-dir", str(fp8_dir), "--model", "tiny",
                 *[a.format(fp8=fp8_dir) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_an_op_without_an_fp8_target_refuses_the_fp8_dtype(capsys):
    from cli.main import main

    code = main(["optimize", "--op", "silu_mul", "--model", "tiny", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "silu_mul has no fp8 target; ops with one: fused_moe, linear (--dtype fp8)" in err
