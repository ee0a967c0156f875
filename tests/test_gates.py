"""Gates outside the gauntlet's manifest (tests/test_gauntlet.py runs that): loading, a
whole honest evaluation through the pipeline, screening rules and the speed-of-light gate
as plain functions."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.job import Candidate, Job, Rules, Shape
from contract.verdict import ShapeTiming, Verdict
from gpu_pool.local import LocalExecutor
from gpu_pool.pool import Host, Slot, local_pool
from harness.screen import screen
from targets import Target
from tasks.evaluate import run_stages
from tracking.ledger import Charge

TARGET = Target(model="tiny", budget={"stage_timeout_s": 60})
from conftest import CANDIDATES as SUITE
from frames import REPORT


def evaluate(candidate: Candidate, target: Target = TARGET) -> tuple[Verdict, Charge]:
    slot = local_pool().slots()[0]
    executor = LocalExecutor()
    charge = Charge()
    verdict = run_stages(candidate, target, slot, lambda stage, job, s, t: executor.run(job, s, t), charge)
    return verdict, charge


def free(name: str, op: str = "rmsnorm") -> Candidate:
    return Candidate(op=op, kind="free", source=(SUITE / op / f"{name}.py").read_text(), origin="test")


@pytest.mark.parametrize("name, gate", [("syntax_error", "load"), ("wrong_signature", "signature")])
def test_unloadable_candidate_fails_at_load(name, gate):
    verdict, _ = evaluate(free(name))
    assert (verdict.status, verdict.failing_gate.name) == ("fail", gate)


def test_honest_torch_module_passes_every_stage():
    verdict, charge = evaluate(free("honest_torch"))
    assert verdict.status == "pass", verdict.to_json()
    assert verdict.stages == ["compile", "check", "bench"]
    assert {g.name for g in verdict.gates} == {"screen", "compile", "correctness", "speed_of_light"}
    assert [t.label for t in verdict.timings] == ["decode_b1", "decode_b4", "prefill_40"]
    # each timing's repetitions, as many as the confidence rule asked (the wall clock: 3 to 50)
    assert all(len(t.reps) == 2 and all(3 <= n <= 50 for n in t.reps) and len(t.steady) == 2
               for t in verdict.timings), verdict.to_json()
    assert 0 < verdict.max_rel_error < TARGET.tolerance
    assert "network: none" in verdict.device["isolation"] or "not isolated" in verdict.device["isolation"]
    assert verdict.score() > 0 and set(charge.stage_seconds) == {"compile", "check", "bench"}


def test_a_candidate_that_takes_the_sandbox_stdin_fails_the_check_on_protocol():
    """The sandbox waits on stdin for the supervisor's `taken` after each output it hands over
    (and, in the bench stage, for its go-ahead before timing each shape); a candidate that closes
    stdin passes compile, which sends no outputs, and fails the check at its first output, named."""
    honest = (SUITE / "rmsnorm" / "honest_torch.py").read_text()
    verdict, _ = evaluate(Candidate(op="rmsnorm", kind="free", origin="test",
                                    source=honest + "\nimport sys\nsys.stdin.close()\n"))
    assert (verdict.status, verdict.failing_gate.name) == ("fail", "protocol"), verdict.to_json()
    assert verdict.failing_gate.detail == ("the supervisor's answer to 'check/0' did not arrive as sent: something in "
                                           "the candidate's process read or closed its stdin")
    assert verdict.stages == ["compile", "check"]


def test_a_candidate_that_takes_the_sandbox_stdin_fails_the_bench_at_the_go_ahead():
    """The bench stage waits on stdin for the supervisor's go-ahead before timing each shape (the
    supervisor's own GPU work must not overlap a timing): a candidate that closes stdin when the
    bench stage loads it fails there, before any shape is timed, named."""
    from tasks.evaluate import jobs_for

    honest = (SUITE / "rmsnorm" / "honest_torch.py").read_text()
    job = jobs_for(Candidate(op="rmsnorm", kind="free", origin="test", source=honest + "\nimport sys\nsys.stdin.close()\n"),
                   TARGET, CPU_SLOT)["bench"]
    verdict = LocalExecutor().run(job, CPU_SLOT, 120).verdict
    assert (verdict.status, verdict.failing_gate.name) == ("fail", "protocol"), verdict.to_json()
    assert verdict.failing_gate.detail == ("decode_b1: the supervisor's go-ahead to time did not arrive as sent: "
                                           "something in the candidate's process read or closed its stdin")
    assert not verdict.timings


def test_point_outside_the_space_fails_at_load():
    verdict, _ = evaluate(Candidate(op="rmsnorm", kind="template", template="rows",
                                    point={"block_n": 3, "rows_per_program": 1, "num_warps": 4, "num_stages": 1}))
    assert (verdict.status, verdict.failing_gate.name) == ("fail", "load")


@pytest.mark.parametrize("source, rule, action", [
    ("import os as o\ndef f():\n    o.fork()\n", "process_creation", "reject"),
    ("from os import system\n", "process_creation", "reject"),
    ("import torch\ntorch.cuda.synchronize = lambda: None\n", "timer_patching", "reject"),
    ("import time\nsetattr(time, 'perf_counter', None)\n", "timer_patching", "reject"),
    ("import torch.nn.functional as F\nF.rms_norm\n", "reference_fallback", "flag"),
    ("import torch\ns = torch.cuda.Stream()\n", "unjoined_stream", "reject"),
    ("import torch\nx = 1\ngetattr(x, 'a' + 'b')\n", "dynamic_attribute", "flag"),
    ("from engine_templates.ops import get_op\n", "harness_access", "reject"),
    ("import sys\nsys.modules['gc']\n", "introspection", "reject"),
    ("__builtins__['sorted'] = min\n", "introspection", "reject"),
])
def test_screen_finds(source, rule, action):
    found = {(f.rule, f.action) for f in screen(source).findings}
    assert (rule, action) in found, found


def test_screen_lets_a_joined_side_stream_and_plain_kernels_through():
    joined = "import torch\ns = torch.cuda.Stream()\ns.wait_stream(torch.cuda.current_stream())\n"
    assert not screen(joined).rejections and [f.rule for f in screen(joined).flags] == ["side_stream"]
    for path in SUITE.glob("*/honest_*.py"):
        assert not screen(path.read_text()).rejections, path


def test_screen_flags_fp8_unless_the_target_asks_for_it():
    """An fp8 target's weights are e4m3: naming that type is what it asks for; e5m2 (or fp8
    under any other target) is still a precision a person approves."""
    e4m3 = "import torch\nimport triton.language as tl\ntorch.float8_e4m3fn\ntl.float8e4nv\n"
    assert [f.what for f in screen(e4m3).flags] == ["torch.float8_e4m3fn", "triton.language.float8e4nv"]
    assert not screen(e4m3, dtype="fp8").flags
    assert [f.what for f in screen("import torch\ntorch.float8_e5m2\n", dtype="fp8").flags] == ["torch.float8_e5m2"]


def test_speed_of_light_rejects_a_time_under_the_roofline():
    from harness.judging import speed_of_light

    job = Job("bench", Candidate(op="rmsnorm", kind="free", source=""), "tiny", [Shape("s", {})], [], Rules())
    v = Verdict(op="rmsnorm", candidate_id="x", device={"gpu_timing": True})
    v.timings.append(ShapeTiming("s", {}, 1.0, 1.0, 10.0, None, roofline_us=5.0, bytes=1, flops=1))
    speed_of_light(job, v)
    assert (v.status, v.failing_gate.name) == ("fail", "speed_of_light") and "faster than" in v.failing_gate.detail
    # either timing under the roofline fails, though their mean is over it
    v = Verdict(op="rmsnorm", candidate_id="x", device={"gpu_timing": True})
    v.timings.append(ShapeTiming("s", {}, 9.0, 4.0, 10.0, None, roofline_us=5.0, bytes=1, flops=1))
    speed_of_light(job, v)
    assert (v.status, v.failing_gate.name) == ("fail", "speed_of_light") and "4.00 us" in v.failing_gate.detail


def test_the_candidate_figure_is_the_mean_of_its_two_timings():
    """The baselines are timed once each: the candidate's figure beside theirs is the mean of its
    two timings, not the faster one, which would favour it by about the spread."""
    v = Verdict(op="rmsnorm", candidate_id="x")
    v.timings.append(ShapeTiming("s", {}, 1.0, 1.5, 2.5, 3.75, roofline_us=0.5, bytes=1, flops=1))
    m = v.metrics()
    assert m["s/latency_us"] == 1.25 and m["s/speedup_vs_eager"] == 2.0 and m["s/speedup_vs_compile"] == 3.0
    assert m["s/pct_roofline"] == 40.0 and m["s/spread"] == 0.5 and v.score() == 2.0


def test_reference_fallback_scores_no_speed_up():
    v = Verdict(op="rmsnorm", candidate_id="x", flags=["reference_fallback"])
    v.timings.append(ShapeTiming("s", {}, 1.0, 1.0, 10.0, None, roofline_us=0.1, bytes=1, flops=1))
    assert v.score() == 1.0
    v.flags = []
    assert v.score() == pytest.approx(10.0)


def test_ops_declare_their_persistent_arguments():
    """What the caching probe leaves alone: weights and tables built at load, never the KV cache,
    lengths, block tables or router logits, which change every step of an engine."""
    from engine_templates.ops import OPS

    for op in OPS.values():
        assert set(op.persistent) <= set(op.arg_names), op.name
    assert {name: set(op.persistent) for name, op in OPS.items() if op.persistent} == {
        "rmsnorm": {"weight"}, "fused_add_rmsnorm": {"weight"}, "rope": {"cos_sin"},
        "qk_norm_rope": {"q_norm", "k_norm", "cos_sin"}, "fused_moe": {"w_gate_up", "w_down"}, "linear": {"weight"},
        "layernorm": {"weight", "bias"}, "vision_attention": {"cos", "sin"}, "vision_linear": {"weight", "bias"}}
    from engine_templates.ops import FP8_OPS

    # an fp8 target's weights and their scales
    assert {name: set(op.persistent) for name, op in FP8_OPS.items()} == {
        "linear": {"weight", "weight_scale"},
        "fused_moe": {"w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale"}}


def test_shapes_under_a_millisecond_of_roofline_are_timed_by_graph():
    """Events would time the host's issue time with the call wherever the host is the slower
    (docs/BENCHMARKS.md): every shape under 1 ms of roofline is graph-timed on a
    GPU, the large prefill calls included; a call far past it keeps events; a CPU never graphs."""
    from contract.job import Rules
    from engine_templates.models import PRESETS
    from engine_templates.ops import get_op
    from harness.timing import by_graph

    bound, h200_copy = Rules().launch_bound_us, 4.25e6  # bytes a microsecond (an H200's measured copy rate)
    rms = get_op("rmsnorm")
    big = rms.shapes(PRESETS["qwen3-8b"], [], [16384], [])[0]
    roof = rms.bytes(big, torch.bfloat16) / h200_copy
    assert 60 < roof < 70 and by_graph("cuda", roof, bound) and not by_graph("cpu", roof, bound)
    attn = get_op("decode_attention")
    longest = [s for s in attn.shapes(PRESETS["qwen3-8b"], [128], [], [32768]) if "contig" in s.label][0]
    assert not by_graph("cuda", attn.bytes(longest, torch.bfloat16) / h200_copy, bound)


def test_timing_method_says_which_contender_was_not_captured():
    """A function that cannot be captured in a CUDA graph is timed with events; the timing's
    method says so for the contender it concerns, and one word when all were timed alike."""
    from harness.stages import method_label
    from harness.timing import Timed

    graph, events = Timed(1.0, "graph"), Timed(2.0, "events", fallback="RuntimeError: sync while capturing")
    wall = Timed(1.0, "wall")
    assert method_label(graph, graph, graph, graph) == "graph"
    assert method_label(wall, wall, wall, None) == "wall"
    assert method_label(graph, graph, events, graph) == ("graph; eager: events (not capturable: RuntimeError: "
                                                         "sync while capturing)")
    assert method_label(events, events, graph, None) == ("events (not capturable: RuntimeError: sync while "
                                                         "capturing); eager: graph")
    assert method_label(graph, events, graph, None).startswith("graph; repeat: events (not capturable")


def test_a_timed_graph_is_checked_on_sets_drawn_after_it_ran():
    """Which captured calls the judge checks: the first, the last and GRAPH_CHECKS others drawn
    at random, so that a candidate skipping work on a share of the sets cannot tell which."""
    from harness.timing import GRAPH_CHECKS, checked_sets

    assert checked_sets(1) == [0] and checked_sets(2) == [0, 1] and checked_sets(5) == [0, 1, 2, 3, 4]
    draws = [checked_sets(2048) for _ in range(20)]
    assert all(d[0] == 0 and d[-1] == 2047 and len(d) == GRAPH_CHECKS + 2 for d in draws)
    middle = {j for d in draws for j in d[1:-1]}
    assert len(middle) > 5 * GRAPH_CHECKS  # not the same few sets each time
    assert checked_sets(2048, draws=0) == [0, 2047]


def test_calls_that_return_the_same_storage_are_named():
    """Captured calls that return the same buffer leave only the last one's values: named, so the
    bench stage fails them. Two outputs of one call may share storage (views of one buffer)."""
    from harness.timing import reused_storage

    a, b, shared = torch.zeros(4), torch.zeros(4), torch.zeros(8)
    assert reused_storage([(a,), (b,)]) == ""
    assert reused_storage([(shared[:4], shared[4:]), (b,)]) == ""
    assert reused_storage([(a,), (b,), (a.view(2, 2),)]) == "calls 0 and 2 of 3"
    assert reused_storage([(a, b), (torch.zeros(1), b)]) == "calls 0 and 1 of 2"


def test_cached_ceilings_that_are_not_figures_are_measured_again(monkeypatch, tmp_path):
    """The ceilings cache is a file the candidate's process could write: what is not two positive
    figures is measured again and replaced, and the result says why."""
    import json

    from engine_templates import ceilings

    monkeypatch.setattr(ceilings, "CACHE_DIR", tmp_path)
    info = {"name": "test device", "torch": torch.__version__}
    first = ceilings.ceilings("cpu", info)
    assert first["copy_bytes_per_s"] > 0 and "replaced" not in first
    path = ceilings._cache_path(info, "bf16")
    assert json.loads(path.read_text()) == first and ceilings.ceilings("cpu", info) == first  # cached
    assert ceilings._cache_path(info, "fp32") != path  # a matmul rate per dtype
    for forged in ({"copy_bytes_per_s": 1e30, "matmul_flops_per_s": -1}, {"copy_bytes_per_s": "1e30"}, [1, 2]):
        path.write_text(json.dumps(forged))
        again = ceilings.ceilings("cpu", info)
        assert again["replaced"] == "the cached file did not hold two positive figures", again
        assert json.loads(path.read_text()) == again


def test_cached_ceilings_must_agree_with_a_quick_measurement():
    """On a GPU the cached figures are checked against a quick measurement every time."""
    from engine_templates.ceilings import disagreement

    quick = {"copy_bytes_per_s": 4.2e12, "matmul_flops_per_s": 7.5e14}
    assert disagreement({"copy_bytes_per_s": 4.5e12, "matmul_flops_per_s": 6.8e14}, quick) == ""
    forged = disagreement({"copy_bytes_per_s": 4.2e20, "matmul_flops_per_s": 7.4e14}, quick)
    assert forged == "the cached copy_bytes_per_s 4.2e+20 differed from one measured now (4.2e+12) by more than 15%"
    assert "matmul_flops_per_s" in disagreement({"copy_bytes_per_s": 4.2e12, "matmul_flops_per_s": 1e14}, quick)


def test_compiled_baseline_has_room_for_every_shape(monkeypatch):
    # Ten shapes and more (decode batches 1..128 and prefills): with Dynamo's default limit of 8
    # recompiles, the ninth shape on would run eager code under the torch.compile label.
    from torch._dynamo.utils import counters

    from engine_templates.ops.silu_mul import OP
    from harness.stages import compile_baseline

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # restored after the test
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_baseline(OP, 12, backend="eager")
    for tokens in range(1, 13):
        gate, up = torch.randn(tokens, 64), torch.randn(tokens, 64)
        torch.testing.assert_close(compiled(gate, up), OP.eager(gate, up))
    assert counters["stats"]["unique_graphs"] == 12
    torch._dynamo.reset()


# Spins on the 40-row shape (tiny's prefill_40); honest on the others.
HANGS_AT_PREFILL = '''import torch


def rmsnorm(x, weight, eps):
    while x.shape[0] == 40:
        pass
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * weight
'''


# The deadline's tests run on the CPU (the interpreter) wherever they run: on a GPU host the
# bench stage's torch.compile baselines alone can take most of a 20 s limit.
CPU_SLOT = Slot(Host(name="local"), None)


@pytest.mark.parametrize("stage, kept", [
    ("compile", "its first call on shape prefill_40 had not returned (2 of 5 shapes compiled before it)"),
    ("check", "6 of 15 planned calls judged, all within tolerance"),
    ("bench", "2 of 3 shapes timed and judged (kept below); not timed: prefill_40"),
])


def test_a_stage_stopped_at_its_limit_keeps_what_it_measured(stage, kept):
    """The harness stops the candidate a little inside the controller's limit and writes the
    verdict itself, so what was judged and timed before survives (the controller's kill writes
    none). Honest, each of these stages takes about 3 s here."""
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source=HANGS_AT_PREFILL), Target(model="tiny", dtype="fp32"), slot)
    verdict = LocalExecutor().run(job[stage], slot, 20).verdict
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit"), verdict.to_json()
    assert verdict.failing_gate.detail.startswith(f"{stage} stage ran past its 20 s limit: the harness killed")
    assert verdict.failing_gate.detail.endswith(kept)
    if stage == "bench":
        assert [t.label for t in verdict.timings] == ["decode_b1", "decode_b4"]
        assert all(t.candidate_us > 0 for t in verdict.timings) and verdict.score() is None


def test_what_torchs_timing_functions_look_up_when_called_is_watched(monkeypatch):
    """torch.cuda.current_stream and synchronize look these up at call time: a swap would move
    the harness's events to another stream, so the identity check names it."""
    from harness import integrity, timing

    before = integrity.Identities()
    assert before.changed() == []
    monkeypatch.setattr(torch.cuda, "_get_device_index", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "device", object)
    assert before.changed() == ["torch.cuda.device", "torch.cuda._get_device_index"]
    if hasattr(torch._C, "_cuda_synchronize"):  # a CUDA build: bound as torch's C function itself
        assert timing._synchronize is torch._C._cuda_synchronize


def test_the_deadline_kills_what_the_sandbox_started_too():
    """Past the stage's limit the supervisor kills the sandbox and everything below it (a
    compile worker, say, that holds a copy of the report channel), without reaping; in a process
    of its own here, since it kills every process below the one that calls it."""
    import subprocess
    import sys

    script = ("import os, subprocess, time\n"
              "from harness import deadline\n"
              "p = subprocess.Popen(['sh', '-c', 'sleep 300 & echo $!; wait'], stdout=subprocess.PIPE, text=True)\n"
              "grandchild = int(p.stdout.readline())\n"
              "deadline.kill_tree()\n"
              "assert p.wait(timeout=10) == -9, p.returncode\n"
              "for _ in range(100):\n"
              "    try:\n"
              "        state = open(f'/proc/{grandchild}/stat').read().rsplit(')', 1)[1].split()[0]\n"
              "    except FileNotFoundError:\n"
              "        break\n"
              "    if state == 'Z':\n"
              "        break\n"
              "    time.sleep(0.1)\n"
              "else:\n"
              "    raise SystemExit(f'the grandchild {grandchild} still runs')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr


def test_a_report_that_ended_before_the_deadline_struck_is_a_process_crash():
    """The deadline may strike between the report's end (the sandbox died, and all it started)
    and the supervisor's cancelling it: that death was the candidate's, and the verdict says
    `process`, not `time_limit`. A report that ends only after the limit struck (a fork the
    sandbox left holding the channel) stays `time_limit` (the fork chain's test)."""
    import io
    import time

    from harness.deadline import Deadline
    from harness.judging import Judge
    from tasks.evaluate import jobs_for

    def strikes(deadline: Deadline) -> bool:
        """Whether its timer thread struck within a minute: however late a loaded machine runs it."""
        for _ in range(600):
            if deadline.struck:
                return True
            time.sleep(0.1)
        return False

    # Each strikes 3 s after it is made (a 2 s reserve; no sandbox to kill): the report's end comes
    # right away, or once the strike has come.
    first, after = Deadline(5.0, time.perf_counter()), Deadline(5.0, time.perf_counter())
    first.report_ended()
    # Through the report's reader: reading a report to its end marks it ended, before the strike.
    import os

    from harness.supervisor import _Report

    r, w = os.pipe()
    os.write(w, _frame("done"))
    os.close(w)
    read = Deadline(5.0, time.perf_counter())
    with io.BufferedReader(_Report(r, read)) as report:
        assert report.read() == _frame("done")
    assert strikes(after)
    after.report_ended()
    for deadline, ended_first in ((first, True), (after, False), (read, True)):
        assert strikes(deadline)
        deadline.report_ended()
        assert deadline.ended_first == ended_first

    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), Target(model="tiny", dtype="fp32"),
                   CPU_SLOT)["check"]
    for ended_first, gate in ((True, "process"), (False, "time_limit")):
        v = Verdict("rmsnorm", "c")
        judge = Judge(job, v)
        judge.read(io.BytesIO(b""), stop=lambda: None)
        deadline = _deadline(17.5)
        deadline.ended_first = ended_first
        judge.finish(3 if ended_first else -9, deadline)
        assert (v.status, v.failing_gate.name) == ("crash", gate), v.to_json()


def test_a_candidate_whose_import_runs_past_the_limit_is_named_so():
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source="while True:\n    pass\n"), Target(model="tiny", dtype="fp32"), slot)
    verdict = LocalExecutor().run(job["compile"], slot, 10).verdict
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit"), verdict.to_json()
    assert verdict.failing_gate.detail.endswith("the candidate had not finished loading (importing it ran past the limit)")


# Forks on its first call, each parent exiting at once: the process alive is always one that no
# look at /proc has listed yet, and every one holds the report channel's write end.
FORKS_A_CHAIN = '''import os

_fork, _leave = getattr(os, "fo" + "rk"), getattr(os, "_ex" + "it")


def rmsnorm(x, weight, eps):
    while True:
        if _fork() != 0:
            _leave(0)
'''


def test_a_chain_of_forks_that_escapes_the_kill_still_gets_the_harness_verdict():
    """The kill at the deadline misses a chain of forks (a copy is always one forked after the
    look), which keeps the report channel open: the judge stops reading a little after the
    deadline all the same, and the verdict is the harness's, not the controller's."""
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source=FORKS_A_CHAIN), Target(model="tiny", dtype="fp32"), slot)
    # 60 s: a reserve of 6 s. The chain's forks and zombies slow the supervisor's end (reaping,
    # /proc scans): at 15 s (a 2 s reserve) CI's two loaded cores let the controller's kill win.
    verdict = LocalExecutor().run(job["compile"], slot, 60).verdict
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit"), verdict.to_json()
    assert verdict.failing_gate.detail.startswith("compile stage ran past its 60 s limit: the harness killed")


# Sends settle frames on the harness's channel (the sandbox's argument) at import, numbered as
# the sandbox numbers its own, and never reads the go-aheads: once stdin's pipe is full, a
# blocking answer would stop the judge.
FLOODS_SETTLE = '''import os
import sys

_write = getattr(os, "wr" + "ite")
for n in range(40000):
    _write(int(sys.argv[1]), b'{"kind": "settle", "n": ' + str(n).encode() + b', "tensors": [], "nbytes": []}\\n')


def rmsnorm(x, weight, eps):
    return x
'''


def test_settle_frames_the_sandbox_never_waits_on_fail_protocol_without_blocking_the_judge():
    """Each go-ahead is written without blocking: the sandbox reads one before it sends its next
    settle, so a pipe full of them was filled by the candidate, and the judge says so at once
    rather than waiting, blocked, for the stage's limit."""
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source=FLOODS_SETTLE), Target(model="tiny", dtype="fp32"), slot)
    verdict = LocalExecutor().run(job["bench"], slot, 60).verdict
    # The judge's own finding: had it blocked, the deadline's kill (54 s) would end it `time_limit`.
    assert (verdict.status, verdict.failing_gate.name) == ("fail", "protocol"), verdict.to_json()
    assert "full of go-aheads" in verdict.failing_gate.detail


def test_a_frame_the_deadline_kill_cut_short_ends_the_report_without_blaming_the_candidate():
    """Killed at the limit, the sandbox may be inside a frame (a header line longer than a pipe
    takes in one write, half written): that frame's end never comes. Unless the harness killed it,
    a frame cut short is still a protocol failure."""
    import io

    from harness.judging import Judge
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), Target(model="tiny", dtype="fp32"), slot)["check"]
    cut = (b'{"kind": "isolation", "tensors": [], "nbytes": [], "detail": "none"}\n'
           b'{"kind": "outputs", "tensors": [{"dtype": "float32", "shape": [4]}], "offsets": [0], "nbytes": [16], "it')
    for killed in (False, True):
        v = Verdict("rmsnorm", "c")
        judge = Judge(job, v)
        judge.read(io.BytesIO(cut), stop=lambda: None, killed=lambda: killed)
        judge.finish(-9, _deadline(17.5 if killed else None))
        gate = v.failing_gate
        if killed:
            assert (v.status, gate.name) == ("crash", "time_limit"), v.to_json()
            assert gate.detail.endswith("0 of 15 planned calls judged, all within tolerance")
        else:
            assert (v.status, gate.name) == ("fail", "protocol") and "header line cut off" in gate.detail


# On its first call, starts an output frame's header on the harness's channel and, before its
# end, takes host memory until the watchdog kills it.
LEAKS_INSIDE_A_FRAME = '''import os
import sys

import torch

_write, _kept = getattr(os, "wr" + "ite"), []


def rmsnorm(x, weight, eps):
    _write(int(sys.argv[1]), b'{"kind": "outputs", "tensors": [{"dtype": "uint8", "shape": [64]}], ')
    while True:
        _kept.append(torch.ones(256 << 20, dtype=torch.uint8))
'''


def test_a_frame_the_memory_watchdog_cut_short_is_a_memory_crash_not_protocol():
    """The watchdog's kill, like the deadline's, may land inside a frame: the verdict names the
    memory, not the report it cut."""
    from dataclasses import replace

    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    job = jobs_for(Candidate("rmsnorm", "free", source=LEAKS_INSIDE_A_FRAME), Target(model="tiny", dtype="fp32"),
                   slot)["check"]
    job = replace(job, rules=replace(job.rules, memory_mb=1024))
    verdict = LocalExecutor().run(job, slot, 60).verdict
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "memory"), verdict.to_json()
    assert [g.name for g in verdict.gates if not g.passed] == ["memory"]


_frame = REPORT.frame  # a frame as harness.channel.Sender writes it, its tensors in REPORT's staging buffer


# A first shape's timing frame as the sandbox sends it, on a CPU (wall clock, no torch.compile).
FIRST_TIMING = dict(label="decode_b1", dims={}, candidate_us=1.0, candidate_us_repeat=1.0, method="wall", sets=2)


def _baselines_then_loading(judge) -> bytes:
    """What the bench stage's sandbox sends before it loads the candidate: every planned shape's
    baselines (harness/baselines.py), measured there, then `loading`."""
    return b"".join(_frame("baseline", label=item["shape"], eager_us=50.0, eager_how="wall", eager_fallback="",
                           compile_us=None, compile_how="", compile_fallback="", graphs_off="")
                    for item in judge.plan["shapes"]) + _frame("loading")


def _probe_frame(judge, phase: str, j: int) -> bytes:
    """The first shape's `phase` probe output (timed or refill) of input set j, right."""
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator
    from harness.stages import refill_seed

    op, spec, shape = get_op("rmsnorm"), judge.plan["shapes"][0], judge.shapes["decode_b1"]
    args = op.inputs(shape, torch.float32, "cpu", generator("cpu", spec["sets"][j]), "normal")
    if phase == "refill":
        fresh = op.inputs(shape, torch.float32, "cpu", generator("cpu", refill_seed(spec, j)), "normal")
        args = tuple(a if op.is_persistent(i) or not isinstance(a, torch.Tensor) else fresh[i]
                     for i, a in enumerate(args))
    return _frame("outputs", [op.eager(*args)], item=f"bench/0/{phase}/{j}")


# Frames, or frame headers, the sandbox never writes; each would otherwise be believed (a
# settle answered, a gate passed or named as the harness's) or stop the judge with a traceback.
FORGED_HEADERS = {
    "stray settle": _frame("settle", n=0) * 2,
    "unnumbered settle": _frame("settle"),
    "harness's gate": _frame("gate", name="time_limit", passed=False, crash=True),
    "crash of a candidate's gate": _frame("gate", name="accuracy", passed=False, crash=True),
    "passed gate": _frame("gate", name="correctness", passed=True),
    "gate without a name": _frame("gate", passed=False),
    "timing without dims": _frame("timing", graph_outputs=0, **{k: v for k, v in FIRST_TIMING.items() if k != "dims"}),
    "timing with a text count": _frame("timing", **FIRST_TIMING | {"graph_outputs": "x"}),
    "timing with a text time": _frame("timing", graph_outputs=0, **FIRST_TIMING | {"candidate_us": "1"}),
    "tensor without a dtype": (b'{"kind": "outputs", "item": "bench/0/timed/0", "tensors": [{"shape": [1]}], "offsets": [0], '
                               b'"nbytes": [4]}\n'),
    "text byte count": (b'{"kind": "outputs", "item": "bench/0/timed/0", "tensors": [{"dtype": "float32", "shape": [1]}], '
                        b'"offsets": [0], "nbytes": ["4"]}\n'),
    "byte count as a float": (b'{"kind": "outputs", "item": "bench/0/timed/0", "tensors": [{"dtype": "float32", "shape": [1]}], '
                              b'"offsets": [0], "nbytes": [4.0]}\n'),
    "negative byte count": (b'{"kind": "outputs", "item": "bench/0/timed/0", "tensors": [{"dtype": "uint8", "shape": [0]}], '
                            b'"offsets": [1], "nbytes": [-1]}\n'),
    "byte counts that cancel": (b'{"kind": "outputs", "item": "bench/0/timed/0", "tensors": [{"dtype": "uint8", "shape": [0]}, '
                                b'{"dtype": "uint8", "shape": [0]}], "offsets": [0, 0], '
                                b'"nbytes": [35184372088832, -35184372088832]}\n'),
}


@pytest.mark.parametrize("forged", ["negative count", "second timing", "output twice", "compiling out of order",
                                    *FORGED_HEADERS])
def test_frames_only_the_candidate_writes_fail_protocol_rather_than_shape_a_stopped_stage(forged):
    """The candidate's process can write to the report channel. A stage stopped at its limit keeps
    the timings whose outputs were all judged, and names the shape it was compiling: frames the
    sandbox never sends (a timing announcing a negative number of outputs, a second timing for a
    shape, an output sent twice, a compiling frame out of the job's order) must not feed those.
    Nor may one pass a gate, claim the harness's own verdicts, or stop the judge (FORGED_HEADERS)."""
    import io

    from harness.judging import Judge
    from tasks.evaluate import jobs_for

    slot = CPU_SLOT
    jobs = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), Target(model="tiny", dtype="fp32"), slot)
    job = jobs["compile" if forged == "compiling out of order" else "bench"]
    v = Verdict("rmsnorm", "c")
    judge = Judge(job, v)
    if forged == "compiling out of order":
        stream = _frame("compiling", shape="decode_b1") + _frame("compiling", shape="GPU is lost")
    elif forged in FORGED_HEADERS:
        stream = FORGED_HEADERS[forged]
    else:
        def probe(phase: str, j: int) -> bytes:
            return _probe_frame(judge, phase, j)

        timed_0 = probe("timed", 0)
        probes = {"negative count": b"", "second timing": timed_0 + probe("timed", 1),
                  "output twice": timed_0 * 4}[forged]
        timings = _frame("timing", graph_outputs=-2 if forged == "negative count" else 0, **FIRST_TIMING)
        if forged == "second timing":
            timings += _frame("timing", graph_outputs=0, **FIRST_TIMING | {"candidate_us": 0.01})
        stream = _baselines_then_loading(judge) + timings + probes + probe("refill", 0) + probe("refill", 1)
    judge.read(io.BytesIO(stream), stop=lambda: None, killed=lambda: True, staging=REPORT.staging)
    judge.finish(-9, _deadline(17.5))
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()


def test_a_bench_sandbox_that_dies_keeps_only_the_timings_whose_outputs_were_judged():
    """A sandbox that ends on its own mid-stage is a `process` crash. Its timings are metrics of
    the crashed run: a shape's timing comes before its outputs, so one whose outputs never came
    is dropped, as at the limit, and the verdict says how far the stage got."""
    import io

    from harness.judging import Judge
    from tasks.evaluate import jobs_for

    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), Target(model="tiny", dtype="fp32"),
                   CPU_SLOT)["bench"]
    for outputs, kept in ((True, ["decode_b1"]), (False, [])):
        v = Verdict("rmsnorm", "c")
        judge = Judge(job, v)  # its plan draws the seeds the frames' outputs are computed from
        stream = _baselines_then_loading(judge) + _frame("timing", graph_outputs=0, **FIRST_TIMING)
        if outputs:
            stream += b"".join(_probe_frame(judge, phase, j) for phase in ("timed", "refill") for j in (0, 1))
        judge.read(io.BytesIO(stream), stop=lambda: None, staging=REPORT.staging)
        judge.finish(-11, _deadline(None))
        assert (v.status, v.failing_gate.name) == ("crash", "process"), v.to_json()
        assert v.failing_gate.detail.startswith("the candidate's process ended (killed by signal 11) before its "
                                                "report was complete; ")
        assert [t.label for t in v.timings] == kept
        assert all(t.eager_us == 50.0 for t in v.timings)  # the baselines sent before the candidate loaded
        if not kept:
            assert "timed but not yet judged (dropped): decode_b1" in v.failing_gate.detail


def test_a_sandbox_killed_over_its_memory_keeps_only_the_timings_whose_outputs_were_judged():
    """The memory watchdog's kill ends a bench as a death does: the verdict says how far the
    stage got, and a shape timed but not judged is dropped."""
    import io

    from harness.judging import Judge
    from tasks.evaluate import jobs_for

    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), Target(model="tiny", dtype="fp32"),
                   CPU_SLOT)["bench"]
    v = Verdict("rmsnorm", "c")
    judge = Judge(job, v)
    judge.read(io.BytesIO(_baselines_then_loading(judge) + _frame("timing", graph_outputs=0, **FIRST_TIMING)),
               stop=lambda: None)
    judge.memory_exceeded(5000.0)
    judge.finish(-9, _deadline(None))
    assert (v.status, v.failing_gate.name) == ("crash", "memory"), v.to_json()
    assert v.timings == []
    assert "timed but not yet judged (dropped): decode_b1" in v.failing_gate.detail


def _deadline(struck_after: float | None):
    """A 20 s stage's deadline, struck after `struck_after` seconds (None: not struck), with no
    timer running."""
    from harness.deadline import Deadline

    deadline = Deadline(None, 0.0)
    deadline.limit_s, deadline.expired_after = 20.0, struck_after
    return deadline
