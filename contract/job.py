"""What the controller sends to a worker: one candidate, one op, the shapes and the rules.

Plain dataclasses that travel as JSON. The controller builds them from validated
models; the worker side reads them with the standard library only.
"""
from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

STAGES = ("compile", "check", "bench")


@dataclass(frozen=True)
class Candidate:
    """One thing to evaluate: a template point, or a free module's source."""

    op: str
    kind: str  # "template" or "free"
    template: str | None = None
    point: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    origin: str = ""  # who proposed it: "random", "tpe", "cli", ...

    def __post_init__(self) -> None:
        if self.kind == "template":
            assert self.template, "a template candidate names its template"
        elif self.kind == "free":
            assert self.source is not None, "a free candidate carries its source"
        else:
            raise ValueError(f"unknown candidate kind {self.kind!r}")

    @property
    def id(self) -> str:
        """Content hash: the same code and point always get the same id."""
        body = json.dumps(
            {"op": self.op, "kind": self.kind, "template": self.template,
             "point": self.point, "source": self.source},
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        if self.kind == "free":
            return f"free:{self.id[:8]}"
        point = ",".join(f"{k}={v}" for k, v in sorted(self.point.items()))
        return f"{self.template}[{point}]"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(**d)


@dataclass(frozen=True)
class Shape:
    """One problem size of an op, e.g. label "decode_b32", dims {"tokens": 32, "hidden": 4096}."""

    label: str
    dims: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rules:
    """Tolerances and timing settings, all from the target."""

    dtype: str = "bf16"
    rtol: float = 1e-2  # allowed ||out - ref|| / ||ref||
    # Looser, set by a target that lets a person approve a numerics change: an output within it
    # but over rtol passes the stages flagged `beyond_tolerance`, and the controller asks.
    approval_rtol: float | None = None
    seeds: int = 3  # fresh random inputs per shape in the check stage
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    sol_margin: float = 1.10  # speed-of-light: achieved rate above margin x ceiling is rejected
    # Shapes whose roofline is under this are timed by CUDA-graph replay (harness.timing.by_graph).
    # It was 50 until 2026-12-04: calls of 60-140 us were timed with events, and the host's time to
    # issue them fell into the timing (torch.compile's rmsnorm at 16384 x 4096: 141 us by events
    # in a flow, 77 us by graph; docs/BENCHMARKS.md).
    launch_bound_us: float = 1000.0
    compile_baseline: bool = True
    memory_mb: int = 16384  # resident host memory of the candidate's process before it is killed
    gpu_memory_fraction: float = 0.8  # of the GPU's memory the candidate's process may allocate
    # Baselines measured for an earlier candidate on the same device are used while a drift check
    # (one shape's eager timing, measured again before the candidate loads) agrees with them
    # within this share; else every baseline is measured again (harness/baselines.py).
    baseline_drift: float = 0.10


@dataclass(frozen=True)
class Job:
    """One stage of one candidate's evaluation."""

    stage: str
    candidate: Candidate
    model: str
    shapes: list[Shape]  # the target's shapes: checked and timed
    odd_shapes: list[Shape]  # checked only
    rules: Rules = field(default_factory=Rules)
    device: str = "auto"  # "auto", "cuda" or "cpu"
    # The controller's time limit for this stage, set by the executor that runs it. The harness
    # stops the candidate a little before it and writes a verdict with what it measured; the
    # controller's kill at the limit itself is the backstop, and loses that.
    limit_s: float | None = None
    # bench: the baselines an earlier bench stage measured on this device (its verdict's
    # `baselines`), used only if measured exactly as this job would measure them.
    baselines: dict | None = None
    # bench: the device's ceilings an earlier bench stage measured on this slot (its verdict's
    # `device["ceilings"]`), used only if measured on this very device (harness/device.py).
    ceilings: dict | None = None

    def __post_init__(self) -> None:
        assert self.stage in STAGES, f"stage must be one of {STAGES}"

    def limited(self, limit_s: float) -> Job:
        return replace(self, limit_s=limit_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Job:
        d = json.loads(text)
        return cls(
            stage=d["stage"],
            candidate=Candidate.from_dict(d["candidate"]),
            model=d["model"],
            shapes=[Shape(**s) for s in d["shapes"]],
            odd_shapes=[Shape(**s) for s in d["odd_shapes"]],
            rules=Rules(**d["rules"]),
            device=d["device"],
            limit_s=d.get("limit_s"),
            baselines=d.get("baselines"),
            ceilings=d.get("ceilings"),
        )


def screen_signature(source: str, name: str, arg_names: list[str]) -> str | None:
    """Without running anything: why this source cannot be an `name(...)` candidate, or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"syntax error at line {e.lineno}: {e.msg}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            positional = len(a.posonlyargs) + len(a.args)
            required = positional - len(a.defaults)
            required_kw = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
            n = len(arg_names)
            if required > n or (positional < n and a.vararg is None) or required_kw:
                got = ", ".join(x.arg for x in a.posonlyargs + a.args)
                return f"`{name}({got})` does not match the op's signature `{name}({', '.join(arg_names)})`"
            return None
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return None  # bound by assignment (a wrapped function): checked when loaded
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (al.asname or al.name) == name for al in node.names):
            return None
    return f"defines no top-level function `{name}`"
