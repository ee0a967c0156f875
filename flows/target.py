"""The target: what to optimize for. Flow parameters are these models, so the Prefect UI
renders them as a form and a bad value is refused before anything runs."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from engine_templates.models import PRESETS, ModelDims
from harness.job import Rules

GPUClass = Literal["any", "cpu", "h100", "h200", "b200"]
DType = Literal["bf16", "fp16", "fp32"]

# Relative error ||out - ref|| / ||ref|| allowed per output dtype: a few ulps of the
# format after a reduction, well under what a wrong kernel produces (~1).
DEFAULT_RTOL = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4}


class Workload(BaseModel):
    """The shapes that matter: decode batch sizes, prefill token counts, attention contexts."""

    model_config = ConfigDict(extra="forbid")
    decode_batches: list[PositiveInt] = Field(default=[1, 8, 32, 128], min_length=1)
    prefill_tokens: list[PositiveInt] = Field(default=[2048, 16384])
    contexts: list[PositiveInt] = Field(default=[4096, 32768], min_length=1)


def is_tiny(model: str) -> bool:
    return model.startswith("tiny")


TINY_WORKLOAD = Workload(decode_batches=[1, 4], prefill_tokens=[40], contexts=[48])


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidates: PositiveInt = Field(16, description="candidates to evaluate in this run")
    wall_clock_s: PositiveFloat = Field(3600.0, description="stop proposing after this long")
    plateau: PositiveInt = Field(
        24, description="stop after this many candidates in a row without a 1% better score")
    stage_timeout_s: PositiveFloat = Field(600.0, description="time limit of one stage of one candidate")


class Target(BaseModel):
    """A model preset, a precision, the shapes of its traffic, where to run, what to beat."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field("qwen3-8b", description=f"model preset: {', '.join(PRESETS)}")
    dtype: DType = "bf16"
    workload: Workload = Field(default_factory=Workload)
    gpu_class: GPUClass = "any"
    rtol: PositiveFloat | None = Field(None, description="relative-error tolerance; default per dtype")
    seeds: PositiveInt = Field(3, description="fresh random input sets per shape in the check stage")
    budget: Budget = Field(default_factory=Budget)

    @model_validator(mode="before")
    @classmethod
    def _tiny_workload(cls, data):
        # The tiny presets run under the CPU interpreter: their default workload is tiny too.
        if isinstance(data, dict) and is_tiny(data.get("model", "")) and "workload" not in data:
            data = {**data, "workload": TINY_WORKLOAD.model_dump()}
        return data

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown model preset {v!r}; known: {', '.join(PRESETS)}")
        return v

    @property
    def dims(self) -> ModelDims:
        return PRESETS[self.model]

    @property
    def tolerance(self) -> float:
        return self.rtol if self.rtol is not None else DEFAULT_RTOL[self.dtype]

    def rules(self, on_gpu: bool) -> Rules:
        return Rules(dtype=self.dtype, rtol=self.tolerance, seeds=self.seeds, compile_baseline=on_gpu)

    def key(self) -> str:
        """What makes two runs comparable: same model, dtype and shapes."""
        w = self.workload
        return (f"{self.model}/{self.dtype}/d{'-'.join(map(str, w.decode_batches))}"
                f"/p{'-'.join(map(str, w.prefill_tokens))}/c{'-'.join(map(str, w.contexts))}")
