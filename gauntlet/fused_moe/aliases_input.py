# expect: fail output_form — returns a view of x (the output's shape): no result of its own.
def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    return x.view(x.shape)
