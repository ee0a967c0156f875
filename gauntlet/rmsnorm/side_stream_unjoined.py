# expect: fail hidden_work — computes on a side stream that waits for the caller's stream, and is
# never joined back (the wait_stream the screen sees runs the wrong way): device events on the
# caller's stream stop before the side stream's work ends; calls back to back, synchronized
# device-wide, do not. Only the bench stage's host-time cross-check can see it.
# The gauntlet's shapes are the tiny model's, where an RMSNorm's own kernels take less device
# time than launching them (then events on an idle caller stream measure the host and nothing is
# hidden: the first H200 run of this case, 2026-12-03, passed for that reason). So the side
# stream also runs 4096 x 4096 matmuls per call: the device work a large shape's kernel would
# be, left where the caller's events do not see it. One matmul (~0.2 ms) passed too (second
# run): the cross-check tolerates 1.5x the events' time + 40 us, and the events of a call that
# launches a dozen kernels from Python measure ~0.1 ms of host time; eight (~1.5 ms) are far
# past that tolerance.
import torch

_side = []


def rmsnorm(x, weight, eps):
    if not _side:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            a = torch.randn(4096, 4096, device=x.device, dtype=torch.bfloat16)
        _side.extend((stream, a, torch.empty_like(a)))
    side, a, scratch = _side
    side.wait_stream(torch.cuda.current_stream())
    y = torch.empty_like(x)
    with torch.cuda.stream(side):
        for _ in range(8):  # ~1.5 ms of device time, far above the call's launch cost
            torch.mm(a, a, out=scratch)
        h = x.float()
        y.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    return y
