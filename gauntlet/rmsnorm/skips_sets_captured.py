# expect: fail timed_outputs (GPU only) — skips_work_captured made harder to see: while a CUDA
# graph is captured it does the work for the first and the last of the harness's input sets, the
# two a judge reading only those would check, and a fill of zeros for the others. It counts the
# calls of a capture and works out how many sets the harness rotates (twice the L2 over the bytes
# of a call, at most 2048): public facts. The judge also checks sets drawn after the graph ran.
import torch

_calls = [0]


def _sets(x):
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
    nbytes = (2 * x.numel() + x.shape[-1]) * x.element_size()
    return max(1, min(2048, -(-2 * l2 // nbytes)))


def rmsnorm(x, weight, eps):
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        i = _calls[0]
        _calls[0] += 1
        if 0 < i < _sets(x) - 1:
            return torch.zeros_like(x)
    else:
        _calls[0] = 0
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
