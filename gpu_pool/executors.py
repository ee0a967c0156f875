"""Pick the executor for a slot: this machine's, or (later) one over SSH."""
from __future__ import annotations

from gpu_pool.local import LocalExecutor
from gpu_pool.pool import Slot


def executor_for(slot: Slot) -> LocalExecutor:
    if slot.host.is_local:
        return LocalExecutor()
    raise NotImplementedError(f"host {slot.host.name}: remote hosts need the SSH executor, not built yet")
