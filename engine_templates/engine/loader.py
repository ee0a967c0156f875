"""A DecoderModel's weights: filled from a HuggingFace directory's safetensors shards, or random.

Checkpoints store each expert apart: `mlp.experts.<e>.gate_proj/up_proj/down_proj` (Qwen3-MoE), or
Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2` with its router at `block_sparse_moe.gate`."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine_templates.engine.config import ModelConfig, ModelDirError
from engine_templates.engine.fp8 import FP8, Fp8Weight, quantize
from engine_templates.engine.model import EXPERT_STACKS, DecoderModel

SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's scales, as Qwen's FP8 releases name them
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
MIXTRAL = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)")
MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def weight_name(name: str) -> str:
    """The name a checkpoint entry has among DecoderModel.weights() (or EXPERT's): Mixtral's
    block_sparse_moe names as Qwen3-MoE's."""
    m = MIXTRAL.fullmatch(name)
    if not m:
        return name
    rest = m.group(2)
    for old, new in MIXTRAL_EXPERTS.items():
        rest = rest.replace(f".{old}.", f".{new}.")
    return f"{m.group(1)}mlp.{rest}"


def shard_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"not a model directory: {model_dir} has no *.safetensors weights")
    return files


def load_weights(model: DecoderModel, model_dir: Path) -> None:
    """Fills the model from the directory's shards. An FP8 weight (e4m3, with its `_scale_inv`
    beside it, in any shard) goes to an FP8 weight of the model as it is, or dequantized where the
    model keeps that weight in its own dtype; a weight in another dtype is quantized at load where
    the model keeps it in FP8 (`--quantization fp8`, or a module a checkpoint left unquantized)."""
    params = model.weights()
    filled: set[str] = set()
    inter = model.cfg.moe_intermediate
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # FP8 weight name -> {"q", "scale"} read so far
    for file in shard_files(model_dir):
        try:
            shard = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ModelDirError(f"{file}: not a readable safetensors file ({e})") from None
        with shard:
            for name in shard.keys():
                weight = name.removesuffix(SCALE_SUFFIX)
                target, key = _target(model, params, weight_name(weight), inter)
                if target is None:
                    continue  # e.g. a tied lm_head stored anyway, or rotary buffers
                tensor = shard.get_tensor(name)
                if name == weight and tensor.dtype != FP8:
                    _fill(file, name, target, tensor, None, model.cfg)
                    filled.add(key)
                    continue
                parts = waiting.setdefault(weight, {})
                parts["scale" if name != weight else "q"] = tensor
                if len(parts) == 2:
                    _fill(file, weight, target, parts["q"], waiting.pop(weight)["scale"], model.cfg)
                    filled.add(key)
    if waiting:
        name, parts = next(iter(waiting.items()))
        lacks = f"{name}{SCALE_SUFFIX}" if "q" in parts else f"the FP8 weight {name}"
        raise ModelDirError(f"{model_dir}: {len(waiting)} FP8 weights lack their other half, e.g. {lacks}")
    # The checkpoint stores each expert apart; the model keeps them stacked.
    expected = {n for n in params if not n.endswith(EXPERT_STACKS)} | {
        f"{i}.{e}.{w}" for i in model.cfg.moe_layers for e in range(model.cfg.experts)
        for w in ("gate_proj", "up_proj", "down_proj")}
    missing = sorted(expected - filled)
    if missing:
        raise ModelDirError(f"{model_dir}: {len(missing)} weights missing from the checkpoint, "
                            f"e.g. {missing[0]}")


def _fill(file: Path, name: str, target, tensor: torch.Tensor, scale: torch.Tensor | None,
          cfg: ModelConfig) -> None:
    """Copies one checkpoint weight (with its scale, when FP8) into the model's tensor or FP8 weight."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelDirError(f"{file}: {name} has shape {tuple(tensor.shape)}; the config "
                            f"implies {tuple(target.shape)}")
    if scale is None:
        target.copy_(quantize(tensor.to(target.device), target.block) if isinstance(target, Fp8Weight) else tensor)
        return
    if cfg.fp8 is None:
        raise ModelDirError(f"{file}: {name} is FP8, but config.json has no quantization_config for it")
    block = cfg.fp8.block_for(tensor.shape[-1])
    rows, cols = tensor.shape[-2:]
    if tuple(scale.shape) != (-(-rows // block[0]), -(-cols // block[1])):
        raise ModelDirError(f"{file}: {name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, not the "
                            f"{(-(-rows // block[0]), -(-cols // block[1]))} of {rows} x {cols} in "
                            f"{block[0]} x {block[1]} blocks")
    weight = Fp8Weight(tensor.to(target.device), scale.to(target.device, torch.float32), block)
    target.copy_(weight if isinstance(target, Fp8Weight) else weight.dequantize(target.dtype))


def random_tensors(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0,
                   std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight, by DecoderModel.weights()'s names and in its order, drawn on the device one at
    a time: norms 1, the rest N(0, std) — transformers' own initialisation, but for Qwen2's q/k/v
    biases, which transformers zeroes and this draws too. The same seed gives the same tensors
    however many of them are kept."""
    shapes = DecoderModel(cfg, None, None, dtype, "meta").weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, meta in shapes.items():
        t = torch.empty(meta.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        yield name, t


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Every weight drawn on the device itself (no host copy: 30B parameters in under a
    second on a GPU), as random_tensors draws them."""
    return dict(random_tensors(cfg, dtype, device, seed, std))


def checkpoint_entries(name: str, tensor: torch.Tensor, moe_intermediate: int,
                       arch: str = "qwen3_moe") -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of one of DecoderModel.weights(), in the layout HF checkpoints
    of `arch` store: an expert stack becomes each expert's own gate_proj, up_proj or down_proj
    (Mixtral: w1, w3, w2, and the router under block_sparse_moe) — views of the stack; the
    inverse of what load_weights fills."""
    names = ({v: k for k, v in MIXTRAL_EXPERTS.items()} if arch == "mixtral"
             else {w: w for w in MIXTRAL_EXPERTS.values()})
    moe = "block_sparse_moe." if arch == "mixtral" else "mlp."
    if arch == "mixtral" and name.endswith("mlp.gate.weight"):
        yield name.removesuffix("mlp.gate.weight") + moe + "gate.weight", tensor
        return
    for stack in EXPERT_STACKS:
        if name.endswith(stack):
            prefix = name[:-len(stack)] + moe + "experts."
            for e in range(tensor.shape[0]):
                if stack == EXPERT_STACKS[1]:
                    yield f"{prefix}{e}.{names['down_proj']}.weight", tensor[e]
                else:
                    yield f"{prefix}{e}.{names['gate_proj']}.weight", tensor[e, :moe_intermediate]
                    yield f"{prefix}{e}.{names['up_proj']}.weight", tensor[e, moe_intermediate:]
            return
    yield name, tensor


def tensor_for(model: DecoderModel, name: str) -> torch.Tensor | None:
    """The model's tensor (or expert slice) that a checkpoint or HF parameter name denotes."""
    return _target(model, model.weights(), name, model.cfg.moe_intermediate)[0]


def _target(model: DecoderModel, params: dict[str, torch.Tensor], name: str, inter: int):
    """(the tensor or slice a checkpoint entry is copied into, the key it fills)."""
    if name in params:
        return params[name], name
    m = EXPERT.fullmatch(name)
    if not m:
        return None, name
    layer, expert, which = int(m.group(1)), int(m.group(2)), m.group(3)
    lay = model.layers[layer] if layer < len(model.layers) else None
    if lay is None or not lay.is_moe or expert >= model.cfg.experts:
        raise ModelDirError(f"checkpoint has {name}, which the config does not describe")
    key = f"{layer}.{expert}.{which}"
    if which == "down_proj":
        return lay.w_down[expert], key
    start = 0 if which == "gate_proj" else inter
    stack = lay.w_gate_up[expert]
    return (stack.rows(start, start + inter) if isinstance(stack, Fp8Weight) else stack[start:start + inter]), key
