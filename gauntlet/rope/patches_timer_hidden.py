# expect: fail timer_integrity — slows time.perf_counter down through a computed name; the
# runtime identity check of the timers catches what screening cannot.
import sys

import torch

clock = getattr(sys, "mod" + "ules")["time"]
_real = clock.perf_counter
setattr(clock, "perf_" + "counter", lambda: _real() * 1e-3)


def rope(q, k, cos_sin, positions):
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
