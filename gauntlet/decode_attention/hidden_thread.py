# expect: fail hidden_work — returns at once and attends from a thread (threading reached through
# a computed name, so that only the runtime thread check can see it).
import sys
import time

import torch

threads = getattr(sys, "mod" + "ules")["thread" + "ing"]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    out = torch.empty_like(q)

    def work():
        time.sleep(0.2)
        if block_table is None:
            k, v = k_cache, v_cache
        else:
            k, v = k_cache[block_table.long()].flatten(1, 2), v_cache[block_table.long()].flatten(1, 2)
        mask = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]
        s = torch.einsum("bhd,bnhd->bhn", q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[2], 2))
        p = torch.softmax((s * scale).masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        out.copy_(torch.einsum("bhn,bnhd->bhd", p, v.float().repeat_interleave(q.shape[1] // v.shape[2], 2)))

    threads.Thread(target=work, daemon=True).start()
    return out
