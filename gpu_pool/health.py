"""Host faults and health: a host that fails is benched for a cool-down, not retried at once.

A host fault is the machine's failure, not the candidate's: the connection is refused or
drops, or the GPU itself errors. A candidate that hangs or crashes its own process is a
`crash` verdict, never a host fault. Health lives in this controller process; every flow
on it shares it.
"""
from __future__ import annotations

import threading
import time

from contract.verdict import CRASH, Verdict
from gpu_pool.pool import Host, Slot

COOL_DOWN_S = 120.0

# Messages a GPU or its driver gives when the device, not the kernel, is at fault. An
# illegal memory access or a device-side assert is the candidate's doing and is not here.
GPU_FAULT_MARKERS = (
    "uncorrectable ECC error",
    "GPU is lost",
    "Xid",
    "no CUDA-capable device is detected",
    "CUDA-capable device(s) is/are busy or unavailable",
    "CUDA driver version is insufficient",
    "Failed to initialize NVML",
    "CUDA error: unknown error",
    "cudaErrorDevicesUnavailable",
    "has no usable GPU",  # the harness's own (harness/device.py), where the job asks for cuda
)


class HostFault(Exception):
    """The host, not the candidate, failed: retry the candidate elsewhere."""

    def __init__(self, host: Host, reason: str):
        super().__init__(f"host {host.name} ({host.address}): {reason}")
        self.host, self.reason = host, reason


class HostUnreachable(HostFault):
    """The connection could not be made, or dropped: nothing else is known of the host. Every
    other HostFault is something the host answered (a workdir it cannot create, a bundle it cannot
    unpack, a command past its time limit)."""


def gpu_fault_in(verdict: Verdict) -> str | None:
    """The GPU error marker a crashed verdict's log or failed gates name, if any. Their text holds
    the candidate's own output, so this is a reason to ask the device (executors.device_fault),
    never proof that it failed."""
    if verdict.status != CRASH:
        return None
    text = " ".join([verdict.log_tail] + [g.detail for g in verdict.gates if not g.passed])
    return next((m for m in GPU_FAULT_MARKERS if m in text), None)


class Health:
    """Which hosts are benched, and until when."""

    def __init__(self, cool_down_s: float = COOL_DOWN_S):
        self.cool_down_s = cool_down_s
        self._benched: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def bench(self, fault: HostFault) -> None:
        with self._lock:
            self._benched[fault.host.name] = (time.monotonic() + self.cool_down_s, fault.reason)

    def healthy(self, host: Host) -> bool:
        with self._lock:
            until = self._benched.get(host.name)
            if until and until[0] <= time.monotonic():
                del self._benched[host.name]
                until = None
            return until is None

    def usable(self, slots: list[Slot], exclude: set[str] = frozenset()) -> list[Slot]:
        """Healthy slots on hosts not excluded, in pool order."""
        return [s for s in slots if s.host.name not in exclude and self.healthy(s.host)]


HEALTH = Health()
