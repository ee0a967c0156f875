# expect: fail output_form — returns a view of the query (the output's shape): no result of its own.
def decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale):
    return q.view(q.shape)
