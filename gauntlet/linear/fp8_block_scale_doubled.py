# expect: fail accuracy (fp8 target) — applies the first block's scale twice (as a kernel that
# indexes one block wrong would): at the target's shapes that block is a large share of the weight.
def linear(x, weight, weight_scale):
    rows, cols = weight.shape
    wrong = weight_scale.clone()
    wrong[0, 0] *= 2
    scale = wrong.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]
    return (x.float() @ (weight.float() * scale).t()).to(x.dtype)
