# expect: fail accuracy — sends each token to its best expert alone (top-1 with weight 1): close
# when one expert dominates the routing, wrong in general.
import torch


def _moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():  # each expert once, on the tokens that picked it
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        gu = x[tokens].float() @ w_gate_up[e].float().t()
        act = gu[:, :inter] * torch.sigmoid(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tokens, (act @ w_down[e].float().t()) * weights[tokens, slots, None])
    return out.to(x.dtype)


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    return _moe(x, router_logits, w_gate_up, w_down, 1, True)
