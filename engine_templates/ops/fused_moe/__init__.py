"""Fused MoE: top-k routing from router logits, then each token's experts (gated SiLU MLPs),
summed with the routing weights. Qwen3-MoE's sparse block without the router's own matmul.

    probs = softmax(router_logits[t]);  w, experts = top_k(probs);  w /= sum(w) if renormalize
    gate, up = split(w_gate_up[e] @ x[t]);  out[t] = sum_k w_k * w_down[e_k] @ (silu(gate) * up)

x [tokens, hidden]; router_logits [tokens, experts] (in x's dtype, as the model's router
produces them); w_gate_up [experts, 2 * inter, hidden] (gate rows first, then up rows);
w_down [experts, hidden, inter]; top_k int; renormalize bool. Returns a new tensor like x.

Generated router logits are distinct multiples of 1/32 (exact in bf16/fp16), so the experts a
token picks are the same in every precision and no kernel is judged on how it breaks a tie.
Each token's top-k experts are drawn so that a shape of T tokens touches exactly
min(experts, T * top_k) distinct experts: `bytes` is the exact weight traffic of every call.

The eager baseline takes one of three paths (`eager_path`): few tokens (tokens * top_k <=
experts) `gather_moe` (each pair's expert gathered into one bmm); more run `grouped_moe` (two
torch._grouped_mm calls over the pairs sorted by expert, no host sync) where `grouped_usable`
says torch can, else `loop_moe` (one matmul per expert, after reading the per-expert counts on
the host).
"""
from __future__ import annotations

import functools

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.ops.rmsnorm import token_shapes

GEMV_TEMPLATE = Template(
    name="gemv",
    module="engine_templates.ops.fused_moe.templates",
    space={
        "block_i": [16, 32, 64, 128],  # gate/up pass: intermediate channels per program
        "block_h": [32, 64, 128, 256],  # gate/up pass: hidden channels per tile
        "block_o": [16, 32, 64, 128],  # down pass: output (hidden) channels per program
        "block_k": [32, 64, 128, 256],  # down pass: intermediate channels per tile
        "num_warps": [1, 2, 4, 8],
    },
    # Small row blocks: at decode there are top_k pairs per token, so the rows are what
    # spreads the work over the GPU's SMs.
    default={"block_i": 16, "block_h": 256, "block_o": 16, "block_k": 256, "num_warps": 4},
)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights [tokens, top_k] float32, experts [tokens, top_k] int64), as HF Qwen3-MoE routes."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


GROUPED_MM_MAX_GROUPS = 1023  # torch's CUDA grouped GEMM sets up one thread per group in one block


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def grouped_mm_device(device: torch.device) -> bool:
    """Whether torch._grouped_mm runs bf16 on `device` without a host sync: on a CUDA GPU of
    compute capability 9.x or 10.x (torch's CUTLASS kernel; on other GPUs and on ROCm torch falls
    back to a loop that copies the group offsets to the host), or on a CPU from torch 2.9 (2.8
    has no CPU kernel)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if torch.version.hip is not None:
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_capability(index)[0] in (9, 10)
    return device.type == "cpu" and torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _row_major_16b(w: torch.Tensor) -> bool:
    """[groups, rows, cols] with unit column stride and 16-byte aligned rows and groups: what
    torch._grouped_mm asks of the transposed view it is given (it checks the data pointer and
    the strides; TMA loads need 16-byte aligned addresses)."""
    align = 16 // w.element_size()
    return (w.stride(2) == 1 and w.stride(1) >= w.shape[2] and w.stride(1) % align == 0
            and w.stride(0) % align == 0 and w.data_ptr() % 16 == 0)


def grouped_fits(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `grouped_moe` runs on expert weights of these sizes in `dtype`, freshly allocated
    (contiguous, as dequantized FP8 experts are) on `device`, with activations of `dtype`: bf16, a
    device where torch._grouped_mm needs no host sync, fewer experts than its group limit, hidden
    and intermediate sizes multiples of 8 (16 bytes: the row strides)."""
    return (dtype == torch.bfloat16 and grouped_mm_device(device) and experts <= GROUPED_MM_MAX_GROUPS
            and hidden % 8 == 0 and inter % 8 == 0)


def grouped_usable(w_gate_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `grouped_moe` can run on these expert weights with activations of `dtype`:
    `grouped_fits` their sizes, both in `dtype` on one device, laid out row-major and 16-byte
    aligned. Decided from shapes, strides and the device alone: no host sync, so it may be asked
    inside a CUDA graph capture."""
    experts, _, hidden = w_gate_up.shape
    return (grouped_fits(experts, hidden, w_down.shape[2], dtype, w_gate_up.device)
            and w_gate_up.dtype == dtype and w_down.dtype == dtype and w_gate_up.device == w_down.device
            and _row_major_16b(w_gate_up) and _row_major_16b(w_down))


def eager_path(tokens: int, top_k: int, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               dtype: torch.dtype) -> str:
    """The path FusedMoE.eager takes for a call of `tokens` tokens: "gather" (few tokens, one
    bmm over each pair's expert), "grouped" (grouped_moe) or "loop" (loop_moe, the only one that
    synchronizes with the host)."""
    if tokens * top_k <= w_gate_up.shape[0]:
        return "gather"
    return "grouped" if grouped_usable(w_gate_up, w_down, dtype) else "loop"


def _swiglu(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up of gate/up rows [pairs, 2 * inter]."""
    return torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]


def _sum_slots(out: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's top_k expert outputs (rows in pair order) weighted and summed, in out's dtype."""
    return (out.view(-1, top_k, out.shape[-1]) * weights.to(out.dtype)[..., None]).sum(dim=1)


def gather_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    """The op for few tokens (decode): each (token, slot) pair's expert gathered and multiplied
    in one batch. No host sync, so a CUDA graph can capture it; it copies the experts it reads."""
    weights, experts = route(router_logits, top_k, renormalize)
    flat = experts.flatten()
    xs = x.repeat_interleave(top_k, dim=0)[:, :, None]
    act = _swiglu(torch.bmm(w_gate_up[flat], xs).squeeze(2), w_down.shape[2])
    return _sum_slots(torch.bmm(w_down[flat], act[:, :, None]).squeeze(2), weights, top_k)


def grouped_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    """The op by grouped GEMMs: the (token, slot) pairs sorted by expert (stably), the group
    ends found by a binary search of the sorted ids (torch.bincount on a GPU reads the largest id
    back to the host), x's rows gathered in that order through torch._grouped_mm with the gate/up
    and then the down weights, the rows put back in pair order and weighted. No host sync (so a
    CUDA graph should be able to capture it: not yet verified on a GPU, and the engine does not
    capture it). Needs `grouped_usable(w_gate_up, w_down, x.dtype)`."""
    weights, experts = route(router_logits, top_k, renormalize)
    ids, order = experts.flatten().sort(stable=True)
    ends = torch.arange(w_gate_up.shape[0], device=ids.device, dtype=ids.dtype)
    offs = torch.searchsorted(ids, ends, right=True, out_int32=True)  # pairs routed to experts <= e
    gu = torch._grouped_mm(x[order // top_k], w_gate_up.transpose(1, 2), offs=offs)
    down = torch._grouped_mm(_swiglu(gu, w_down.shape[2]), w_down.transpose(1, 2), offs=offs)
    return _sum_slots(torch.empty_like(down).index_copy_(0, order, down), weights, top_k)


def loop_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize):
    """The op by one matmul per expert that has pairs: the per-expert counts are read on the
    host (a sync), so a CUDA graph cannot capture it. Any dtype, device and size."""
    weights, experts = route(router_logits, top_k, renormalize)
    tokens, inter = x.shape[0], w_down.shape[2]
    flat = experts.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()  # host sync
    out = torch.zeros((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            out[pairs] = _swiglu(x[pairs // top_k] @ w_gate_up[e].t(), inter) @ w_down[e].t()
            start += n
    return _sum_slots(out, weights, top_k)


EAGER_PATHS = {"gather": gather_moe, "grouped": grouped_moe, "loop": loop_moe}


class FusedMoE(Drawn, Op):
    name = "fused_moe"
    signature = "fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize)"
    persistent = ("w_gate_up", "w_down")  # the router logits are this step's, not a weight
    summary = ("x[tokens, hidden] through its top_k of experts (softmax over router_logits"
               "[tokens, experts]; w_gate_up[experts, 2*inter, hidden], w_down[experts, hidden, "
               "inter]) -> new tensor like x")
    templates = {GEMV_TEMPLATE.name: GEMV_TEMPLATE}

    @staticmethod
    def _dims(model: ModelDims) -> dict[str, int]:
        if not model.is_moe:
            raise ValueError(f"fused_moe needs a mixture-of-experts preset; {model.name} is dense")
        return {"hidden": model.hidden, "inter": model.intermediate, "experts": model.experts,
                "top_k": model.experts_per_token}

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        return token_shapes(self._dims(model), decode_batches, prefill_tokens)

    def odd_shapes(self, model: ModelDims):
        d = self._dims(model)
        return [Shape("odd_3tokens", {**d, "tokens": 3}),
                Shape("odd_sizes", {**d, "tokens": 7, "hidden": d["hidden"] // 2 + 7,
                                    "inter": d["inter"] // 2 + 5})]

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        t, h, n, e, k = d["tokens"], d["hidden"], d["inter"], d["experts"], d["top_k"]
        assert e <= 256, "logits are multiples of 1/32 below 8, exact in bf16"
        logits = [self._logits(t, e, k, g, device, dtype) for g in gens]  # each set's own stream
        x = random_stack((t, h), dtype, device, gens, dist)
        w_gate_up = random_stack((e, 2 * n, h), dtype, device, gens, dist, scale=h ** -0.5)
        w_down = random_stack((e, h, n), dtype, device, gens, dist, scale=n ** -0.5)
        return [(*a, k, True) for a in zip(unstack(x), logits, unstack(w_gate_up), unstack(w_down))]

    @staticmethod
    def _logits(t: int, e: int, k: int, gen, device, dtype) -> torch.Tensor:
        """Router logits whose top k of token i are experts perm[(i * k + j) % e], j < k: min(e,
        t * k) distinct experts."""
        perm = torch.randperm(e, generator=gen, device=gen.device)
        chosen = perm[(torch.arange(t * k, device=gen.device) % e).view(t, k)]
        key = torch.rand((t, e), generator=gen, device=gen.device)
        key.scatter_(1, chosen, 2.0 + torch.rand((t, k), generator=gen, device=gen.device))
        ranks = key.argsort(dim=1, descending=True).argsort(dim=1)
        return ((e - ranks).float() / 32).to(device=device, dtype=dtype)

    def reference(self, x, router_logits, w_gate_up, w_down, top_k, renormalize):
        probs = torch.softmax(router_logits.double(), dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        inter = w_down.shape[2]
        gu = torch.einsum("tkoh,th->tko", w_gate_up[experts].double(), x.double())
        act = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
        out = torch.einsum("tkhi,tki->tkh", w_down[experts].double(), act)
        return (out * weights[..., None]).sum(dim=1)

    def eager(self, x, router_logits, w_gate_up, w_down, top_k, renormalize):
        path = EAGER_PATHS[eager_path(x.shape[0], top_k, w_gate_up, w_down, x.dtype)]
        return path(x, router_logits, w_gate_up, w_down, top_k, renormalize)

    def bytes(self, shape, dtype):
        d = shape.dims
        t, h, n, e = d["tokens"], d["hidden"], d["inter"], d["experts"]
        used = min(e, t * d["top_k"])  # exact for the generated routing (see the module docstring)
        return (used * 3 * n * h + 2 * t * h + t * e) * dtype.itemsize

    def flops(self, shape):
        d = shape.dims
        return 2 * d["tokens"] * d["top_k"] * 3 * d["inter"] * d["hidden"]


OP = FusedMoE()
