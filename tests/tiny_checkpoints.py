"""Tiny Qwen3 and Qwen3-MoE checkpoints for the engine tests: random weights saved by HF
transformers, a byte-level BPE tokenizer trained on the spot (engine_templates/engine/
random_checkpoint.py's, on this corpus), a ChatML chat template."""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A small engine serves a tiny model, one token at a time.",
    "Paged attention keeps the cache in blocks; the scheduler batches requests.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols: + - * / = ( ) [ ] { } < > ' \" , .",
    "Continuous batching lets new requests join while others decode.",
] * 20
VOCAB = 384


def train_tokenizer(out: Path) -> int:
    """Writes tokenizer.json and tokenizer_config.json; returns the EOS id (<|im_end|>)."""
    from engine_templates.engine.random_checkpoint import train_tokenizer as train

    return train(out, CORPUS, bpe_vocab=VOCAB - 8)["<|im_end|>"]


def make_checkpoint(out: Path, moe: bool, seed: int = 0, wide: bool = False) -> Path:
    """A saved model directory; weights drawn with a larger std than HF's default so that the
    next-token distribution is peaked and greedy choices are not near-ties. `wide`: every matrix
    a whole number of 128 x 128 blocks (hidden 256, 128-wide heads), for Qwen's FP8 blocks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    eos = train_tokenizer(out)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                  initializer_range=0.15, eos_token_id=eos, pad_token_id=0)
    if wide:
        # the std scaled down with the width: logits as large as the narrow model's
        common |= dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       initializer_range=0.075)
    torch.manual_seed(seed)
    if moe:
        # Layer 1 dense (mlp_only_layers): both kinds of MLP in one model.
        config = Qwen3MoeConfig(intermediate_size=512 if wide else 80, moe_intermediate_size=128 if wide else 32,
                                num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                tie_word_embeddings=False, **common)
        model = Qwen3MoeForCausalLM(config)
    else:
        config = Qwen3Config(intermediate_size=512 if wide else 96, tie_word_embeddings=True, **common)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    return out


_made: dict[str, Path] = {}


def checkpoint(kind: str, wide: bool = False) -> Path:
    """The `dense` or `moe` checkpoint (`wide`: see make_checkpoint), made once per test process."""
    name = f"{kind}-wide" if wide else kind
    if name not in _made:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix=f"infersmith-{name}-"))
        atexit.register(shutil.rmtree, root, True)
        _made[name] = make_checkpoint(root / f"tiny-qwen3-{name}", moe=kind == "moe", wide=wide)
    return _made[name]
