"""Each gate rejects a planted bad candidate, and honest candidates pass: real harness
processes on this machine (Triton interpreter when there is no GPU)."""
from __future__ import annotations

import pytest

from conftest import CANDIDATES
from engine_templates.ops import get_op
from flows.pipeline import run_stages
from flows.target import Target
from gpu_pool.local import LocalExecutor
from gpu_pool.pool import local_pool
from harness.job import Candidate
from harness.verdict import Verdict
from tracking.ledger import Charge

TARGET = Target(model="tiny", budget={"stage_timeout_s": 60})


def evaluate(candidate: Candidate, target: Target = TARGET) -> tuple[Verdict, Charge]:
    slot = local_pool().slots()[0]
    executor = LocalExecutor()
    charge = Charge()
    verdict = run_stages(candidate, target, slot, lambda stage, job, s, t: executor.run(job, s, t), charge)
    return verdict, charge


def free(name: str, op: str = "rmsnorm") -> Candidate:
    return Candidate(op=op, kind="free", source=(CANDIDATES / op / f"{name}.py").read_text(), origin="test")


@pytest.mark.parametrize("name, status, gate", [
    ("wrong_values", "fail", "accuracy"),
    ("nan_output", "fail", "finite"),
    ("constant_output", "fail", "accuracy"),
    ("unwritten_output", "fail", "finite"),
    ("mutates_input", "fail", "inputs_unchanged"),
    ("wrong_dtype", "fail", "output_form"),
    ("raises", "fail", "compile"),
    ("crashes", "crash", "process"),
])
def test_planted_candidate_is_rejected_by_its_gate(name, status, gate):
    verdict, _ = evaluate(free(name))
    assert (verdict.status, verdict.failing_gate.name) == (status, gate), verdict.to_json()
    assert verdict.score() is None and not verdict.timings


def test_hang_past_the_time_limit_is_a_crash():
    target = TARGET.model_copy(update={"budget": TARGET.budget.model_copy(update={"stage_timeout_s": 12})})
    verdict, charge = evaluate(free("hangs"), target)
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit")
    assert 12 <= charge.gpu_seconds < 40  # killed at the limit, not left running


@pytest.mark.parametrize("name, gate", [("syntax_error", "load"), ("wrong_signature", "signature")])
def test_unloadable_candidate_fails_at_load(name, gate):
    verdict, _ = evaluate(free(name))
    assert (verdict.status, verdict.failing_gate.name) == ("fail", gate)


def test_honest_torch_module_passes_every_stage():
    verdict, charge = evaluate(free("honest_torch"))
    assert verdict.status == "pass", verdict.to_json()
    assert verdict.stages == ["compile", "check", "bench"]
    assert {g.name for g in verdict.gates} == {"compile", "correctness", "speed_of_light"}
    assert [t.label for t in verdict.timings] == ["decode_b1", "decode_b4", "prefill_40"]
    assert 0 < verdict.max_rel_error < TARGET.tolerance
    assert verdict.score() > 0 and set(charge.stage_seconds) == {"compile", "check", "bench"}


@pytest.mark.parametrize("op_name", ["rmsnorm", "silu_mul"])
def test_triton_template_points_pass(op_name):
    template = next(iter(get_op(op_name).templates.values()))
    point = {k: v[-1] for k, v in template.space.items()}  # the other end of the space from the default
    for p in (template.default, point):
        verdict, _ = evaluate(Candidate(op=op_name, kind="template", template=template.name, point=p))
        assert verdict.status == "pass", verdict.to_json()
        assert verdict.device["gpu_timing"] is (verdict.device["kind"] == "cuda")


def test_point_outside_the_space_fails_at_load():
    verdict, _ = evaluate(Candidate(op="rmsnorm", kind="template", template="rows",
                                    point={"block_n": 3, "rows_per_program": 1, "num_warps": 4, "num_stages": 1}))
    assert (verdict.status, verdict.failing_gate.name) == ("fail", "load")
