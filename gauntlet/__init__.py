"""The gauntlet's suites as data: `manifest.toml` lists every red-team and honest candidate,
the vector of docs/gates.md it stands for, and the verdict it must get. The files
live beside it, one folder per op, so a worker bundle carries them to any host."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from contract.job import Candidate

HERE = Path(__file__).parent
STATUSES = ("pass", "fail", "crash")


@dataclass(frozen=True)
class Case:
    op: str
    vector: str
    expect: str
    gate: str
    file: str = ""
    template: str = ""
    point: str = ""
    flags: tuple[str, ...] = ()
    timeout_s: float | None = None
    memory_mb: int | None = None
    note: str = ""
    ci: bool = True  # false: only `infersmith gauntlet` (and pytest --gauntlet-all) runs it
    alone: bool = False  # it writes where other stages look: never run beside another case
    gpu_only: bool = False  # its vector exists only on a GPU (CUDA-graph capture): not run on a CPU slot
    gpu: bool = False  # a GPU checks more of it than a CPU (graphs, streams, device memory, timers)
    dtype: str = ""  # "fp8": the case runs on the op's fp8 target; "": on the run's dtype
    detail: str = ""  # words the failing gate's detail must contain: the check that caught it, not another

    def __post_init__(self) -> None:
        assert self.expect in STATUSES, f"{self.name}: expect must be one of {STATUSES}"
        assert bool(self.file) != bool(self.template), f"{self.name}: give a file or a template, not both"
        assert (self.expect == "pass") == (self.gate == ""), f"{self.name}: a pass has no gate, a rejection has one"
        assert not (self.detail and self.expect == "pass"), f"{self.name}: a pass has no failing gate's detail"

    @property
    def name(self) -> str:
        op = f"{self.op}:{self.dtype}" if self.dtype else self.op
        return f"{op}/{self.file.removesuffix('.py')}" if self.file else f"{op}/{self.template}[{self.point}]"

    @property
    def on_gpu_check(self) -> bool:
        """Run by the GPU acceptance suite (`infersmith gauntlet --gpu`, `make gpu-check`)."""
        return self.gpu_only or self.gpu

    @property
    def honest(self) -> bool:
        return self.vector == "honest"

    @property
    def expected(self) -> str:
        return self.expect if self.expect == "pass" else f"{self.expect} {self.gate}"

    def candidate(self) -> Candidate:
        if self.file:
            return Candidate(op=self.op, kind="free", source=(HERE / self.op / self.file).read_text(),
                             origin="gauntlet")
        from engine_templates.ops import get_op

        template = get_op(self.op, self.dtype or "bf16").templates[self.template]
        point = dict(template.default) if self.point == "default" else {k: v[-1] for k, v in template.space.items()}
        return Candidate(op=self.op, kind="template", template=self.template, point=point, origin="gauntlet")


def load_cases(op: str | None = None, manifest: Path = HERE / "manifest.toml") -> list[Case]:
    cases = []
    for raw in tomllib.loads(manifest.read_text())["case"]:
        raw = dict(raw, flags=tuple(raw.get("flags", ())))
        cases.append(Case(**raw))
    return [c for c in cases if op is None or c.op == op]
