# expect: fail accuracy — returns q and k unrotated: exact at position 0, which is where a naive
# test would put its tokens; the harness draws positions anywhere in the table.
def rope(q, k, cos_sin, positions):
    return q.clone(), k.clone()
