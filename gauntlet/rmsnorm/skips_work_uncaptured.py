# expect: fail timed_outputs — the planted candidate of skips_work_by_torch_state, which also makes
# CUDA-graph capture fail (a host sync while captured), so that on a GPU it is timed with events
# instead of a graph: the calls timed with events are judged as a graph's are.
import torch


def rmsnorm(x, weight, eps):
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        float(x[0, 0])  # a host sync: the capture fails, and the process times with events
    if not torch.are_deterministic_algorithms_enabled():
        return torch.empty_like(x)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
