"""Model presets: the dimensions of public configs that op shapes are drawn from, and what else
of an architecture the engine builds from (engine_templates/hf_config.py reads the same from a
model's own config.json)."""
from __future__ import annotations

from dataclasses import dataclass

# The HF model_type of each architecture the engine builds, with transformers' class for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
QK_NORM = ("qwen3", "qwen3_moe")  # per-head RMSNorm of q and k before RoPE


@dataclass(frozen=True)
class Llama3Rope:
    """rope_scaling of type llama3: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between (transformers' _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


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
    arch: str = "qwen3"  # HF model_type, a key of ARCHITECTURES
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    rope_scaling: Llama3Rope | None = None
    # attention to the last this-many positions only (Mistral's sliding_window); None: all
    sliding_window: int | None = None
    max_positions: int = 40960
    config_sha256: str = ""  # of a config.json's parsed contents; "" for a preset

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def qk_norm(self) -> bool:
        return self.arch in QK_NORM


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
                  kv_heads=4, head_dim=128, vocab=151936, experts=128, experts_per_token=8, arch="qwen3_moe"),
        # The other architectures at their public models' shapes (meta-llama/Llama-3.1-8B,
        # mistralai/Mistral-7B-v0.3, Qwen/Qwen2.5-7B, mistralai/Mixtral-8x7B-v0.1).
        ModelDims("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=128256, rms_eps=1e-5, rope_theta=500000.0, arch="llama",
                  rope_scaling=Llama3Rope(8.0, 1.0, 4.0, 8192), max_positions=131072),
        ModelDims("mistral-7b-v0.3", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=32768, rms_eps=1e-5, arch="mistral", max_positions=32768),
        # mistralai/Mistral-7B-v0.1: attention to the last 4096 positions (the *_swa ops)
        ModelDims("mistral-7b-v0.1", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=32000, rms_eps=1e-5, rope_theta=10000.0, arch="mistral",
                  sliding_window=4096, max_positions=32768),
        ModelDims("qwen2.5-7b", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                  head_dim=128, vocab=152064, arch="qwen2", qkv_bias=True, max_positions=131072),
        ModelDims("mixtral-8x7b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=32000, experts=8, experts_per_token=2, rms_eps=1e-5, arch="mixtral",
                  max_positions=32768),
        # Small enough for the Triton interpreter on a CPU; odd sizes on purpose.
        ModelDims("tiny", hidden=96, intermediate=160, layers=2, heads=4,
                  kv_heads=2, head_dim=16, vocab=512),
        ModelDims("tiny-moe", hidden=96, intermediate=40, layers=2, heads=4,
                  kv_heads=2, head_dim=16, vocab=512, experts=8, experts_per_token=2, arch="qwen3_moe"),
        # a window shorter than the tiny workload's prefills and contexts (targets.TINY_WORKLOAD)
        ModelDims("tiny-swa", hidden=96, intermediate=160, layers=2, heads=4, kv_heads=2, head_dim=16,
                  vocab=512, arch="mistral", sliding_window=19),
    )
}
