"""Which device a stage runs on, and what it is: name, versions, whether timings mean anything."""
from __future__ import annotations

import functools
import os
import subprocess

import torch
import triton


def pick(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the job asks for cuda but this host has no usable GPU")
    return requested


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
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, sm_count=props.multi_processor_count,
                    l2_bytes=getattr(props, "L2_cache_size", 0),
                    memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    driver=driver_version())
    else:
        info.update(name="cpu", cuda=None, driver=None)
    return info


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
