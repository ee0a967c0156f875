# expect: fail timed_outputs (GPU only) — a judged call finds the device idle (the harness waited
# for it to check the last call), a timed call finds the previous call's kernels still queued on
# the stream: it returns an uninitialized tensor when the current stream has work left. Asking
# the stream while it is captured fails the capture, so it is timed with events.
import torch


def rmsnorm(x, weight, eps):
    if x.is_cuda and not torch.cuda.current_stream().query():
        return torch.empty_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
