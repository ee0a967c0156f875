"""Each defence of the harness proven by what it stops: a candidate (or the frames one can write
on the harness's channel) that gets through were the check removed. Every test names the gate
and the words of the check that caught it, not only `fail`: another check failing the same
candidate for another reason would hide the removal (docs/gates.md, "Every defence proven").

Real supervisor and sandbox processes run the candidates, one stage each, from a worker bundle
unpacked for the test where the candidate writes into the harness; the channel's rules are
proven on the judge reading the frames a candidate would write."""
from __future__ import annotations

import io
import json
import re
import socket

import pytest
import torch
from frames import REPORT

from contract.job import Candidate
from contract.verdict import Verdict
from gpu_pool.bundle import current_bundle, unpack
from gpu_pool.local import LocalExecutor
from gpu_pool.pool import Host, Slot
from targets import Target
from tasks.evaluate import jobs_for

CPU_SLOT = Slot(Host(name="local"), None)
TARGET = Target(model="tiny", dtype="fp32")
RMSNORM = '''

def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
'''


def run_stage(stage: str, source: str, executor: LocalExecutor | None = None) -> Verdict:
    job = jobs_for(Candidate("rmsnorm", "free", source=source, origin="test"), TARGET, CPU_SLOT)[stage]
    return (executor or LocalExecutor()).run(job, CPU_SLOT, 120).verdict


def failed(v: Verdict) -> tuple[str, str, str]:
    return v.status, v.failing_gate.name if v.failing_gate else "", v.failing_gate.detail if v.failing_gate else ""


# -- forged frames, written by a real candidate at import -----------------------------------------

# The channel is the sandbox's argument: a candidate reaches it as any file descriptor.
WRITES_FRAMES = '''import json
import os
import sys

import torch

_write = getattr(os, "wr" + "ite")
for header in {frames!r}:
    _write(int(sys.argv[1]), json.dumps(dict(header, tensors=[], nbytes=[])).encode() + b"\\n")
''' + RMSNORM


def test_a_done_frame_forged_at_import_does_not_pass_the_check_stage():
    """Judged calls must number the plan's: with nothing judged the check stage is no pass."""
    v = run_stage("check", WRITES_FRAMES.format(frames=[{"kind": "done"}]))
    status, gate, detail = failed(v)
    assert (status, gate) == ("fail", "protocol"), v.to_json()
    assert re.fullmatch(r"0 of \d+ planned calls reported", detail), detail


def test_a_done_frame_forged_at_import_does_not_pass_the_compile_stage():
    """The compile stage passes on the sandbox's `compile` pass, sent once every shape was called."""
    job = jobs_for(Candidate("rmsnorm", "free", source=""), TARGET, CPU_SLOT)["compile"]
    v = run_stage("compile", WRITES_FRAMES.format(frames=[{"kind": "done"}]))
    status, gate, detail = failed(v)
    assert (status, gate) == ("fail", "protocol"), v.to_json()
    total = len(job.shapes) + len(job.odd_shapes)
    assert detail == f"the compile stage's report ended without its pass, after 0 of {total} shapes were called"


def test_timing_frames_forged_at_import_do_not_pass_the_bench_stage():
    """A timing frame for every shape and a `done`: without the outputs of the probes and of the
    timed calls that must follow each timing, the bench stage is no pass (it was 36x)."""
    labels = [s.label for s in jobs_for(Candidate("rmsnorm", "free", source=""), TARGET, CPU_SLOT)["bench"].shapes]
    timings = [{"kind": "timing", "label": label, "dims": {}, "candidate_us": 0.5, "candidate_us_repeat": 0.5,
                "method": "wall", "sets": 2, "graph_outputs": 0} for label in labels]
    v = run_stage("bench", WRITES_FRAMES.format(frames=[*timings, {"kind": "done"}]))
    status, gate, detail = failed(v)
    assert (status, gate) == ("fail", "protocol"), v.to_json()
    assert detail == f"0 of {4 * len(labels)} probe outputs and 0 of 0 timed-call outputs reported", detail


# -- the channel's rules, on the frames a candidate could write -----------------------------------

_frame = REPORT.frame  # a frame as harness.channel.Sender writes it, its tensors in REPORT's staging buffer


def _judge(stage: str):
    from harness.judging import Judge

    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), TARGET, CPU_SLOT)[stage]
    v = Verdict("rmsnorm", "c")
    return Judge(job, v), v


def _read(judge, stream: bytes, staging=REPORT.staging, taken=lambda: True) -> None:
    judge.read(io.BytesIO(stream), stop=lambda: None, staging=staging, taken=taken)
    judge.finish(0)


def _bench_report(judge, timing: dict) -> bytes:
    """A bench report whose first shape's timing is `timing`: the baselines, `loading`, the
    timing, the four right probe outputs, `done`."""
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator
    from harness.stages import refill_seed

    op, spec = get_op("rmsnorm"), judge.plan["shapes"][0]
    shape = judge.shapes[spec["shape"]]
    baselines = b"".join(_frame("baseline", label=i["shape"], eager_us=50.0, eager_how="wall", eager_fallback="",
                                compile_us=None, compile_how="", compile_fallback="", graphs_off="")
                         for i in judge.plan["shapes"])
    probes = b""
    for phase in ("timed", "refill"):
        for j in (0, len(spec["sets"]) - 1):
            args = op.inputs(shape, torch.float32, "cpu", generator("cpu", spec["sets"][j]), "normal")
            if phase == "refill":
                fresh = op.inputs(shape, torch.float32, "cpu", generator("cpu", refill_seed(spec, j)), "normal")
                args = tuple(a if op.is_persistent(i) or not isinstance(a, torch.Tensor) else fresh[i]
                             for i, a in enumerate(args))
            probes += _frame("outputs", [op.eager(*args)], item=f"bench/0/{phase}/{j}")
    return baselines + _frame("loading") + _frame("timing", **timing) + probes + _frame("done")


def _refilled_report(judge, refilled: str) -> bytes:
    """A complete bench report of wall-clock timings whose two refilled calls (call 3 of each) return
    the op on the refilled inputs (`refilled="new"`), on the set's own values ("stale"), or are not
    reported ("none"); with "leaked", right too, but a plain call of the same set after them (call 5)
    returns what the refilled values give."""
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator
    from harness.stages import refill_seed

    op = get_op("rmsnorm")
    report = b"".join(_frame("baseline", label=i["shape"], eager_us=50.0, eager_how="wall", eager_fallback="",
                             compile_us=None, compile_how="", compile_fallback="", graphs_off="")
                      for i in judge.plan["shapes"]) + _frame("loading")

    def args(shape, set_seed, new_seed=None):
        own = op.inputs(shape, torch.float32, "cpu", generator("cpu", set_seed), "normal")
        if new_seed is None:
            return own
        new = op.inputs(shape, torch.float32, "cpu", generator("cpu", new_seed), "normal")
        return tuple(a if op.is_persistent(i) or not isinstance(a, torch.Tensor) else new[i] for i, a in enumerate(own))

    for k, spec in enumerate(judge.plan["shapes"]):
        shape, last = judge.shapes[spec["shape"]], len(spec["sets"]) - 1
        report += _frame("timing", label=spec["shape"], dims={}, candidate_us=1.0, candidate_us_repeat=1.0,
                         method="wall", sets=len(spec["sets"]),
                         graph_outputs={"none": 0, "leaked": 4}.get(refilled, 2))
        for run, seed in zip(("wall", "wall-repeat"), spec["timed_refill"]):
            if refilled != "none":
                on = args(shape, spec["sets"][3 % len(spec["sets"])], None if refilled == "stale" else seed)
                report += _frame("outputs", [op.eager(*on)], item=f"bench/{k}/{run}-refilled/3")
            if refilled == "leaked":
                report += _frame("outputs", [op.eager(*on)], item=f"bench/{k}/{run}/5")
        for phase in ("timed", "refill"):
            for j in (0, last):
                on = args(shape, spec["sets"][j], refill_seed(spec, j) if phase == "refill" else None)
                report += _frame("outputs", [op.eager(*on)], item=f"bench/{k}/{phase}/{j}")
    return report + _frame("done")


def test_a_call_on_inputs_refilled_while_timed_is_judged_on_the_new_values_and_must_be_reported():
    """Each timing's call after the in-run refill: right on the new values passes; the result for
    the set's own values fails `caching`, naming the refill; a report without it is protocol."""
    judge, v = _judge("bench")
    _read(judge, _refilled_report(judge, "new"))
    assert v.status == "pass", v.to_json()
    judge, v = _judge("bench")
    _read(judge, _refilled_report(judge, "stale"))
    assert (v.status, v.failing_gate.name) == ("fail", "caching"), v.to_json()
    assert "(call 3 of the wall timing, input set 1, refilled between two timed calls)" in v.failing_gate.detail
    judge, v = _judge("bench")
    _read(judge, _refilled_report(judge, "none"))
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
    n = len(judge.plan["shapes"])
    assert v.failing_gate.detail == (f"0 outputs of calls on inputs refilled while timed reported; each of the {n} "
                                     "shapes' two timings has one")


def test_a_result_cached_while_a_set_was_refilled_and_returned_later_for_its_own_values_is_caching():
    """The timings refill sets in place as they go: a candidate that caches on pointer can get the
    refilled call right (it recomputed) and return that result later, on the set's own values. That
    call fails, and the judge names it `caching`, for the values the result belongs to."""
    judge, v = _judge("bench")
    _read(judge, _refilled_report(judge, "leaked"))
    assert (v.status, v.failing_gate.name) == ("fail", "caching"), v.to_json()
    assert v.failing_gate.detail.startswith(
        "decode_b1 (call 5 of the wall timing, input set 1, refilled between two timed calls before it: the result of "
        "those values, returned for its own): output relative error"), v.failing_gate.detail


def test_a_harness_gate_named_by_the_candidate_is_protocol_without_a_crash_flag():
    """`time_limit`, `process` and `harness` are the supervisor's: a frame naming one, even as a
    plain failed gate, would make the candidate's verdict read as the platform's."""
    judge, v = _judge("check")
    _read(judge, _frame("loading") + _frame("gate", name="time_limit", passed=False, detail="hung"))
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
    assert v.failing_gate.detail.startswith('a frame the sandbox never sends (a gate frame {"kind": "gate"')
    assert '"name": "time_limit"' in v.failing_gate.detail


def test_a_malformed_timing_frame_after_loading_is_protocol():
    """A timing frame's fields are checked before they become a verdict's figures: here a time
    as text, in a report otherwise complete and right."""
    judge, v = _judge("bench")
    label = judge.plan["shapes"][0]["shape"]
    _read(judge, _bench_report(judge, dict(label=label, dims={}, candidate_us="0.01", candidate_us_repeat=1.0,
                                           method="wall", sets=2, graph_outputs=0)))
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
    assert v.failing_gate.detail.startswith('a frame the sandbox never sends (a timing frame {"kind": "timing"')


def test_the_compile_pass_counts_only_once_every_shape_was_announced():
    judge, v = _judge("compile")
    first = judge.job.shapes[0].label
    _read(judge, _frame("loading") + _frame("compiling", shape=first) + _frame("gate", name="compile", passed=True)
          + _frame("done"))
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
    assert '"name": "compile", "passed": true' in v.failing_gate.detail


def test_an_output_changed_after_it_was_taken_cannot_change_the_verdict():
    """The judge copies each output out of the staging buffer before it answers `taken`, and
    judges that copy alone: what the sandbox's process writes there once answered (NaN here, over
    each output the moment its `taken` is written) changes nothing, and the right outputs pass.
    Judged where they lie, the same report would fail `finite`."""
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator

    judge, v = _judge("check")
    op, report, places = get_op("rmsnorm"), _frame("loading"), []
    for i, call in enumerate(judge.plan["calls"]):
        args = op.inputs(judge.shapes[call["shape"]], torch.float32, "cpu", generator("cpu", call["seed"]), call["dist"])
        frame = _frame("outputs", [op.eager(*args)], item=f"check/{i}")
        header = json.loads(frame)
        places.append((header["offsets"][0], header["nbytes"][0]))
        report += frame
    answered = []

    def taken() -> bool:  # the buffer is the sandbox's again: it writes NaN over what was just taken
        offset, nbytes = places[len(answered)]
        REPORT.staging.view[offset:offset + nbytes].fill_(255)
        answered.append(offset)
        return True

    _read(judge, report + _frame("done"), taken=taken)
    assert v.status == "pass" and judge.judged == len(places) == len(answered), v.to_json()
    assert all(REPORT.staging.view[o:o + n].view(torch.float32).isnan().all() for o, n in places)


def test_what_lies_in_the_staging_buffer_when_taken_is_judged_not_what_was_copied_in():
    """Bytes written over an output between its frame and the judge's copy (by a thread of the
    sandbox's process, say) are what the judge judges: the right outputs were copied in, NaN lay
    there when they were taken, and the check fails `finite`."""
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator

    judge, v = _judge("check")
    op, report = get_op("rmsnorm"), _frame("loading")
    for i, call in enumerate(judge.plan["calls"]):
        args = op.inputs(judge.shapes[call["shape"]], torch.float32, "cpu", generator("cpu", call["seed"]), call["dist"])
        frame = _frame("outputs", [op.eager(*args)], item=f"check/{i}")
        report += frame
        if i == 0:
            header = json.loads(frame)
            offset, nbytes = header["offsets"][0], header["nbytes"][0]
    REPORT.staging.view[offset:offset + nbytes].fill_(255)  # after the frame, before the judge reads it
    _read(judge, report + _frame("done"))
    assert (v.status, v.failing_gate.name) == ("fail", "finite"), v.to_json()
    assert "NaN or Inf" in v.failing_gate.detail, v.failing_gate.detail


# -- isolation and integrity, by real candidates ---------------------------------------------------

# Opens a socket at its first call, through names computed at run time (past static screening),
# to a port the test listens on.
CONNECTS = '''import sys

import torch


def rmsnorm(x, weight, eps):
    net = getattr(getattr(sys, "mod" + "ules")["builtins"], "__imp" + "ort__")("soc" + "ket")
    net.create_connection(("127.0.0.1", {port}), timeout=5).close()
''' + RMSNORM.split("\n", 3)[3]


def test_a_socket_opened_past_the_screen_finds_no_network():
    """The sandbox has an empty network namespace of its own: not even loopback is up there, so a
    connection to a port listening on this machine's loopback fails in the candidate's call."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0)
        v = run_stage("check", CONNECTS.format(port=server.getsockname()[1]))
        if "not isolated" in v.device.get("isolation", ""):
            pytest.skip(f"this OS gives the sandbox no network namespace: {v.device['isolation']}")
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected
    status, gate, detail = failed(v)
    assert "network: none" in v.device["isolation"]
    assert (status, gate) == ("fail", "runtime"), v.to_json()
    assert "OSError: [Errno 101] Network is unreachable" in detail, detail


# Rewrites a harness file at import: with one byte more and its modification time put back, or
# with the bytes it had.
EDITS_HARNESS = '''import os
import sys

import torch

for entry in sys.path:
    path = os.path.join(entry, "harness", "plan.py")
    if os.path.isfile(path):
        before = os.stat(path)
        with open(path, "rb") as f:
            text = f.read()
        with open(path, "wb") as f:
            f.write(text + b"{extra}")
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns)) if {keep_time} else None
        break
''' + RMSNORM


@pytest.mark.parametrize("extra, keep_time", [("#", True), ("", False)], ids=["changed-bytes-same-time",
                                                                           "same-bytes-new-time"])
def test_a_changed_harness_file_fails_harness_integrity(extra, keep_time, tmp_path):
    worker = unpack(current_bundle(), tmp_path)
    v = run_stage("compile", EDITS_HARNESS.format(extra=extra, keep_time=keep_time), LocalExecutor(worker_root=worker))
    status, gate, detail = failed(v)
    assert (status, gate) == ("fail", "harness_integrity"), v.to_json()
    assert detail == f"the harness's files changed while the candidate ran: changed {worker / 'harness' / 'plan.py'}"


# Replaces, at its first call, the function the check stage calls it through, with one that
# calls the original: harmless here, and caught by identity alone.
PATCHES_HARNESS = '''import sys

import torch

_done = []


def rmsnorm(x, weight, eps):
    if not _done:
        stages = getattr(sys, "mod" + "ules")["harness.st" + "ages"]
        real = stages.run_call
        setattr(stages, "run_" + "call", lambda *a, **k: real(*a, **k))
        _done.append(1)
''' + RMSNORM.split("\n", 3)[3]


def test_a_harness_function_patched_at_run_time_fails_timer_integrity():
    v = run_stage("check", PATCHES_HARNESS)
    status, gate, detail = failed(v)
    assert (status, gate) == ("fail", "timer_integrity"), v.to_json()
    assert detail == "the candidate replaced harness.stages.run_call: timers and checks must stay the harness's"


# -- timed = judged: what the timing keeps for the judge -----------------------------------------

def test_calls_timed_by_the_wall_clock_are_kept_for_the_judge_as_they_returned():
    """The first, the last and drawn calls of a wall-clock run (a uniform sample of 32, which may
    hold the last), copied as each returned (call c ran on input set c % sets); a kept call whose
    outputs take another form than its warm-up's is named instead, for `timed_outputs` to fail."""
    from harness.timing import Method, median_us

    sets = [(torch.randn(4, 64),) for _ in range(2)]
    calls = []

    def doubles(x):
        calls.append(x)
        return x * 2

    timed = median_us(doubles, sets, Method("cpu", warmup_ms=0, rep_ms=5))
    n_timed = len(calls) - 2  # a warm-up (the model of the copies' buffers) and an estimate go first
    assert timed.how == "wall" and not timed.misfit and 10 <= n_timed <= 50 and timed.reps == n_timed
    assert {0, n_timed - 1} <= set(timed.outputs) and min(n_timed, 33) <= len(timed.outputs) <= min(n_timed, 34)
    for c, (out,) in timed.outputs.items():
        assert calls[2 + c] is sets[c % 2][0] and torch.equal(out, sets[c % 2][0] * 2)

    def widens(x):
        calls.append(x)
        return x * 2 if len(calls) <= 2 else (x * 2).double()

    calls.clear()
    timed = median_us(widens, sets, Method("cpu", warmup_ms=0, rep_ms=5))
    assert not timed.outputs
    assert re.fullmatch(r"call 0 of the timed run returned float64 \(4, 64\) where its warm-up returned float32 \(4, 64\)",
                        timed.misfit), timed.misfit


def test_a_wall_clock_run_refills_sets_between_two_calls_and_puts_them_back():
    """Call c (from 1) runs on the new values with chance 1/c — call 1 always — so the last such
    call falls uniformly over a run whose length the confidence rule decides; that call's outputs
    are kept for the judge, every other call runs on its set's own values, and the sets hold their
    own values again after the run."""
    from harness.timing import Method, median_us

    sets = [(torch.randn(4, 64),) for _ in range(2)]
    own, fresh, seen = [s[0].clone() for s in sets], (torch.randn(4, 64),), []

    def doubles(x):
        seen.append(x.clone())
        return x * 2

    timed = median_us(doubles, sets, Method("cpu", warmup_ms=0, rep_ms=5), fresh)
    n_timed, r = len(seen) - 2, timed.refilled
    on_new = [c for c in range(n_timed) if torch.equal(seen[2 + c], fresh[0])]
    assert on_new[0] == 1 and on_new[-1] == r and 1 <= r < n_timed and torch.equal(timed.outputs[r][0], fresh[0] * 2)
    for c in set(range(n_timed)) - set(on_new):
        assert torch.equal(seen[2 + c], own[c % 2]), c
    assert all(torch.equal(s[0], o) for s, o in zip(sets, own))


# Frames a candidate can write, and the words of the one rule that stops each (stage, frames
# after what the sandbox sent, words). Without the rule, each would be believed, stop the judge
# with a traceback, or be stopped later for another reason.
def _header(**fields) -> bytes:
    return json.dumps(fields).encode() + b"\n"


CHANNEL_RULES = {
    "a-second-loading": ("check", _frame("loading"), "a frame the sandbox never sends (a second loading frame)"),
    "a-timing-before-loading": ("bench", _frame("timing", label="decode_b1", dims={}, candidate_us=1.0,
                                                candidate_us_repeat=1.0, method="wall", sets=2, graph_outputs=0),
                                "a frame the sandbox never sends (a timing frame for decode_b1 before the candidate "
                                "was loaded)"),
    "outputs-never-planned": ("check", _frame("outputs", [torch.zeros(1)], item="check/99999"),
                              "outputs for 'check/99999', which the plan never asked for"),
    "a-kind-it-never-sends": ("check", _frame("verdict", status="pass"), "unexpected frame 'verdict' in the check stage"),
    "an-oversized-payload": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "uint8", "shape": [1 << 40]}],
                                              offsets=[0], nbytes=[1 << 40]), "past the end of the"),
    "an-offset-past-the-end": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float32", "shape": [4]}],
                                                offsets=[REPORT.staging.size - 8], nbytes=[16]),
                               f"bytes {REPORT.staging.size - 8} to {REPORT.staging.size + 8} past the end of the"),
    "a-negative-offset": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float32", "shape": [4]}],
                                           offsets=[-16], nbytes=[16]), "malformed header"),
    "overlapping-outputs": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float32", "shape": [4]}] * 2,
                                             offsets=[64, 72], nbytes=[16, 16]),
                            "outputs overlap in the staging buffer (one ends at 80, the next starts at 72)"),
    "outputs-without-offsets": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float32", "shape": [4]}],
                                                 nbytes=[16]) + bytes(16), "malformed header"),
    "outputs-without-the-buffer": ("check", _frame("outputs", [torch.zeros(1)], item="check/0"),
                                   "tensors, and no staging buffer to find them in"),
    "an-unknown-dtype": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float128", "shape": [1]}],
                                          offsets=[0], nbytes=[16]), "unknown dtype 'float128'"),
    "a-payload-off-its-shape": ("check", _header(kind="outputs", item="check/0", tensors=[{"dtype": "float32", "shape": [3]}],
                                                 offsets=[0], nbytes=[4]), "4 bytes for shape [3] of float32, which takes 12"),
    "a-header-past-the-limit": ("check", b"x" * (1 << 20) + b"\n", "header line too long"),
}


@pytest.mark.parametrize("rule", CHANNEL_RULES)
def test_each_channel_rule_stops_its_frame_in_its_own_words(rule):
    stage, frames, words = CHANNEL_RULES[rule]
    judge, v = _judge(stage)
    before = b"".join(_frame("baseline", label=i["shape"], eager_us=50.0, eager_how="wall", eager_fallback="",
                             compile_us=None, compile_how="", compile_fallback="", graphs_off="")
                      for i in judge.plan["shapes"]) if stage == "bench" else b""
    if rule != "a-timing-before-loading":
        before += _frame("loading")
    _read(judge, before + frames + _frame("done"), staging=None if rule == "outputs-without-the-buffer" else REPORT.staging)
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
    assert words in v.failing_gate.detail, v.failing_gate.detail


# At import, starts a thread that shrinks the staging buffer to nothing and grows it back, over
# and over, until the system refuses: a read of the supervisor's mapping past the file's end
# would kill it (SIGBUS). Otherwise an honest rmsnorm.
SHRINKS_STAGING = '''import sys

import torch

_imp = getattr(getattr(sys, "mod" + "ules")["builtins"], "__imp" + "ort__")
_os, _threads = _imp("o" + "s"), _imp("thr" + "eading")
_fd = int(sys.argv[2])
_size, _cut = getattr(_os, "fst" + "at")(_fd).st_size, getattr(_os, "ftrun" + "cate")
_refused = []


def _shrink():
    while not _refused:
        try:
            _cut(_fd, 0)
            _cut(_fd, _size)
        except OSError as e:
            _refused.append(e)


getattr(_threads, "Thr" + "ead")(target=_shrink, daemon=True).start()
''' + RMSNORM


def test_the_staging_buffer_is_sealed_against_shrinking_from_under_the_judge():
    """The supervisor seals the buffer's size before the sandbox runs a candidate: the first
    attempt to shrink it is refused, and the honest rmsnorm passes. Unsealed, the buffer would
    vanish under the sandbox's copies or the judge's (SIGBUS), and no verdict would pass."""
    v = run_stage("check", SHRINKS_STAGING)
    assert v.status == "pass", v.to_json()
    assert v.device["staging"].endswith("bytes of shared memory, sealed"), v.device
