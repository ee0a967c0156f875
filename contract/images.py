"""The image serve stage's side of the contract (SAM 3: image + text prompts -> masks, boxes,
scores): its traffic patterns, its accuracy rules, its job. Plain dataclasses, standard library."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

# name: (AIPerf metric, statistic, higher is better). One image a request, so AIPerf's requests
# per second are images per second; a request's own throughput is 1/its latency, so its p50 and
# its low tail (p10) are 1000 / the latency's p50 and p90 (parse() derives them).
IMAGE_METRICS = {
    "images_per_s": ("request_throughput", "avg", True),
    "latency_p50_ms": ("request_latency", "p50", False),
    "latency_p90_ms": ("request_latency", "p90", False),
    "images_per_s_per_request_p50": ("request_latency", "p50", True),
    "images_per_s_per_request_p10": ("request_latency", "p90", True),
}


@dataclass(frozen=True)
class ImagePattern:
    """One AIPerf workload of images: `concurrency` requests in flight, `request_count` of them
    (after `warmup_requests`), each one image of `image_size` pixels a side with
    `prompts_per_image` text prompts."""

    name: str
    concurrency: int = 1
    request_count: int = 32
    warmup_requests: int = 2
    prompts_per_image: int = 1
    image_size: int = 640


PATTERNS = (ImagePattern("single", concurrency=1), ImagePattern("c8", concurrency=8, request_count=64),
            ImagePattern("c32", concurrency=32, request_count=128),
            ImagePattern("c8_prompts4", concurrency=8, request_count=64, prompts_per_image=4))


@dataclass(frozen=True)
class ImageAccuracyRules:
    """The mask, box and score agreement a candidate must show with the full-precision reference
    on held-out images (docs/images.md#the-accuracy-gate says why each number).

    Per image, prompt and judged query: over the pixels where the reference's mask logit is
    confident (|logit| > mask_margin), the IoU of the two masks (logit > 0) is at least
    mask_iou; over the others, every logit within logit_rtol of the largest |logit| of the
    reference's mask (bf16's rounding error grows with the values rounded). Every query's
    box (xyxy, a fraction of the image's side) within box_atol, its score within score_atol."""

    prompts: tuple[str, ...] = ("a cat", "the red car", "person", "a tree")
    held_out: int = 4  # fresh images drawn for each run, never logged
    image_size: int = 96
    prompts_per_image: int = 3  # several: a kernel that mixes a batch's prompts up must show
    mask_margin: float = 2.0
    mask_iou: float = 0.99
    logit_rtol: float = 0.04
    box_atol: float = 0.02
    score_atol: float = 0.02
    judged_queries: int = 4  # the reference's best-scoring queries whose mask logits are compared


@dataclass(frozen=True)
class ImageServeJob:
    model_dir: Path
    dtype: str  # the candidate's: "bf16", "fp16", "fp32"
    device: str
    env: dict[str, str]
    patterns: tuple[ImagePattern, ...]
    accuracy: ImageAccuracyRules
    margin: float  # every metric must beat the baseline's by this fraction
    start_timeout_s: float
    pattern_timeout_s: float
    python: str
    reference_dtype: str = "fp32"  # the full-precision reference


def serving_file(path: Path) -> tuple[tuple[ImagePattern, ...], ImageAccuracyRules, float | None]:
    """A serving file of the image stage (JSON): `traffic` (a list of ImagePattern fields),
    `accuracy` (ImageAccuracyRules fields), `margin`; each left out keeps the defaults. A mistake
    is a ValueError naming it."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read serving file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict) or set(raw) - {"traffic", "accuracy", "margin"}:
        raise ValueError(f"{path}: expected an object of traffic, accuracy and margin")

    def build(cls, values, where):
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - known:
            raise ValueError(f"{path}: {where}: expected an object of {', '.join(sorted(known))}")
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        except TypeError as e:
            raise ValueError(f"{path}: {where}: {e}") from None

    traffic = raw.get("traffic")
    if traffic is not None and (not isinstance(traffic, list) or not traffic):
        raise ValueError(f"{path}: traffic: expected a non-empty list of patterns")
    patterns = tuple(build(ImagePattern, p, f"traffic[{i}]") for i, p in enumerate(traffic)) if traffic else PATTERNS
    rules = build(ImageAccuracyRules, raw.get("accuracy", {}), "accuracy")
    margin = raw.get("margin")
    if margin is not None and not isinstance(margin, (int, float)):
        raise ValueError(f"{path}: margin: expected a number")
    return patterns, rules, margin
