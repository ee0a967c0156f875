"""`engine random-checkpoint`: a HuggingFace-format model directory with random weights at a
model preset's shape, or a config.json's, for running the end-to-end stage where no real
checkpoint can be fetched.

config.json as the public checkpoints of the architecture write it; bf16 weights drawn on the device
as `engine bench` draws them (loader.random_tensors: the same seed, the same tensors), one tensor
at a time, into safetensors shards of at most ~4 GB with HF's model.safetensors.index.json, so the
host holds at most a shard and its serialisation; a byte-level BPE tokenizer trained here on a
little English, padded with plain added tokens up to the model's vocabulary so that every id the
random model emits decodes to text, and Qwen's ChatML chat template.

A vision model (a SAM 3 preset or config, engine_templates/vision.py) is transformers' Sam3Model as
its own initialisation draws it from the seed, calibrated so that its masks are not all of one kind
(see MASK_LOGIT_STD), in bf16, written by save_pretrained (config.json and safetensors), with the
same tokenizer padded to its text encoder's vocabulary: the SAM 3 engine's model directory.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine_templates.engine.config import EngineSetupError, ModelConfig, pick_device
from engine_templates.engine.tokenizer import CHATML
from engine_templates.models import ARCHITECTURES

# Ordinary English, so that AIPerf's synthetic prompts (English prose) get English-like merges.
CORPUS = [
    "The morning train was late again, so she read the news on her phone while she waited.",
    "He opened the window, and the smell of fresh bread came up from the bakery below.",
    "We walked along the river until the light began to fade and the air grew cold.",
    "Please send me the report by Friday; I would like to read it before the meeting.",
    "The children played in the garden while their parents talked about the weather.",
    "A good teacher listens first, asks simple questions, and gives students time to think.",
    "The city council voted to build a new library near the old market square.",
    "After dinner they washed the dishes, turned off the lights, and went to bed early.",
    "It is hard to say what will happen next year, but most people remain hopeful.",
    "The doctor told him to rest for a week, drink plenty of water, and avoid stress.",
    "Our company has grown quickly, and we are looking for people who enjoy hard problems.",
    "She wrote a long letter to her brother, who had moved to another country last spring.",
    "The road through the mountains is narrow, so drivers must be careful in winter.",
    "When the music started, everyone stood up and began to dance in the small hall.",
    "I have never seen such a beautiful sunset; the whole sky turned orange and red.",
    "The students were asked to explain their answers in their own words.",
    "Water boils at one hundred degrees at sea level, but at a lower temperature on a mountain.",
    "The history of the town goes back more than a thousand years, to a small farming village.",
    "If you have any questions about your order, you can call us or write an email.",
    "The old man sat on the bench every afternoon, feeding the birds and watching the boats.",
    "Good health depends on sleep, exercise, and a diet with fruit and vegetables.",
    "The story follows a young woman who leaves her home to find work in the capital.",
    "Prices rose again this month, and many families are spending less on travel.",
    "He forgot his keys at the office and had to wait outside until his wife came home.",
    "Scientists have found that some birds can remember hundreds of hiding places for food.",
    "The meeting was moved to Tuesday because two members of the team were ill.",
    "They built the house themselves, one room at a time, over nearly ten years.",
    "Reading every day is one of the best ways to learn new words and ideas.",
    "The museum is open from nine in the morning until five in the evening, except on Mondays.",
    "What do you think we should do if it rains during the concert on Saturday?",
    "Numbers such as 3, 17, 250 and 1,000 appear in prices, dates and addresses.",
    "The king and the queen walked slowly through the castle, speaking of war and peace.",
    "My friend says that the best coffee in town is sold at a small shop by the station.",
    "Love, time and honour are old themes, and poets have written about them for centuries.",
]
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BPE_VOCAB = 4096  # merges stop earlier when the corpus runs out of pairs
MAX_SHARD_BYTES = 4 * 10**9


def train_tokenizer(out: Path, corpus: Iterable[str] = CORPUS, bpe_vocab: int = BPE_VOCAB,
                    pad_to: int | None = None) -> dict[str, int]:
    """Writes tokenizer.json and tokenizer_config.json: a byte-level BPE trained on `corpus`, the
    special tokens first, then, with `pad_to`, plain (not special) added tokens `<|rID|>` up to
    that many ids — they decode to text and encode back to themselves. Returns the special ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    size = tok.get_vocab_size()
    if pad_to is not None and pad_to < size:
        raise EngineSetupError(f"a vocabulary of {pad_to} is smaller than the tokenizer's {size} tokens")
    if pad_to is not None and pad_to > size:
        tok.add_tokens([AddedToken(f"<|r{i}|>", special=False, normalized=False) for i in range(size, pad_to)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}, indent=2))
    return {s: tok.token_to_id(s) for s in SPECIAL}


def config_json(cfg: ModelConfig, bos: int, eos: int) -> dict:
    """config.json as the public checkpoints of cfg's architecture write it (transformers 4.x
    keys, which transformers 5 and ModelConfig.from_dir read)."""
    arch = cfg.model_type
    raw = {"architectures": [ARCHITECTURES[arch]], "model_type": arch,
           "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos,
           "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden,
           "initializer_range": 0.02, "intermediate_size": cfg.intermediate,
           "max_position_embeddings": cfg.max_positions,
           "num_attention_heads": cfg.heads, "num_hidden_layers": cfg.layers,
           "num_key_value_heads": cfg.kv_heads, "rms_norm_eps": cfg.rms_eps, "rope_scaling": None,
           "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": cfg.vocab}
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        raw.update(max_window_layers=cfg.layers, sliding_window=None, use_sliding_window=False)
    if arch in ("llama", "qwen3", "qwen3_moe"):
        raw.update(attention_bias=False)
    if arch == "llama":
        raw.update(mlp_bias=False, pretraining_tp=1)
    if arch in ("mistral", "mixtral"):
        raw.update(sliding_window=cfg.sliding_window)
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        raw["rope_scaling"] = {"factor": r.factor, "high_freq_factor": r.high_freq_factor,
                               "low_freq_factor": r.low_freq_factor,
                               "original_max_position_embeddings": r.original_max_positions, "rope_type": "llama3"}
    if arch == "qwen3_moe":
        raw.update(decoder_sparse_step=1, moe_intermediate_size=cfg.moe_intermediate,
                   mlp_only_layers=[i for i in range(cfg.layers) if i not in cfg.moe_layers],
                   norm_topk_prob=cfg.norm_topk_prob, num_experts=cfg.experts,
                   num_experts_per_tok=cfg.experts_per_token, output_router_logits=False,
                   router_aux_loss_coef=0.001)
    if arch == "mixtral":
        raw.update(intermediate_size=cfg.moe_intermediate, num_local_experts=cfg.experts,
                   num_experts_per_tok=cfg.experts_per_token, output_router_logits=False,
                   router_aux_loss_coef=0.02, router_jitter_noise=0.0)
    return dict(sorted(raw.items()))


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Whole weights (in order) grouped into shards of at most max_bytes (one larger weight alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def human_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_random_checkpoint(model: str, out: Path, seed: int = 0, device: str | None = None,
                            layers: int | None = None, force: bool = False,
                            max_shard_bytes: int = MAX_SHARD_BYTES,
                            log: Callable[[str], None] = _log_stderr) -> dict:
    """Writes the model directory of `model` (a preset's name, or a config.json or a directory
    holding one; see the module's docstring); returns its summary: model, parameters, bytes,
    shards, seconds, path. A bad request is a one-line EngineSetupError, raised before anything
    is written."""
    from safetensors.torch import save_file

    from engine_templates.engine.loader import checkpoint_entries, random_tensors
    from engine_templates.engine.model import DecoderModel
    from engine_templates.hf_config import ConfigError, model_dims
    from engine_templates.vision import is_vision_model, target_dims

    start = time.perf_counter()
    try:
        if is_vision_model(model):
            return _write_random_sam3(model, out, seed, device, layers, force, log)
        target_dims(model)  # the error of an unknown name lists the vision presets too
        dims = full = model_dims(model)
    except ConfigError as e:
        raise EngineSetupError(str(e)) from None
    if layers is not None:
        if layers < 1:
            raise EngineSetupError(f"--layers must be at least 1, got {layers}")
        dims = dataclasses.replace(dims, layers=layers)
    device = pick_device(device)
    out = _writable(Path(out), force)
    cfg = ModelConfig.from_preset(dims)
    dtype = torch.bfloat16
    shapes = DecoderModel(cfg, None, None, dtype, "meta").weights()
    sizes = {name: t.numel() * t.element_size() for name, t in shapes.items()}
    total = sum(sizes.values())
    old = sorted(out.glob("*.safetensors")) + sorted(out.glob("*.safetensors.index.json"))
    existing = out if out.is_dir() else next(p for p in out.parents if p.is_dir())
    free = shutil.disk_usage(existing).free + sum(f.stat().st_size for f in old)
    if total + 64 * 2**20 > free:
        raise EngineSetupError(f"--out {out}: the checkpoint needs {total / 1e9:.1f} GB and its file "
                               f"system has {free / 1e9:.1f} GB free")

    out.mkdir(parents=True, exist_ok=True)
    for f in old:  # stale shards of another shape would be read with the new ones
        f.unlink()
    ids = train_tokenizer(out, bpe_vocab=min(BPE_VOCAB, cfg.vocab), pad_to=cfg.vocab)
    bos, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    cfg = dataclasses.replace(cfg, eos_token_ids=(eos, bos))
    (out / "config.json").write_text(json.dumps(config_json(cfg, bos, eos), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, bos], "pad_token_id": bos}, indent=2) + "\n")

    shards = _shards(sizes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    log(f"{model} ({cfg.model_type}{f', {cfg.layers} of {full.layers} layers' if layers is not None else ''}): "
        f"{human_size(total)} of random bf16 weights drawn on {device} (seed {seed}), "
        f"{len(shards)} shard(s) -> {out}")
    weight_map: dict[str, str] = {}
    drawn = random_tensors(cfg, dtype, device, seed)
    for file, names in zip(files, shards):
        shard: dict[str, torch.Tensor] = {}
        for expected in names:
            name, tensor = next(drawn)
            assert name == expected, (name, expected)
            for key, part in checkpoint_entries(name, tensor, cfg.moe_intermediate, cfg.model_type):
                shard[key] = part.to("cpu", copy=True).contiguous()  # its own storage, on the host
                weight_map[key] = file
            del tensor
        save_file(shard, str(out / file), metadata={"format": "pt"})
        log(f"[{time.perf_counter() - start:6.1f}s] {file}: {len(shard)} tensors, "
            f"{human_size(sum(sizes[n] for n in names))}")
        del shard
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    params = sum(t.numel() for t in shapes.values())
    return {"model": model, "parameters": params, "bytes": total, "shards": len(shards),
            "seconds": time.perf_counter() - start, "path": str(out)}


def _writable(out: Path, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise EngineSetupError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise EngineSetupError(f"--out {out} is not empty (--force writes over its checkpoint)")
    return out


# Random weights of transformers' initialization give mask logits of about 1e-5: no pixel is
# confidently in or out. The mask embedder's last layer is scaled so that their standard deviation
# on a random image is MASK_LOGIT_STD, as a trained model's spread over several units either side
# of 0, and the image accuracy gate sees both kinds of pixel. (The logits are linear in that layer.)
MASK_LOGIT_STD = 1.5
# Likewise the ViT's attention is near uniform (q.k of about 1e-3) and adds little to the residual
# stream: blind to positions. In a ViT of at most GAIN_MAX_LAYERS layers the query and key
# projections are scaled so that attention picks out neighbours, and the value and output
# projections so that what it picks counts, as in a trained ViT. A deeper one keeps its draw:
# many layers of sharpened attention amplify a rounding into a different answer.
ATTENTION_GAIN = 12.0
VALUE_GAIN = 6.0
GAIN_MAX_LAYERS = 4


def _write_random_sam3(model: str, out: Path, seed: int, device: str | None, layers: int | None, force: bool,
                       log: Callable[[str], None]) -> dict:
    """A SAM 3 directory the SAM 3 engine serves: transformers' Sam3Model at the preset's or
    config's shape, its weights as the model's own initialisation draws them from `seed` (on
    `device`), calibrated (see MASK_LOGIT_STD) and saved in bf16, and a tokenizer.json: the byte-level
    BPE of a language model's checkpoint, padded to the text encoder's vocabulary, whose special
    ids the config's text_config names."""
    from transformers import Sam3Model
    from transformers.utils import logging as hf_logging

    from engine_templates.vision import sam3_hf_config

    hf_logging.disable_progress_bar()  # the log lines below say what it writes

    if layers is not None:
        raise EngineSetupError("--layers is for a language model; a vision model's checkpoint has all its layers")
    start = time.perf_counter()
    cfg = sam3_hf_config(model)
    device = pick_device(device)
    out = _writable(Path(out), force)
    torch.manual_seed(seed)
    with torch.device(device):
        net = Sam3Model(cfg).eval()
    with torch.no_grad():
        _calibrate_sam3(net, cfg, device)
    net = net.to(torch.bfloat16)
    params = sum(p.numel() for p in net.parameters())
    total = sum(p.numel() * p.element_size() for p in net.parameters())
    log(f"{model} (sam3): {human_size(total)} of random bf16 weights drawn on {device} (seed {seed}) -> {out}")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(out.glob("*.safetensors")) + sorted(out.glob("*.safetensors.index.json")):
        f.unlink()  # stale shards of another shape would be read with the new ones
    vocab = cfg.text_config.vocab_size
    ids = train_tokenizer(out, bpe_vocab=min(BPE_VOCAB, vocab), pad_to=vocab)
    text = net.config.text_config
    text.pad_token_id, text.bos_token_id, text.eos_token_id = (ids[s] for s in SPECIAL)
    net.save_pretrained(out, max_shard_size=MAX_SHARD_BYTES)
    shards = len(list(out.glob("*.safetensors")))
    return {"model": model, "parameters": params, "bytes": total, "shards": shards,
            "seconds": time.perf_counter() - start, "path": str(out)}


def _calibrate_sam3(net, cfg, device: str) -> None:
    """The ViT gains where it is shallow, then the mask embedder's last layer scaled so that the
    mask logits' std is MASK_LOGIT_STD on a random image and prompt (one float32 forward)."""
    layers = net.vision_encoder.backbone.layers
    for layer in layers if len(layers) <= GAIN_MAX_LAYERS else ():
        layer.attention.q_proj.weight.mul_(ATTENTION_GAIN)
        layer.attention.k_proj.weight.mul_(ATTENTION_GAIN)
        layer.attention.v_proj.weight.mul_(VALUE_GAIN)
        layer.attention.o_proj.weight.mul_(VALUE_GAIN)
    size = cfg.vision_config.backbone_config.image_size
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(1, 3, size, size, generator=generator)
    ids = torch.randint(3, cfg.text_config.vocab_size, (1, 8), generator=generator)
    std = net(pixel_values=pixels.to(device), input_ids=ids.to(device)).pred_masks.float().std().item()
    last = net.mask_decoder.mask_embedder.layers[-1]
    last.weight.mul_(MASK_LOGIT_STD / std)
    if last.bias is not None:
        last.bias.mul_(MASK_LOGIT_STD / std)
