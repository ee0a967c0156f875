"""Which device a stage runs on, and what it is: name, versions, whether timings mean anything,
and the measured ceilings its rooflines are set against.

Learning what a GPU is takes a CUDA context, and creating one takes seconds — in every stage, on
the supervisor's critical path, before the sandbox could be handed its job. The fork server
learns it once instead (`learn`), in a child of its own (a process that touched CUDA cannot hand
the device to its forks), and every supervisor forked from it reads the facts from memory. A
supervisor started fresh (on a pool host over SSH) asks CUDA itself, as before.
"""
from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess

import torch
import triton

from contract.job import Job
from engine_templates import ceilings as measured
from harness import processes

LEARN_TIMEOUT_S = 120.0
_facts: dict | None = None  # the slot's GPU as `learn` found it; inherited by forks
_holding: int | None = None  # the pipe the child that keeps the GPU initialised waits on


def pick(requested: str) -> str:
    if _facts is not None and requested in ("auto", "cuda"):
        return "cuda"  # the fork server found the GPU, without this process touching CUDA
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the job asks for cuda but this host has no usable GPU")
    return requested


def known(requested: str) -> str | None:
    """The device `pick` would give, where that needs no CUDA call in this process; else None."""
    if requested == "cpu" or _facts is not None:
        return pick(requested)
    return None


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def describe(device: str) -> dict:
    info = {
        "kind": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "gpu_timing": device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
    }
    if device == "cuda":
        info.update(_facts if _facts is not None else gpu_facts())
    else:
        info.update(name="cpu", cuda=None, driver=None)
    return info


def gpu_facts() -> dict:
    """The visible GPU's name, size and versions, asked of CUDA in this process (which this
    initialises)."""
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "uuid": str(getattr(props, "uuid", "")), "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", 0), "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda, "driver": driver_version()}


def learn() -> str:
    """In the fork server, before it forks: the GPU's facts from a child process of its own, kept
    for every stage forked from here. '' when learned, else why not (then each stage asks CUDA).

    The child then stays, idle, until the fork server exits: a process attached to the driver
    keeps the GPU initialised between stages, as persistence mode would, so that no stage's
    process pays for bringing it up again."""
    global _facts, _holding
    facts_r, facts_w = os.pipe()
    hold_r, hold_w = os.pipe()
    driver_version()  # nvidia-smi, its own process: asked here once, the answer inherited by every fork

    def ask() -> int:
        if not torch.cuda.is_available():
            return 3
        os.write(facts_w, json.dumps(gpu_facts()).encode())
        os.close(facts_w)
        os.read(hold_r, 1)  # returns at the fork server's end, when the last write end closes
        return 0

    devnull = os.open(os.devnull, os.O_RDWR)
    pid = processes.fork(ask, {0: devnull, 1: devnull, 2: 2, facts_w: facts_w, hold_r: hold_r}, "/")
    for fd in (devnull, facts_w, hold_r):
        os.close(fd)
    data = b""
    try:
        while select.select([facts_r], [], [], LEARN_TIMEOUT_S)[0] and (chunk := os.read(facts_r, 1 << 16)):
            data += chunk
    finally:
        os.close(facts_r)
    try:
        _facts = json.loads(data)
    except ValueError:  # nothing, or cut short: no GPU there, or the child hung or died
        os.close(hold_w)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        processes.Forked(pid).wait()
        return "the GPU's facts did not come from the child that asked CUDA"
    _holding = hold_w  # held open, never written: the child waits on it
    return ""


def ceilings_for(job: Job, device: str, info: dict) -> tuple[dict, bool]:
    """The device's measured ceilings for the job's dtype, and whether they were measured now:
    the job's record (`Job.ceilings`, an earlier bench stage's on this slot in this flow) when it
    was measured on this very device, else `engine_templates.ceilings` (its cache file, checked
    against a quick measurement). Each record carries the identity it was measured on (`key`)."""
    key = ceilings_key(info, job.rules.dtype)
    record = job.ceilings
    if record is not None and record.get("key") == key and all(
            type(record.get(k)) in (int, float) and record[k] > 0 for k in measured.KEYS):
        return {**record, "source": "carried"}, False
    return {**measured.ceilings(device, info, job.rules.dtype), "key": key, "source": "measured"}, True


def ceilings_key(info: dict, dtype: str) -> dict:
    """What a device's ceilings belong to: the card (its UUID where known), the host and index,
    the versions, and the dtype of the matmul."""
    return {"host": socket.gethostname(), "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "dtype": dtype,
            **{k: info.get(k) for k in ("name", "uuid", "torch", "cuda", "driver")}}


@functools.lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi (its own process: nothing here touches CUDA).
    Asked once a process; the fork server asks it before it forks, so that its stages need not."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
