# expect: fail caching — routes once per router-logits tensor, keyed on its pointer (holding it,
# so fresh inputs never reuse one): right on every fresh input, stale when new logits arrive in
# the same buffer, as they do every step (the logits are the router's output, not a weight).
import torch

_routes = {}


def _route(router_logits, top_k, renormalize):
    key = (router_logits.data_ptr(), tuple(router_logits.shape), top_k)
    if key not in _routes:
        weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        _routes[key] = (router_logits, weights, experts)
    return _routes[key][1], _routes[key][2]


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    weights, experts = _route(router_logits, top_k, renormalize)
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        gu = x[tokens].float() @ w_gate_up[e].float().t()
        act = gu[:, :inter] * torch.sigmoid(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tokens, (act @ w_down[e].float().t()) * weights[tokens, slots, None])
    return out.to(x.dtype)
