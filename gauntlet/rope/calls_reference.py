# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops.rope import OP


def rope(q, k, cos_sin, positions):
    q_out, k_out = OP.reference(q, k, cos_sin, positions)
    return q_out.to(q.dtype), k_out.to(k.dtype)
