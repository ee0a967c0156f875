"""The device's measured ceilings: copy bandwidth and matmul rate, measured once and cached.

A roofline against datasheet numbers flatters nobody in particular; against what this card
actually does, it says how much is left. The speed-of-light gate uses the same numbers.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path

import torch

CACHE_DIR = Path(os.environ.get("INFERSMITH_CACHE", Path.home() / ".cache" / "infersmith"))


def _cache_path(info: dict) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{info['name']}-torch{info['torch']}").strip("-")
    return CACHE_DIR / f"ceilings-{slug}.json"


def ceilings(device: str, info: dict) -> dict:
    """Copy bytes/s (read + written) and dense matmul FLOP/s in the op dtype's matmul (bf16 on GPU)."""
    path = _cache_path(info)
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass  # a torn cache file is re-measured below
    result = measure(device)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def measure(device: str) -> dict:
    """Measured now, not cached: for a caller that reports it beside figures of the same run."""
    return _measure_cuda() if device == "cuda" else _measure_cpu()


def _events_median_s(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _measure_cuda() -> dict:
    n_bytes = 2 << 30  # 2 GiB each way: far past L2
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_s = _events_median_s(lambda: dst.copy_(src), reps=20)
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_s = _events_median_s(lambda: a @ b, reps=10)
    return {"copy_bytes_per_s": 2 * n_bytes / copy_s, "matmul_flops_per_s": 2 * n**3 / mm_s,
            "method": "torch copy_ of 2 GiB bf16 (bytes read+written); 8192^3 bf16 matmul; event medians"}


def _measure_cpu() -> dict:
    def median_s(fn, reps):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    src = torch.rand(32 << 20)  # 128 MiB of float32
    dst = torch.empty_like(src)
    copy_s = median_s(lambda: dst.copy_(src), reps=5)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_s = median_s(lambda: a @ b, reps=5)
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / copy_s, "matmul_flops_per_s": 2 * n**3 / mm_s,
            "method": "cpu: torch copy_ of 128 MiB float32; 1024^3 float32 matmul; wall-clock medians"}
