# expect: fail hidden_work — computes on a side stream that waits for the caller's stream, and is
# never joined back (the wait_stream the screen sees runs the wrong way): device events on the
# caller's stream stop before the side stream's work ends; calls back to back, synchronized
# device-wide, do not. Only the bench stage's host-time cross-check can see it.
import torch

_side = []


def rmsnorm(x, weight, eps):
    if not _side:
        _side.append(torch.cuda.Stream())
    side = _side[0]
    side.wait_stream(torch.cuda.current_stream())
    y = torch.empty_like(x)
    with torch.cuda.stream(side):
        h = x.float()
        for _ in range(32):  # hidden work well above launch overhead at every shape
            h = h * 1.0
        y.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    return y
