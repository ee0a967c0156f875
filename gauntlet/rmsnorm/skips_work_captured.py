# expect: fail timed_outputs (GPU only) — right whenever it is called, but while a CUDA graph is
# being captured (how launch-bound shapes are timed) it records a fill of zeros instead of the
# work: the graph that is timed computes nothing. On a CPU nothing is captured; it is not run.
import torch


def rmsnorm(x, weight, eps):
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
