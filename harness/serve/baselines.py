"""Baselines named by engine: `vllm` and `sglang` (serving.baseline, --baseline) stand for that
engine's OpenAI-compatible server on the job's checkpoint, started by the job's python
(`python -m <its server module>`), so the interpreter asked whether it has the engine is the one
that runs it. Each is started on loopback with the target's dtype and context length, and the
model id AIPerf sends; an FP8 target's with FP8 weights (`--quantization fp8`).

Whether the engine is there is asked where the baseline will run, before anything starts:
`python -m harness.serve check DIR --baseline NAME` (this machine's python, or a pool host's)."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

from contract.serve import BASELINE_ENGINES, ServeJob

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the names both engines take


def _fp8(job: ServeJob) -> list[str]:
    """An FP8 job: both engines quantize a bf16 checkpoint's weights to FP8 at load (and serve an
    FP8 checkpoint as it is)."""
    return ["--quantization", "fp8"] if job.dtype == "fp8" else []


def _vllm(job: ServeJob, port: int, name: str) -> list[str]:
    return [job.python, "-m", "vllm.entrypoints.cli.main", "serve", str(job.model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, "--dtype", DTYPES[job.activation_dtype],
            "--max-model-len", str(job.max_model_len), *_fp8(job)]


def _sglang(job: ServeJob, port: int, name: str) -> list[str]:
    return [job.python, "-m", "sglang.launch_server", "--model-path", str(job.model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, "--dtype", DTYPES[job.activation_dtype],
            "--context-length", str(job.max_model_len), *_fp8(job)]


@dataclass(frozen=True)
class Engine:
    package: str  # what the job's python must be able to import
    module: str  # what it runs, for the messages
    argv: Callable[[ServeJob, int, str], list[str]]  # (job, port, served model name)


ENGINES = {"vllm": Engine("vllm", "vllm.entrypoints.cli.main serve", _vllm),
           "sglang": Engine("sglang", "sglang.launch_server", _sglang)}
assert tuple(ENGINES) == BASELINE_ENGINES, "contract.serve.BASELINE_ENGINES names the engines started here"


def missing(name: str) -> str | None:
    """Why this interpreter cannot run the baseline engine `name`, as one line; None when it can."""
    engine = ENGINES[name]
    if importlib.util.find_spec(engine.package) is not None:
        return None
    return (f"{sys.executable} cannot import {engine.package}, which the baseline {name!r} needs "
            f"(python -m {engine.module}); install {engine.package} into that environment or name another baseline")
