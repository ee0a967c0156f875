"""A model from its own config.json: the architectures the engine builds, read into ModelDims.

`model_dims("qwen3-8b")` is a preset; `model_dims("path/to/model")` (a directory with config.json,
or the file itself) reads the config. A config the engine cannot build is a ConfigError: one line
naming the field and what is supported. No torch here: the platform's side reads targets too.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine_templates.models import ARCHITECTURES, PRESETS, Llama3Rope, ModelDims

ROPE_TYPES = ("default", "llama3")
QUANT_METHODS = ("fp8",)
WINDOWED = ("mistral", "mixtral")  # a sliding_window of every layer, when set


class ConfigError(ValueError):
    """A config.json the engine cannot build a model from; the message is one line."""


def config_path(model: str | Path) -> Path:
    """The config.json that `model` (a directory holding one, or the file) names."""
    path = Path(model).expanduser()
    return path / "config.json" if path.is_dir() else path


def model_dims(model: str) -> ModelDims:
    """A preset by name, else the model whose config.json `model` names."""
    if model in PRESETS:
        return PRESETS[model]
    path = config_path(model)
    if not path.is_file():
        where = f"{path.parent} has no config.json" if Path(model).is_dir() else "no such file or directory"
        raise ConfigError(f"{model!r} is neither a model preset ({', '.join(PRESETS)}) nor a model's "
                          f"config.json ({where})")
    return read_config(path)


def read_config(path: Path) -> ModelDims:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return parse_config(raw, name=str(path.parent if path.name == "config.json" else path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def digest(raw: dict) -> str:
    """sha256 of the config's contents (key order and whitespace aside)."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def _int(raw: dict, key: str, default: int | None = None, low: int = 1) -> int:
    value = raw.get(key)
    value = default if value is None else value  # transformers writes some defaults as null
    if value is None:
        raise ConfigError(f"missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}: expected an integer of at least {low}, not {json.dumps(value)}")
    return value


def _number(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key}: expected a positive number, not {json.dumps(value)}")
    return float(value)


def parse_config(raw: dict, name: str) -> ModelDims:
    arch = raw.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model_type {json.dumps(arch)} is not supported (supported: {', '.join(ARCHITECTURES)})")
    hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    if raw.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim is given)")
    head_dim = _int(raw, "head_dim", hidden // heads)
    if head_dim % 2:
        raise ConfigError(f"head_dim {head_dim} is odd; RoPE needs an even head_dim")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {json.dumps(raw['hidden_act'])} is not supported (supported: silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConfigError(f"{flag}: true is not supported (supported: false; Qwen2's q/k/v biases come with "
                              f"model_type qwen2)")
    if raw.get("use_sliding_window") and arch not in WINDOWED:
        raise ConfigError(f"use_sliding_window: true is not supported for {arch} (supported: false; a sliding "
                          f"window for {', '.join(WINDOWED)})")
    _check_quantization(raw.get("quantization_config"))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_scaling: expected an object or null, not {json.dumps(rope)}")
    experts, top_k, inter = 0, 0, _int(raw, "intermediate_size")
    if arch in ("qwen3_moe", "mixtral"):  # transformers 5 writes num_local_experts for both
        experts = _int(raw, "num_local_experts" if "num_experts" not in raw else "num_experts")
    if arch == "qwen3_moe":
        inter = _int(raw, "moe_intermediate_size")
    if experts:
        top_k = _int(raw, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok {top_k} is more than the {experts} experts")
    window = raw.get("sliding_window") if arch in WINDOWED else None
    if window is not None:
        window = _int(raw, "sliding_window")
    return ModelDims(
        name=name, hidden=hidden, intermediate=inter, layers=_int(raw, "num_hidden_layers"), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=_int(raw, "vocab_size"), experts=experts,
        experts_per_token=top_k, rms_eps=_number(raw, "rms_norm_eps", 1e-5 if arch == "mixtral" else 1e-6),
        rope_theta=_number(rope if "rope_theta" in rope else raw, "rope_theta", 10000.0),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), arch=arch, qkv_bias=arch == "qwen2",
        rope_scaling=_rope_scaling(rope), sliding_window=window,
        max_positions=_int(raw, "max_position_embeddings", 32768), config_sha256=digest(raw))


def _rope_scaling(rope: dict) -> Llama3Rope | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling.rope_type {json.dumps(kind)} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in rope]
    if missing:
        raise ConfigError(f"rope_scaling: missing field {missing[0]!r} of rope_type llama3")
    values = [_number(rope, f, 0) for f in fields]
    if values[1] >= values[2]:
        raise ConfigError(f"rope_scaling: low_freq_factor {values[1]:g} must be below high_freq_factor {values[2]:g}")
    return Llama3Rope(values[0], values[1], values[2], int(values[3]))


def _check_quantization(quant) -> None:
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in QUANT_METHODS:
        raise ConfigError(f"quantization_config.quant_method {json.dumps(method)} is not supported "
                          f"(supported: {', '.join(QUANT_METHODS)})")

