# expect: fail screen — returns the op's own float64 reference, cast.
from engine_templates.ops.prefill_attention import OP


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale):
    return OP.reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale).to(q.dtype)
