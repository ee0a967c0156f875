# expect: pass (fp8 target) — each routed expert dequantized block by block (q * scale, one
# scale per 128 x 128 block), then fused_moe's plain PyTorch rewrite, accumulated in float32.
import torch


def _dequant(q, scale):
    rows, cols = q.shape[-2:]
    s = scale.repeat_interleave(128, dim=-2)[..., :rows, :].repeat_interleave(128, dim=-1)[..., :cols]
    return q.float() * s


def fused_moe(x, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k, renormalize):
    weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():  # each expert once, on the tokens that picked it
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        gu = x[tokens].float() @ _dequant(w_gate_up[e], w_gate_up_scale[e]).t()
        act = gu[:, :inter] * torch.sigmoid(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tokens, (act @ _dequant(w_down[e], w_down_scale[e]).t()) * weights[tokens, slots, None])
    return out.to(x.dtype)
