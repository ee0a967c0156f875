"""The SAM 3 model configurations the engine knows by name, and a random checkpoint at one.

`sam3-tiny` is a few hundred thousand parameters of every SAM 3 part (ViT with windowed and
global RoPE attention, FPN neck, CLIP text encoder, DETR encoder and decoder, mask decoder), sized
to run in milliseconds on a CPU. `sam3` is the public checkpoint's configuration (transformers'
defaults)."""
from __future__ import annotations

import json
from pathlib import Path

CONTEXT_LENGTH = 32  # text tokens per prompt, as SAM 3's processor pads them (max_length=32)


def tiny_config() -> dict:
    """The sam3-tiny configuration, as keyword arguments of transformers' Sam3Config."""
    return {
        "vision_config": {"backbone_config": {
            "model_type": "sam3_vit_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": 112, "patch_size": 14, "window_size": 4,
            "global_attn_indexes": [1], "pretrain_image_size": 56},
            "fpn_hidden_size": 32, "backbone_feature_sizes": [[32, 32], [16, 16], [8, 8]]},
        "text_config": {"vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "max_position_embeddings": CONTEXT_LENGTH, "projection_dim": 32,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        "geometry_encoder_config": {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2,
                                    "intermediate_size": 64},
        "detr_encoder_config": {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
        "detr_decoder_config": {"hidden_size": 32, "num_layers": 2, "num_queries": 8, "num_attention_heads": 2,
                                "intermediate_size": 64},
        "mask_decoder_config": {"hidden_size": 32, "num_upsampling_stages": 3, "num_attention_heads": 2},
    }


PRESETS = {"sam3-tiny": tiny_config, "sam3": dict}
# the ViT attention gains below, per preset: only the tiny model's two layers take them; 32
# layers of sharpened attention amplify a rounding into a different answer (chaos, not a model)
VIT_GAINS = {"sam3-tiny": True, "sam3": False}

# Random weights of transformers' initialization give mask logits of about 1e-5: no pixel is
# confidently in or out. The mask embedder's last layer is scaled so that their standard deviation
# on a random image is MASK_LOGIT_STD, as a trained model's spread over several units either side
# of 0, and the accuracy gate sees both kinds of pixel. (The logits are linear in that layer.)
MASK_LOGIT_STD = 1.5
# Likewise its ViT's attention is near uniform (q.k of about 1e-3) and adds little to the residual
# stream: blind to positions. Its query and key projections are scaled so that attention picks
# out neighbours, and its value and output projections so that what it picks counts, as in a
# trained ViT.
ATTENTION_GAIN = 12.0
VALUE_GAIN = 6.0


def write_random_checkpoint(preset: str, out: Path, seed: int = 0) -> Path:
    """A model directory (config.json, model.safetensors, tokenizer.json) with random weights
    at the preset's shape; the tokenizer is a byte-level BPE trained on a little English, padded
    to the text encoder's vocabulary (the text engine's, engine/random_checkpoint.py)."""
    import torch
    from transformers import Sam3Config, Sam3Model

    from engine_templates.engine.random_checkpoint import train_tokenizer

    if preset not in PRESETS:
        raise KeyError(f"unknown SAM 3 preset {preset!r}; known: {', '.join(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Sam3Config(**PRESETS[preset]())
    model = Sam3Model(config).eval()
    with torch.no_grad():
        for layer in model.vision_encoder.backbone.layers if VIT_GAINS[preset] else ():
            layer.attention.q_proj.weight.mul_(ATTENTION_GAIN)
            layer.attention.k_proj.weight.mul_(ATTENTION_GAIN)
            layer.attention.v_proj.weight.mul_(VALUE_GAIN)
            layer.attention.o_proj.weight.mul_(VALUE_GAIN)
        _calibrate_mask_logits(model, config)
    model.save_pretrained(out)
    vocab = config.text_config.vocab_size
    train_tokenizer(out, bpe_vocab=min(600, vocab), pad_to=vocab)
    meta = json.loads((out / "config.json").read_text())
    meta["infersmith_preset"] = preset
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return out


def _calibrate_mask_logits(model, config) -> None:
    """Scales the mask embedder's last layer so that the mask logits' std is MASK_LOGIT_STD on a
    random image and prompt (one forward, on a GPU where there is one)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = config.vision_config.backbone_config.image_size
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(1, 3, size, size, generator=generator)
    ids = torch.randint(3, config.text_config.vocab_size, (1, 8), generator=generator)
    model.to(device)
    std = model(pixel_values=pixels.to(device), input_ids=ids.to(device)).pred_masks.float().std().item()
    model.to("cpu")
    last = model.mask_decoder.mask_embedder.layers[-1]
    last.weight.mul_(MASK_LOGIT_STD / std)
    if last.bias is not None:
        last.bias.mul_(MASK_LOGIT_STD / std)
