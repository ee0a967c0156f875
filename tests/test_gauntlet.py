"""The gauntlet on this machine: every red-team candidate is rejected by the gate its vector
names, and every honest candidate passes (docs/gates.md; gauntlet/manifest.toml).
Real supervisor and sandbox processes, Triton's interpreter when there is no GPU.

CI runs every rmsnorm and silu_mul case. For the engine's other ops (not rope, which the
engine no longer calls, nor qk_norm_rope beyond its template default) it runs what depends on the
op itself — stale output on its own inputs, mutation of its own arguments (the KV cache), the
caching probe with its declared persistent arguments — and its plain-PyTorch, template-default
and persistent-cache honest candidates. The cases marked `ci = false` (the same vectors again
per op, template far points) run with `pytest --gauntlet-all` and in `infersmith gauntlet`."""
from __future__ import annotations

from pathlib import Path

import pytest

from flows.gauntlet import run_case, table, target_for
from gauntlet import load_cases
from gpu_pool.bundle import current_bundle, unpack
from gpu_pool.local import LocalExecutor
from gpu_pool.pool import local_pool
from targets import Target

TARGET = Target(model="tiny", budget={"stage_timeout_s": 300})  # room for a loaded 2-core machine
CASES = load_cases()
RED_TEAM_VECTORS = {"stale output", "input mutation", "caching", "constant / low-signal output", "hidden work",
                    "lazy result", "timer patching", "reference fallback", "precision downgrade"}
# What depends on the op itself (its inputs, its arguments, its persistent ones): in CI for every op.
OP_DEPENDENT_VECTORS = {"stale output", "input mutation", "caching"}
ENGINE_OPS = ("decode_attention", "prefill_attention", "fused_moe", "rope")  # with a red team, in CI
# rope left the engine (qk_norm_rope does its work): its cases run outside CI. qk_norm_rope has
# no red team yet; its template default runs in CI.


@pytest.fixture(scope="module")
def bundle_executor(tmp_path_factory) -> LocalExecutor:
    """Stages run from an unpacked worker bundle, as on a pool host, not from the checkout: the
    integrity gate watches that copy, so a case that writes into the harness changes neither
    the checkout nor a stage another test runs meanwhile (pytest-xdist)."""
    return LocalExecutor(worker_root=unpack(current_bundle(), tmp_path_factory.mktemp("worker-bundle")))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_gets_its_expected_verdict(case, request, bundle_executor):
    if case.gpu_only and local_pool().slots()[0].gpu is None:
        pytest.skip("its vector exists only on a GPU (CUDA-graph capture); tests/test_gpu.py and "
                    "`infersmith gauntlet` on a GPU run it")
    if not case.ci and not request.config.getoption("--gauntlet-all"):
        pytest.skip("CI runs the op-dependent vectors of this op; "
                    "`pytest --gauntlet-all` or `infersmith gauntlet` runs every case")
    row = run_case(case, TARGET, local_pool().slots()[0], bundle_executor)
    assert row.ok, f"expected {case.expected}, got {row.got}\n{row.verdict.to_json()}"
    if case.expect == "pass":
        assert row.verdict.stages == ["compile", "check", "bench"] and row.verdict.timings
        assert row.verdict.score() <= 1.0 or "reference_fallback" not in row.verdict.flags
    else:
        assert row.verdict.score() is None


def test_every_way_of_telling_timed_calls_apart_has_a_case_that_runs_on_a_cpu():
    """Timed = judged (docs/gates.md): a case per tell a candidate can key on — global torch state,
    the call count, the input object, the time since its last return, a capture it breaks — each
    rejected on a CPU slot too (the stream's, which needs a GPU, aside), by `timed_outputs`."""
    tells = {c.file for c in CASES if c.vector == "timed ≠ judged"}
    assert tells == {"skips_work_by_torch_state.py", "skips_work_by_call_count.py", "skips_work_on_seen_input.py",
                     "skips_work_back_to_back.py", "skips_work_off_default_stream.py", "skips_work_uncaptured.py",
                     "shrinks_output_when_timed.py"}
    for c in CASES:
        if c.vector == "timed ≠ judged":
            assert (c.expect, c.gate, c.ci) == ("fail", "timed_outputs", True), c.name
            assert c.gpu_only == (c.file == "skips_work_off_default_stream.py"), c.name


def test_manifest_lists_every_file_and_every_vector():
    here = Path(__file__).resolve().parent.parent / "gauntlet"
    listed = {f"{c.op}/{c.file}" for c in CASES if c.file}
    on_disk = {f"{p.parent.name}/{p.name}" for p in here.glob("*/*.py")}
    unused = on_disk - listed - {"rmsnorm/syntax_error.py", "rmsnorm/wrong_signature.py"}  # usage errors
    assert not unused, f"candidates not in the manifest: {sorted(unused)}"
    vectors = {c.vector for c in CASES if c.ci}
    for v in ("stale output", "input mutation", "caching", "constant / low-signal output", "hidden work",
              "lazy result", "timer patching", "reference fallback", "reading the oracle", "harness editing",
              "precision downgrade", "runaway", "forged verdict", "network", "process creation", "timed ≠ judged",
              "honest"):
        assert v in vectors, v
    for op in ("rmsnorm", "silu_mul"):  # every vector on both, in CI
        assert {c.vector for c in CASES if c.op == op and c.expect != "pass" and c.ci} >= RED_TEAM_VECTORS, op
    for op in ENGINE_OPS:
        cases = [c for c in CASES if c.op == op]
        red = {c.vector for c in cases if c.expect != "pass"}
        assert red >= RED_TEAM_VECTORS | {"reading the oracle"}, (op, RED_TEAM_VECTORS - red)
        assert {c.vector for c in cases if c.expect != "pass" and c.ci} >= OP_DEPENDENT_VECTORS, op
        honest = [c for c in cases if c.honest]
        assert {c.point for c in honest if c.template} == {"default", "far"}, op
        in_ci = {c.file or c.point for c in honest if c.ci}
        assert {"honest_torch.py", "default"} <= in_ci, op
        assert {c.file for c in honest if "cache" in c.file} <= in_ci, f"{op}: persistent caches must pass in CI"
    assert any(c.op == "qk_norm_rope" and c.point == "default" and c.ci for c in CASES)


def test_the_window_ops_reject_a_kernel_ignoring_the_window_and_pass_their_honest_suite_in_ci():
    for op in ("decode_attention_swa", "prefill_attention_swa"):
        cases = {c.file or c.point: c for c in CASES if c.op == op}
        ignores = cases["ignores_window.py"]
        assert (ignores.expect, ignores.gate, ignores.ci) == ("fail", "accuracy", True), op
        assert {"honest_torch.py", "default"} <= {k for k, c in cases.items() if c.honest and c.ci}, op
        assert {c.point for c in cases.values() if c.template} == {"default", "far"}, op
        assert target_for(ignores, TARGET).model == "tiny-swa"


def test_fused_moe_cases_run_on_the_moe_preset_of_the_models_size_class():
    moe = next(c for c in CASES if c.op == "fused_moe")
    dense = next(c for c in CASES if c.op == "rmsnorm")
    assert target_for(moe, TARGET).model == "tiny-moe" and target_for(dense, TARGET).model == "tiny"
    assert target_for(moe, Target(model="qwen3-8b")).model == "qwen3-30b-a3b"
    assert target_for(moe, Target(model="qwen3-30b-a3b")).model == "qwen3-30b-a3b"


def test_vision_op_cases_run_on_the_vision_preset_of_the_models_size_class():
    attention = next(c for c in CASES if c.op == "vision_attention")
    dense = next(c for c in CASES if c.op == "rmsnorm")
    assert target_for(attention, TARGET).model == "sam3-tiny" and target_for(attention, Target(model="qwen3-8b")).model == "sam3"
    assert target_for(dense, Target(model="sam3-tiny")).model == "tiny"
    assert target_for(attention, Target(model="sam3-tiny")).model == "sam3-tiny"
    for op in ("layernorm", "gelu", "vision_attention", "vision_linear"):  # an honest rewrite, the template, a cheat, a mutation
        cases = [c for c in CASES if c.op == op]
        assert {c.file or c.point for c in cases if c.honest and c.ci} >= {"honest_torch.py", "default"}, op
        assert {c.vector for c in cases if not c.honest and c.ci} >= {"wrong answer", "input mutation"}, op


def test_table_marks_a_wrong_verdict():
    from contract.verdict import Verdict
    from flows.gauntlet import Row

    case = next(c for c in CASES if c.gate == "caching")
    passed = Verdict(op=case.op, candidate_id="x")
    text = table([Row(case, passed, 1.0)], on_gpu=False)
    assert "| pass | **NO** |" in text and "red team rejected as expected: 0/1" in text
    wrong = Verdict(op=case.op, candidate_id="y")
    wrong.gate("runtime", False, "CUDA out of memory | tried 2 GiB")
    text = table([Row(case, wrong, 1.0)], on_gpu=True)
    assert "| fail runtime | **NO** |" in text and "got: CUDA out of memory / tried 2 GiB |" in text


def test_cases_side_by_side_from_the_command(capsys):
    """`infersmith gauntlet --jobs 3`: cases run at once from an unpacked copy of the worker
    packages; the one that writes into the harness runs last, alone, and touches neither the
    checkout nor the cases beside it (each of which would otherwise fail harness_integrity)."""
    from cli.main import main

    checkout = Path(__file__).resolve().parent.parent / "harness"
    before = sorted(p.name for p in checkout.iterdir())
    code = main(["gauntlet", "--op", "rmsnorm", "--jobs", "3", "--stage-timeout", "120",
                 "--case", "writes_harness", "--case", "stale_buffer", "--case", "mutates_input",
                 "--case", "rmsnorm/rows[default]"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "4 cases on" in err and "3 at a time" in err
    progress = [line.split(":")[0].split()[-1] for line in err.splitlines() if line.startswith("  ok ")]
    assert len(progress) == 4 and progress[-1] == "rmsnorm/writes_harness", err
    assert "red team rejected as expected: 3/3; honest passed: 1/1" in out
    table_order = [line.split("`")[1] for line in out.splitlines() if line.startswith("| red team")]
    assert table_order == ["rmsnorm/stale_buffer", "rmsnorm/mutates_input", "rmsnorm/writes_harness"]
    assert sorted(p.name for p in checkout.iterdir()) == before


def test_gpu_only_cases_are_listed_as_not_run_on_a_cpu_slot(capsys):
    """A vector that only a GPU has (a CUDA graph being captured) is not run on a CPU slot: the
    command says so, and asking for such cases alone is a usage error."""
    from cli.main import main

    if local_pool().slots()[0].gpu is not None:
        pytest.skip("this machine's slot has a GPU: the case runs there")
    assert [c.name for c in CASES if c.gpu_only] == ["rmsnorm/side_stream_unjoined", "rmsnorm/skips_work_captured",
                                                   "rmsnorm/skips_sets_captured", "rmsnorm/skips_work_off_default_stream"]
    assert main(["gauntlet", "--case", "skips_work_captured"]) == 2
    assert "every chosen case needs a GPU" in capsys.readouterr().err
    assert main(["gauntlet", "--op", "rmsnorm", "--case", "skips_work_captured", "--case", "stale_buffer"]) == 0
    out, err = capsys.readouterr()
    assert "not run on local:cpu, which has no GPU: rmsnorm/skips_work_captured" in err
    assert "`rmsnorm/stale_buffer`" in out and "skips_work_captured" not in out
