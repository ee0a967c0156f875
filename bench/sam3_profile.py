"""Where an image's time goes in the SAM 3 reference (transformers' Sam3Model, random weights at a
vision preset's shape, float32 unless --dtype): torch.profiler over one forward pass of `--images`
images and a text prompt, then the time by operator and by the model's parts (backbone attention,
MLP, norms; neck, DETR, mask decoder, text encoder). It names the ops worth a kernel; the op
tables themselves come from `bench/gpu_bench.sh` with MODELS=sam3.

    python3 bench/sam3_profile.py --preset sam3-tiny            # a CPU: seconds
    python3 bench/sam3_profile.py --preset sam3 --device cuda --dtype bf16
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine_templates.vision import SAM3_PRESETS, sam3_hf_config

PARTS = {"vision_encoder.backbone": "backbone", "vision_encoder.neck": "neck", "text_encoder": "text encoder",
         "detr_encoder": "DETR encoder", "detr_decoder": "DETR decoder", "mask_decoder": "mask decoder",
         "geometry_encoder": "geometry encoder"}
LAYER_PARTS = ("attention", "mlp", "layer_norm1", "layer_norm2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="sam3-tiny", choices=list(SAM3_PRESETS))
    p.add_argument("--images", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--rows", type=int, default=15, help="operators listed")
    a = p.parse_args()
    from transformers import Sam3Model

    dims = SAM3_PRESETS[a.preset]
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(a.device):
        model = Sam3Model(sam3_hf_config(a.preset)).to(dtype).eval()
    pixels = torch.randn(a.images, 3, dims.image_size, dims.image_size, device=a.device, dtype=dtype)
    ids = torch.randint(0, 49000, (a.images, 8), device=a.device)
    with torch.no_grad():
        model(pixel_values=pixels, input_ids=ids)  # warm-up
        spans: dict[str, float] = defaultdict(float)
        hooks = []
        for name, module in model.named_modules():
            leaf = name.split(".")[-1]
            part = next((v for k, v in PARTS.items() if name == k), None)
            if part or (".layers." in name and "backbone" in name and leaf in LAYER_PARTS):
                label = part or f"backbone {leaf}"
                hooks.append(module.register_forward_pre_hook(lambda m, i, label=label: _start(m, label)))
                hooks.append(module.register_forward_hook(lambda m, i, o, spans=spans: _stop(m, spans, a.device)))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        with profile(activities=activities) as prof, record_function("forward"):
            start = time.perf_counter()
            model(pixel_values=pixels, input_ids=ids)
            _sync(a.device)
            total = time.perf_counter() - start
    for h in hooks:
        h.remove()
    print(f"{a.preset}, {a.images} image(s) of {dims.image_size}px on {a.device} in {a.dtype}: {total * 1e3:.1f} ms")
    print("by part (wall clock, nested parts inside the backbone's):")
    for label, s in sorted(spans.items(), key=lambda kv: -kv[1]):
        print(f"  {label:22s} {s * 1e3:9.1f} ms  {100 * s / total:5.1f}%")
    key = "self_cuda_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows))


_open: dict[int, tuple[str, float]] = {}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _start(module, label: str) -> None:
    _open[id(module)] = (label, time.perf_counter())


def _stop(module, spans: dict[str, float], device: str) -> None:
    _sync(device)
    label, t0 = _open.pop(id(module))
    spans[label] += time.perf_counter() - t0


if __name__ == "__main__":
    main()
