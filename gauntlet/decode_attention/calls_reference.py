# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops.decode_attention import OP


def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    return OP.reference(q, k_cache, v_cache, seq_lens, block_table, scale).to(q.dtype)
