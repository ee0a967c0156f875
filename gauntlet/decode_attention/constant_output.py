# expect: fail accuracy — zeros of the right shape and dtype.
import torch


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    return torch.zeros_like(q)
