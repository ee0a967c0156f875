"""The engine's settings and the model's, each one validated dataclass built at the edge."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_templates.engine.fp8 import Fp8Scheme
from engine_templates.hf_config import ConfigError, parse_config
from engine_templates.models import QK_NORM, Llama3Rope, ModelDims
from engine_templates.ops.base import DTYPES  # noqa: F401  (the engine's dtypes are the ops')

QUANTIZATIONS = ("", "fp8")
MOE_PREFILL = ("torch", "triton")  # EngineConfig.moe_prefill (moe_prefill.py)


class EngineSetupError(ValueError):
    """What the engine was given cannot be used; the message is one line for a person."""


class ModelDirError(EngineSetupError):
    """A model directory that cannot be served."""


def at_least(option: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise EngineSetupError(f"{option} must be at least {low}, not {value}")


def pick_device(device: str | None) -> str:
    """`--device`: cuda (or cuda:N) or cpu, refused in one line where this machine cannot use it;
    None: cuda when available."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise EngineSetupError(f"--device: expected cuda or cpu, got {device!r}") from None
    if kind not in ("cuda", "cpu"):
        raise EngineSetupError(f"--device: expected cuda or cpu, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise EngineSetupError(f"--device {device}: CUDA is not available on this machine")
    return device


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a HuggingFace config.json of one of ARCHITECTURES."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    tie_embeddings: bool
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    fp8: Fp8Scheme | None = None  # FP8 linear layers and experts (a quantized checkpoint's, or asked for)
    qkv_bias: bool = False
    rope_scaling: Llama3Rope | None = None
    sliding_window: int | None = None

    @property
    def qk_norm(self) -> bool:
        return self.model_type in QK_NORM

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"q heads ({self.heads}) must be a multiple of kv heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, not {self.head_dim}")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(f"experts per token must be 1..{self.experts} (the experts), "
                             f"not {self.experts_per_token}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelDirError(f"no such model directory: {model_dir}")
        if not path.is_file():
            raise ModelDirError(f"not a model directory: {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelDirError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(raw, dict):
            raise ModelDirError(f"{path}: expected a JSON object")
        try:
            return cls._parse(raw, path.parent)
        except ConfigError as e:
            raise ModelDirError(f"{path}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ModelDirError(f"{path}: {e or 'inconsistent values'}") from None

    @classmethod
    def from_preset(cls, dims: ModelDims, max_positions: int | None = None) -> "ModelConfig":
        """A model of a preset's (or a parsed config's) shape: an MoE model has experts in every
        layer and renormalised top-k weights, as Qwen3-MoE's presets and Mixtral have."""
        return cls(model_type=dims.arch, hidden=dims.hidden,
                   intermediate=dims.intermediate, layers=dims.layers, heads=dims.heads,
                   kv_heads=dims.kv_heads, head_dim=dims.head_dim, vocab=dims.vocab,
                   rms_eps=dims.rms_eps, rope_theta=dims.rope_theta,
                   max_positions=max_positions or dims.max_positions,
                   tie_embeddings=dims.tie_embeddings, experts=dims.experts,
                   experts_per_token=dims.experts_per_token,
                   moe_intermediate=dims.intermediate if dims.is_moe else 0,
                   norm_topk_prob=dims.is_moe, moe_layers=tuple(range(dims.layers)) if dims.is_moe else (),
                   qkv_bias=dims.qkv_bias, rope_scaling=dims.rope_scaling, sliding_window=dims.sliding_window)

    @classmethod
    def _parse(cls, raw: dict, model_dir: Path) -> "ModelConfig":
        """config.json read as hf_config reads it, with what only the engine needs: Qwen3-MoE's
        dense layers and top-k normalisation, the EOS ids, the FP8 scheme."""
        dims = parse_config(raw, str(model_dir))
        cfg = cls.from_preset(dims)
        if dims.arch == "qwen3_moe":
            step = int(raw.get("decoder_sparse_step", 1))
            skip = set(raw.get("mlp_only_layers", []))
            cfg = dataclasses.replace(
                cfg, intermediate=int(raw["intermediate_size"]), norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in range(dims.layers) if i not in skip and (i + 1) % step == 0))
        return dataclasses.replace(cfg, eos_token_ids=_eos_ids(raw, model_dir),
                                   fp8=_fp8_scheme(raw.get("quantization_config")))


def _fp8_scheme(quant) -> Fp8Scheme | None:
    """config.json's quantization_config, as Qwen's FP8 releases write it: {"quant_method": "fp8",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128]} (no block size: one scale per
    output channel, as `engine quantize --block 0` writes)."""
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported (fp8 only)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("quantization_config: only dynamic activation scales are supported, not "
                         f"{quant['activation_scheme']!r}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config: fmt {quant['fmt']!r} is not supported (e4m3 only)")
    block = quant.get("weight_block_size")
    return Fp8Scheme(None if block is None else tuple(int(b) for b in block))


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id wins over config.json's, as in transformers."""
    eos = raw.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError as e:
            raise ModelDirError(f"{gen}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


@dataclass(frozen=True)
class KernelSpec:
    """Where one op's implementation comes from (see kernels.py)."""

    impl: str = "eager"  # reference | eager | template | free
    template: str = ""
    point: dict = field(default_factory=dict)
    path: str = ""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path | None = None  # None: the weights are handed to LLMEngine (see there)
    dtype: str = "bf16"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: from gpu_memory_utilization on a GPU, from the limits below on a CPU
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step with a prompt chunk; longer prompts are chunked
    # Decodes and prompt chunks in one step (scheduler.py); False: decodes wait for every prompt
    mixed_steps: bool = True
    # Queue a decode step behind the one in flight before reading its tokens (engine.py); graphs only
    async_decode: bool = True
    max_model_len: int = 4096
    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    # "fp8": a bf16 checkpoint's linear layers and experts quantized to FP8 at load, one scale per
    # output channel (a checkpoint already in FP8 is served in FP8 either way)
    quantization: str = ""
    # Speculative decoding by prompt lookup (speculative.py): draft tokens per step (0: off) and the
    # longest n-gram looked up
    spec_tokens: int = 0
    spec_ngram: int = 3
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # MoE calls of more than 64 tokens (prefill): "torch", the kernels file's path (eager's grouped GEMMs
    # by torch._grouped_mm where they run), or "triton", Triton grouped GEMMs (moe_prefill.py)
    moe_prefill: str = "torch"
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0

    def __post_init__(self):
        # Named as the engine's command-line options (engine_templates/engine/cli.py) name them.
        if self.dtype not in DTYPES:
            raise EngineSetupError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        for option, value, low in (("--block-size", self.block_size, 1), ("--max-num-seqs", self.max_num_seqs, 1),
                                   ("--max-model-len", self.max_model_len, 1),
                                   ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
                                   ("--num-kv-blocks", self.num_kv_blocks, 0),
                                   ("--spec-tokens", self.spec_tokens, 0), ("--spec-ngram", self.spec_ngram, 1)):
            at_least(option, value, low)
        if self.quantization not in QUANTIZATIONS:
            raise EngineSetupError(f"--quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, "
                                   f"not {self.quantization!r}")
        if self.moe_prefill not in MOE_PREFILL:
            raise EngineSetupError(f"--moe-prefill must be one of {', '.join(MOE_PREFILL)}, not {self.moe_prefill!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineSetupError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise EngineSetupError(f"--cuda-graph-batch-sizes must all be at least 1, not "
                                   f"{','.join(map(str, self.cuda_graph_batch_sizes))}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
