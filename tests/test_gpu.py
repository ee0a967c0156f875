"""On a real GPU: timings are GPU timings, ceilings are measured, gates hold.
Skipped where CUDA is not available (CI)."""
from __future__ import annotations

import re

import pytest
import torch
from test_gates import evaluate, free

from contract.job import Candidate
from engine_templates.ops import get_op
from targets import Target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TARGET = Target(model="qwen3-8b", workload={"decode_batches": [1, 32], "prefill_tokens": [4096],
                                            "contexts": [4096]})


@pytest.mark.parametrize("op_name", ["rmsnorm", "silu_mul"])
def test_template_default_is_timed_on_the_gpu_against_both_baselines(op_name):
    template = next(iter(get_op(op_name).templates.values()))
    verdict, charge = evaluate(Candidate(op=op_name, kind="template", template=template.name,
                                         point=template.default), TARGET)
    assert verdict.status == "pass", verdict.to_json()
    assert verdict.device["gpu_timing"] and verdict.device["driver"] and verdict.device["cuda"]
    ceil = verdict.device["ceilings"]
    assert 1e12 < ceil["copy_bytes_per_s"] < 2e13 and ceil["matmul_flops_per_s"] > 1e14
    for t in verdict.timings:
        assert t.compile_us and t.eager_us and t.candidate_us > 0
        assert t.roofline_us <= t.fastest_us * 1.1  # the speed-of-light gate passed for a reason


@pytest.mark.parametrize("name, status, gate", [
    ("unwritten_output", "fail", "finite"),
    ("mutates_input", "fail", "inputs_unchanged"),
    ("wrong_values", "fail", "accuracy"),
])
def test_planted_candidates_are_rejected_on_the_gpu(name, status, gate):
    verdict, _ = evaluate(free(name), TARGET)
    assert (verdict.status, verdict.failing_gate.name) == (status, gate), verdict.to_json()


def test_honest_torch_candidate_passes_on_the_gpu():
    verdict, _ = evaluate(free("honest_torch"), TARGET)
    assert verdict.status == "pass" and verdict.gpu_timing, verdict.to_json()


def test_a_forged_ceilings_cache_is_measured_again_on_the_gpu(monkeypatch, tmp_path):
    """A cached figure a quick measurement disagrees with (written by a candidate, say) is
    replaced; one it agrees with is kept, and fp32 gets its own matmul rate."""
    import json

    from engine_templates import ceilings
    from harness import device

    monkeypatch.setattr(ceilings, "CACHE_DIR", tmp_path)
    info = device.describe("cuda")
    honest = ceilings.ceilings("cuda", info)
    assert ceilings.ceilings("cuda", info) == honest  # kept: a quick measurement agrees
    ceilings._cache_path(info, "bf16").write_text(json.dumps({**honest, "copy_bytes_per_s": 1e30}))
    again = ceilings.ceilings("cuda", info)
    assert "copy_bytes_per_s 1e+30 differed" in again["replaced"]
    assert abs(again["copy_bytes_per_s"] / honest["copy_bytes_per_s"] - 1) < ceilings.AGREE
    fp32 = ceilings.ceilings("cuda", info, "fp32")
    assert fp32["matmul_flops_per_s"] < honest["matmul_flops_per_s"] / 2 and "float32" in fp32["method"]


def test_a_baseline_that_cannot_be_captured_leaves_every_contender_on_events():
    """fused_moe's eager code at fp32 loops with a host sync once a call's (token, expert) pairs
    outnumber the experts (prefill_40 of tiny-moe): its capture fails, which leaves the process
    on events, so every baseline is timed again with events, as the candidate then is — never a
    graph-timed baseline beside an events-timed candidate."""
    template = next(iter(get_op("fused_moe").templates.values()))
    verdict, _ = evaluate(Candidate(op="fused_moe", kind="template", template=template.name,
                                    point=template.default), Target(model="tiny-moe", dtype="fp32"))
    assert verdict.status == "pass" and len(verdict.timings) == 3, verdict.to_json()
    for t in verdict.timings:
        assert t.method.startswith("events") and "eager: graph" not in t.method, t.method
        assert "compile: graph" not in t.method, t.method


def test_an_uncapturable_function_is_timed_with_events_and_graphs_stay_off_after():
    """CUDA-graph timing: what it computed comes back for the judge; a host sync during capture
    falls back to events with the reason, and later graph timings of the process use events."""
    from harness import timing

    sets = [(torch.randn(4096, device="cuda"),) for _ in range(4)]
    method = timing.Method("cuda", warmup_ms=5, rep_ms=20, graph=True)
    try:
        doubled = timing.median_us(lambda t: t * 2, sets, method)
        assert doubled.how == "graph" and set(doubled.outputs) == {0, 1, 2, 3} and not doubled.reused
        assert all(torch.equal(doubled.outputs[j][0], sets[j][0] * 2) for j in range(4))
        buffer = torch.empty(4096, device="cuda")
        into_one = timing.median_us(lambda t: torch.mul(t, 2, out=buffer), sets, method)
        assert into_one.how == "graph" and into_one.reused == "calls 0 and 1 of 4" and not into_one.outputs
        syncing = timing.median_us(lambda t: t * float(t.sum().item()), sets, method)
        assert syncing.how == "events" and syncing.fallback and syncing.us > 0
        after = timing.median_us(lambda t: t * 2, sets, method)
        assert after.how == "events" and "failed capture" in after.fallback
        # what the calls timed with events returned, copied for the judge: call c ran on set c % 4
        assert 0 in after.outputs and len(after.outputs) >= 10 and not after.misfit
        assert all(torch.equal(outs[0], sets[c % 4][0] * 2) for c, outs in after.outputs.items())
    finally:
        timing._graphs_off = ""


@pytest.mark.parametrize("op_name, target", [("rmsnorm", TARGET), ("fused_moe", Target(model="tiny-moe", dtype="fp32"))])
def test_a_slots_baselines_are_reused_by_the_next_candidate_timed_as_they_were(op_name, target):
    """Stages forked from the warm fork server; the second candidate on the slot reuses the first's
    baselines (torch.compile's included) after its drift check. Where a baseline could not be
    captured (fused_moe's eager code at fp32), every contender of the second is timed with events
    too, whether it reused the baselines or its drift check had them measured again."""
    from gpu_pool.baselines import Baselines
    from gpu_pool.local import LocalExecutor
    from gpu_pool.pool import local_pool
    from tasks.evaluate import run_stages
    from tracking.ledger import Charge

    slot, executor, store = local_pool().slots()[0], LocalExecutor(), Baselines()
    template = next(iter(get_op(op_name).templates.values()))
    first, second = [run_stages(Candidate(op=op_name, kind="template", template=template.name, point=point), target,
                                slot, lambda stage, job, s, t: executor.run(job, s, t), Charge(), baselines=store)
                     for point in (template.default, {**template.default, "num_warps": 8})]
    for v in (first, second):
        assert v.status == "pass" and v.device["sandbox_start"] == "a fork of the supervisor", v.to_json()
        # the judge's end of the staging buffer page-locked: its copies to the GPU are DMA
        assert re.fullmatch(r"\d+ bytes of shared memory, sealed; its first \d+ bytes pinned", v.device["staging"]), \
            v.device
    assert first.baselines["source"] == "timed"
    if op_name == "rmsnorm":
        assert second.baselines["source"] == "cached", second.baselines
        assert [t.compile_us for t in second.timings] == [t.compile_us for t in first.timings]
    else:
        assert first.baselines["graphs_off"]
        for t in second.timings:
            assert t.method.startswith("events") and "eager: graph" not in t.method, t.method
            assert "compile: graph" not in t.method and "repeat: graph" not in t.method, t.method


def test_engine_profile_splits_a_decode_step_into_kernels(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    kernels = tmp_path / "k.json"
    kernels.write_text('{"rmsnorm": {"impl": "template", "template": "rows"}}')
    # its own process, as a user runs it (a failed capture earlier in this one leaves the RNG unusable)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "engine_templates.engine", "profile", "--presets", "tiny-moe",
                           "--batches", "1,4", "--steps", "5", "--top", "1000", "--kernels", str(kernels)],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "### batch 1: step" in done.stdout and "### batch 4: step" in done.stdout
    # the template's kernel, named in each eager step's table (all of it: --top 1000). Only layer 0's
    # input norm is a plain rmsnorm (the rest are fused_add_rmsnorm), so it runs once a step.
    rows = [line for line in done.stdout.splitlines() if line.startswith("| `_rmsnorm_rows")]
    assert len(rows) == 2, done.stdout[-3000:]
    assert all(row.split("|")[2].strip() == "1" for row in rows), rows
    assert " others |" not in done.stdout  # nothing folded away


def test_a_warm_stage_knows_its_gpu_and_ceilings_without_waiting_on_cuda():
    """The fork server learned the GPU (harness/device.py), so a forked stage hands its sandbox
    the job before this process touches CUDA: the sandbox is ready in well under the seconds a
    CUDA context takes. The second bench on the slot carries the first one's ceilings."""
    from gpu_pool.baselines import Baselines
    from gpu_pool.local import LocalExecutor
    from gpu_pool.pool import local_pool
    from harness import device
    from tasks.evaluate import run_stages
    from tracking.ledger import Charge

    slot, executor, store = local_pool().slots()[0], LocalExecutor(), Baselines()
    runs = [run_stages(free("honest_torch"), TARGET, slot, lambda stage, job, s, t: executor.run(job, s, t), Charge(),
                       baselines=store) for _ in range(2)]
    for v in runs:
        assert v.status == "pass" and v.device["sandbox_start"] == "a fork of the supervisor", v.to_json()
        facts = device.gpu_facts()
        assert v.device["uuid"] and all(v.device[k] == facts[k] for k in ("name", "uuid", "l2_bytes", "sm_count"))
        # the first bench on the slot measures the ceilings before it can plan: the only wait left
        waits = ("compile", "check", "bench") if v is runs[1] else ("compile", "check")
        assert all(v.phases[f"{s}/sandbox_start"] < 1.0 for s in waits), v.phases
    assert [v.device["ceilings"]["source"] for v in runs] == ["measured", "carried"]
    assert runs[1].device["ceilings"]["copy_bytes_per_s"] == runs[0].device["ceilings"]["copy_bytes_per_s"]
