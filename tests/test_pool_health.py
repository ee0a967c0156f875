"""Host health: what counts as the GPU's fault. A crash whose output names a GPU error only makes
the pool ask the device itself; a candidate that prints such an error benches no host. Real stage
processes on this machine's slot (a GPU slot, where there is one)."""
from __future__ import annotations

import pytest
import torch

from contract.job import Candidate
from contract.verdict import Verdict
from gpu_pool.executors import device_fault, run_stage
from gpu_pool.health import HostFault, gpu_fault_in
from gpu_pool.pool import Host, Slot
from targets import Target
from tasks.evaluate import jobs_for

# Prints what a lost GPU makes the driver log, then hangs until the stage's time limit kills it.
CRY_WOLF = ('import sys\n\nprint("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus", file=sys.stderr, '
            'flush=True)\n\n\ndef rmsnorm(x, weight, eps):\n    while True:\n        pass\n\n\nwhile True:\n    pass\n')


def crashed(log: str = "", detail: str = "") -> Verdict:
    v = Verdict("rmsnorm", "c", log_tail=log)
    v.crash("process", detail)
    return v


def test_gpu_fault_in_names_a_marker_of_a_crash_only():
    assert gpu_fault_in(crashed(log="RuntimeError: CUDA error: unknown error")) == "CUDA error: unknown error"
    assert gpu_fault_in(crashed(detail="the bench process died; last log line: GPU is lost")) == "GPU is lost"
    assert gpu_fault_in(crashed(log="IndexError: list index out of range")) is None
    failed = Verdict("rmsnorm", "c", log_tail="Xid 79")
    failed.gate("accuracy", False, "Xid")  # a fail is the candidate's verdict, whatever it printed
    assert gpu_fault_in(failed) is None


def stage(slot: Slot):
    job = jobs_for(Candidate("rmsnorm", "free", source=CRY_WOLF), Target(model="tiny", dtype="fp32"), slot)["compile"]
    return run_stage(job, slot, 20)  # a limit a loaded machine starts the stage well within


def test_a_candidate_printing_a_gpu_error_and_crashing_on_a_cpu_slot_is_its_own_crash():
    run = stage(Slot(Host(name="local"), None))
    assert run.verdict.status == "crash" and run.verdict.failing_gate.name == "time_limit"
    assert "Xid" in run.verdict.log_tail  # the claim was there; no host was blamed for it


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU slot here would pass the device check")
def test_a_gpu_slot_whose_device_fails_the_pools_check_is_a_host_fault_in_the_checks_words():
    slot = Slot(Host(name="local", gpus=[0], gpu_class="h200"), 0)
    fault = device_fault(slot)
    assert fault and "Xid" not in fault
    with pytest.raises(HostFault, match="GPU 0 failed the pool's device check after the compile stage crashed: ") as e:
        stage(slot)
    assert e.value.reason.endswith(fault)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_candidate_printing_a_gpu_error_on_a_healthy_gpu_is_its_own_crash():
    slot = Slot(Host(name="local", gpus=[0], gpu_class="h200"), 0)
    assert device_fault(slot) is None
    run = stage(slot)
    assert run.verdict.status == "crash" and "Xid" in run.verdict.log_tail
