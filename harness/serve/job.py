"""What the serve stage is given: the traffic patterns, the accuracy rules, the candidate engine
configuration. Plain dataclasses; the controller builds them from the validated target."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    """One AIPerf workload (see flows.target.TrafficPattern for the meaning of each field)."""

    name: str
    endpoint: str = "chat"
    concurrency: int | None = 1
    request_rate: float | None = None
    input_tokens_mean: int = 128
    input_tokens_stddev: int = 0
    output_tokens_mean: int = 128
    output_tokens_stddev: int = 0
    dataset: str = "synthetic"  # "synthetic", "structured", or a JSONL file of {"text": ...} lines
    request_count: int | None = 32
    duration_s: float | None = None
    warmup_requests: int = 2


@dataclass(frozen=True)
class AccuracyRules:
    prompts: tuple[str, ...]  # shown: part of the target, visible to anyone
    held_out: int  # fresh random token-id prompts drawn for each run, never logged
    held_out_tokens: int
    max_tokens: int  # greedy tokens compared per prompt
    logprob_atol: float  # nats, on every token where candidate and reference agree
    tie_nats: float  # a different greedy token is allowed only where the reference's top two are this close


@dataclass(frozen=True)
class ServeJob:
    model_dir: Path
    dtype: str
    device: str  # "cuda" or "cpu"
    env: dict[str, str]  # for every server and the balancer
    devices: tuple[str, ...]  # CUDA_VISIBLE_DEVICES of each replica ("" on a CPU): one server per entry
    max_model_len: int
    patterns: tuple[Pattern, ...]
    accuracy: AccuracyRules
    margin: float  # every metric must beat the baseline's by this fraction
    baseline: str  # "reference", "vllm", "sglang", or a shell command with {port}, {model_dir}, {name}, {replica}
    start_timeout_s: float
    pattern_timeout_s: float
    python: str  # the interpreter that runs the engine, the reference server and the balancer

    @property
    def replica_envs(self) -> list[dict[str, str]]:
        return [{**self.env, "CUDA_VISIBLE_DEVICES": d} for d in self.devices]


@dataclass(frozen=True)
class EngineCandidate:
    """One engine configuration: a kernels-file mapping plus the engine's knobs."""

    kernels: dict[str, dict] = field(default_factory=dict)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cuda_graph_max_batch: int = 64  # decode batches up to this are CUDA graphs; 0: none
    origin: str = ""

    @property
    def id(self) -> str:
        """Content hash; a free kernel counts by its source, not its path."""
        kernels = {op: {**c, "path": _sha(Path(c["path"]))} if c.get("impl") == "free" else c
                   for op, c in self.kernels.items()}
        body = {k: v for k, v in asdict(self).items() if k != "origin"} | {"kernels": kernels}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        picked = ",".join(f"{op}={c.get('template') or c['impl']}" for op, c in sorted(self.kernels.items())
                          if c.get("impl") != "eager")
        return (f"engine[bs={self.block_size},seqs={self.max_num_seqs},chunk={self.max_num_batched_tokens},"
                f"graphs={self.cuda_graph_max_batch}" + (f",{picked}" if picked else "") + "]")

    def engine_args(self, kernels_file: Path) -> list[str]:
        graphs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= self.cuda_graph_max_batch]
        args = ["--kernels", str(kernels_file), "--block-size", str(self.block_size),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return args + (["--cuda-graph-batch-sizes", ",".join(map(str, graphs))] if graphs else ["--enforce-eager"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineCandidate:
        return cls(**d)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else f"missing:{path}"
