"""The pool of GPU hosts and the slots (one per GPU) that candidates are leased onto."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    field_validator,
    model_validator,
)

from targets import GPUClassName

# What a GPU-hour costs when neither the pool file nor the host names a price: typical on-demand
# list prices of GPU clouds, as of PRICES_AS_OF (docs/cost.md). A CPU host's time is not priced;
# "other" is any class infersmith does not know, priced only by the pool file.
PRICES_AS_OF = "2026-12-01"
DEFAULT_USD_PER_GPU_HOUR: dict[str, float] = {
    "h100": 2.99, "h200": 3.79, "b200": 5.99, "a100": 1.79, "l40s": 0.99, "cpu": 0.0, "other": 0.0}


class Host(BaseModel):
    """One machine of the pool. SSH settings matter only when `address` is not "local"."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    address: str = Field("local", description='"local" for this machine, else a hostname or IP')
    port: int = Field(22, ge=1, le=65535)
    user: str | None = Field(None, description="SSH user; default: the local user name")
    key_file: Path | None = Field(None, description="private key; unset: the SSH agent and ~/.ssh keys")
    known_hosts: Path | None = Field(None, description="known_hosts file; default ~/.ssh/known_hosts")
    trust_unknown_host_key: bool = Field(
        False, description="accept a host key that known_hosts lacks (first contact); a changed key is always refused")
    connect_timeout_s: PositiveFloat = 10.0
    gpus: list[NonNegativeInt] = Field(default_factory=list, description="GPU indices; empty: CPU only")
    gpu_class: GPUClassName = "cpu"
    usd_per_gpu_hour: NonNegativeFloat | None = Field(
        None, description="what one of its GPU-hours costs; unset: the pool's price for its gpu_class")
    python: str = Field("python3", description="the Python (with torch and triton) that runs the harness")
    workdir: str = Field("~/.infersmith-worker", description="where bundles and scratch dirs live")

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"GPU indices repeat: {v}")
        return v

    @model_validator(mode="after")
    def _cpu_means_no_gpus(self) -> Host:
        if self.gpus and self.gpu_class == "cpu":
            raise ValueError("lists GPUs but gpu_class is cpu; name the class (h100, h200, b200, ...)")
        if not self.gpus and self.gpu_class != "cpu":
            raise ValueError(f"gpu_class is {self.gpu_class} but no GPU indices are listed (gpus: [0, 1, ...])")
        return self


class Pool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    hosts: list[Host] = Field(min_length=1)
    usd_per_gpu_hour: dict[GPUClassName, NonNegativeFloat] = Field(
        default_factory=dict, description="price of one GPU-hour per GPU class; a host's own price wins")

    @field_validator("hosts")
    @classmethod
    def _unique_names(cls, hosts: list[Host]) -> list[Host]:
        names = [h.name for h in hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"host names must be unique: {', '.join(dupes)} repeats")
        return hosts

    def slots(self, gpu_class: str = "any") -> list[Slot]:
        """One slot per GPU (or one per CPU-only host), filtered by GPU class."""
        out = []
        for h in self.hosts:
            if gpu_class not in ("any", h.gpu_class):
                continue
            price = self.price(h)
            out += [Slot(h, g, price) for g in h.gpus] if h.gpus else [Slot(h, None, price)]
        return out

    def price(self, host: Host) -> float:
        """$ per GPU-hour of the host: its own, else its class's in the pool's price table; a pool
        without a table (this machine, an unpriced file) has the shipped defaults, a table that
        leaves a class out prices it at 0 (the time is still counted)."""
        if host.usd_per_gpu_hour is not None:
            return host.usd_per_gpu_hour
        return self.usd_per_gpu_hour.get(host.gpu_class, 0.0) if self.usd_per_gpu_hour \
            else DEFAULT_USD_PER_GPU_HOUR[host.gpu_class]

    def priced(self, usd_per_gpu_hour: float) -> Pool:
        """This pool with every GPU-hour at one run's price, over the file's, the hosts' and the default."""
        return self.model_copy(update={"hosts": [h.model_copy(update={"usd_per_gpu_hour": usd_per_gpu_hour})
                                                 for h in self.hosts]})

    def group_problem(self, gpu_class: str, n: int) -> str | None:
        """Why no host of the class can run n servers of one GPU each (a CPU-only host runs them
        all on its CPU); None when one can, or when the pool has no host of the class at all."""
        hosts = [h for h in self.hosts if gpu_class in ("any", h.gpu_class)]
        if n == 1 or not hosts or any(not h.gpus or len(h.gpus) >= n for h in hosts):
            return None
        most = max(len(h.gpus) for h in hosts)
        return (f"{n} replicas need {n} GPUs of one host, and no host of the pool"
                f"{'' if gpu_class == 'any' else ' of class ' + gpu_class} has more than {most}")


@dataclass(frozen=True)
class Slot:
    host: Host
    gpu: int | None  # None: no GPU, the Triton interpreter on the CPU
    usd_per_gpu_hour: float = 0.0  # resolved by Pool.price

    @property
    def label(self) -> str:
        return f"{self.host.name}:{'cpu' if self.gpu is None else f'gpu{self.gpu}'}"

    @property
    def lease_name(self) -> str:
        """The Prefect global concurrency limit (limit 1) that guards this GPU."""
        return f"infersmith-gpu-{self.host.name}-{'cpu' if self.gpu is None else self.gpu}"

    @property
    def usd_per_second(self) -> float:
        return self.usd_per_gpu_hour / 3600.0


def gpu_class_of(name: str) -> GPUClassName:
    name = name.upper()
    for cls in ("H100", "H200", "B200", "A100", "L40S"):
        if cls in name:
            return cls.lower()  # type: ignore[return-value]
    return "other"


# Present wherever a GPU driver torch could use is loaded (NVIDIA's, or ROCm's kernel driver).
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def local_pool() -> Pool:
    """This machine: each visible GPU a slot, or one CPU slot running the Triton interpreter."""
    if not any(Path(p).exists() for p in GPU_DRIVER_PATHS):
        return Pool(hosts=[Host(name="local")])  # known without importing torch (seconds of a command's start)
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        cls = gpu_class_of(torch.cuda.get_device_name(0))
        return Pool(hosts=[Host(name="local", gpus=list(range(n)), gpu_class=cls)])
    return Pool(hosts=[Host(name="local")])
