"""One sandbox a candidate: the three stages of a candidate drive one supervisor and one sandbox
(`python -m harness session`, gpu_pool/local.py's LocalSession), and the next candidate gets fresh
ones. Real supervisor, sandbox and fork-server processes on a CPU; the candidates are files in
tests/session_candidates/."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from contract.job import Candidate
from contract.verdict import Verdict
from gpu_pool.executors import candidate_session, run_stage
from gpu_pool.local import LocalExecutor, StageRun, signed_reply
from gpu_pool.pool import Host, Slot
from targets import Target
from tasks.evaluate import jobs_for, run_stages
from tracking.ledger import Charge

CPU_SLOT = Slot(Host(name="local"), None)
TARGET = Target(model="tiny", dtype="fp32")
CANDIDATES = Path(__file__).resolve().parent / "session_candidates"


def source(name: str, **constants) -> str:
    """A candidate file, its module constants (`PID_LOG = None`, …) set to `constants`."""
    text = (CANDIDATES / f"{name}.py").read_text()
    for key, value in constants.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value!r}", text, flags=re.M)
        assert n == 1, key
    return text


def evaluate(text: str, target: Target = TARGET) -> tuple[Verdict, list[Verdict]]:
    """The candidate's merged verdict and each stage's, its stages in one session."""
    stages: list[Verdict] = []

    def stage(name: str, job, slot: Slot, limit: float, session) -> StageRun:
        run = run_stage(job, slot, limit, session)
        stages.append(Verdict.from_json(run.verdict.to_json()))
        return run

    verdict = run_stages(Candidate("rmsnorm", "free", source=text, origin="test"), target, CPU_SLOT, stage, Charge(),
                         session=candidate_session)
    return verdict, stages


def sandbox_pid(v: Verdict) -> int:
    """The sandbox's process id as the supervisor started it."""
    return int(re.match(r"pid (\d+), stage \d+ of its session", v.device["sandbox"]).group(1))


def test_a_candidates_stages_share_one_sandbox_and_its_state_never_reaches_the_next(tmp_path):
    """The three stages of a candidate run in one sandbox: the one process id the supervisor
    started, the sandbox reported, and the candidate's own calls saw, stage after stage. A
    candidate that leaves a global, a patched torch function, a running thread, a file in its
    working directory and one in its compile cache behind passes; the next candidate's session
    is another sandbox, where none of that is found. Both in one source, it is found."""
    logs = [tmp_path / "first.pids", tmp_path / "second.pids"]
    first, first_stages = evaluate(source("leaves_state", PID_LOG=str(logs[0])))
    assert (first.status, first.stages) == ("pass", ["compile", "check", "bench"]), first.to_json()
    pids = {sandbox_pid(v) for v in first_stages}
    assert len(pids) == 1 and [v.device["sandbox"].split(", ")[1] for v in first_stages] == [
        f"stage {n} of its session" for n in (1, 2, 3)]
    assert {int(p) for p in logs[0].read_text().split()} == pids  # the candidate's calls, in every stage
    assert all(v.device["isolation"].endswith(f"pid {next(iter(pids))}") for v in first_stages)

    second, second_stages = evaluate(source("finds_state", PID_LOG=str(logs[1])))
    assert second.status == "pass", second.to_json()
    assert {sandbox_pid(v) for v in second_stages} == {int(p) for p in logs[1].read_text().split()}
    assert not {sandbox_pid(v) for v in second_stages} & pids

    both, _ = evaluate(source("leaves_state") + "\n" + source("finds_state"))
    assert (both.status, both.failing_gate.name) == ("fail", "accuracy"), both.to_json()


def _limits(**budget) -> Target:
    return TARGET.model_copy(update={"budget": TARGET.budget.model_copy(update=budget)})


def _calls(stage: str) -> int:
    """How many calls of the candidate the stages before `stage` make, on TARGET."""
    jobs = jobs_for(Candidate("rmsnorm", "free", source=""), TARGET, CPU_SLOT)
    compile_calls = len(jobs["compile"].shapes) + len(jobs["compile"].odd_shapes)
    check_calls = compile_calls * jobs["check"].rules.seeds
    return {"compile": 0, "check": compile_calls, "bench": compile_calls + check_calls}[stage]


@pytest.mark.parametrize("stage, budget", [("compile", {"compile_timeout_s": 8}), ("check", {"check_timeout_s": 8}),
                                           ("bench", {"stage_timeout_s": 8})])
def test_a_hang_in_a_stage_of_the_session_is_stopped_at_that_stages_limit(stage, budget):
    """The candidate's calls are counted across its one sandbox; the call that hangs is the first
    of `stage`. The supervisor stops it at that stage's limit, the verdict says which, and the
    session ends there: no later stage runs."""
    target = _limits(**budget)
    t = time.monotonic()
    verdict, stages = evaluate(source("hangs_after", HANG_AFTER=_calls(stage)), target)
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit"), verdict.to_json()
    assert verdict.failing_gate.detail.startswith(f"{stage} stage ran past its 8 s limit")
    order = ["compile", "check", "bench"]
    assert verdict.stages == order[:order.index(stage) + 1]
    assert len({sandbox_pid(v) for v in stages}) == 1
    assert stages[-1].wall_s < 8 and time.monotonic() - t < 60


def test_verdicts_forged_into_the_controllers_pipes_or_files_reach_no_verdict():
    """A candidate that writes passing verdicts where a stage's harness writes its own, and an exit
    status and passing verdicts into every pipe of the controller's process, fails the check stage
    all the same, in a session and in stages of their own: the session's channel and a stage's
    exit status are sockets, which no other process can open through /proc. The controller is a
    process of its own here, so that what the candidate writes into its pipes reaches no pipe of
    the test runner's."""
    controller = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_session import CPU_SLOT, TARGET, evaluate, source
from contract.job import Candidate
from gpu_pool.local import LocalExecutor
from tasks.evaluate import jobs_for
forged = source("forges_verdicts")
executor, jobs = LocalExecutor(), jobs_for(Candidate("rmsnorm", "free", source=forged, origin="test"), TARGET, CPU_SLOT)
compiled = executor.run(jobs["compile"], CPU_SLOT, 120).verdict
checked = executor.run(jobs["check"], CPU_SLOT, 120).verdict
session, _ = evaluate(forged)
print(json.dumps([v.to_json() for v in (compiled, checked, session)]))
"""
    done = subprocess.run([sys.executable, "-c", controller], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, checked, session = (Verdict.from_json(t) for t in json.loads(done.stdout.strip().splitlines()[-1]))
    assert (compiled.status, checked.status, checked.failing_gate.name) == ("pass", "fail", "accuracy"), \
        checked.to_json()
    assert (session.status, session.failing_gate.name) == ("fail", "accuracy"), session.to_json()


KEY = bytes(range(32))


def _session(tmp_path: Path, jobs: dict) -> tuple[subprocess.Popen, socket.socket]:
    (tmp_path / "session.json").write_text(json.dumps({"jobs": {s: j.limited(60).to_json() for s, j in jobs.items()}}))
    ours, theirs = socket.socketpair()
    env = LocalExecutor().env(CPU_SLOT)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "session", "session.json", "--channel",
                             str(theirs.fileno())], cwd=tmp_path, env=env, pass_fds=(theirs.fileno(),))
    theirs.close()
    ours.sendall((json.dumps({"key": KEY.hex()}) + "\n").encode())
    return proc, ours


def _ask(channel: socket.socket, stage: str) -> Verdict:
    channel.sendall((json.dumps({"stage": stage}) + "\n").encode())
    with channel.makefile("rb") as f:
        line = f.readline().rstrip(b"\n")
    text = signed_reply(KEY, line)
    assert text is not None, line
    # signed under the session's key, and only so: the same verdict changed, or under another key, is refused
    assert signed_reply(KEY, line.replace(b'"status": "', b'"status": "x')) is None
    assert signed_reply(bytes(32), line) is None
    return Verdict.from_json(text)


def test_a_session_runs_its_stages_once_each_in_their_order(tmp_path):
    """The supervisor runs the stages its session was opened with, in their order, each once: a
    request for another (were one written into its channel) is refused, and ends the session."""
    jobs = jobs_for(Candidate("rmsnorm", "free", source=source("finds_state"), origin="test"), TARGET, CPU_SLOT)
    proc, channel = _session(tmp_path, jobs)
    try:
        out_of_order = _ask(channel, "check")
        assert (out_of_order.status, out_of_order.failing_gate.name) == ("crash", "harness")
        assert "the check stage was asked of a session of ['compile', 'check', 'bench'] after none" in \
            out_of_order.failing_gate.detail
        assert proc.wait(60) == 0  # the session ended
    finally:
        channel.close()
        proc.kill()
    proc, channel = _session(tmp_path, jobs)
    try:
        assert _ask(channel, "compile").status == "pass"
        again = _ask(channel, "compile")
        assert (again.status, again.failing_gate.name) == ("crash", "harness")
        assert "after ['compile']" in again.failing_gate.detail
    finally:
        channel.close()
        proc.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_candidates_cuda_state_never_reaches_the_next_on_a_gpu():
    """On a GPU slot: a candidate that holds device memory and turns torch's device settings on
    passes in its session; the next candidate's session is a fresh sandbox and CUDA context, where
    none of it is found. Both in one source, it is found."""
    from gpu_pool.pool import local_pool

    slot = local_pool().slots()[0]
    target = Target(model="tiny", dtype="fp32")

    def on_gpu(text: str) -> Verdict:
        return run_stages(Candidate("rmsnorm", "free", source=text, origin="test"), target, slot,
                          lambda name, job, s, limit, session: run_stage(job, s, limit, session), Charge(),
                          session=candidate_session)

    first = on_gpu(source("leaves_cuda_state"))
    assert (first.status, first.stages) == ("pass", ["compile", "check", "bench"]), first.to_json()
    second = on_gpu(source("finds_cuda_state"))
    assert second.status == "pass", second.to_json()
    both = on_gpu(source("leaves_cuda_state") + "\n" + source("finds_cuda_state"))
    assert (both.status, both.failing_gate.name) == ("fail", "accuracy"), both.to_json()


def test_the_staging_buffer_holds_every_stage_of_the_session_or_the_stage_is_the_harness_s_crash(tmp_path):
    """The supervisor sizes the staging buffer, once, before the sandbox's first request, for one
    call's outputs at the largest shape of the session's first stage and of its bench stage, and
    seals that size; a later stage whose outputs could need more is refused as the harness's
    fault, before the sandbox is asked to run it, rather than left to fail in the sandbox."""
    from dataclasses import replace

    from contract.job import Shape

    jobs = jobs_for(Candidate("rmsnorm", "free", source=source("finds_state"), origin="test"), TARGET, CPU_SLOT)
    hidden = jobs["check"].shapes[0].dims["hidden"]
    jobs["check"] = replace(jobs["check"], odd_shapes=[*jobs["check"].odd_shapes,
                                                       Shape("wide_4096", {"tokens": 4096, "hidden": hidden})])
    proc, channel = _session(tmp_path, jobs)
    try:
        compiled = _ask(channel, "compile")
        assert compiled.status == "pass", compiled.to_json()
        size = int(re.fullmatch(r"(\d+) bytes of shared memory, sealed", compiled.device["staging"]).group(1))
        checked = _ask(channel, "check")
        assert (checked.status, checked.failing_gate.name) == ("crash", "harness"), checked.to_json()
        assert re.fullmatch(rf"the check stage's outputs may take \d+ bytes a call; the session's staging buffer "
                            rf"holds {size}", checked.failing_gate.detail), checked.failing_gate.detail
        assert proc.wait(60) == 0  # the session ended
    finally:
        channel.close()
        proc.kill()
