# expect: fail accuracy (flagged reduced_precision) — multiplies by an e4m3 copy of the weight
# (one scale per 128 x 128 block, as an fp8 target's weights are) under a target that did not
# ask for fp8: the bf16 target's tolerance sees e4m3's rounding.
import torch


def linear(x, weight):
    rows, cols = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, -cols % 128, 0, -rows % 128))
    blocks = w.view(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / 448
    w8 = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return (x.float() @ w8.view(w.shape)[:rows, :cols].t()).to(x.dtype)
