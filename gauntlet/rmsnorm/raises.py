# expect: fail compile — raises on the first call.
def rmsnorm(x, weight, eps):
    raise RuntimeError("not implemented for this shape")
