"""The pool of GPU hosts and the slots (one per GPU) that candidates are leased onto."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt

GPUClassName = Literal["cpu", "h100", "h200", "b200", "a100", "l40s", "other"]


class Host(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    address: str = Field("local", description='"local" for this machine, else a hostname or IP')
    port: int = Field(22, ge=1, le=65535)
    user: str | None = None
    key_file: Path | None = None
    gpus: list[NonNegativeInt] = Field(default_factory=list, description="GPU indices; empty: CPU only")
    gpu_class: GPUClassName = "cpu"
    usd_per_gpu_hour: NonNegativeFloat = 0.0
    python: str = "python3"
    workdir: str = "~/.infersmith-worker"

    @property
    def is_local(self) -> bool:
        return self.address == "local"


class Pool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hosts: list[Host] = Field(min_length=1)

    def slots(self, gpu_class: str = "any") -> list[Slot]:
        """One slot per GPU (or one per CPU-only host), filtered by GPU class."""
        out = []
        for h in self.hosts:
            if gpu_class not in ("any", h.gpu_class):
                continue
            out += [Slot(h, g) for g in h.gpus] if h.gpus else [Slot(h, None)]
        return out


@dataclass(frozen=True)
class Slot:
    host: Host
    gpu: int | None  # None: no GPU, the Triton interpreter on the CPU

    @property
    def label(self) -> str:
        return f"{self.host.name}:{'cpu' if self.gpu is None else f'gpu{self.gpu}'}"

    @property
    def usd_per_second(self) -> float:
        return self.host.usd_per_gpu_hour / 3600.0


def gpu_class_of(name: str) -> GPUClassName:
    name = name.upper()
    for cls in ("H100", "H200", "B200", "A100", "L40S"):
        if cls in name:
            return cls.lower()  # type: ignore[return-value]
    return "other"


def local_pool() -> Pool:
    """This machine: each visible GPU a slot, or one CPU slot running the Triton interpreter."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        cls = gpu_class_of(torch.cuda.get_device_name(0))
        return Pool(hosts=[Host(name="local", gpus=list(range(n)), gpu_class=cls)])
    return Pool(hosts=[Host(name="local")])
