"""What the hardware allows: the bytes a forward pass must read, its matmul FLOPs, and each
measured figure as a fraction of the bound those give with the measured ceilings.

Weight bytes of a forward pass over T tokens (each weight read once): every attention and MLP
matrix, the norms and the LM head; of the embedding table only the T rows looked up. For an MoE
layer the router and only the experts the T tokens route to: k of them for one token, and for
T tokens the expected number of distinct experts when each token picks k of E uniformly,
E * (1 - (1 - k/E)^T). With FP8 weights the matrices (attention, MLP, experts) count one byte a
parameter; their scales (4 bytes per 128 x 128 block, or per row) are left out, under 0.1%.

A decode step also reads each sequence's KV cache: K and V of every cached position in every
layer (`kv_bytes`). The decode and concurrent bounds count it at the phase's mean context, so a
fraction of the roofline stays honest at long contexts (at 32k tokens qwen3-8b reads 4.8 GB of
cache a step beside its 15 GB of weights). A prefill's bound is its weights alone.
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


def weight_bytes(cfg: ModelConfig, tokens: int, itemsize: int, matrix_itemsize: float | None = None) -> float:
    """Bytes of weights one forward pass over `tokens` tokens reads, each weight once; the layers'
    matrices at `matrix_itemsize` bytes a parameter (1 for FP8) when given."""
    h = cfg.hidden
    router = cfg.experts * h if cfg.is_moe else 0
    matrices = cfg.layers * (_layer_matrices(cfg, tokens) - router)
    per_layer = router + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)  # norms, and Qwen3's q/k norms
    per_layer += (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
    rest = cfg.layers * per_layer + h + cfg.vocab * h + min(tokens, cfg.vocab) * h
    return matrices * (itemsize if matrix_itemsize is None else matrix_itemsize) + rest * itemsize


def kv_bytes(cfg: ModelConfig, context: float, itemsize: int) -> float:
    """Bytes of KV cache one decode step reads for one sequence of `context` cached positions (its
    last sliding_window positions, where the model has a window)."""
    if cfg.sliding_window is not None:
        context = min(context, cfg.sliding_window)
    return 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * context * itemsize


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of one prompt of `tokens` tokens: the weights (k experts a token for MoE),
    causal attention, and the LM head at the last position only."""
    h, hd = cfg.hidden, cfg.head_dim
    attn_w = (cfg.heads + 2 * cfg.kv_heads) * hd * h + h * cfg.heads * hd
    mlp_w = (cfg.experts * h + cfg.experts_per_token * 3 * cfg.moe_intermediate * h) if cfg.is_moe \
        else 3 * cfg.intermediate * h
    pairs = tokens * (tokens + 1) / 2  # the causal triangle, less what is outside a sliding window
    if cfg.sliding_window is not None and tokens > cfg.sliding_window:
        w = cfg.sliding_window
        pairs = w * (w + 1) / 2 + (tokens - w) * w
    scores = 4 * cfg.heads * hd * pairs  # q.k and p.v
    return cfg.layers * (2 * tokens * (attn_w + mlp_w) + scores) + 2 * cfg.vocab * h


def bounds(cfg: ModelConfig, itemsize: int, copy_bytes_per_s: float, matmul_flops_per_s: float,
           ttft_lengths: list[int], concurrency: int, decode_context: float = 0.0,
           concurrent_context: float = 0.0, long_contexts: tuple[int, ...] = (), decode_tokens: int = 0,
           matrix_itemsize: float | None = None) -> dict:
    """The bytes roofline of every metric (and, for TTFT, the matmul-FLOP bound): decode at batch 1
    with `decode_context` cached positions on average, `concurrency` sequences at
    `concurrent_context`, and batch 1 after each prompt of `long_contexts` tokens while it makes
    `decode_tokens` more (`decode_b1_ctx<N>_tok_s`)."""
    def weights(tokens: int) -> float:
        return weight_bytes(cfg, tokens, itemsize, matrix_itemsize)

    out = {"decode_b1_tok_s": copy_bytes_per_s / (weights(1) + kv_bytes(cfg, decode_context, itemsize)),
           f"concurrent_{concurrency}_tok_s": concurrency * copy_bytes_per_s / (
               weights(concurrency) + concurrency * kv_bytes(cfg, concurrent_context, itemsize))}
    for n in long_contexts:
        out[f"decode_b1_ctx{n}_tok_s"] = copy_bytes_per_s / (weights(1) + kv_bytes(cfg, n + decode_tokens / 2, itemsize))
    for n in ttft_lengths:
        out[f"ttft_{n}_ms"] = 1e3 * weights(n) / copy_bytes_per_s
        out[f"ttft_{n}_ms_flops"] = 1e3 * prefill_flops(cfg, n) / matmul_flops_per_s
    return out


def fraction(metric: str, measured: float, roofline: float) -> float:
    """Measured over the roofline: rates directly, times (ms) inverted; 1.0 is the bound."""
    return roofline / measured if metric.endswith("_ms") else measured / roofline
