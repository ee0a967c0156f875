"""Run one stage on a slot: this machine's executor or the SSH one, and tell host faults apart."""
from __future__ import annotations

from gpu_pool.health import HostFault, gpu_fault_in
from gpu_pool.local import LocalExecutor, StageRun
from gpu_pool.pool import Slot
from gpu_pool.ssh import SSHExecutor
from harness.job import Job


def executor_for(slot: Slot) -> LocalExecutor | SSHExecutor:
    return LocalExecutor() if slot.host.is_local else SSHExecutor()


def run_stage(job: Job, slot: Slot, timeout_s: float) -> StageRun:
    """The stage's run; a HostFault when the host failed (unreachable, dropped, or its GPU erred)."""
    run = executor_for(slot).run(job, slot, timeout_s)
    marker = gpu_fault_in(run.verdict)
    if marker:
        raise HostFault(slot.host, f"GPU {slot.gpu} error in the {job.stage} stage: {marker}")
    return run
