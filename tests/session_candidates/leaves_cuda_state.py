# On a GPU: passes every gate, and leaves state behind in its process's CUDA context and torch's
# device settings: memory held on the device, TF32 matmuls allowed, CUDA's synchronisation
# warnings on.
import torch

_HELD = torch.ones(1 << 20, device="cuda")
torch.set_float32_matmul_precision("high")
torch.cuda.set_sync_debug_mode("warn")


def rmsnorm(x, weight, eps):
    h = x.float()
    return (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
