"""What the hardware allows: the weight bytes a forward pass must read, its matmul FLOPs, and
each measured figure as a fraction of the bound those give with the measured ceilings.

Weight bytes of a forward pass over T tokens (each weight read once): every attention and MLP
matrix, the norms and the LM head; of the embedding table only the T rows looked up. For an MoE
layer the router and only the experts the T tokens route to: k of them for one token, and for
T tokens the expected number of distinct experts when each token picks k of E uniformly,
E * (1 - (1 - k/E)^T). The KV cache is not counted: at these lengths it is small next to the
weights, and leaving it out keeps the bound a pure weight-streaming one.
"""
from __future__ import annotations

from engine_templates.engine.config import ModelConfig


def experts_hit(cfg: ModelConfig, tokens: int) -> float:
    e, k = cfg.experts, cfg.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def _layer_matrices(cfg: ModelConfig, tokens: int) -> float:
    """Parameters of one layer's matrices that `tokens` tokens read (experts: those routed to)."""
    h, hd = cfg.hidden, cfg.head_dim
    attn = (cfg.heads + 2 * cfg.kv_heads) * hd * h + h * cfg.heads * hd
    if cfg.is_moe:
        mlp = cfg.experts * h + experts_hit(cfg, tokens) * 3 * cfg.moe_intermediate * h
    else:
        mlp = 3 * cfg.intermediate * h
    return attn + mlp


def weight_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> float:
    """Bytes of weights one forward pass over `tokens` tokens reads, each weight once."""
    h = cfg.hidden
    norms = cfg.layers * (2 * h + 2 * cfg.head_dim) + h
    params = cfg.layers * _layer_matrices(cfg, tokens) + norms + cfg.vocab * h + min(tokens, cfg.vocab) * h
    return params * itemsize


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of one prompt of `tokens` tokens: the weights (k experts a token for MoE),
    causal attention, and the LM head at the last position only."""
    h, hd = cfg.hidden, cfg.head_dim
    attn_w = (cfg.heads + 2 * cfg.kv_heads) * hd * h + h * cfg.heads * hd
    mlp_w = (cfg.experts * h + cfg.experts_per_token * 3 * cfg.moe_intermediate * h) if cfg.is_moe \
        else 3 * cfg.intermediate * h
    scores = 4 * cfg.heads * hd * tokens * (tokens + 1) / 2  # q.k and p.v over the causal triangle
    return cfg.layers * (2 * tokens * (attn_w + mlp_w) + scores) + 2 * cfg.vocab * h


def bounds(cfg: ModelConfig, itemsize: int, copy_bytes_per_s: float, matmul_flops_per_s: float,
           ttft_lengths: list[int], concurrency: int) -> dict:
    """The weight-bytes roofline of every metric (and, for TTFT, the matmul-FLOP bound)."""
    out = {"decode_b1_tok_s": copy_bytes_per_s / weight_bytes(cfg, 1, itemsize),
           f"concurrent_{concurrency}_tok_s":
               concurrency * copy_bytes_per_s / weight_bytes(cfg, concurrency, itemsize)}
    for n in ttft_lengths:
        out[f"ttft_{n}_ms"] = 1e3 * weight_bytes(cfg, n, itemsize) / copy_bytes_per_s
        out[f"ttft_{n}_ms_flops"] = 1e3 * prefill_flops(cfg, n) / matmul_flops_per_s
    return out


def fraction(metric: str, measured: float, roofline: float) -> float:
    """Measured over the roofline: rates directly, times (ms) inverted; 1.0 is the bound."""
    return roofline / measured if metric.endswith("_ms") else measured / roofline
