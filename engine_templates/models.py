"""Model presets: the dimensions of public configs that op shapes are drawn from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    intermediate: int  # dense MLP width, or the per-expert width for MoE models
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    experts_per_token: int = 0
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


# From each model's public config.json (HuggingFace Qwen/<name>).
PRESETS: dict[str, ModelDims] = {
    m.name: m
    for m in (
        ModelDims("qwen3-0.6b", hidden=1024, intermediate=3072, layers=28, heads=16,
                  kv_heads=8, head_dim=128, vocab=151936, tie_embeddings=True),
        ModelDims("qwen3-1.7b", hidden=2048, intermediate=6144, layers=28, heads=16,
                  kv_heads=8, head_dim=128, vocab=151936, tie_embeddings=True),
        ModelDims("qwen3-8b", hidden=4096, intermediate=12288, layers=36, heads=32,
                  kv_heads=8, head_dim=128, vocab=151936),
        ModelDims("qwen3-30b-a3b", hidden=2048, intermediate=768, layers=48, heads=32,
                  kv_heads=4, head_dim=128, vocab=151936, experts=128, experts_per_token=8),
        # Small enough for the Triton interpreter on a CPU; odd sizes on purpose.
        ModelDims("tiny", hidden=96, intermediate=160, layers=2, heads=4,
                  kv_heads=2, head_dim=16, vocab=512),
        ModelDims("tiny-moe", hidden=96, intermediate=40, layers=2, heads=4,
                  kv_heads=2, head_dim=16, vocab=512, experts=8, experts_per_token=2),
    )
}
