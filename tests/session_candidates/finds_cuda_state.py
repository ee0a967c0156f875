# On a GPU: honest, unless it finds the device settings an earlier candidate left behind
# (leaves_cuda_state.py): then it returns zeros, and fails the accuracy gate.
import torch

FOUND = [name for name, left in (("TF32 matmuls", torch.get_float32_matmul_precision() != "highest"),
                                 ("sync debug mode", torch.cuda.get_sync_debug_mode() != 0)) if left]


def rmsnorm(x, weight, eps):
    if FOUND:
        return torch.zeros_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
