# expect: pass (fp8 target) — the weight dequantized block by block (q * scale, one scale per
# 128 x 128 block), then the matmul, accumulated in float32.
def linear(x, weight, weight_scale):
    rows, cols = weight.shape
    scale = weight_scale.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]
    return (x.float() @ (weight.float() * scale).t()).to(x.dtype)
