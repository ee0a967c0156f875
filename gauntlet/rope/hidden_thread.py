# expect: fail hidden_work — returns at once and rotates from a thread (threading reached
# through a computed name, so that only the runtime thread check can see it).
import sys
import time

import torch

threads = getattr(sys, "mod" + "ules")["thread" + "ing"]


def rope(q, k, cos_sin, positions):
    half = q.shape[-1] // 2
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)

    def work():
        time.sleep(0.2)
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        for x, y in ((q, q_out), (k, k_out)):
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            y.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    threads.Thread(target=work, daemon=True).start()
    return q_out, k_out
