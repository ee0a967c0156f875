"""What both SAM 3 servers do around the model, so that a comparison of their answers is one
of the models alone: the image decoded and checked, resized and normalized as SAM 3's processor
does (bilinear to the model's square input, [0, 1], mean 0.5, std 0.5), text prompts tokenized
and padded as its processor does (32 tokens), and the outputs made into the reply: scores
(sigmoid(logit) x sigmoid(presence)), boxes in the image's pixels, masks bilinear-upsampled to
the image's size and cut at logit 0, run-length encoded.

transformers' Sam3ImageProcessor needs torchvision, which the hosts do not carry; these steps are
its steps written with PIL and torch."""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_templates.sam3_engine.config import CONTEXT_LENGTH

MAX_PIXELS = 4096 * 4096  # larger images are refused (400): a decoded 16-megapixel RGB image is 48 MB
MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 512
RAW_TOP = 4  # mask logits returned for this many queries (the highest scores) unless the request names them


class BadInput(ValueError):
    """A request the server answers with 400 and this message."""


def decode_image(data: str, max_pixels: int = MAX_PIXELS):
    """A base64 PNG or JPEG (any format PIL reads) -> an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str) or not data:
        raise BadInput("image must be a base64 string of a PNG or JPEG file")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput("image is not valid base64") from None
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            width, height = probe.size  # the header only: a huge image is refused before it is decoded
            if width * height > max_pixels:
                raise BadInput(f"image too large: {width}x{height} pixels; at most {max_pixels} pixels")
            return probe.convert("RGB")
    except Image.DecompressionBombError:
        raise BadInput(f"image too large: at most {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError):
        raise BadInput("image is not an image PIL can read (PNG or JPEG, base64)") from None


def check_prompts(prompts) -> list[str]:
    if not isinstance(prompts, list) or not prompts:
        raise BadInput("prompts must be a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise BadInput(f"at most {MAX_PROMPTS} prompts a request, not {len(prompts)}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise BadInput(f"prompts[{i}] is empty: every prompt must be non-empty text")
        if len(p) > MAX_PROMPT_CHARS:
            raise BadInput(f"prompts[{i}] has {len(p)} characters; at most {MAX_PROMPT_CHARS}")
    return prompts


def pixel_values(image, size: int) -> torch.Tensor:
    """(3, size, size) float32: bilinear resize, [0, 1], normalized by mean 0.5 and std 0.5."""
    from PIL import Image

    resized = image.resize((size, size), Image.Resampling.BILINEAR)
    x = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return (x.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5


class PromptTokenizer:
    """The model directory's tokenizer.json; ids truncated and padded to CONTEXT_LENGTH."""

    def __init__(self, model_dir: Path, pad_id: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.pad_id = pad_id

    def __call__(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tok.encode(text).ids[:CONTEXT_LENGTH]
        pad = CONTEXT_LENGTH - len(ids)
        return ids + [self.pad_id] * pad, [1] * len(ids) + [0] * pad


@dataclass
class PromptOutput:
    """One prompt's raw outputs on one image, on the CPU in float32: scores (Q,), boxes (Q, 4)
    xyxy in [0, 1], mask logits (Q, h, w) at the mask decoder's resolution."""
    scores: torch.Tensor
    boxes: torch.Tensor
    mask_logits: torch.Tensor


def rle(mask: torch.Tensor) -> dict:
    """Row-major run lengths of a boolean (H, W) mask, alternating out/in, starting with out."""
    flat = mask.flatten().to(torch.int8)
    change = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    edges = torch.cat([torch.tensor([0]), change, torch.tensor([flat.numel()])])
    counts = (edges[1:] - edges[:-1]).tolist()
    if flat.numel() and flat[0]:
        counts = [0] + counts
    return {"size": list(mask.shape), "counts": counts}


def reply(prompt: str, out: PromptOutput, width: int, height: int, threshold: float,
          raw: bool = False, raw_queries: list[int] | None = None) -> dict:
    keep = torch.nonzero(out.scores > threshold).flatten().tolist()
    detections = []
    if keep:
        masks = F.interpolate(out.mask_logits[keep][None], size=(height, width), mode="bilinear",
                              align_corners=False)[0] > 0
        scale = torch.tensor([width, height, width, height], dtype=torch.float32)
        for j, q in enumerate(keep):
            detections.append({"query": q, "score": float(out.scores[q]),
                               "box": [round(v, 3) for v in (out.boxes[q] * scale).tolist()], "mask": rle(masks[j])})
    answer = {"prompt": prompt, "detections": detections}
    if raw:
        queries = raw_queries if raw_queries is not None else \
            out.scores.argsort(descending=True)[:RAW_TOP].tolist()
        logits = out.mask_logits[queries].contiguous().float()
        answer["raw"] = {"scores": out.scores.tolist(), "boxes": out.boxes.tolist(), "queries": queries,
                         "mask_shape": list(logits.shape),
                         "mask_logits": base64.b64encode(logits.numpy().tobytes()).decode()}
    return answer


def check_raw_queries(value, num_queries: int) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(q, int) and 0 <= q < num_queries for q in value):
        raise BadInput(f"raw_queries must be a list of query numbers in [0, {num_queries})")
    return value
