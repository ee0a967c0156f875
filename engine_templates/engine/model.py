"""The forward pass of every architecture of models.ARCHITECTURES over a paged KV cache, every hot
op from a KernelSet. They differ in three places only: Qwen3's per-head q/k norms (qk_norm_rope;
the others rotate with rope), Qwen2's q/k/v biases, and a MoE block (Qwen3-MoE's, Mixtral's:
softmax over the experts, top-k, weights renormalised where the config says) in place of the MLP.

Weights are plain tensors (no nn.Module): `DecoderModel.weights()` names each one the way HF
transformers (5.x) names its parameters — the MoE experts stacked per layer as
`mlp.experts.gate_up_proj` [experts, 2 * inter, hidden] and `mlp.experts.down_proj`, for Mixtral
too — so the loader can fill them and an HF model can share them. The matmuls are torch's (through
fp8.Fp8Linear where the config quantizes the linear layers and experts to FP8: those weights are
then fp8.Fp8Weight); the rest is the kernels' (FP8 experts through fp8_moe.Fp8MoE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_templates.engine.config import ModelConfig
from engine_templates.engine.fp8 import Fp8Linear, Fp8Weight, quantize
from engine_templates.engine.fp8_moe import Fp8MoE
from engine_templates.engine.kernels import KernelSet


@dataclass
class AttentionInputs:
    """Where this step's tokens go in the cache and what they attend to."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [tokens]: flat cache row of each new token's K/V
    seq_lens: torch.Tensor  # int32 [batch]: cache positions of each sequence after this step
    block_table: torch.Tensor  # int32 [batch, max_blocks]
    cu_seqlens_q: torch.Tensor | None = None  # int32 [batch + 1], prefill only


EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Layer:
    def __init__(self, cfg: ModelConfig, index: int, tensor, stacked, biases):
        h, hd, p = cfg.hidden, cfg.head_dim, f"model.layers.{index}."
        self.input_norm = tensor(p + "input_layernorm.weight", h)
        self.post_attention_norm = tensor(p + "post_attention_layernorm.weight", h)
        # q, k and v stacked in one matrix: one matmul reads them (at decode, one long GEMV
        # streams better than three, the k and v ones small)
        self.qkv_split = (cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)
        self.qkv = stacked([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                            p + "self_attn.v_proj.weight"], self.qkv_split, h)
        self.qkv_bias = (biases([p + f"self_attn.{x}_proj.bias" for x in "qkv"], self.qkv_split)
                         if cfg.qkv_bias else None)
        self.o_proj = tensor(p + "self_attn.o_proj.weight", h, cfg.heads * hd, fp8=True)
        if cfg.qk_norm:
            self.q_norm = tensor(p + "self_attn.q_norm.weight", hd)
            self.k_norm = tensor(p + "self_attn.k_norm.weight", hd)
        self.is_moe = index in cfg.moe_layers
        if self.is_moe:
            n = cfg.moe_intermediate
            self.router = tensor(p + "mlp.gate.weight", cfg.experts, h)
            # each expert's gate rows, then its up rows
            self.w_gate_up = tensor(p + EXPERT_STACKS[0], cfg.experts, 2 * n, h, fp8=True, part_rows=n)
            self.w_down = tensor(p + EXPERT_STACKS[1], cfg.experts, h, n, fp8=True)
        else:
            self.gate_up = stacked([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                   (cfg.intermediate, cfg.intermediate), h)
            self.down_proj = tensor(p + "mlp.down_proj.weight", h, cfg.intermediate, fp8=True)


class DecoderModel:
    def __init__(self, cfg: ModelConfig, kernels: KernelSet | None, cos_sin: torch.Tensor | None,
                 dtype: torch.dtype, device: str, weights: dict[str, torch.Tensor] | None = None,
                 window: int | None = None):
        """Empty weights for a loader to fill, or `weights` (every name of `weights()`) used as
        they are, not copied: models built from one dict share their storage — except the
        matrices the model stacks (q/k/v, and a dense MLP's gate/up), which it copies into one
        tensor each and then names as row views of it, and, when cfg.fp8 asks for FP8, the
        linear layers and experts given in another dtype, which it quantizes. `window`: attend
        each position's last `window` positions only (the *_swa ops), None: all before it."""
        self.cfg = cfg
        self.window = window
        self.k = kernels
        self.cos_sin = cos_sin
        self.scale = cfg.head_dim ** -0.5
        self._weights: dict[str, torch.Tensor | Fp8Weight] = {}
        scheme = cfg.fp8
        self.linear = Fp8Linear(torch.device(device), dtype) if scheme else F.linear

        def block(rows: int, cols: int) -> tuple[int, int]:
            """The scale blocks of a matrix whose stacked parts have `rows` rows each: the scheme's,
            or one scale row per weight row where the parts do not align with its block rows."""
            br, bc = scheme.block_for(cols)
            return (br if rows % br == 0 else 1), bc

        def tensor(name: str, *shape: int, fp8: bool = False, part_rows: int = 0):
            quantized = fp8 and scheme is not None
            if weights is None:
                t = (Fp8Weight.empty(shape, block(part_rows or shape[-2], shape[-1]), device) if quantized
                     else torch.empty(shape, dtype=dtype, device=device))
            else:
                t = weights[name]
                if quantized and not isinstance(t, Fp8Weight):
                    t = quantize(t, block(part_rows or shape[-2], shape[-1]))
                assert tuple(t.shape) == shape and (quantized or t.dtype == dtype), \
                    f"{name}: {tuple(t.shape)} {getattr(t, 'dtype', 'fp8')}, expected {shape} {dtype}"
            self._weights[name] = t
            return t

        def stacked(names: list[str], rows: tuple[int, ...], cols: int):
            if scheme is None:
                whole = torch.empty((sum(rows), cols), dtype=dtype, device=device)
                parts = whole.split(rows)
            else:
                blocks = block(math.gcd(*rows), cols)
                whole = Fp8Weight.empty((sum(rows), cols), blocks, device)
                ends = [sum(rows[:i + 1]) for i in range(len(rows))]
                parts = [whole.rows(end - r, end) for r, end in zip(rows, ends)]
            for name, part in zip(names, parts):
                if weights is not None:
                    given = weights[name]
                    if scheme is not None and not isinstance(given, Fp8Weight):
                        given = quantize(given, part.block)
                    assert given.shape == part.shape and (scheme is not None or given.dtype == dtype), \
                        f"{name}: {tuple(given.shape)}, expected {tuple(part.shape)} {dtype}"
                    part.copy_(given)
                self._weights[name] = part
            return whole

        def biases(names: list[str], rows: tuple[int, ...]):
            """One vector of the parts' biases, kept in the model's dtype (FP8 or not)."""
            whole = torch.empty(sum(rows), dtype=dtype, device=device)
            for name, part in zip(names, whole.split(rows)):
                if weights is not None:
                    assert weights[name].shape == part.shape, f"{name}: {tuple(weights[name].shape)}"
                    part.copy_(weights[name])
                self._weights[name] = part
            return whole

        self.embed = tensor("model.embed_tokens.weight", cfg.vocab, cfg.hidden)
        self.layers = [Layer(cfg, i, tensor, stacked, biases) for i in range(cfg.layers)]
        self.norm = tensor("model.norm.weight", cfg.hidden)
        self.lm_head = self.embed if cfg.tie_embeddings else tensor("lm_head.weight", cfg.vocab, cfg.hidden)
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        moe = next((layer for layer in self.layers if layer.is_moe), None)
        self.moe_fp8 = (Fp8MoE(kernels, moe.w_gate_up, moe.w_down, cfg.experts_per_token, dtype)
                        if kernels is not None and moe is not None and isinstance(moe.w_gate_up, Fp8Weight)
                        else None)
        self.moe_prefill = None  # moe_prefill.MoEPrefill where the engine runs large calls through it

    def weights(self) -> dict[str, torch.Tensor | Fp8Weight]:
        """Every weight by its HF transformers name (a tied lm_head is the embedding, not listed)."""
        return dict(self._weights)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionInputs) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm."""
        k, eps = self.k, self.cfg.rms_eps
        hidden = F.embedding(input_ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, x = hidden, k.rmsnorm(hidden, layer.input_norm, eps)
            else:
                x, residual = k.fused_add_rmsnorm(hidden, residual, layer.input_norm, eps)
            x = self._attention(i, layer, x, positions, attn)
            x, residual = k.fused_add_rmsnorm(x, residual, layer.post_attention_norm, eps)
            hidden = self._moe(layer, x) if layer.is_moe else self._mlp(layer, x)
        out, _ = k.fused_add_rmsnorm(hidden, residual, self.norm, eps)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    def _attention(self, i: int, layer: Layer, x, positions, attn: AttentionInputs):
        cfg, k = self.cfg, self.k
        tokens, hd = x.shape[0], cfg.head_dim
        if layer.qkv_bias is None:
            qkv = self.linear(x, layer.qkv)
        elif self.linear is F.linear:
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # one rounding, as transformers' nn.Linear
        else:
            qkv = self.linear(x, layer.qkv) + layer.qkv_bias
        q, key, value = (t.view(tokens, -1, hd) for t in qkv.split(layer.qkv_split, dim=-1))
        # q and k (normalized and) rotated straight from qkv's rows; v stays a view of them
        if cfg.qk_norm:
            q, key = k.qk_norm_rope(qkv, cfg.heads, cfg.kv_heads, layer.q_norm, layer.k_norm, cfg.rms_eps,
                                    self.cos_sin, positions)
        else:
            q, key = k.rope(q, key, self.cos_sin, positions)
        k_cache, v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        k_cache.view(-1, cfg.kv_heads, hd).index_copy_(0, attn.slot_mapping, key)
        v_cache.view(-1, cfg.kv_heads, hd).index_copy_(0, attn.slot_mapping, value)
        if attn.is_prefill and self.window is not None:
            out = k.prefill_attention_swa(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                          attn.block_table, self.scale, self.window)
        elif attn.is_prefill:
            out = k.prefill_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                      attn.block_table, self.scale)
        elif self.window is not None:
            out = k.decode_attention_swa(q, k_cache, v_cache, attn.seq_lens, attn.block_table, self.scale,
                                         self.window)
        else:
            out = k.decode_attention(q, k_cache, v_cache, attn.seq_lens, attn.block_table, self.scale)
        return self.linear(out.reshape(tokens, -1), layer.o_proj)

    def _mlp(self, layer: Layer, x):
        gate, up = (t.contiguous() for t in self.linear(x, layer.gate_up).chunk(2, dim=-1))
        return self.linear(self.k.silu_mul(gate, up), layer.down_proj)

    def _moe(self, layer: Layer, x):
        router_logits = F.linear(x, layer.router)
        moe = self.moe_fp8 if isinstance(layer.w_gate_up, Fp8Weight) else self.k.fused_moe
        if self.moe_prefill is not None and self.moe_prefill.takes(x):
            return self.moe_prefill(x, router_logits, layer.w_gate_up, layer.w_down, self.cfg.experts_per_token,
                                    self.cfg.norm_topk_prob, moe)
        return moe(x, router_logits, layer.w_gate_up, layer.w_down, self.cfg.experts_per_token,
                   self.cfg.norm_topk_prob)
