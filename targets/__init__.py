"""The target: what to optimize for. Flow parameters are these models, so the Prefect UI
renders them as a form and a bad value is refused before anything runs."""
from __future__ import annotations

import random
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from contract.job import Rules, Shape
from contract.serve import AccuracyRules, Pattern
from engine_templates.models import ModelDims
from engine_templates.vision import Sam3Dims, target_dims
from targets.held_out import held_out_shapes
from targets.model import ALL_PRESETS, ModelName, is_tiny

if TYPE_CHECKING:  # the ops import torch, which a controller that only reads a target need not
    from engine_templates.ops.base import Op

# The GPU classes a pool file's host may have.
GPUClassName = Literal["cpu", "h100", "h200", "b200", "a100", "l40s", "other"]
GPUClass = Literal["any", GPUClassName]  # "any", or a class a pool file's host may have
# fp8: FP8 (e4m3) weights for the linear layers and experts, bf16 activations, judged against the
# bf16 model: end to end, and for the ops with an fp8 target (engine_templates.ops.FP8_OPS)
DType = Literal["bf16", "fp16", "fp32", "fp8"]

# Relative error ||out - ref|| / ||ref|| allowed per output dtype: a few ulps of the
# format after a reduction, well under what a wrong kernel produces (~1). fp8 is an fp8 op
# target against the bf16 weights' float64 result: e4m3 keeps 3 mantissa bits, and the honest
# dequantize-then-multiply lands up to 0.030 from it for linear (every input distribution, tiny to
# qwen3-8b shapes; 0.041 with the activations rounded to e4m3 too) and up to 0.076 for fused_moe
# (three products and a gate: tiny-moe, 12 seeds); a scale off by 2x, or used as a divisor, lands
# near 1 or far above (docs/targets.md#fp8-op-targets).
DEFAULT_RTOL = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4, "fp8": 0.15}


class Workload(BaseModel):
    """The shapes that matter: decode batch sizes, prefill token counts, attention contexts; for a
    vision model, images per batch."""

    model_config = ConfigDict(extra="forbid")
    decode_batches: list[PositiveInt] = Field(default=[1, 8, 32, 128], min_length=1)
    prefill_tokens: list[PositiveInt] = Field(default=[2048, 16384])
    contexts: list[PositiveInt] = Field(default=[4096, 32768], min_length=1)
    images: list[PositiveInt] = Field(default=[1, 8], min_length=1,
                                      description="images per batch (a vision model's only axis)")


TINY_WORKLOAD = Workload(decode_batches=[1, 4], prefill_tokens=[40], contexts=[48], images=[1, 2])


class HeldOut(BaseModel):
    """Shapes no proposer sees (targets/held_out.py): every candidate is checked and timed on them
    (its score is the shown shapes' alone), so that a kernel tuned to the shown shapes alone shows
    as such."""

    model_config = ConfigDict(extra="forbid")
    per_list: NonNegativeInt = Field(1, description="odd sizes drawn from each workload list's range (decode "
                                                    "batches, prefill tokens, contexts); 0: none held out")
    timed: NonNegativeInt = Field(3, description="best passed candidates of an optimization printed with their "
                                                 "held-out speed-up at its end")
    seed: int | None = Field(None, description="draw from this seed, the same shapes each run; default: "
                                               "drawn afresh for every run")


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidates: PositiveInt = Field(16, description="candidates to evaluate in this run")
    wall_clock_s: PositiveFloat = Field(3600.0, description="stop proposing after this long")
    plateau: PositiveInt = Field(
        24, description="stop after this many candidates in a row without a 1% better score")
    stage_timeout_s: PositiveFloat = Field(600.0, description="time limit of any one stage of one candidate: the "
                                           "microbench's, and the most the others get")
    compile_timeout_s: PositiveFloat = Field(
        120.0, description="the compile stage's limit (when under stage_timeout_s): a hang stops here")
    check_timeout_s: PositiveFloat = Field(
        180.0, description="the check stage's limit (when under stage_timeout_s): a hang stops here")
    max_tokens_total: PositiveInt | None = Field(
        None, description="stop before the proposer's tokens (input, cached input, output) would pass this")
    max_usd: PositiveFloat | None = Field(
        None, description="stop before the dollars spent (proposer tokens and GPU time) would pass this")
    max_gpu_hours: PositiveFloat | None = Field(
        None, description="stop before the GPU-hours held (the candidates' running ones counted) would pass this")

    def stage_limit(self, stage: str) -> float:
        """Seconds the stage may run: its kind's own limit, at most stage_timeout_s."""
        own = {"compile": self.compile_timeout_s, "check": self.check_timeout_s}.get(stage, self.stage_timeout_s)
        return min(own, self.stage_timeout_s)


class TrafficPattern(BaseModel):
    """One AIPerf workload the end-to-end stage loads every server with."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="names the pattern's metrics: <name>/<metric>")
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: PositiveInt | None = Field(1, description="requests kept in flight (or set request_rate)")
    request_rate: PositiveFloat | None = Field(None, description="requests per second, Poisson arrivals")
    input_tokens_mean: PositiveInt = 128
    input_tokens_stddev: NonNegativeInt = 0
    output_tokens_mean: PositiveInt = 128
    output_tokens_stddev: NonNegativeInt = 0
    dataset: str = Field("synthetic", description='"synthetic" (AIPerf\'s prompts of the lengths above), '
                         '"structured" (repetitive CSV and JSON records), or a JSONL file of {"text": ...} lines')
    request_count: PositiveInt | None = Field(32, description="requests measured (or set duration_s)")
    duration_s: PositiveFloat | None = None
    warmup_requests: NonNegativeInt = Field(2, description="requests sent first and not measured")

    @model_validator(mode="after")
    def _one_of_each(self) -> TrafficPattern:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError(f"pattern {self.name}: set exactly one of concurrency and request_rate")
        if (self.request_count is None) == (self.duration_s is None):
            raise ValueError(f"pattern {self.name}: set exactly one of request_count and duration_s")
        if self.dataset not in ("synthetic", "structured") and not Path(self.dataset).is_file():
            raise ValueError(f"pattern {self.name}: dataset {self.dataset!r} is not synthetic, structured or a file")
        return self

    def to_job(self) -> Pattern:
        return Pattern(**self.model_dump())


# The production questions: one user chatting, one user with a long document, a busy server,
# and text whose tokens repeat (records, logs, code).
DEFAULT_TRAFFIC = [
    TrafficPattern(name="chat-short", concurrency=1, input_tokens_mean=128, output_tokens_mean=128, request_count=32),
    TrafficPattern(name="long-prompt", endpoint="completions", concurrency=1, input_tokens_mean=3072,
                   output_tokens_mean=128, request_count=16),
    TrafficPattern(name="concurrency-32", concurrency=32, input_tokens_mean=512, input_tokens_stddev=128,
                   output_tokens_mean=256, request_count=256, warmup_requests=32),
    TrafficPattern(name="structured", dataset="structured", concurrency=1, input_tokens_mean=512,
                   output_tokens_mean=256, request_count=32),
]
# The same four questions at the tiny checkpoints' scale (a 512-token context, a CPU).
TINY_TRAFFIC = [
    TrafficPattern(name="chat-short", concurrency=1, input_tokens_mean=32, output_tokens_mean=16, request_count=8),
    TrafficPattern(name="long-prompt", endpoint="completions", concurrency=1, input_tokens_mean=320,
                   output_tokens_mean=16, request_count=4),
    TrafficPattern(name="concurrency-32", concurrency=32, input_tokens_mean=64, output_tokens_mean=16,
                   request_count=64, warmup_requests=4),
    TrafficPattern(name="structured", dataset="structured", concurrency=1, input_tokens_mean=96,
                   output_tokens_mean=16, request_count=8),
]
# Per dtype, in nats: well above what a correct engine shows against transformers (README:
# ~3e-6 in fp32, under 0.1 in bf16), far below a wrong token's. fp8 is FP8 weights against the
# bf16 model: e4m3 keeps 3 mantissa bits, so a weight moves by up to 1/16 of itself and a
# log-probability by a few tenths of a nat (docs/engine-fp8-speculative.md), still well below
# what a wrong scale or a wrong token costs.
DEFAULT_LOGPROB_ATOL = {"bf16": 0.1, "fp16": 0.05, "fp32": 1e-3, "fp8": 0.5}
SHOWN_PROMPTS = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog.",
                 "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols: + - * / =",
                 "A small engine serves a model, one token at a time."]


class Accuracy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[str] = Field(default_factory=lambda: list(SHOWN_PROMPTS), description="shown prompts")
    held_out: NonNegativeInt = Field(4, description="random token-id prompts drawn per run, never logged")
    held_out_tokens: PositiveInt = 32
    max_tokens: PositiveInt = Field(32, description="greedy tokens compared per prompt")
    logprob_atol: PositiveFloat | None = Field(None, description="nats; default per dtype")
    tie_nats: PositiveFloat | None = Field(None, description="a different greedy token passes only where the "
                                                               "reference's two candidates are this close; default logprob_atol")
    under_load: NonNegativeInt = Field(3, description="accuracy prompts sent during each traffic pattern's load "
                                       "and judged alike: a fresh held-out one drawn for the pattern, the others of "
                                       "those asked before load; 0: none")


class Serving(BaseModel):
    """The end-to-end stage: traffic, accuracy, what to beat and by how much."""

    model_config = ConfigDict(extra="forbid")
    traffic: list[TrafficPattern] = Field(default_factory=lambda: list(DEFAULT_TRAFFIC), min_length=1)
    accuracy: Accuracy = Field(default_factory=Accuracy)
    margin: NonNegativeFloat = Field(0.02, description="every metric must beat the baseline's by this fraction")
    baseline: str = Field("reference", description='"reference" (the HF transformers reference server), '
                          '"vllm" or "sglang" (that engine\'s OpenAI-compatible server, with the target\'s dtype '
                          'and max_model_len), or a command starting an OpenAI-compatible server, with {port}, '
                          '{model_dir}, {name}, {replica}')
    max_model_len: PositiveInt = 4096
    start_timeout_s: PositiveFloat = Field(600.0, description="seconds a server may take to answer /v1/models")
    ready_path: str = Field("/v1/models", pattern=r"^/", description="the path a candidate server (and a baseline "
                            "command's) answers 200 on once it is ready, e.g. /health")
    replicas: PositiveInt = Field(1, description="copies of the candidate server, and of the baseline, each on its "
                                  "own GPU of one host, behind one load balancer")
    reference_model_dir: str | None = Field(None, description="the checkpoint the reference server loads, when not "
                                            "the served one: an FP8 checkpoint's bf16 original (the oracle is "
                                            "never quantized)")

    @field_validator("traffic")
    @classmethod
    def _unique(cls, v: list[TrafficPattern]) -> list[TrafficPattern]:
        names = [p.name for p in v]
        if len(set(names)) != len(names):
            raise ValueError(f"traffic pattern names repeat: {names}")
        return v


TINY_SERVING = Serving(traffic=TINY_TRAFFIC, max_model_len=512,
                       accuracy=Accuracy(held_out_tokens=16, max_tokens=8))


class Target(BaseModel):
    """A model (a preset, or a model's own config.json), a precision, the shapes of its traffic,
    where to run, what to beat."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName = "qwen3-8b"
    architecture: str | None = Field(None, description="the model's architecture (HF model_type); set from the "
                                     "model, recorded with each run")
    config_sha256: str | None = Field(None, description="sha256 of the model's config.json contents; set from "
                                      "the config (none for a preset), recorded with each run")
    dtype: DType = "bf16"
    workload: Workload = Field(default_factory=Workload)
    gpu_class: GPUClass = "any"
    rtol: PositiveFloat | None = Field(None, description="relative-error tolerance; default per dtype")
    approval_rtol: PositiveFloat | None = Field(
        None, description="a looser tolerance: a candidate over rtol but within it waits for a person's approval "
                          "in the Prefect UI (unset: it fails)")
    approval_timeout_s: PositiveFloat = Field(86400.0, description="seconds a candidate waits for approval "
                                                                   "before it is rejected")
    seeds: PositiveInt = Field(3, description="fresh random input sets per shape in the check stage")
    budget: Budget = Field(default_factory=Budget)
    held_out: HeldOut = Field(default_factory=HeldOut)
    serving: Serving = Field(default_factory=Serving)

    @model_validator(mode="before")
    @classmethod
    def _tiny_workload(cls, data):
        # The tiny presets run under the CPU interpreter: their default workload is tiny too.
        if isinstance(data, dict) and is_tiny(data.get("model", "")):
            data = {"workload": TINY_WORKLOAD.model_dump(), "serving": TINY_SERVING.model_dump(), **data}
        return data

    @model_validator(mode="after")
    def _approval_looser(self) -> Target:
        tolerance = self.tolerance
        if self.approval_rtol is not None and self.approval_rtol <= tolerance:
            raise ValueError(f"approval_rtol {self.approval_rtol:g} must be looser than the tolerance "
                             f"{tolerance:g}, not tighter")
        return self

    @model_validator(mode="after")
    def _model_record(self) -> Target:
        # Read afresh from the model, whatever a form or an old target.json said.
        dims = self.dims
        self.__dict__.update(architecture=dims.arch, config_sha256=dims.config_sha256 or None)
        return self

    @property
    def dims(self) -> ModelDims | Sam3Dims:
        """The preset's, or the config's as it is now."""
        return target_dims(self.model)

    @property
    def modality(self) -> str:
        """"vision" for a vision model (engine_templates/vision.py), else "text": the ops' kind it takes."""
        return "vision" if isinstance(self.dims, Sam3Dims) else "text"

    @property
    def shape_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The workload as an op's `shapes` takes it: a vision op's batch list is images per batch."""
        w = self.workload
        if self.modality == "vision":
            return list(w.images), [], []
        return list(w.decode_batches), list(w.prefill_tokens), list(w.contexts)

    def op_shapes(self, op: Op) -> list[Shape]:
        """The op's shapes on this target; ValueError (one line) for an op of the other modality or
        one the model cannot take."""
        if op.modality != self.modality:
            raise ValueError(f"{op.name} is a {op.modality} op and {self.model} a {self.modality} model "
                             f"(--model {'sam3, sam3-tiny or a SAM 3 config' if op.modality == 'vision' else 'a text preset or config'})")
        return op.shapes(self.dims, *self.shape_lists)

    @property
    def model_key(self) -> str:
        """The model as keys compare it: a preset's name, or a config's architecture and digest
        (two paths to one config are one model; an edited config is another)."""
        return self.model if self.model in ALL_PRESETS else f"{self.architecture}-{self.config_sha256[:12]}"

    @property
    def tolerance(self) -> float:
        return self.rtol if self.rtol is not None else DEFAULT_RTOL[self.dtype]

    @property
    def activation_dtype(self) -> str:
        """What the engine computes in: bf16 for an fp8 target (its weights are FP8)."""
        return "bf16" if self.dtype == "fp8" else self.dtype

    def rules(self, on_gpu: bool) -> Rules:
        return Rules(dtype=self.dtype, rtol=self.tolerance, approval_rtol=self.approval_rtol, seeds=self.seeds,
                     compile_baseline=on_gpu)

    def held_out_shapes(self, op: Op) -> list[Shape]:
        """One run's held-out shapes of `op` (targets/held_out.py): from `held_out.seed`, else drawn afresh."""
        seed = self.held_out.seed if self.held_out.seed is not None else secrets.randbits(64)
        return held_out_shapes(op, self.dims, *self.shape_lists, self.held_out.per_list, random.Random(seed))

    def key(self) -> str:
        """What makes two runs comparable: same model, dtype and shapes."""
        w = self.workload
        if self.modality == "vision":
            return f"{self.model_key}/{self.dtype}/i{'-'.join(map(str, w.images))}"
        return (f"{self.model_key}/{self.dtype}/d{'-'.join(map(str, w.decode_batches))}"
                f"/p{'-'.join(map(str, w.prefill_tokens))}/c{'-'.join(map(str, w.contexts))}")

    def serve_key(self) -> str:
        """What makes two end-to-end runs comparable: model, dtype, traffic, baseline, margin."""
        import hashlib

        # replicas, the reference's directory and the prompts sent under load only when set: the
        # keys of runs from before those fields existed stay the same. Prompts under load are part
        # of the load both sides serve, so they count when sent.
        unset: dict = {"start_timeout_s": True, "ready_path": True}
        unset |= {"replicas": True} if self.serving.replicas == 1 else {}
        unset |= {"reference_model_dir": True} if self.serving.reference_model_dir is None else {}
        unset |= {"accuracy": {"under_load": True}} if self.serving.accuracy.under_load == 0 else {}
        body = self.serving.model_dump_json(exclude=unset)
        return f"{self.model_key}/{self.dtype}/serve-{hashlib.sha256(body.encode()).hexdigest()[:10]}"

    def accuracy_rules(self) -> AccuracyRules:
        a = self.serving.accuracy
        atol = a.logprob_atol or DEFAULT_LOGPROB_ATOL[self.dtype]
        return AccuracyRules(tuple(a.prompts), a.held_out, a.held_out_tokens, a.max_tokens, atol, a.tie_nats or atol,
                             a.under_load)
