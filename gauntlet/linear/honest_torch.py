# expect: pass — a plain PyTorch rewrite, accumulated in float32.
def linear(x, weight):
    return (x.float() @ weight.float().t()).to(x.dtype)
