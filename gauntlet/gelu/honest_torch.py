# expect: pass — the exact GELU written out in float32, without torch's gelu.
import math

import torch


def gelu(x):
    h = x.float()
    return (0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))).to(x.dtype)
