# expect: pass (flagged side_stream, for a look) — replays a CUDA graph on a GPU, one a shape as an
# engine captures one a batch size, warmed on a side stream that is joined back, as capture
# requires; plain PyTorch on a CPU. Keyed on the shape, not the input's pointer: the bench rotates
# up to 2048 input sets a shape, and a graph a pointer (each with its own private memory pool of
# at least 2 MiB, kept across shapes) held 8 GiB by the second tiny shape.
import torch

_graphs = {}


def _compute(x, weight, eps, out):
    h = x.float()
    out.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float())


def rmsnorm(x, weight, eps):
    if not x.is_cuda:
        out = torch.empty_like(x)
        _compute(x, weight, eps, out)
        return out
    key = (tuple(x.shape), x.dtype, eps)  # the caller's values are copied in below, whatever their storage
    if key not in _graphs:
        static_x, static_w, static_out = x.clone(), weight.clone(), torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _compute(static_x, static_w, eps, static_out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _compute(static_x, static_w, eps, static_out)
        _graphs[key] = (graph, static_x, static_w, static_out)
    graph, static_x, static_w, static_out = _graphs[key]
    static_x.copy_(x)  # the graph reads its own buffers: the caller's current values go in
    static_w.copy_(weight)
    graph.replay()
    return static_out.clone()
