"""Leases: one Prefect global concurrency limit of 1 per GPU, so no two candidates share one.

Any flow on any machine that talks to the same Prefect server sees the same limits. A lease
is held for LEASE_S seconds and renewed by Prefect while its holder lives; when the holder
dies, the server's repossessor service revokes the lease once it expires. That needs a
Prefect server with its services running (`prefect server start`): the ephemeral API and
Prefect's test server run no services, so there a killed process's GPU stays held until
`infersmith pool release`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from gpu_pool.pool import Pool, Slot

LEASE_S = 60.0  # a dead holder's GPU is freed this long (plus a repossessor pass) after it died
WAIT_POLL_S = 0.2  # a candidate queued behind a running one starts this soon after its lease is let go
ACQUIRING_SERVICE = "ConcurrencySlotAcquisitionWithLeaseService"


def refused_try_unlogged(record: logging.LogRecord) -> bool:
    """A filter for Prefect's concurrency services' logger: its slot-acquisition service logs every
    failed acquisition as an error, and a lease refused because another candidate holds the slot
    (HTTP 423) is an answer try_lease expects — a candidate proposed ahead meets it whenever two
    start at once. That record is dropped; any other failure is logged as Prefect logs it (and
    raised to try_lease's caller too)."""
    args = record.args if isinstance(record.args, tuple) else ()
    if len(args) != 2 or args[0] != ACQUIRING_SERVICE or not isinstance(args[1], tuple) or not args[1]:
        return True
    done = args[1][-1]
    if not isinstance(done, Future) or not done.done() or done.cancelled():
        return True
    error = done.exception()
    return not (isinstance(error, httpx.HTTPStatusError) and error.response.status_code == 423)


logging.getLogger("prefect._internal.concurrency").addFilter(refused_try_unlogged)


def ensure_limits(pool: Pool) -> None:
    """One limit of 1 per slot of the pool; existing limits are kept, with their holders."""
    with get_client(sync_client=True) as client:
        for slot in pool.slots():
            try:
                limit = client.read_global_concurrency_limit_by_name(slot.lease_name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=slot.lease_name, limit=1))
                except ObjectAlreadyExists:  # another flow created it a moment ago
                    pass
                continue
            if limit.limit != 1 or not limit.active:
                client.update_global_concurrency_limit(slot.lease_name,
                                                       GlobalConcurrencyLimitUpdate(limit=1, active=True))


def release_all(pool: Pool) -> list[str]:
    """Free every slot of the pool, held or not; the slots that were held. Only for dead holders."""
    freed = []
    with get_client(sync_client=True) as client:
        for slot in pool.slots():
            try:
                limit = client.read_global_concurrency_limit_by_name(slot.lease_name)
            except ObjectNotFound:
                continue
            if limit.active_slots:
                client.update_global_concurrency_limit(slot.lease_name, GlobalConcurrencyLimitUpdate(active_slots=0))
                freed.append(slot.label)
    return freed


def free_slots(slots: list[Slot]) -> list[Slot]:
    """The slots no one holds a lease on right now (a snapshot: taking one may still race)."""
    if not slots:
        return []
    with get_client(sync_client=True) as client:
        return [s for s in slots if client.read_global_concurrency_limit_by_name(s.lease_name).active_slots == 0]


def _locked(e: Exception) -> bool:
    cause = e.__cause__
    return isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423


@contextmanager
def try_lease(slot: Slot) -> Iterator[bool]:
    """Hold the slot's lease if it is free right now: yields True while held, False if taken."""
    with ExitStack() as stack:
        try:
            stack.enter_context(concurrency(slot.lease_name, occupy=1, max_retries=0, strict=True,
                                            lease_duration=LEASE_S))
            held = True
        except Exception as e:  # prefect's ConcurrencySlotAcquisitionError; a 423 means someone holds it
            if not _locked(e):
                raise
            held = False
        yield held


def group_size(slot: Slot, n: int) -> int:
    """Slots a job of n servers (one GPU each) holds on slot's host: n, or a CPU-only host's one slot."""
    return 1 if slot.gpu is None else n


@contextmanager
def lease_group(choices: Callable[[], list[Slot]], n: int) -> Iterator[list[Slot]]:
    """Hold n free slots of one host (the one slot of a CPU-only host, whose servers share its
    CPU), waiting until a host has them. Only slots that look free are tried (another flow or a
    candidate proposed ahead may still take one first: that refusal is not logged). All or none:
    a group that cannot be completed is let go at once, so two waiting groups never hold each
    other's GPUs. `choices()` is asked again once the group is held: a host benched meanwhile is
    let go."""
    while True:
        hosts: dict[str, list[Slot]] = {}
        for slot in free_slots(choices()):
            hosts.setdefault(slot.host.name, []).append(slot)
        for free in hosts.values():
            need = group_size(free[0], n)
            if len(free) < need:
                continue
            with ExitStack() as stack:
                held: list[Slot] = []
                for slot in free:  # another flow may take one meanwhile: then the next
                    if len(held) < need and stack.enter_context(try_lease(slot)):
                        held.append(slot)
                if len(held) == need and all(s in choices() for s in held):
                    yield held
                    return
        time.sleep(WAIT_POLL_S)
