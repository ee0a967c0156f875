# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops import get_op


def rmsnorm(x, weight, eps):
    return get_op("rmsnorm").reference(x, weight, eps).to(x.dtype)
