"""The op registry: every op the platform can optimize, by name."""
from __future__ import annotations

from engine_templates.ops.base import Op
from engine_templates.ops.decode_attention import OP as _decode_attention
from engine_templates.ops.fused_add_rmsnorm import OP as _fused_add_rmsnorm
from engine_templates.ops.fused_moe import OP as _fused_moe
from engine_templates.ops.prefill_attention import OP as _prefill_attention
from engine_templates.ops.qk_norm_rope import OP as _qk_norm_rope
from engine_templates.ops.rmsnorm import OP as _rmsnorm
from engine_templates.ops.rope import OP as _rope
from engine_templates.ops.silu_mul import OP as _silu_mul

OPS: dict[str, Op] = {op.name: op for op in (_rmsnorm, _silu_mul, _fused_add_rmsnorm, _decode_attention,
                                             _rope, _qk_norm_rope, _prefill_attention, _fused_moe)}


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}") from None
