"""Every architecture from its config.json alone: the engine against HF transformers' own class for
it (greedy tokens equal, log-probabilities within 1e-4 in float32, as tests/test_engine.py), the
target's op shapes from the config, a random checkpoint that round-trips through the loader.

Each model is tiny, built by transformers from the config with random weights (biases and norms
drawn too, so that Qwen2's biases count) and saved by its save_pretrained: the checkpoint layout is
transformers' own, not ours.
"""
from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tiny_checkpoints import VOCAB, train_tokenizer  # noqa: E402

from engine_templates.engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.sequence import SamplingParams  # noqa: E402

COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
          "initializer_range": 0.15}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # a short original context: every band of the rescaling (kept, blended, slowed) is used
               "original_max_position_embeddings": 64}
CONFIGS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **COMMON, "rope_scaling": LLAMA3_ROPE},
    "llama-tied": {"model_type": "llama", **COMMON, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", **COMMON, "head_dim": 16, "sliding_window": None},
    # a window no sequence of max_model_len reaches: full attention is exact
    "mistral-window": {"model_type": "mistral", **COMMON, "sliding_window": 4096},
    "qwen2": {"model_type": "qwen2", **COMMON, "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", **COMMON, "head_dim": 16},
    "qwen3_moe": {"model_type": "qwen3_moe", **COMMON, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "mixtral": {"model_type": "mixtral", **COMMON, "intermediate_size": 32, "num_local_experts": 8,
                "num_experts_per_tok": 2, "sliding_window": None},
}
PROMPTS = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog. " * 3, "A"]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def save_hf_model(kind: str, out):
    """transformers' own model of CONFIGS[kind], random, saved with a tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    eos = train_tokenizer(out)
    raw = dict(CONFIGS[kind])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw, eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    from engine_templates.engine.oracle import HFOracle

    kind = request.param
    out = save_hf_model(kind, tmp_path_factory.mktemp(kind))
    eng = LLMEngine(EngineConfig(model_dir=out, dtype="fp32", device="cpu", max_num_seqs=4, max_model_len=256,
                                 max_num_batched_tokens=32, block_size=4))
    return kind, out, eng, HFOracle.from_dir(out, "fp32")


def test_greedy_tokens_and_logprobs_equal_transformers(pair):
    kind, out, eng, oracle = pair
    cfg = eng.model_config
    assert cfg.model_type == CONFIGS[kind]["model_type"]
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.qk_norm == kind.startswith("qwen3")
    assert (cfg.rope_scaling is not None) == (kind == "llama") and cfg.tie_embeddings == (kind == "llama-tied")
    assert cfg.is_moe == (kind in ("qwen3_moe", "mixtral"))
    seqs = eng.generate(PROMPTS, GREEDY)
    assert any(s.num_prompt_tokens > 32 for s in seqs), "one prompt is chunked over several steps"
    for seq in seqs:
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == oracle.greedy(prompt, GREEDY.max_tokens), (kind, seq)
        expected = oracle.logprobs(prompt, seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4, kind
    # The tokens are the model's own: a plain greedy run of each prompt differs between prompts.
    assert len({tuple(s.completion_token_ids) for s in seqs}) > 1


def test_the_calls_of_rope_or_qk_norm_rope_follow_the_architecture(pair):
    kind, _, eng, _ = pair
    rotated = {}
    for op in ("rope", "qk_norm_rope"):
        fn = getattr(eng.kernels, op)
        rotated[op] = 0

        def counted(*args, _fn=fn, _op=op):
            rotated[_op] += 1
            return _fn(*args)
        setattr(eng.kernels, op, counted)
    eng.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    used, unused = ("qk_norm_rope", "rope") if kind.startswith("qwen3") else ("rope", "qk_norm_rope")
    assert rotated[used] > 0 and rotated[unused] == 0, rotated


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_target_takes_its_op_shapes_from_the_config(kind, tmp_path):
    from engine_templates.ops import get_op
    from targets import Target

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[kind]))
    for model in (tmp_path, tmp_path / "config.json"):
        target = Target(model=str(model))
        dims = target.dims
        assert dims.arch == CONFIGS[kind]["model_type"] and len(dims.config_sha256) == 64
        moe = kind in ("qwen3_moe", "mixtral")
        (attn,) = get_op("decode_attention").shapes(dims, [1], [], [64])[:1]
        assert {k: attn.dims[k] for k in ("q_heads", "kv_heads", "head_dim")} == {
            "q_heads": 4, "kv_heads": 2, "head_dim": 16}
        norm = get_op("rmsnorm").shapes(dims, [1], [], [64])[0]
        assert norm.dims["hidden"] == 64
        if moe:
            moe_shape = get_op("fused_moe").shapes(dims, [1], [], [64])[0]
            assert moe_shape.dims["experts"] == 8 and moe_shape.dims["top_k"] == 2
            assert moe_shape.dims["inter"] == 32
        else:
            assert get_op("silu_mul").shapes(dims, [1], [], [64])[0].dims["inter"] == 96
    # Two paths to one config are the same target; a changed config is another.
    assert Target(model=str(tmp_path)).key() == Target(model=str(tmp_path / "config.json")).key()
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS[kind], "rms_norm_eps": 1e-5}))
    assert Target(model=str(tmp_path)).key() != target.key()


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen2", "mixtral"])
def test_a_random_checkpoint_of_a_config_round_trips_through_the_loader(kind, tmp_path):
    from engine_templates.engine.loader import load_weights, random_weights
    from engine_templates.engine.model import DecoderModel
    from engine_templates.engine.oracle import HFOracle
    from engine_templates.engine.random_checkpoint import write_random_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[kind]))
    out = tmp_path / "ckpt"
    write_random_checkpoint(str(tmp_path / "config.json"), out, seed=2, device="cpu", log=lambda _: None)
    cfg = ModelConfig.from_dir(out)
    assert cfg.model_type == CONFIGS[kind]["model_type"] and cfg.vocab == VOCAB
    assert cfg.rope_scaling == ModelConfig.from_dir(tmp_path).rope_scaling
    model = DecoderModel(cfg, None, None, torch.bfloat16, "cpu")
    load_weights(model, out)
    drawn = random_weights(cfg, torch.bfloat16, "cpu", seed=2)
    assert model.weights().keys() == drawn.keys()
    assert all(torch.equal(model.weights()[k], drawn[k]) for k in drawn)
    if kind == "mixtral":  # Mixtral's own layout, which transformers converts on load
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in f.keys()

    # transformers loads the same directory (every weight found, none left over), and both generate alike.
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    assert not any(info.values()), info
    eng = LLMEngine(EngineConfig(model_dir=out, dtype="fp32", device="cpu", max_num_seqs=1, max_model_len=64))
    seq = eng.generate(["Hello world, how are you?"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    oracle = HFOracle(hf)
    assert oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 6) == seq.completion_token_ids
