"""What the serve stage is given: the traffic patterns, the accuracy rules, the candidate engine
configuration. Plain dataclasses; the controller builds them from the validated target."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from contract.verdict import Verdict

# The serving engines a target may name as its baseline besides "reference" (the HF server) or a
# shell command; harness/serve/baselines.py says how each is started.
BASELINE_ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Pattern:
    """One AIPerf workload (see targets.TrafficPattern for the meaning of each field)."""

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
    under_load: int = 0  # prompts sent during each pattern's load (a fresh one among them), judged alike; 0: none


@dataclass(frozen=True)
class ServeJob:
    model_dir: Path
    dtype: str  # "bf16", "fp16", "fp32", or "fp8": FP8 weights, bf16 activations, a bf16 reference
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
    reference_model_dir: Path | None = None  # the reference's checkpoint, when not model_dir (FP8's bf16 original)
    ready_path: str = "/v1/models"  # what the candidate and a command's baseline answer 200 on once ready

    @property
    def replica_envs(self) -> list[dict[str, str]]:
        return [{**self.env, "CUDA_VISIBLE_DEVICES": d} for d in self.devices]

    @property
    def activation_dtype(self) -> str:
        """The dtype every server computes in: an FP8 job's weights are FP8, its activations bf16."""
        return "bf16" if self.dtype == "fp8" else self.dtype

    @property
    def reference_dir(self) -> Path:
        return self.reference_model_dir or self.model_dir


SPEC_NGRAM = 3  # the engine's default n-gram size (EngineConfig.spec_ngram)


@dataclass(frozen=True)
class EngineCandidate:
    """One engine configuration: a kernels-file mapping plus the engine's knobs; or, from an engine
    spec file (`engine` names it), the knobs' settings and the server command they render to."""

    kernels: dict[str, dict] = field(default_factory=dict)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cuda_graph_max_batch: int = 64  # decode batches up to this are CUDA graphs; 0: none
    spec_tokens: int = 0  # speculative decoding by prompt lookup: draft tokens per step; 0: off
    spec_ngram: int = 3  # the longest n-gram looked up (only with spec_tokens)
    origin: str = ""
    engine: str = ""  # an engine spec file's engine: then only settings and command count
    settings: dict = field(default_factory=dict)  # the spec's knobs that apply, by name
    command: str = ""  # the server command, {port}, {model_dir}, {name}, {replica} left to fill in

    def __post_init__(self):
        if not self.spec_tokens:  # without speculation the n-gram size changes nothing: one configuration
            object.__setattr__(self, "spec_ngram", SPEC_NGRAM)

    @property
    def id(self) -> str:
        """Content hash; a free kernel counts by its source, not its path. Speculation only when on,
        so that configurations from before it existed keep their ids."""
        if self.engine:
            body = {"engine": self.engine, "settings": self.settings, "command": self.command}
            return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        kernels = {op: {**c, "path": _sha(Path(c["path"]))} if c.get("impl") == "free" else c
                   for op, c in self.kernels.items()}
        unset = {"engine", "settings", "command"} | ({"spec_tokens", "spec_ngram"} if not self.spec_tokens else set())
        body = {k: v for k, v in asdict(self).items() if k != "origin" and k not in unset} | {"kernels": kernels}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        if self.engine:
            return f"{self.engine}[{','.join(f'{k}={v}' for k, v in self.settings.items())}]"
        picked = ",".join(f"{op}={c.get('template') or c['impl']}" for op, c in sorted(self.kernels.items())
                          if c.get("impl") != "eager")
        spec = f",spec={self.spec_tokens}/{self.spec_ngram}" if self.spec_tokens else ""
        return (f"engine[bs={self.block_size},seqs={self.max_num_seqs},chunk={self.max_num_batched_tokens},"
                f"graphs={self.cuda_graph_max_batch}{spec}" + (f",{picked}" if picked else "") + "]")

    def engine_args(self, kernels_file: Path) -> list[str]:
        graphs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= self.cuda_graph_max_batch]
        args = ["--kernels", str(kernels_file), "--block-size", str(self.block_size),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.spec_tokens:
            args += ["--spec-tokens", str(self.spec_tokens), "--spec-ngram", str(self.spec_ngram)]
        return args + (["--cuda-graph-batch-sizes", ",".join(map(str, graphs))] if graphs else ["--enforce-eager"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineCandidate:
        return cls(**d)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else f"missing:{path}"


# What the serve stage returns: AIPerf's figures per pattern, the reference's answers, the verdict.
# name: (AIPerf metric, statistic, higher is better). Latencies at the median and p90; the
# tail of a throughput is its low end, so per-user throughput at the median and p10.
METRICS = {
    "ttft_p50_ms": ("time_to_first_token", "p50", False),
    "ttft_p90_ms": ("time_to_first_token", "p90", False),
    "itl_p50_ms": ("inter_token_latency", "p50", False),
    "itl_p90_ms": ("inter_token_latency", "p90", False),
    "output_tps": ("output_token_throughput", "avg", True),
    "output_tps_per_user_p50": ("output_token_throughput_per_user", "p50", True),
    "output_tps_per_user_p10": ("output_token_throughput_per_user", "p10", True),
}


class AIPerfError(Exception):
    pass


class ServerError(Exception):
    """The server did not come up, or went away; the message names why and ends in its log."""


@dataclass
class PatternRun:
    pattern: str
    metrics: dict[str, float]
    errors: int  # requests that failed
    out_dir: Path


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]  # the reference's alternatives per token; empty for a candidate


@dataclass
class Reference:
    """The reference server's prompts and greedy answers. A pool host never holds the answers: it
    asks the controller to judge (harness/serve/remote.py)."""

    prompts: list[list[int]]
    completions: list[Completion]



@dataclass
class Served:
    """One server's evaluation: the verdict and, per pattern it finished, AIPerf's metrics."""

    verdict: Verdict
    runs: dict[str, PatternRun] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def compare(result: Served, baseline: dict[str, PatternRun], margin: float, metrics: dict | None = None) -> None:
    """The all-metrics gate: on every pattern, every metric at least `margin` better than the
    baseline's. A metric missing, or not above zero, on either side fails it: a latency of 0 (all
    tokens in one read) or a throughput of 0 is no measurement to beat. Adds per pattern
    `<pattern>/<metric>`, `baseline_<metric>`, `vs_baseline_<metric>` (>1: better; only where both
    are measured), and `score` (their geometric mean) and `worst_vs_baseline` to result.metrics.
    `metrics`: the names compared and their direction (default METRICS, the text stage's)."""
    metrics = METRICS if metrics is None else metrics
    short, ratios = [], []
    for pattern, run in result.runs.items():
        for name, (_, _, higher) in metrics.items():
            c, b = run.metrics.get(name), baseline[pattern].metrics.get(name)
            if c is None or b is None:
                short.append(f"{pattern}/{name} (not measured)")
                continue
            result.metrics |= {f"{pattern}/{name}": c, f"{pattern}/baseline_{name}": b}
            if not (0 < c < math.inf and 0 < b < math.inf):
                short.append(f"{pattern}/{name} {c:.4g} vs baseline {b:.4g} (not a measurement: each must be "
                             "above 0)")
                continue
            ratio = c / b if higher else b / c
            result.metrics[f"{pattern}/vs_baseline_{name}"] = ratio
            ratios.append(ratio)
            needed = b * (1 + margin) if higher else b * (1 - margin)
            if (c < needed) if higher else (c > needed):
                short.append(f"{pattern}/{name} {c:.4g} vs baseline {b:.4g} (needs {'≥' if higher else '≤'} {needed:.4g})")
    if ratios:
        result.metrics["score"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        result.metrics["worst_vs_baseline"] = min(ratios)
    total = len(result.runs) * len(metrics)
    detail = (f"every one of {total} metrics beats the baseline by {margin:.0%}" if not short else
              f"{len(short)} of {total} metrics short of the baseline by {margin:.0%}: " + "; ".join(short))
    result.verdict.gate("all_metrics", not short, detail)
