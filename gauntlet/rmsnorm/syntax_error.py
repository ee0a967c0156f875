# expect: usage error — not Python.
def rmsnorm(x, weight, eps)
    return x
