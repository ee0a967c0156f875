# expect: fail output_form — returns views of its inputs: no result of its own.
def rope(q, k, cos_sin, positions):
    return q.view(q.shape), k.view(k.shape)
