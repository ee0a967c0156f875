"""The one JSON verdict a candidate's evaluation ends in.

Status is `pass` only when every gate passed; `fail` when a gate rejected the candidate;
`crash` when the process died, hung past its limit, or the harness could not finish;
`malformed` when a proposer's reply held no module to judge (the controller writes that one).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, CRASH, MALFORMED = "pass", "fail", "crash", "malformed"
# Flags on which a passed candidate waits for a person's approval: outputs over the target's
# tolerance but within its approval tolerance, and a computation the screen found in a lower
# precision than the target's.
BEYOND_TOLERANCE = "beyond_tolerance"
APPROVAL_FLAGS = (BEYOND_TOLERANCE, "reduced_precision")


@dataclass
class Gate:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class ShapeTiming:
    """Timings of one target shape: the candidate's, and the baselines' measured on the same device
    before the candidate was loaded (in its process, or for an earlier candidate and checked for
    drift: `Verdict.baselines`)."""

    label: str
    dims: dict[str, int]
    candidate_us: float
    candidate_us_repeat: float  # a second timing of the candidate, to show the spread
    eager_us: float
    compile_us: float | None
    roofline_us: float
    bytes: int
    flops: int
    method: str = "events"  # "graph": CUDA-graph replay; "events": one event pair per call; "wall": CPU
    # The rotated input sets' bytes over the GPU's L2 (0: not known, or a CPU). Under 2 (the sets
    # were capped at timing.ROTATION_CAP), repeats may have been served from the L2, for candidate
    # and baselines alike.
    l2_cover: float = 0.0
    # Per candidate timing (first, repeat): the repetitions timed, and whether the confidence rule
    # stopped them (the median known within 0.5%) before the time cap (harness.timing.until_steady).
    reps: list[int] = field(default_factory=list)
    steady: list[bool] = field(default_factory=list)

    @property
    def spread(self) -> float:
        lo, hi = sorted((self.candidate_us, self.candidate_us_repeat))
        return (hi - lo) / lo if lo > 0 else 0.0

    @property
    def measured_us(self) -> float:
        """The candidate's figure, set beside the baselines' one median each: the mean of its two
        timings. Their minimum would favour the candidate by about the spread; until 2026-12-04
        every figure was that minimum."""
        return (self.candidate_us + self.candidate_us_repeat) / 2

    @property
    def fastest_us(self) -> float:
        """The faster of the candidate's two timings: what the speed-of-light gate holds against
        the roofline, so that a time under it in either timing fails."""
        return min(self.candidate_us, self.candidate_us_repeat)

    def metrics(self) -> dict[str, float]:
        m = {
            "latency_us": self.measured_us,
            "eager_us": self.eager_us,
            "roofline_us": self.roofline_us,
            "pct_roofline": 100.0 * self.roofline_us / self.measured_us,
            "eager_pct_roofline": 100.0 * self.roofline_us / self.eager_us,
            "speedup_vs_eager": self.eager_us / self.measured_us,
            "spread": self.spread,
        }
        if self.l2_cover:
            m["l2_cover"] = self.l2_cover
        if self.compile_us:
            m["compile_us"] = self.compile_us
            m["compile_pct_roofline"] = 100.0 * self.roofline_us / self.compile_us
            m["speedup_vs_compile"] = self.compile_us / self.measured_us
        return m


@dataclass
class Verdict:
    op: str
    candidate_id: str
    status: str = PASS
    gates: list[Gate] = field(default_factory=list)
    timings: list[ShapeTiming] = field(default_factory=list)
    max_rel_error: float | None = None
    device: dict[str, Any] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    log_tail: str = ""
    flags: list[str] = field(default_factory=list)  # screening findings for a person to look at
    # Seconds per part of each stage, "<stage>/<part>": where a candidate's time goes.
    phases: dict[str, float] = field(default_factory=dict)
    # bench: the baselines its timings are set against (harness/baselines.py): "source" is
    # "timed" (in its own process) or "cached" (an earlier candidate's, drift-checked).
    baselines: dict[str, Any] = field(default_factory=dict)

    # -- building ---------------------------------------------------------------
    def gate(self, name: str, passed: bool, detail: str = "") -> bool:
        self.gates.append(Gate(name, passed, detail))
        if not passed and self.status == PASS:
            self.status = FAIL
        return passed

    def crash(self, name: str, detail: str) -> None:
        self.gates.append(Gate(name, False, detail))
        self.status = CRASH

    def malformed(self, detail: str) -> None:
        self.gates.append(Gate("reply", False, detail))
        self.status = MALFORMED

    def merge(self, later: Verdict) -> None:
        """Fold a later stage's verdict into this one."""
        self.gates.extend(later.gates)
        self.timings.extend(later.timings)
        self.stages.extend(later.stages)
        self.wall_s += later.wall_s
        self.device = later.device or self.device
        if later.max_rel_error is not None:
            self.max_rel_error = max(self.max_rel_error or 0.0, later.max_rel_error)
        if later.log_tail:
            self.log_tail = later.log_tail
        self.flags = sorted(set(self.flags) | set(later.flags))
        self.phases |= later.phases
        self.baselines = later.baselines or self.baselines
        if later.status != PASS and self.status == PASS:
            self.status = later.status

    # -- reading ----------------------------------------------------------------
    @property
    def failing_gate(self) -> Gate | None:
        return next((g for g in self.gates if not g.passed), None)

    @property
    def needs_approval(self) -> list[str]:
        """The flags a person must approve before this pass counts (none unless passed)."""
        return [f for f in APPROVAL_FLAGS if f in self.flags] if self.status == PASS else []

    @property
    def gpu_timing(self) -> bool:
        return bool(self.device.get("gpu_timing"))

    def score(self) -> float | None:
        """Geometric-mean speed-up over the best baseline per shape; None unless passed and timed.

        A candidate flagged for calling PyTorch's own implementation of the op counts as no
        speed-up (at most 1): its speed is torch's, not its own."""
        if self.status != PASS or not self.timings:
            return None
        import math

        logs = []
        for t in self.timings:
            base = min(x for x in (t.eager_us, t.compile_us) if x)
            logs.append(math.log(base / t.measured_us))
        score = math.exp(sum(logs) / len(logs))
        return min(score, 1.0) if "reference_fallback" in self.flags else score

    def metrics(self) -> dict[str, float]:
        """Flat metrics for tracking: per shape `<label>/<name>`, plus summaries."""
        out: dict[str, float] = {}
        for t in self.timings:
            for k, v in t.metrics().items():
                out[f"{t.label}/{k}"] = v
        if self.max_rel_error is not None:
            out["max_rel_error"] = self.max_rel_error
        score = self.score()
        if score is not None:
            out["score"] = score
        if self.timings:
            import math

            for key in ("speedup_vs_eager", "speedup_vs_compile", "pct_roofline"):
                vals = [t.metrics().get(key) for t in self.timings]
                if all(v for v in vals):
                    out[f"geomean_{key}"] = math.exp(sum(math.log(v) for v in vals) / len(vals))
        out["harness_wall_s"] = self.wall_s
        out |= {f"phase_s/{k}": v for k, v in self.phases.items()}
        if self.baselines:
            out["baselines_cached"] = float(self.baselines.get("source") == "cached")
        return out

    # -- JSON -------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["failing_gate"] = self.failing_gate.name if self.failing_gate else None
        d["metrics"] = self.metrics()
        return json.dumps(d, indent=1, default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(
            op=d["op"],
            candidate_id=d["candidate_id"],
            status=d["status"],
            gates=[Gate(**g) for g in d.get("gates", [])],
            timings=[ShapeTiming(**t) for t in d.get("timings", [])],
            max_rel_error=d.get("max_rel_error"),
            device=d.get("device", {}),
            stages=d.get("stages", []),
            wall_s=d.get("wall_s", 0.0),
            log_tail=d.get("log_tail", ""),
            flags=d.get("flags", []),
            phases=d.get("phases", {}),
            baselines=d.get("baselines", {}),
        )

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        return cls.from_dict(json.loads(text))
