# expect: pass — keeps float32, transposed copies of the expert weights, keyed on the weight
# tensors' pointers as an engine would (its weights are loaded once and never change). The op
# declares w_gate_up and w_down persistent, so the caching probe leaves them alone; a probe that
# refilled them would reject this honest candidate.
import torch

_experts: dict = {}


def _transposed_f32(w):
    key = (w.data_ptr(), tuple(w.shape))
    if key not in _experts:
        if len(_experts) > 8:
            _experts.clear()
        _experts[key] = (w, w.float().transpose(1, 2).contiguous())  # holding w keeps its pointer unique
    return _experts[key][1]


def fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    gate_up_t, down_t = _transposed_f32(w_gate_up), _transposed_f32(w_down)
    weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = down_t.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tokens, slots = (experts == e).nonzero(as_tuple=True)
        gu = x[tokens].float() @ gate_up_t[e]
        act = gu[:, :inter] * torch.sigmoid(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tokens, (act @ down_t[e]) * weights[tokens, slots, None])
    return out.to(x.dtype)
