"""What makes a candidate cheap without making a gate weaker: stages forked from a warm
interpreter (harness/processes.py, harness/forkserver.py, gpu_pool/warm.py), a limit per stage
kind, and baselines measured once per slot and reused only where measured alike
(harness/baselines.py, gpu_pool/baselines.py). Real supervisor and sandbox processes."""
from __future__ import annotations

import io
import time
from dataclasses import replace

import pytest

from contract.job import Candidate
from contract.verdict import Verdict
from gpu_pool import warm
from gpu_pool.baselines import Baselines
from gpu_pool.local import LocalExecutor
from gpu_pool.pool import Host, Slot
from targets import Target
from tasks.evaluate import jobs_for, run_stages
from tracking.ledger import Charge

CPU_SLOT = Slot(Host(name="local"), None)
TARGET = Target(model="tiny", dtype="fp32")

# Leaves state behind in every way a process can: a global in a module, a patched torch function
# (both in modules the fork server imported), a thread still running, a file in its working
# directory and one in its compile cache. Passes nothing itself: it only has to run.
LEAVES_STATE = '''import logging.handlers
import math
import queue
import time

import torch
import triton

vars(math)["_left_global"] = "set by an earlier candidate"
vars(torch)["rsqrt"] = lambda t: t * 0


class _Busy(logging.Handler):
    def handle(self, record):
        while True:  # the listener's thread never comes back from here
            vars(math)["_left_thread"] = "alive"
            time.sleep(0.01)


_q = queue.Queue()
logging.handlers.QueueListener(_q, _Busy()).start()
_q.put(logging.makeLogRecord({}))
with open("left.txt", "w") as f:
    f.write("left behind")
with open(f"{triton.knobs.cache.dir}/left.txt", "w") as f:
    f.write("left behind")
'''

# Honest, unless it finds any of that: then it returns zeros, and fails the accuracy gate.
FINDS_STATE = '''import math
import os
import time

import torch
import triton


def _left_behind() -> list[str]:
    found = [k for k in ("_left_global", "_left_thread") if k in vars(math)]
    vars(math).pop("_left_thread", None)
    time.sleep(0.1)  # a live thread sets it again
    found += ["thread"] if "_left_thread" in vars(math) else []
    found += ["patched torch.rsqrt"] if torch.rsqrt(torch.ones(1)).item() != 1.0 else []
    found += ["file in the working directory"] if os.path.exists("left.txt") else []
    found += ["file in the compile cache"] if os.path.exists(f"{triton.knobs.cache.dir}/left.txt") else []
    found += ["the controller's environment"] if b"INFERSMITH_TEST_SECRET" in open("/proc/self/environ", "rb").read() else []
    return found


FOUND = _left_behind()


def rmsnorm(x, weight, eps):
    if FOUND:
        return torch.zeros_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
'''


def _compile_and_check(executor: LocalExecutor, source: str) -> Verdict:
    jobs = jobs_for(Candidate("rmsnorm", "free", source=source, origin="test"), TARGET, CPU_SLOT)
    verdict = executor.run(jobs["compile"], CPU_SLOT, 120).verdict
    verdict.merge(executor.run(jobs["check"], CPU_SLOT, 120).verdict)
    return verdict


def test_state_a_candidate_leaves_behind_does_not_reach_the_next_candidate(monkeypatch):
    """Each stage is a fork of the warm fork server, and its sandbox a fork of that: a candidate
    that leaves a global, a patched module, a running thread, a file in its working directory or
    in its compile cache changes nothing the next candidate's stages see; nor does the sandbox see
    the controller's environment. Both in one source, the state is found: the detector works."""
    monkeypatch.setenv("INFERSMITH_TEST_SECRET", "the controller's, never a stage's")
    executor = LocalExecutor()
    server = warm.server_for(executor.python, executor.worker_root, executor.env(CPU_SLOT))
    _compile_and_check(executor, LEAVES_STATE + "\n\ndef rmsnorm(x, weight, eps):\n    return x\n")
    after = _compile_and_check(executor, FINDS_STATE)
    assert after.status == "pass", after.to_json()
    assert after.device["sandbox_start"] == "a fork of the supervisor"
    # one fork server served both, and is still the one a stage would start from
    assert warm.server_for(executor.python, executor.worker_root, executor.env(CPU_SLOT)) is server
    assert server.served and server.proc.poll() is None
    both = _compile_and_check(executor, LEAVES_STATE + FINDS_STATE)
    assert (both.status, both.failing_gate.name) == ("fail", "accuracy"), both.to_json()


HANGS = '''def rmsnorm(x, weight, eps):
    while True:
        pass
'''


def test_a_hanging_compile_is_stopped_at_the_compile_limit_not_the_bench_limit():
    target = TARGET.model_copy(update={"budget": TARGET.budget.model_copy(update={"compile_timeout_s": 10})})
    assert (target.budget.stage_limit("compile"), target.budget.stage_limit("bench")) == (10, 600)
    executor = LocalExecutor()
    t = time.monotonic()
    verdict = run_stages(Candidate("rmsnorm", "free", source=HANGS), target, CPU_SLOT,
                         lambda stage, job, slot, limit: executor.run(job, slot, limit), Charge())
    assert (verdict.status, verdict.failing_gate.name) == ("crash", "time_limit"), verdict.to_json()
    assert verdict.failing_gate.detail.startswith("compile stage ran past its 10 s limit")
    assert verdict.stages == ["compile"] and time.monotonic() - t < 60


def test_stage_limits_default_per_kind_and_never_exceed_the_stage_timeout():
    budget = Target(model="tiny").budget
    assert [budget.stage_limit(s) for s in ("compile", "check", "bench")] == [120, 180, 600]
    tight = budget.model_copy(update={"stage_timeout_s": 15})  # a gauntlet case's own limit
    assert [tight.stage_limit(s) for s in ("compile", "check", "bench")] == [15, 15, 15]


HONEST = '''import torch


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
'''


def test_baselines_are_measured_once_per_slot_and_reused_only_where_measured_alike():
    """The first bench measures the baselines before the candidate loads; the next candidate's on
    the same slot reuses them after its drift check; a record of another dtype, shape, device or
    version is measured again, and says which of them differed."""
    executor, store = LocalExecutor(), Baselines()
    loose = replace(TARGET.rules(False), baseline_drift=100.0)  # wall-clock timings on a loaded CPU

    def bench(source: str, target: Target = TARGET, record: dict | None = None) -> Verdict:
        job = jobs_for(Candidate("rmsnorm", "free", source=source), target, CPU_SLOT)["bench"]
        job = replace(job, rules=replace(loose, dtype=target.dtype, rtol=target.tolerance))
        job = replace(job, baselines=record or store.for_job(CPU_SLOT, job))
        verdict = executor.run(job, CPU_SLOT, 120).verdict
        store.keep(CPU_SLOT, job, verdict)
        assert verdict.status == "pass", verdict.to_json()
        return verdict

    first = bench(HONEST)
    assert first.baselines["source"] == "timed" and first.baselines["why"] == "none measured before on this device"
    second = bench(HONEST + "\n# another candidate\n")
    assert second.baselines["source"] == "cached" and second.baselines["drift"]["shape"] in second.baselines["shapes"]
    assert [t.eager_us for t in second.timings] == [first.baselines["shapes"][t.label]["eager_us"]
                                                   for t in second.timings]
    bf16 = bench(HONEST, Target(model="tiny", dtype="bf16"), record=first.baselines)
    assert bf16.baselines["source"] == "timed" and "dtype" in bf16.baselines["why"]
    for field, value in (("name", "another device"), ("torch", "0.0"), ("shapes", {})):
        forged = first.baselines | {"key": first.baselines["key"] | {field: value}}
        again = bench(HONEST, record=forged)
        assert again.baselines["source"] == "timed" and field in again.baselines["why"], again.baselines


def test_the_ceilings_are_measured_once_per_slot_and_carried_only_to_the_device_they_name():
    """The first bench on a slot measures the device's ceilings; the store keeps them, and the next
    bench job on the slot carries them, used as they are (no second measurement). A record that
    names another device, host or version is measured again."""
    executor, store = LocalExecutor(), Baselines()

    def bench(record: dict | None = None) -> Verdict:
        job = jobs_for(Candidate("rmsnorm", "free", source=HONEST), TARGET, CPU_SLOT)["bench"]
        job = replace(job, ceilings=record if record is not None else store.ceilings_for(CPU_SLOT, job))
        verdict = executor.run(job, CPU_SLOT, 120).verdict
        store.keep(CPU_SLOT, job, verdict)
        assert verdict.status == "pass", verdict.to_json()
        return verdict

    first = bench()
    measured = first.device["ceilings"]
    assert measured["source"] == "measured" and measured["key"]["name"] == "cpu"
    assert bench().device["ceilings"]["source"] == "carried"
    # carried as they are: figures no measurement would give are the verdict's when the key is this device's
    record = store.ceilings_for(CPU_SLOT, jobs_for(Candidate("rmsnorm", "free", source=HONEST), TARGET, CPU_SLOT)["bench"])
    mine = bench(record | {"copy_bytes_per_s": 1.5e3, "matmul_flops_per_s": 2.5e3})
    assert (mine.device["ceilings"]["copy_bytes_per_s"], mine.device["ceilings"]["source"]) == (1.5e3, "carried")
    for field, value in (("name", "another device"), ("host", "another host"), ("torch", "0.0"), ("dtype", "fp8")):
        forged = record | {"copy_bytes_per_s": 1.5e3, "key": record["key"] | {field: value}}
        again = bench(forged).device["ceilings"]
        assert again["source"] == "measured" and again["copy_bytes_per_s"] != 1.5e3, (field, again)


def test_a_gpu_slots_fork_server_still_serves_where_it_cannot_learn_the_gpu(tmp_path):
    """On a GPU slot the fork server asks a child of its own what the GPU is, and hashes Triton's
    and Inductor's files, before it serves; neither leaves it unable to fork a clean stage. Where
    there is no GPU to learn (this host), it serves all the same: its stages ask CUDA themselves."""
    executor = LocalExecutor()
    server = warm.ForkServer(executor.python, executor.worker_root,
                             executor.env(CPU_SLOT) | {"CUDA_VISIBLE_DEVICES": "0"})
    try:
        job = jobs_for(Candidate("rmsnorm", "free", source=HONEST), TARGET, CPU_SLOT)["compile"]
        (tmp_path / "job.json").write_text(job.limited(120).to_json())
        with open(tmp_path / "stdout.log", "wb") as so, open(tmp_path / "stderr.log", "wb") as se:
            stage = server.start(["job.json", "--out", str(tmp_path / "verdict.json")], tmp_path, so, se)
            assert stage is not None, server.why
            assert stage.wait(120) == 0, (tmp_path / "stderr.log").read_text()
        verdict = Verdict.from_json((tmp_path / "verdict.json").read_text())
        assert verdict.status == "pass" and verdict.device["sandbox_start"] == "a fork of the supervisor"
    finally:
        server.close()


def _frame(kind: str, **fields) -> bytes:
    import json

    return json.dumps({"kind": kind, "tensors": [], "nbytes": [], **fields}).encode() + b"\n"


def _baseline(label: str, eager_us: float = 50.0) -> bytes:
    return _frame("baseline", label=label, eager_us=eager_us, eager_how="wall", eager_fallback="", compile_us=None,
                  compile_how="", compile_fallback="", graphs_off="")


@pytest.mark.parametrize("case", ["after loading", "drift disagrees", "some shapes only", "drift not asked",
                                  "their crash after loading"])
def test_baselines_are_believed_only_as_measured_before_the_candidate_loaded(case):
    """The candidate's process can write to the report channel once it is loaded: baselines sent
    after `loading`, a drift check that disagreed with no baselines measured after it, baselines
    for some shapes only, a drift frame the plan did not ask for, or the baselines' crash (the
    platform's fault, not the candidate's) claimed after loading fail `protocol`."""
    from harness.judging import Judge

    job = jobs_for(Candidate("rmsnorm", "free", source="x = 1\n"), TARGET, CPU_SLOT)["bench"]
    if case == "drift disagrees":
        record = Verdict("rmsnorm", "c")
        judge = Judge(job, record)
        labels = [i["shape"] for i in judge.plan["shapes"]]
        judge.book.shapes = {label: {"eager_us": 50.0, "eager_how": "wall", "eager_fallback": "", "compile_us": None,
                                     "compile_how": "", "compile_fallback": ""} for label in labels}
        judge.book.source = "timed"
        job = replace(job, baselines=judge.book.record(judge.key))
    v = Verdict("rmsnorm", "c")
    judge = Judge(job, v)
    labels = [i["shape"] for i in judge.plan["shapes"]]
    stream = {
        "after loading": b"".join(map(_baseline, labels)) + _frame("loading") + _baseline(labels[0], 1e9),
        "drift disagrees": (_frame("drift", label=judge.plan["baselines"].get("drift_shape"), eager_us=1e9)
                            + _frame("loading")),
        "some shapes only": _baseline(labels[0]) + _frame("loading"),
        "drift not asked": _frame("drift", label=labels[0], eager_us=50.0),
        "their crash after loading": (b"".join(map(_baseline, labels)) + _frame("loading")
                                      + _frame("gate", name="baseline", passed=False, crash=True, detail="")),
    }[case]
    judge.read(io.BytesIO(stream), stop=lambda: None)
    assert (v.status, v.failing_gate.name) == ("fail", "protocol"), v.to_json()
