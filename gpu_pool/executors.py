"""Run one stage on a slot: this machine's executor or the SSH one, and tell host faults apart."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from contract.images import ImageServeJob
from contract.job import Job
from contract.serve import EngineCandidate, ServeJob
from gpu_pool.health import HostFault, HostUnreachable, gpu_fault_in
from gpu_pool.local import LocalExecutor, LocalSession, StageRun
from gpu_pool.pool import Slot
from gpu_pool.ssh import SSHExecutor, SSHSession, connect, run_command
from gpu_pool.ssh_images import SSHImages
from gpu_pool.ssh_serve import SSHServe
from harness.serve import images, stage


def executor_for(slot: Slot) -> LocalExecutor | SSHExecutor:
    return LocalExecutor() if slot.host.is_local else SSHExecutor()


def prewarm(slots: list[Slot]) -> None:
    """Start the fork servers of this machine's slots now (gpu_pool/warm.py), so that their imports
    overlap the controller's own start; a host over SSH starts each stage fresh."""
    for slot in slots:
        if slot.host.is_local:
            LocalExecutor().prewarm(slot)


# Run by the pool in a process of its own, never by a candidate: whether the slot's GPU still
# initializes and computes. Its outcome, not a candidate's log, is what benches a host.
DEVICE_CHECK = """
import torch
torch.cuda.init()
x = torch.ones(1 << 20, device="cuda")
assert int(x.sum().item()) == 1 << 20, "a sum of ones on the GPU came out wrong"
"""


def candidate_session(slot: Slot, jobs: dict[str, Job], limits: dict[str, float]) -> LocalSession | SSHSession:
    """One session for a candidate's stages on the slot (gpu_pool/local.py's LocalSession, or over
    SSH gpu_pool/ssh.py's SSHSession); a context manager that ends it on leaving."""
    return executor_for(slot).session(slot, jobs, limits)


def run_stage(job: Job, slot: Slot, timeout_s: float, session: LocalSession | SSHSession | None = None) -> StageRun:
    """The stage's run, in `session` when given; a HostFault when the host failed: unreachable, dropped, or its GPU fails
    the pool's device check after a crash whose output names a GPU error. That output is partly
    the candidate's, which may print anything: it only decides whether the device is asked."""
    run = (session or executor_for(slot)).run(job, slot, timeout_s)
    if slot.gpu is not None and gpu_fault_in(run.verdict):
        fault = device_fault(slot)
        if fault:
            raise HostFault(slot.host, f"GPU {slot.gpu} failed the pool's device check after the {job.stage} "
                                       f"stage crashed: {fault}")
    return run


def device_fault(slot: Slot, timeout_s: float = 120.0) -> str | None:
    """Why the slot's GPU fails DEVICE_CHECK, run with the python that runs the harness there
    and only that GPU visible; None when it passes."""
    host = slot.host
    if host.is_local:
        try:
            done = subprocess.run([sys.executable, "-c", DEVICE_CHECK], capture_output=True, text=True,
                                  timeout=timeout_s, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(slot.gpu)})
        except subprocess.TimeoutExpired:
            return f"the device check ran past {timeout_s:g} s"
        rc, err = done.returncode, done.stderr
    else:
        client = connect(host)
        try:
            rc, _, err = run_command(client, host, f"env CUDA_VISIBLE_DEVICES={slot.gpu} {host.python} -c "
                                                   f"{shlex.quote(DEVICE_CHECK)}", timeout_s)
        except HostUnreachable:
            raise
        except HostFault as e:  # the check itself ran past its limit
            return e.reason
        finally:
            client.close()
    return None if rc == 0 else (err.strip().splitlines() or [f"exit code {rc}"])[-1]


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


def run_images(group: list[Slot], job: ImageServeJob, kernels: Path | None, out: Path) -> stage.Served:
    """The image stage (harness/serve/images.py) on the group's host, here or over SSH
    (gpu_pool/ssh_images.py): the reference's answers and baseline, then the SAM 3 engine with
    `kernels` judged against them; a HostFault when that host failed."""
    if not group[0].host.is_local:
        return SSHImages(group).stage(job, kernels, out)
    return images.stage(job, "sam3-engine", lambda port: images.engine_argv(job, port, kernels), out)
