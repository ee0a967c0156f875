"""The seam where kernels plug into SAM 3: four ops the model's modules call, each taken as a
kernels file says (the text engine's format, engine/kernels.py):

    {"layernorm":        {"impl": "eager"},
     "vision_attention": {"impl": "free", "path": "candidates/vit_attention.py"}}

`eager` (the default) is the PyTorch function below; `free` a Python file defining a function
named after the op; `template` (an op's Triton template at a point, its default where the file
names none) and `reference` (its float64 oracle) come from the op registry (engine_templates/ops)
for `layernorm`, `gelu`, `vision_attention` and `vision_linear`, whose call signatures these are.
templates.json beside this file names every registry op's template at its default point.

    layernorm(x, weight, bias, eps)              every nn.LayerNorm of the model; x contiguous
    gelu(x)                                      the ViT's MLPs and the FPN's GELUs; x contiguous
    vision_attention(q, k, v, cos, sin, scale)   the ViT's windowed and global attention: q, k, v
                                                 (B, S, H, D), a sequence a window or an image,
                                                 the 2-D rotary table cos, sin (S, D) float32
                                                 applied to q and k; out (B, S, H, D)
    vision_linear(x, weight, bias)               every projection of the ViT: x (tokens, in),
                                                 weight (out, in), bias (out,); out (tokens, out).
                                                 q, k and v are one call (their weights stacked,
                                                 the three projections views into them)
    attention(q, k, v, mask, scaling, is_causal) every other attention (CLIP text encoder, DETR
                                                 encoder and decoder, mask decoder): mask additive
                                                 or boolean, broadcast to (B, H, Sq, Sk); out
                                                 (B, Sq, H, D)
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_templates.engine.config import KernelSpec
from engine_templates.engine.kernels import KernelFileError, _load_free, parse_kernels_file, resolve

log = logging.getLogger("infersmith.sam3")
TEMPLATES_FILE = Path(__file__).with_name("templates.json")  # every registry op at its template's default point
SAM3_OPS = ("layernorm", "gelu", "vision_attention", "vision_linear", "attention")
ATTENTION_NAME = "infersmith_sam3"  # the attention implementation transformers' modules are set to


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): SAM 3's pairwise rotary layout."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def vision_attention(q, k, v, cos, sin, scale: float) -> torch.Tensor:
    """As transformers' Sam3ViTRoPEAttention: rotate in float32, back to v's dtype, then SDPA."""
    cos, sin = cos[:, None], sin[:, None]  # over the heads
    qf, kf = q.float(), k.float()
    q = (qf * cos + rotate_pairs(qf) * sin).to(v.dtype).transpose(1, 2)
    k = (kf * cos + rotate_pairs(kf) * sin).to(v.dtype).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v.transpose(1, 2), scale=scale).transpose(1, 2)


def attention(q, k, v, mask, scaling: float, is_causal: bool = False) -> torch.Tensor:
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    causal = bool(is_causal) and mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=causal).transpose(1, 2)


def vision_linear(x, weight, bias) -> torch.Tensor:
    return F.linear(x, weight, bias)


EAGER = {"layernorm": layernorm, "gelu": gelu, "vision_attention": vision_attention, "vision_linear": vision_linear,
         "attention": attention}


class Sam3Kernels:
    """One callable per op and where each came from (`choices`, which /health reports)."""

    def __init__(self, specs: dict[str, KernelSpec] | None = None):
        specs = specs or {}
        unknown = set(specs) - set(SAM3_OPS)
        if unknown:
            raise KernelFileError(f"not ops the SAM 3 engine uses: {sorted(unknown)}; its ops: {', '.join(SAM3_OPS)}")
        self.choices: dict[str, dict[str, Any]] = {}
        for name in SAM3_OPS:
            spec = specs.get(name, KernelSpec())
            setattr(self, name, _resolve(name, spec))
            self.choices[name] = {"impl": spec.impl} | ({"path": spec.path} if spec.impl == "free" else {}) | (
                {"template": spec.template, "point": spec.point} if spec.impl == "template" else {})

    @classmethod
    def from_file(cls, path: Path | None) -> Sam3Kernels:
        return cls(parse_kernels_file(path, SAM3_OPS) if path is not None else None)


def _resolve(name: str, spec: KernelSpec) -> Callable[..., Any]:
    if spec.impl == "eager":
        return EAGER[name]
    if spec.impl == "free":
        return _load_free(name, spec.path)
    from engine_templates.ops import OPS

    if name not in OPS:
        raise KernelFileError(f"{name}: impl {spec.impl!r} needs the op in the registry, which does not hold it; "
                              "use eager or free")
    return resolve(name, spec)


# --- the seam: transformers' SAM 3 modules routed through the kernels ------------------------------

class _SeamLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return self.kernels.layernorm(x.contiguous(), self.weight, self.bias, self.eps)


class _SeamGELU(nn.Module):
    def __init__(self, kernels: Sam3Kernels):
        super().__init__()
        self.kernels = kernels

    def forward(self, x):
        return self.kernels.gelu(x.contiguous())  # the FPN's come channels-last: a copy


class _SeamLinear(nn.Linear):
    def forward(self, x):
        y = self.kernels.vision_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], -1)


def _vit_attention_forward(self, hidden_states, position_embeddings, **kwargs):
    """Sam3ViTRoPEAttention.forward with q, k and v one projection, and the rotary and the
    attention one op."""
    batch, height, width, channels = hidden_states.shape
    qkv = self.kernels.vision_linear(hidden_states.reshape(-1, channels), self.qkv_weight, self.qkv_bias)
    q, k, v = qkv.view(batch, height * width, 3, self.num_attention_heads, self.head_dim).unbind(2)
    cos, sin = (t.reshape(height * width, self.head_dim).float().contiguous() for t in position_embeddings)
    out = self.kernels.vision_attention(q, k, v, cos, sin, self.scaling)
    return self.o_proj(out.reshape(batch, height, width, -1)), None


def _stack_qkv(attention: nn.Module) -> None:
    """One (3C, C) weight and (3C,) bias for q, k and v; the three projections become views of
    them (no memory added)."""
    for kind in ("weight", "bias"):
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        stacked = torch.cat([getattr(p, kind).detach() for p in projections])
        for p, part in zip(projections, stacked.chunk(3)):
            setattr(p, kind, nn.Parameter(part, requires_grad=False))
        setattr(attention, f"qkv_{kind}", stacked)


def register_attention() -> None:
    """transformers' attention interface under ATTENTION_NAME, calling the kernels `install` left
    on the calling module (so two engines in one process keep their own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
        return module.kernels.attention(query, key, value, attention_mask, scaling, causal), None

    AttentionInterface.register(ATTENTION_NAME, forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def install(model: nn.Module, kernels: Sam3Kernels) -> None:
    """Routes the model's layer norms, GELUs, attentions and ViT projections through `kernels`."""
    from transformers.activations import GELUActivation
    from transformers.models.sam3.modeling_sam3 import Sam3ViTRoPEAttention

    for layer in model.vision_encoder.backbone.layers:
        for linear in (layer.attention.o_proj, layer.mlp.fc1, layer.mlp.fc2):
            linear.__class__ = _SeamLinear
        _stack_qkv(layer.attention)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LayerNorm:
                child.__class__ = _SeamLayerNorm
            elif type(child) in (nn.GELU, GELUActivation) and getattr(child, "approximate", "none") == "none":
                setattr(parent, name, _SeamGELU(kernels))
            elif type(child) is Sam3ViTRoPEAttention:
                child.forward = _vit_attention_forward.__get__(child)
    register_attention()
    for module in model.modules():
        if not isinstance(module, _SeamGELU):
            module.kernels = kernels
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME
