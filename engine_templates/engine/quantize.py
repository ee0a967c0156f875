"""`engine quantize SRC DST`: a bf16 Qwen3 / Qwen3-MoE checkpoint to an FP8 (e4m3) one, in the
layout of Qwen's own FP8 releases, which the loader reads (and so do other engines):

- every attention and MLP projection, and every expert's gate/up/down, as e4m3 `<name>` with its
  float32 scales `<name>_scale_inv` (the multiplier: weight = q * scale), one per block of
  --block x --block elements (default 128, as Qwen's) or, with --block 0, per output channel;
  experts stored fused (transformers 5) are written one per expert, as Qwen's releases have them;
- embeddings, the LM head, norms and the MoE router unchanged;
- config.json with quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
  "dynamic", "weight_block_size": [b, b]} (null for per-channel), every other top-level file
  (tokenizer, generation config, chat template) copied.

One shard at a time: the host holds at most one shard and its quantized copy.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from engine_templates.engine.config import EngineSetupError, ModelConfig, pick_device
from engine_templates.engine.loader import SCALE_SUFFIX, checkpoint_entries, shard_files
from engine_templates.engine.random_checkpoint import human_size

# The matrices: attention's, a dense MLP's, and every expert's (Mixtral's named w1, w3, w2).
QUANTIZED = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj"
                       r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight")
INDEX = "model.safetensors.index.json"


def quantize_checkpoint(src: Path, dst: Path, block: int = 128, device: str | None = None,
                        force: bool = False, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Writes the FP8 checkpoint; returns its summary (matrices, bytes before and after, seconds,
    path). A bad request is a one-line EngineSetupError, raised before anything is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine_templates.engine.fp8 import quantize

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_dir(src)
    if cfg.fp8 is not None:
        raise EngineSetupError(f"{src} is already an FP8 checkpoint (config.json has a quantization_config)")
    if block < 0:
        raise EngineSetupError(f"--block must be at least 0 (0: one scale per output channel), not {block}")
    shards = shard_files(src)
    if dst.exists() and not dst.is_dir():
        raise EngineSetupError(f"{dst} exists and is not a directory")
    if dst.resolve() == src.resolve():
        raise EngineSetupError("the FP8 checkpoint must go to another directory than its source")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise EngineSetupError(f"{dst} is not empty (--force writes over its checkpoint)")
    device = pick_device(device)
    dst.mkdir(parents=True, exist_ok=True)
    for old in list(dst.glob("*.safetensors")) + list(dst.glob(INDEX)):
        old.unlink()  # a stale shard of another model would be read with the new ones
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", INDEX):
            shutil.copy2(f, dst / f.name)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block] if block else None}
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")

    weight_map: dict[str, str] = {}
    matrices, before, after = 0, 0, 0
    for file in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                tensor = shard.get_tensor(name)
                before += tensor.numel() * tensor.element_size()
                for key, part in checkpoint_entries(name, tensor, cfg.moe_intermediate, cfg.model_type):
                    if QUANTIZED.fullmatch(key) and part.dim() == 2:
                        w = quantize(part.to(device), (block, block) if block else (1, part.shape[1]))
                        out[key], out[key + SCALE_SUFFIX] = w.q.cpu(), w.scale.cpu()
                        matrices += 1
                    else:
                        out[key] = part.contiguous()
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        after += sum(t.numel() * t.element_size() for t in out.values())
        weight_map |= {key: file.name for key in out}
        log(f"[{time.perf_counter() - start:6.1f}s] {file.name}: {len(out)} tensors, {human_size(after)} so far")
    if len(shards) > 1 or (src / INDEX).is_file():
        index = {"metadata": {"total_size": after}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return {"matrices": matrices, "bytes_before": before, "bytes_after": after,
            "seconds": time.perf_counter() - start, "path": str(dst)}
