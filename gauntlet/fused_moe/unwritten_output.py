# expect: fail finite — computes the first half of the hidden channels and leaves the rest as
# the allocation held them.
import torch


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter, half = w_down.shape[2], max(1, x.shape[1] // 2)
    out = torch.empty_like(x)
    acc = torch.zeros((x.shape[0], half), dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        gu = x[tokens].float() @ w_gate_up[e].float().t()
        act = gu[:, :inter] * torch.sigmoid(gu[:, :inter]) * gu[:, inter:]
        acc.index_add_(0, tokens, (act @ w_down[e, :half].float().t()) * weights[tokens, slots, None])
    out[:, :half] = acc.to(x.dtype)
    return out
