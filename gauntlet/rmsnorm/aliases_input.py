# expect: fail output_form — returns a view of its input (whatever the values): no result of its own.
def rmsnorm(x, weight, eps):
    return x.view(x.shape)
