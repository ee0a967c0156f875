"""A kernel that fails on any batch of more than one image (the ViT's windowed layers see 9
windows an image of sam3-tiny, its global layer 1 row): the engine must answer each request alone."""

from engine_templates.sam3_engine.ops import vision_attention as eager


def vision_attention(q, k, v, cos, sin, scale):
    if q.shape[0] not in (1, 9):
        raise RuntimeError(f"no batches: {q.shape[0]} rows")
    return eager(q, k, v, cos, sin, scale)


