# expect: fail timed_outputs (GPU only) — judged calls run on the device's default stream; a graph
# timing warms and captures its calls on streams of its own: it returns an uninitialized tensor
# when the current stream is not the default one. On a CPU there is no stream: it is right there.
import torch


def rmsnorm(x, weight, eps):
    if x.is_cuda and torch.cuda.current_stream(x.device) != torch.cuda.default_stream(x.device):
        return torch.empty_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
