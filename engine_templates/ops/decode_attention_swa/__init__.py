"""Decode attention with a sliding window (Mistral's `sliding_window`): decode_attention where the
query, at position seq_lens[b] - 1, attends the last `window` positions of its sequence only:

    out[b, h] = softmax(scale * q[b, h] . K[b, lo:n, h // group]^T) . V[b, lo:n, h // group],
    n = seq_lens[b], lo = max(0, n - window)

the keys j with p - window < j <= p of the query at position p, as transformers' Mistral masks
them. Inputs, layouts and the split_kv template are decode_attention's; `window` is a dim of the
shape, the model's own.
"""
from __future__ import annotations

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.decode_attention import DecodeAttention, _cdiv, seq_lens_for

ODD_WINDOW = 7  # odd shapes' window at most: a prime, shorter than their longest sequences


def window_of(op: str, model: ModelDims) -> int:
    """The model's sliding window; ValueError (one line) for a model without one."""
    if model.sliding_window is None:
        raise ValueError(f"{op} needs a model with a sliding_window; {model.name} has none "
                         f"(the windowed presets: tiny-swa, mistral-7b-v0.1)")
    return model.sliding_window


def with_window(shapes: list[Shape], window: int) -> list[Shape]:
    return [Shape(s.label, {**s.dims, "window": window}) for s in shapes]


class Windowed:
    """An attention op's shapes, odd shapes and inputs with the model's window added: the shapes
    carry it as a dim, the inputs as their last argument. Mixed in before the op it windows."""

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        window = window_of(self.name, model)
        return with_window(super().shapes(model, decode_batches, prefill_tokens, contexts), window)

    def odd_shapes(self, model: ModelDims):
        return with_window(super().odd_shapes(model), min(window_of(self.name, model), ODD_WINDOW))

    def draw(self, shape, dtype, device, gens, dist):
        return [(*a, shape.dims["window"]) for a in super().draw(shape, dtype, device, gens, dist)]


class DecodeAttentionSWA(Windowed, DecodeAttention):
    name = "decode_attention_swa"
    signature = "decode_attention_swa(q, k_cache, v_cache, seq_lens, block_table, scale, window)"
    summary = ("decode_attention over the last `window` positions of each sequence only (a sliding "
               "window: keys p - window < j <= p of the query at position p) -> new tensor like q")

    @staticmethod
    def _read(shape: Shape) -> list[tuple[int, int]]:
        """(first, end) of the positions each sequence's query attends."""
        d = shape.dims
        return [(max(0, n - d["window"]), n) for n in seq_lens_for(d["batch"], d["context"])]

    def bytes(self, shape, dtype):
        d = shape.dims
        read = self._read(shape)
        kv = sum(end - first for first, end in read) * d["kv_heads"] * d["head_dim"] * 2 * dtype.itemsize
        q_out = 2 * d["batch"] * d["q_heads"] * d["head_dim"] * dtype.itemsize
        meta = 4 * d["batch"]  # seq_lens
        if d["paged"]:  # the table entries of the blocks in the window
            meta += 4 * sum(_cdiv(end, d["block_size"]) - first // d["block_size"] for first, end in read)
        return kv + q_out + meta

    def flops(self, shape):
        d = shape.dims
        return 4 * sum(end - first for first, end in self._read(shape)) * d["q_heads"] * d["head_dim"]


OP = DecodeAttentionSWA()
