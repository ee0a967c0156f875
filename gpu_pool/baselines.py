"""The baselines measured on each slot, kept for a flow's later candidates on it.

A bench stage measures torch eager and torch.compile of the op before it loads the candidate
and returns them in its verdict (`Verdict.baselines`, harness/baselines.py). The next bench job
of the same op, dtype and shapes on the same slot carries that record; the harness there uses it
only if it would have measured them exactly so (device, versions, sources, input sets, rules)
and a drift check agrees, and otherwise measures them again — a record it returns replaces the
one kept here. One store per flow: baselines are measured once a flow, not once a candidate.
"""
from __future__ import annotations

import threading

from contract.job import Job
from contract.verdict import Verdict
from gpu_pool.pool import Slot


class Baselines:
    def __init__(self) -> None:
        self._records: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(slot: Slot, job: Job) -> tuple:
        shapes = tuple((s.label, tuple(sorted(s.dims.items()))) for s in job.shapes)
        return slot.label, job.candidate.op, job.rules.dtype, shapes

    def for_job(self, slot: Slot, job: Job) -> dict | None:
        """The record measured last on this slot for this op, dtype and shapes; None if none was."""
        with self._lock:
            return self._records.get(self._key(slot, job))

    def keep(self, slot: Slot, job: Job, verdict: Verdict) -> None:
        """The baselines the verdict's bench stage measured itself (not those it reused)."""
        if verdict.baselines.get("source") == "timed":
            with self._lock:
                self._records[self._key(slot, job)] = verdict.baselines
