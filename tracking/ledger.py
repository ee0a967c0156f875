"""What a candidate cost: where it ran, GPU-seconds held, dollars, proposer tokens."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Charge:
    host: str = ""
    gpu: str = ""  # slot label, e.g. "local:gpu0"
    gpu_class: str = ""
    gpu_index: int | None = None  # None: a CPU-only host
    attempts: int = 0  # hosts tried: more than one after a host fault
    gpu_seconds: float = 0.0  # on every host tried: a faulted host's time was held too
    usd: float = 0.0  # what those GPU-seconds cost at their slots' prices
    # What proposing it cost: the LLM's tokens (input not read from the provider's cache, cached
    # input, output) and their dollars. Zero for a template search.
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    proposer_usd: float = 0.0
    # Tokens the proposer said it spent (an agent over MCP), not counted from a provider's reply.
    self_reported: bool = False
    stage_seconds: dict[str, float] = field(default_factory=dict)
    held: list[tuple[str, float, float]] = field(default_factory=list)  # (slot, from, to) epoch s, per attempt

    def place(self, host: str, gpu: str, gpu_class: str, gpu_index: int | None) -> None:
        """Where the next attempt runs; the charge keeps adding up across attempts."""
        self.host, self.gpu, self.gpu_class, self.gpu_index = host, gpu, gpu_class, gpu_index
        self.attempts += 1

    def add_stage(self, stage: str, held_s: float, usd_per_second: float) -> None:
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + held_s
        self.gpu_seconds += held_s
        self.usd += held_s * usd_per_second

    def metrics(self) -> dict[str, float]:
        """`cost_usd` is the GPU time's, `total_usd` adds the proposer's (tracking/cost.py)."""
        m = {"gpu_seconds": self.gpu_seconds, "gpu_hours": self.gpu_seconds / 3600.0, "cost_usd": self.usd,
             "total_usd": self.usd + self.proposer_usd, "host_attempts": float(self.attempts)}
        m |= self.token_metrics()
        m.update({f"stage_seconds/{k}": v for k, v in self.stage_seconds.items()})
        return m

    @property
    def proposer_tokens(self) -> int:
        return self.input_tokens + self.cached_input_tokens + self.output_tokens

    def token_metrics(self) -> dict[str, float]:
        return {"proposer_tokens": float(self.proposer_tokens), "proposer_input_tokens": float(self.input_tokens),
                "proposer_cached_input_tokens": float(self.cached_input_tokens),
                "proposer_output_tokens": float(self.output_tokens), "proposer_usd": self.proposer_usd,
                **({"self_reported_tokens": float(self.proposer_tokens)} if self.self_reported else {})}

    @property
    def token_source(self) -> str:
        """Who counted the tokens: `counted` (the platform, from the provider's reply), `self-reported`
        (the proposer's word), or "" when there were none."""
        return "" if not self.proposer_tokens else "self-reported" if self.self_reported else "counted"
