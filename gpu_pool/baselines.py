"""The baselines measured on each slot, kept for a flow's later candidates on it.

A bench stage measures torch eager and torch.compile of the op before it loads the candidate
and returns them in its verdict (`Verdict.baselines`, harness/baselines.py). The next bench job
of the same op, dtype and shapes on the same slot carries that record; the harness there uses it
only if it would have measured them exactly so (device, versions, sources, input sets, rules)
and a drift check agrees, and otherwise measures them again — a record it returns replaces the
one kept here. One store per flow: baselines are measured once a flow, not once a candidate.

The device's ceilings (a 2 GiB copy and an 8192^3 matmul, the rooflines' denominators) are kept
the same way, per slot and dtype: the first bench stage on a slot measures them, later ones
carry that record (`Job.ceilings`), used only where the harness finds itself on the very device
it names (harness/device.py).
"""
from __future__ import annotations

import threading

from contract.job import Job
from contract.verdict import Verdict
from gpu_pool.pool import Slot


class Baselines:
    def __init__(self) -> None:
        self._records: dict[tuple, dict] = {}
        self._ceilings: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(slot: Slot, job: Job) -> tuple:
        shapes = tuple((s.label, tuple(sorted(s.dims.items()))) for s in job.shapes)
        return slot.label, job.candidate.op, job.rules.dtype, shapes

    def for_job(self, slot: Slot, job: Job) -> dict | None:
        """The record measured last on this slot for this op, dtype and shapes; None if none was."""
        with self._lock:
            return self._records.get(self._key(slot, job))

    def ceilings_for(self, slot: Slot, job: Job) -> dict | None:
        """The ceilings a bench stage measured last on this slot in the job's dtype; None if none did."""
        with self._lock:
            return self._ceilings.get((slot.label, job.rules.dtype))

    def keep(self, slot: Slot, job: Job, verdict: Verdict) -> None:
        """The baselines and ceilings the verdict's bench stage measured itself (not those it reused)."""
        ceilings = verdict.device.get("ceilings") or {}
        with self._lock:
            if verdict.baselines.get("source") == "timed":
                self._records[self._key(slot, job)] = verdict.baselines
            if job.stage == "bench" and ceilings.get("source") == "measured" and "key" in ceilings:
                self._ceilings[(slot.label, job.rules.dtype)] = {k: v for k, v in ceilings.items() if k != "source"}
