"""Vision targets: SAM 3 (image segmentation from a text or box prompt) at a preset's shape or a
config.json's.

`sam3_dims("sam3")` is a preset; `sam3_dims("path/to/model")` (a directory with config.json, or the
file) reads a SAM 3 config (model_type "sam3"). `Sam3Dims` holds what the vision ops' shapes come
from — the backbone ViT: width, heads, MLP width, patch and image size, the attention window and
the layers that attend globally — and the rest of the model's widths, from which
`sam3_hf_config` builds transformers' `Sam3Config`, the reference's (a config file's own contents
for a path). `target_dims` names either kind of model, text or vision. No torch here: the
platform's side reads targets too; `write_random_sam3` imports it when it runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine_templates.hf_config import ConfigError, _int, _number, config_path, digest, model_dims
from engine_templates.models import PRESETS, ModelDims

ARCH = "sam3"  # the HF model_type of a SAM 3 config.json


@dataclass(frozen=True)
class Sam3Dims:
    """SAM 3's widths; the defaults are the public model's (facebook/sam3, transformers' Sam3Config)."""

    name: str
    # the backbone ViT: every layer LayerNorm -> attention with 2D axial RoPE -> LayerNorm -> MLP (exact GELU)
    hidden: int = 1024
    intermediate: int = 4736
    layers: int = 32
    heads: int = 16
    patch_size: int = 14
    image_size: int = 1008
    pretrain_image_size: int = 336  # the learned position embeddings' grid, tiled over the image
    window_size: int = 24  # the windowed layers attend within window_size x window_size patches
    global_layers: tuple[int, ...] = (7, 15, 23, 31)  # these attend over the whole image
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # the neck, the DETR encoder and decoder, the geometry encoder and the mask decoder
    fpn_hidden: int = 256
    decoder_heads: int = 8
    decoder_intermediate: int = 2048
    detr_layers: int = 6
    geometry_layers: int = 3
    queries: int = 200
    # the text encoder (CLIP's)
    text_hidden: int = 1024
    text_layers: int = 24
    text_heads: int = 16
    text_intermediate: int = 4096
    text_vocab: int = 49408
    arch: str = field(default=ARCH)
    config_sha256: str = ""  # of a config.json's parsed contents; "" for a preset

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> int:
        """Patches along each side of an image."""
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.grid * self.grid

    @property
    def windows_per_image(self) -> int:
        """Windows a windowed layer cuts an image into (the grid padded up to whole windows)."""
        per_side = -(-self.grid // self.window_size)
        return per_side * per_side

    @property
    def window_tokens(self) -> int:
        return self.window_size * self.window_size

    @property
    def is_moe(self) -> bool:
        return False


SAM3_PRESETS: dict[str, Sam3Dims] = {
    d.name: d
    for d in (
        Sam3Dims("sam3"),
        # Small enough for the Triton interpreter on a CPU: a 10 x 10 grid cut into 4 x 4 windows
        # (so the last ones are padded), 3 heads of 16, odd widths.
        Sam3Dims("sam3-tiny", hidden=48, intermediate=136, layers=2, heads=3, patch_size=8, image_size=80,
                 pretrain_image_size=32, window_size=4, global_layers=(1,), fpn_hidden=32, decoder_heads=2,
                 decoder_intermediate=64, detr_layers=1, geometry_layers=1, queries=8, text_hidden=32,
                 text_layers=1, text_heads=2, text_intermediate=64, text_vocab=49408),
    )
}


def is_vision_model(model: str) -> bool:
    """Whether `model` names a vision model: a SAM 3 preset, or a config.json of model_type sam3."""
    if model in SAM3_PRESETS:
        return True
    if model in PRESETS:
        return False
    path = config_path(model)
    try:
        return path.is_file() and json.loads(path.read_text()).get("model_type") == ARCH
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False  # the text reader names what is wrong with it


def target_dims(model: str) -> ModelDims | Sam3Dims:
    """A text or vision preset by name, else the model whose config.json `model` names."""
    if is_vision_model(model):
        return sam3_dims(model)
    if model not in PRESETS and not config_path(model).is_file():
        where = f"{Path(model)} has no config.json" if Path(model).is_dir() else "no such file or directory"
        raise ConfigError(f"{model!r} is neither a model preset ({', '.join([*PRESETS, *SAM3_PRESETS])}) nor a "
                          f"model's config.json ({where})")
    return model_dims(model)


def sam3_dims(model: str) -> Sam3Dims:
    """A SAM 3 preset by name, else the SAM 3 config.json `model` names (ConfigError: one line)."""
    if model in SAM3_PRESETS:
        return SAM3_PRESETS[model]
    path = config_path(model)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{model!r} is neither a SAM 3 preset ({', '.join(SAM3_PRESETS)}) nor a readable "
                          f"config.json ({e})") from None
    try:
        return parse_sam3_config(raw, name=str(path.parent if path.name == "config.json" else path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _section(raw: dict, *keys: str) -> dict:
    for key in keys:
        raw = raw.get(key) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{'.'.join(keys)}: expected an object")
    return raw


def parse_sam3_config(raw: dict, name: str) -> Sam3Dims:
    if not isinstance(raw, dict) or raw.get("model_type") != ARCH:
        raise ConfigError(f"model_type {json.dumps(raw.get('model_type') if isinstance(raw, dict) else None)} "
                          f"is not a SAM 3 config (expected \"{ARCH}\")")
    d = Sam3Dims(name)
    vit, vision = _section(raw, "vision_config", "backbone_config"), _section(raw, "vision_config")
    text, dec = _section(raw, "text_config"), _section(raw, "detr_decoder_config")
    hidden, heads = _int(vit, "hidden_size", d.hidden), _int(vit, "num_attention_heads", d.heads)
    if hidden % heads or (hidden // heads) % 4:
        raise ConfigError(f"vision_config.backbone_config: num_attention_heads {heads} must divide hidden_size "
                          f"{hidden} into heads of a multiple of 4 (2D rotary: a pair per axis)")
    if vit.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"vision_config.backbone_config.hidden_act {json.dumps(vit['hidden_act'])} is not "
                          f"supported (supported: gelu)")
    rope = vit.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"vision_config.backbone_config.rope_parameters.rope_type {json.dumps(rope['rope_type'])} "
                          f"is not supported (supported: axial)")
    layers = _int(vit, "num_hidden_layers", d.layers)
    global_layers = vit.get("global_attn_indexes", list(d.global_layers))
    if not isinstance(global_layers, list) or not all(isinstance(i, int) and 0 <= i < layers
                                                      for i in global_layers):
        raise ConfigError(f"vision_config.backbone_config.global_attn_indexes: expected layer indexes below "
                          f"{layers}, not {json.dumps(global_layers)}")
    patch, image = _int(vit, "patch_size", d.patch_size), _int(vit, "image_size", d.image_size)
    if image < patch:
        raise ConfigError(f"vision_config.backbone_config.image_size {image} is smaller than patch_size {patch}")
    return Sam3Dims(
        name=name, hidden=hidden, intermediate=_int(vit, "intermediate_size", d.intermediate), layers=layers,
        heads=heads, patch_size=patch, image_size=image,
        pretrain_image_size=_int(vit, "pretrain_image_size", d.pretrain_image_size),
        window_size=_int(vit, "window_size", d.window_size), global_layers=tuple(global_layers),
        layer_norm_eps=_number(vit, "layer_norm_eps", d.layer_norm_eps),
        rope_theta=_number(rope, "rope_theta", d.rope_theta),
        fpn_hidden=_int(vision, "fpn_hidden_size", d.fpn_hidden),
        decoder_heads=_int(dec, "num_attention_heads", d.decoder_heads),
        decoder_intermediate=_int(dec, "intermediate_size", d.decoder_intermediate),
        detr_layers=_int(dec, "num_layers", d.detr_layers),
        geometry_layers=_int(_section(raw, "geometry_encoder_config"), "num_layers", d.geometry_layers),
        queries=_int(dec, "num_queries", d.queries), text_hidden=_int(text, "hidden_size", d.text_hidden),
        text_layers=_int(text, "num_hidden_layers", d.text_layers),
        text_heads=_int(text, "num_attention_heads", d.text_heads),
        text_intermediate=_int(text, "intermediate_size", d.text_intermediate),
        text_vocab=_int(text, "vocab_size", d.text_vocab), config_sha256=digest(raw))


def sam3_hf_config(model: str):
    """transformers' Sam3Config of `model`: a config file's own contents, or a preset's numbers."""
    from transformers import Sam3Config

    d = sam3_dims(model)
    if model not in SAM3_PRESETS:
        return Sam3Config.from_dict(json.loads(config_path(model).read_text()))
    g = d.grid
    backbone = {"hidden_size": d.hidden, "intermediate_size": d.intermediate, "num_hidden_layers": d.layers,
                "num_attention_heads": d.heads, "patch_size": d.patch_size, "image_size": d.image_size,
                "pretrain_image_size": d.pretrain_image_size, "window_size": d.window_size,
                "global_attn_indexes": list(d.global_layers), "layer_norm_eps": d.layer_norm_eps,
                "rope_parameters": {"rope_theta": d.rope_theta, "rope_type": "axial"}, "hidden_act": "gelu",
                "model_type": "sam3_vit_model"}
    decoder = {"hidden_size": d.fpn_hidden, "num_attention_heads": d.decoder_heads,
               "intermediate_size": d.decoder_intermediate}
    return Sam3Config(
        vision_config={"backbone_config": backbone, "fpn_hidden_size": d.fpn_hidden,
                       "backbone_feature_sizes": [[4 * g, 4 * g], [2 * g, 2 * g], [g, g]]},
        text_config={"model_type": "clip_text_model", "hidden_size": d.text_hidden,
                     "intermediate_size": d.text_intermediate, "num_hidden_layers": d.text_layers,
                     "num_attention_heads": d.text_heads, "vocab_size": d.text_vocab, "projection_dim": 512,
                     "max_position_embeddings": 32, "hidden_act": "gelu"},
        geometry_encoder_config={**decoder, "num_layers": d.geometry_layers},
        detr_encoder_config={**decoder, "num_layers": d.detr_layers},
        detr_decoder_config={**decoder, "num_layers": d.detr_layers, "num_queries": d.queries},
        mask_decoder_config={"hidden_size": d.fpn_hidden, "num_attention_heads": d.decoder_heads})
