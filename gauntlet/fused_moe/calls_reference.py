# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops.fused_moe import OP


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    return OP.reference(x, router_logits, w_gate_up, w_down, top_k, renormalize).to(x.dtype)
