"""The op registry: every op the platform can optimize, by name — a language model's and a vision
model's (`Op.modality`: layernorm, gelu, vision_attention, vision_linear) — and the ops with an fp8 target (FP8
weights with block scales, judged against the full-precision op: ops/fp8.py)."""
from __future__ import annotations

from engine_templates.ops.base import Op
from engine_templates.ops.decode_attention import OP as _decode_attention
from engine_templates.ops.decode_attention_swa import OP as _decode_attention_swa
from engine_templates.ops.fused_add_rmsnorm import OP as _fused_add_rmsnorm
from engine_templates.ops.fused_moe import OP as _fused_moe
from engine_templates.ops.fused_moe.fp8 import OP as _fused_moe_fp8
from engine_templates.ops.gelu import OP as _gelu
from engine_templates.ops.layernorm import OP as _layernorm
from engine_templates.ops.linear import OP as _linear
from engine_templates.ops.linear.fp8 import OP as _linear_fp8
from engine_templates.ops.prefill_attention import OP as _prefill_attention
from engine_templates.ops.prefill_attention_swa import OP as _prefill_attention_swa
from engine_templates.ops.qk_norm_rope import OP as _qk_norm_rope
from engine_templates.ops.rmsnorm import OP as _rmsnorm
from engine_templates.ops.rope import OP as _rope
from engine_templates.ops.silu_mul import OP as _silu_mul
from engine_templates.ops.vision_attention import OP as _vision_attention
from engine_templates.ops.vision_linear import OP as _vision_linear

OPS: dict[str, Op] = {op.name: op for op in (_rmsnorm, _silu_mul, _fused_add_rmsnorm, _decode_attention,
                                             _rope, _qk_norm_rope, _prefill_attention, _fused_moe, _linear,
                                             _decode_attention_swa, _prefill_attention_swa,
                                             _layernorm, _gelu, _vision_attention, _vision_linear)}
FP8_OPS: dict[str, Op] = {op.name: op for op in (_linear_fp8, _fused_moe_fp8)}


def ops_for(dtype: str) -> dict[str, Op]:
    """The ops a target of `dtype` has: for fp8, the fp8 targets only."""
    return FP8_OPS if dtype == "fp8" else OPS


def get_op(name: str, dtype: str = "bf16") -> Op:
    """The op `name` as a target of `dtype` judges it: for fp8, its fp8 target."""
    try:
        return ops_for(dtype)[name]
    except KeyError:
        if dtype == "fp8" and name in OPS:
            raise KeyError(f"{name} has no fp8 target; ops with one: {', '.join(sorted(FP8_OPS))}") from None
        raise KeyError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}") from None
