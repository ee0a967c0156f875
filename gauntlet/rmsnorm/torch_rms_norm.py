# expect: pass, flagged reference_fallback — PyTorch's own rms_norm: correct, but its speed is
# torch's, so the score counts as no speed-up (at most 1).
import torch


def rmsnorm(x, weight, eps):
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
