"""Run one stage on a slot: this machine's executor or the SSH one, and tell host faults apart."""
from __future__ import annotations

from pathlib import Path

from gpu_pool.health import HostFault, gpu_fault_in
from gpu_pool.local import LocalExecutor, StageRun
from gpu_pool.pool import Slot
from gpu_pool.ssh import SSHExecutor
from gpu_pool.ssh_serve import SSHServe
from harness.job import Job
from harness.serve import stage
from harness.serve.job import EngineCandidate, ServeJob


def executor_for(slot: Slot) -> LocalExecutor | SSHExecutor:
    return LocalExecutor() if slot.host.is_local else SSHExecutor()


def run_stage(job: Job, slot: Slot, timeout_s: float) -> StageRun:
    """The stage's run; a HostFault when the host failed (unreachable, dropped, or its GPU erred)."""
    run = executor_for(slot).run(job, slot, timeout_s)
    marker = gpu_fault_in(run.verdict)
    if marker:
        raise HostFault(slot.host, f"GPU {slot.gpu} error in the {job.stage} stage: {marker}")
    return run


class LocalServe:
    """The serve stage's sessions on this machine: the stage's functions, in this process."""

    reference = staticmethod(stage.reference_answers)
    baseline = staticmethod(stage.measure_baseline)
    candidate = staticmethod(stage.serve)


def serve_sessions(group: list[Slot]) -> LocalServe | SSHServe:
    """Where the group's servers (a replica per slot, or all on a CPU-only host's one) start and
    AIPerf loads them: here, or on their pool host."""
    return LocalServe() if group[0].host.is_local else SSHServe(group)


def run_serve(group: list[Slot], job: ServeJob, cand: EngineCandidate, reference: stage.Reference, out: Path,
              command: str | None = None) -> stage.Served:
    """The candidate's serve stage on the group's host; a HostFault when that host failed."""
    return serve_sessions(group).candidate(job, cand, reference, out, command)
