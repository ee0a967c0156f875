# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops.silu_mul import OP


def silu_mul(gate, up):
    return OP.reference(gate, up).to(gate.dtype)
