"""Run work on a leased, healthy slot; a host fault benches the host and retries elsewhere."""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from gpu_pool.health import HEALTH, Health, HostFault
from gpu_pool.leases import lease_group
from gpu_pool.pool import Slot

MAX_ATTEMPTS = 3
T = TypeVar("T")
log = logging.getLogger("infersmith.pool")


class NoHealthyHost(HostFault):
    pass


def run_leased(slots: list[Slot], work: Callable[[Slot], T], health: Health = HEALTH,
               attempts: int = MAX_ATTEMPTS) -> T:
    """work(slot) while holding slot's lease. Another host is preferred after a fault; the last
    fault is raised when `attempts` are spent or no healthy host is left."""
    return run_leased_group(slots, 1, lambda group: work(group[0]), health, attempts)


def run_leased_group(slots: list[Slot], n: int, work: Callable[[list[Slot]], T], health: Health = HEALTH,
                     attempts: int = MAX_ATTEMPTS) -> T:
    """work(group) while holding the leases of n slots of one host (see leases.lease_group), as
    run_leased does for one."""
    tried: set[str] = set()
    last: HostFault | None = None

    def choices() -> list[Slot]:
        fresh = health.usable(slots, exclude=tried)
        if fresh:
            return fresh
        if last is not None and not health.usable(slots):
            raise last
        if not health.usable(slots):
            raise NoHealthyHost(slots[0].host, f"every host of the pool is cooling down after a fault: "
                                               f"{', '.join(sorted({s.host.name for s in slots}))}")
        return health.usable(slots)

    for attempt in range(1, attempts + 1):
        with lease_group(choices, n) as group:
            try:
                return work(group)
            except HostFault as fault:
                health.bench(fault)
                tried.add(fault.host.name)
                last = fault
                log.warning("attempt %d/%d: %s; host benched for %.0f s", attempt, attempts, fault,
                            health.cool_down_s)
    raise last
