"""What a candidate cost: where it ran, GPU-seconds held, dollars, proposer tokens."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Charge:
    host: str = ""
    gpu: str = ""  # slot label, e.g. "local:gpu0"
    gpu_class: str = ""
    gpu_seconds: float = 0.0
    usd: float = 0.0
    proposer_tokens: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def add_stage(self, stage: str, held_s: float, usd_per_second: float) -> None:
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + held_s
        self.gpu_seconds += held_s
        self.usd += held_s * usd_per_second

    def metrics(self) -> dict[str, float]:
        m = {"gpu_seconds": self.gpu_seconds, "cost_usd": self.usd, "proposer_tokens": float(self.proposer_tokens)}
        m.update({f"stage_seconds/{k}": v for k, v in self.stage_seconds.items()})
        return m
