"""The baselines a candidate's timings are set against: torch eager and torch.compile of the op.

Measured in the bench stage's sandbox before the candidate is loaded — no candidate code has run
in the process yet, so none can slow them — and sent to the supervisor as `baseline` frames, which
it believes only before the sandbox's `loading` frame. The verdict keeps them, with a key of
everything that decides how they were measured (`key`): op, dtype, shapes with their input sets
and timing method, device, host, versions, the worker's sources, the timing rules. A later bench
job on the same device may carry that record (`Job.baselines`); the supervisor uses it only if
its key is exactly this job's, and only while a drift check agrees: one shape's eager baseline,
drawn at random and measured again before the candidate loads, within `Rules.baseline_drift` of
the record. Otherwise every baseline is measured again, and that record replaces the old one.
"""
from __future__ import annotations

import hashlib
import os
import random
import socket
from typing import Callable

from contract.job import Job
from harness import timing

FIELDS = ("eager_us", "eager_how", "eager_fallback", "compile_us", "compile_how", "compile_fallback")
_draw = random.SystemRandom()


def key(job: Job, device: dict, items: list[dict], sources: dict[str, str]) -> dict:
    """Everything that decides how the baselines are measured. `sources`: the watched trees'
    digest (harness.integrity.tree_digest), whose source files count, not their bytecode."""
    code = hashlib.sha256("".join(f"{p} {d.split()[0]}\n" for p, d in sorted(sources.items())
                                  if "__pycache__" not in p).encode()).hexdigest()[:16]
    shapes = {s.label: s.dims for s in job.shapes}
    r = job.rules
    return {"op": job.candidate.op, "dtype": r.dtype, "host": socket.gethostname(),
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            **{k: device.get(k) for k in ("name", "torch", "triton", "cuda", "driver", "gpu_timing")},
            "sources": code, "warmup_ms": r.warmup_ms, "rep_ms": r.rep_ms, "compile": r.compile_baseline,
            "shapes": {i["shape"]: {"dims": shapes[i["shape"]], "graph": i["graph"], "sets": len(i["sets"])}
                       for i in items}}


def plan(job: Job, this_key: dict) -> dict:
    """The bench plan's `baselines`: measure them all, or check the job's record for drift."""
    record = job.baselines
    if not record or record.get("key") != this_key:
        why = "none measured before on this device" if not record else (
            "the earlier ones were measured otherwise: " + ", ".join(differences(record.get("key") or {}, this_key)))
        return {"time": True, "why": why}
    labels = sorted(record["shapes"])
    return {"cached": record["shapes"], "graphs_off": record.get("graphs_off", ""),
            "drift_shape": _draw.choice(labels), "tolerance": job.rules.baseline_drift}


def differences(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)) or ["(nothing)"]


def drifted(now_us: float, then_us: float, tolerance: float) -> bool:
    return not (then_us > 0 and abs(now_us / then_us - 1) <= tolerance)


def measure(job: Job, op, dev: str, plan_: dict, send: Callable[..., None], settle: Callable[[], bool]) -> dict | None:
    """Sandbox side, before the candidate loads: {shape: (eager, torch.compile or None)} as
    timing.Timed, measured here or the plan's record after its drift check; None when measuring
    failed (the failed gate was sent)."""
    from harness.stages import baseline_timings, prepare_shape

    section = plan_["baselines"]
    if "cached" in section:
        label = section["drift_shape"]
        item = next(i for i in plan_["shapes"] if i["shape"] == label)
        if (ready := prepare_shape(job, op, dev, item, send, settle)) is None:
            return None
        eager = baseline_timings(op, None, ready, send)
        if eager is None:
            return None
        send("drift", label=label, eager_us=eager[0].us)
        if not drifted(eager[0].us, section["cached"][label]["eager_us"], section["tolerance"]):
            timing.turn_graphs_off(section["graphs_off"])  # as when they were measured
            return {k: _timed(v) for k, v in section["cached"].items()}
    measured = measure_all(job, op, dev, plan_, send, settle)
    if measured is not None:
        for label, (eager, comp) in measured.items():
            send("baseline", label=label, eager_us=eager.us, eager_how=eager.how, eager_fallback=eager.fallback,
                 compile_us=comp.us if comp else None, compile_how=comp.how if comp else "",
                 compile_fallback=comp.fallback if comp else "", graphs_off=timing.graphs_off())
    return measured


def measure_all(job: Job, op, dev: str, plan_: dict, send, settle) -> dict | None:
    from harness.stages import baseline_timings, compile_baseline, prepare_shape

    compiled = compile_baseline(op, len(plan_["shapes"])) if dev == "cuda" and job.rules.compile_baseline else None

    def once() -> dict | None:
        out = {}
        for item in plan_["shapes"]:
            if (ready := prepare_shape(job, op, dev, item, send, settle)) is None:
                return None
            if (pair := baseline_timings(op, compiled, ready, send)) is None:
                return None
            out[item["shape"]] = pair
        return out

    if (measured := once()) is None:
        return None
    # A baseline that could not be captured (a host sync: fused_moe's loop at fp16/fp32) leaves
    # every later timing of the process to events, the candidate's at every shape included: the
    # baselines timed by graph before it are timed again, with events, as the candidate will be.
    if timing.graphs_off() and any(t.how == "graph" for pair in measured.values() for t in pair if t):
        measured = once()
    return measured


def _timed(d: dict) -> tuple:
    comp = timing.Timed(d["compile_us"], d["compile_how"], d["compile_fallback"]) if d.get("compile_us") else None
    return timing.Timed(d["eager_us"], d["eager_how"], d["eager_fallback"]), comp


class Book:
    """The supervisor's side: the baselines it believes, from `baseline` frames sent before the
    sandbox said `loading`, or the job's record once the `drift` frame agreed with it. Any other
    such frame was not written by the sandbox: a ProtocolError."""

    def __init__(self, section: dict, labels: list[str]):
        self.section, self.labels = section, labels
        self.shapes: dict[str, dict] = {}
        self.drift: dict | None = None
        self.graphs_off, self.source, self.loaded = "", "", False

    def take(self, kind: str, header: dict) -> None:
        from harness.channel import ProtocolError

        label = header.get("label")
        if self.loaded or label not in self.labels:
            raise ProtocolError(f"a {kind} frame for {str(label)[:80]!r}"
                                + (" after the candidate began loading" if self.loaded else ""))
        if kind == "drift":
            if "cached" not in self.section or self.drift is not None or label != self.section["drift_shape"] \
                    or type(header.get("eager_us")) not in (int, float):
                raise ProtocolError(f"a drift frame for {label!r} the plan did not ask for")
            self.drift = {"shape": label, "eager_us": header["eager_us"],
                          "recorded_us": self.section["cached"][label]["eager_us"]}
            return
        values = {k: header.get(k) for k in FIELDS}
        numbers = type(values["eager_us"]) in (int, float) and type(values["compile_us"]) in (int, float, type(None))
        if label in self.shapes or not numbers or not all(isinstance(values[k], str) for k in FIELDS if "us" not in k):
            raise ProtocolError(f"a baseline frame for {label!r}, twice or malformed")
        self.shapes[label] = values
        self.graphs_off = str(header.get("graphs_off", ""))

    def start_loading(self) -> str:
        """The sandbox is about to load the candidate: '' when the baselines are known, else why not."""
        self.loaded = True
        if set(self.shapes) == set(self.labels):
            self.source = "timed"
        elif not self.shapes and self.drift and not drifted(self.drift["eager_us"], self.drift["recorded_us"],
                                                            self.section["tolerance"]):
            self.source, self.shapes, self.graphs_off = "cached", self.section["cached"], self.section["graphs_off"]
        else:
            return (f"the sandbox began loading the candidate with baselines for {sorted(self.shapes)} of "
                    f"{self.labels}" + (" after a drift check that disagreed" if self.drift else ""))
        return ""

    def record(self, this_key: dict) -> dict:
        """What the verdict keeps, and a later job on this device may carry (`Job.baselines`)."""
        out = {"source": self.source, "key": this_key, "shapes": self.shapes, "graphs_off": self.graphs_off}
        if self.drift:
            out["drift"] = self.drift
        if "why" in self.section:
            out["why"] = self.section["why"]
        return out
