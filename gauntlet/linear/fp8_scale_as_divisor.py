# expect: fail accuracy (fp8 target) — reads the block scales as `scale_inv` divisors (weight =
# q / scale), the other convention a checkpoint's name suggests: every block off by scale^2.
def linear(x, weight, weight_scale):
    rows, cols = weight.shape
    scale = weight_scale.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]
    return (x.float() @ (weight.float() / scale).t()).to(x.dtype)
