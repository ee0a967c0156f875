"""bench/points_probe.py: its grid parsing, and a smoke run on a CPU (Triton's interpreter:
the times mean nothing there; the check of every point and the output's form are what is tested)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from points_probe import parse_grid  # noqa: E402

SPACE = {"num_warps": [0, 1, 2, 4, 8, 16], "block_n": [0, 256, 1024]}


def test_grid_takes_values_of_the_space():
    assert parse_grid("num_warps=0,8 block_n=1024", SPACE) == {"num_warps": [0, 8], "block_n": [1024]}
    assert parse_grid("", SPACE) == {}


@pytest.mark.parametrize("text, says", [
    ("warps=4", "'warps' is not a parameter of the template"),
    ("num_warps=3", "num_warps=3 is outside the template's space"),
])
def test_grid_refuses_what_the_template_cannot_build(text, says):
    with pytest.raises(SystemExit, match=says):
        parse_grid(text, SPACE)


def test_smoke_run_checks_and_times_every_point():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "bench/points_probe.py", "--op", "fused_add_rmsnorm", "--preset", "tiny",
                          "--batches", "2", "--grid", "num_warps=0,2 block_n=0,256"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# CPU (Triton interpreter")
    timed = [line for line in lines if " us (" in line]
    assert [line.split()[0] for line in timed] == ["eager", "torch.compile"] + [
        f"rows[block_n={b},num_stages=1,num_warps={w},rows_per_program=1]" for w in (0, 2) for b in (0, 256)]
    assert "fails the check" not in out.stdout


def test_unknown_op_is_one_line():
    out = subprocess.run([sys.executable, "bench/points_probe.py", "--op", "nope"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().startswith("points_probe: no op 'nope'")


@pytest.mark.parametrize("script, args, says", [
    ("bench/diagnostics/stage_vs_probe.py", ["stage", "short"], "stage_vs_probe: needs a CUDA GPU"),
    ("bench/diagnostics/stage_vs_probe.py", ["sideways"], "MODE is one of stage, stage-first"),
    ("bench/diagnostics/compile_var.py", ["fresh1"], "compile_var: needs a CUDA GPU"),
    ("bench/diagnostics/norm_variants.py", ["decode"], "norm_variants: needs a CUDA GPU"),
    ("bench/diagnostics/norm_variants.py", ["sideways"], "norm_variants: say decode, prefill [rounds] or modes"),
    ("bench/diagnostics/norm_variants.py", ["prefill", "x"], "prefill takes a count of rounds (1 or more), not 'x'"),
    ("bench/diagnostics/bench_job.py", ["nope"], "bench_job: name an op: rmsnorm"),
    ("bench/diagnostics/bench_job.py", ["rmsnorm", "qwen9"], "bench_job: no preset 'qwen9'"),
    ("bench/diagnostics/fixed_cost.py", [], "fixed_cost: needs a CUDA GPU"),
    ("bench/diagnostics/fixed_cost.py", ["prefill"], "fixed_cost: takes no arguments"),
    ("bench/diagnostics/silu_persistent.py", [], "silu_persistent: needs a CUDA GPU"),
    ("bench/moe_prefill_probe.py", [], "moe_prefill_probe: needs a CUDA GPU"),
    ("bench/moe_prefill_probe.py", ["--preset", "qwen3-8b"], "moe_prefill_probe: qwen3-8b is dense"),
])
def test_diagnostics_say_what_they_need(script, args, says):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_stage_vs_probe_writes_the_bench_job_the_harness_reads():
    from contract.job import Job

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "bench/diagnostics/stage_vs_probe.py", "job", "short"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    job = Job.from_json(out.stdout)
    assert (job.stage, job.candidate.op, [s.label for s in job.shapes]) == \
        ("bench", "silu_mul", ["decode_b8", "decode_b32", "decode_b128"])


def test_bench_job_is_the_template_default_at_the_prefill_shapes():
    from contract.job import Job

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "bench/diagnostics/bench_job.py", "fused_add_rmsnorm"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    job = Job.from_json(out.stdout)
    assert (job.stage, job.model, job.candidate.template, [s.label for s in job.shapes]) == \
        ("bench", "qwen3-8b", "rows", ["prefill_2048", "prefill_16384"])
    assert job.candidate.point["num_warps"] == 0 and job.rules.launch_bound_us == 1000.0
