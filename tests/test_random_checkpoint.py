"""`infersmith engine random-checkpoint`: a directory of random weights at a preset's shape that
the engine and HF transformers both load, and on which they generate the same greedy tokens;
sharded as HF shards, holding exactly the weights `engine bench` draws for the same seed; a
tokenizer in which every id of the model's vocabulary decodes; one-line usage errors."""
from __future__ import annotations

import dataclasses
import json
import re

import torch
from safetensors import safe_open

from cli.main import main
from engine_templates.engine.config import ModelConfig
from engine_templates.engine.random_checkpoint import SPECIAL, write_random_checkpoint
from engine_templates.models import PRESETS
from engine_templates.vision import SAM3_PRESETS


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def hf_model(model_dir):
    """transformers' model of the directory, in float32; it must find every weight and no other."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                       attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return model


def test_a_qwen3_0_6b_layer_generates_what_transformers_generates(capsys, tmp_path):
    from engine_templates.engine.oracle import HFOracle
    from engine_templates.engine.tokenizer import Tokenizer

    out = tmp_path / "qwen3-0.6b-random"
    code, stdout, err = run(capsys, "engine", "random-checkpoint", "--preset", "qwen3-0.6b", "--layers", "1",
                            "--out", str(out), "--seed", "3", "--device", "cpu")
    assert code == 0, err
    assert re.fullmatch(r"qwen3-0\.6b: 171,314,432 parameters, 342\.6 MB in 1 shard\(s\), [\d.]+ s -> "
                        + re.escape(str(out)) + "\n", stdout), stdout
    assert "model.safetensors: 13 tensors" in err  # progress, a line per shard
    # The preset's shape (one layer), tied embeddings, a 40960-position context, EOS <|im_end|>
    # then <|endoftext|> (generation_config.json), as the public Qwen3 checkpoints.
    cfg = ModelConfig.from_dir(out)
    assert cfg == dataclasses.replace(ModelConfig.from_preset(dataclasses.replace(PRESETS["qwen3-0.6b"], layers=1)),
                                      eos_token_ids=(2, 0))
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["torch_dtype"] == "bfloat16"

    # Random weights emit any id: each one decodes to text, and the padding ids back to themselves.
    tok = Tokenizer(out)
    texts = [tok.decode([i]) for i in range(cfg.vocab)]
    assert [i for i, t in enumerate(texts) if not t] == [0, 1, 2]  # the special tokens, skipped
    trained = next(i for i, t in enumerate(texts) if t == f"<|r{i}|>")  # the BPE's own tokens before
    assert 300 < trained < 4096 and tok.encode("".join(texts[trained:])) == list(range(trained, cfg.vocab))
    assert len(tok.encode("The children played in the garden while their parents talked.")) < 20

    code, stdout, err = run(capsys, "engine", "generate", "--model-dir", str(out), "--prompt",
                            "The quick brown fox", "--max-tokens", "6", "--ignore-eos", "--dtype", "fp32",
                            "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "1", "--json")
    assert code == 0, err
    answer = json.loads(stdout)
    assert len(answer["token_ids"]) == 6 and answer["text"]
    oracle = HFOracle(hf_model(out))
    assert oracle.greedy(answer["prompt_token_ids"], 6) == answer["token_ids"]


def test_moe_shards_hold_the_weights_engine_bench_draws(tmp_path):
    from engine_templates.engine.config import EngineConfig
    from engine_templates.engine.engine import LLMEngine
    from engine_templates.engine.loader import load_weights, random_weights
    from engine_templates.engine.model import DecoderModel
    from engine_templates.engine.oracle import HFOracle
    from engine_templates.engine.sequence import SamplingParams

    out, lines = tmp_path / "tiny-moe", []
    summary = write_random_checkpoint("tiny-moe", out, seed=1, device="cpu", max_shard_bytes=150_000,
                                      log=lines.append)
    shards = sorted(out.glob("*.safetensors"))
    assert summary["shards"] == len(shards) == 6 and len(lines) == 1 + len(shards)
    assert shards[0].name == "model-00001-of-00006.safetensors"
    # HF's index names every tensor's shard, and each shard holds what the index says.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    held = {}
    for shard in shards:
        assert shard.stat().st_size < 150_000 + 20_000  # the limit, and the header
        with safe_open(str(shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            held.update({k: shard.name for k in f.keys()})
    assert held == index["weight_map"] and index["metadata"]["total_size"] == summary["bytes"]
    # One expert per tensor, as HF checkpoints store them.
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in held and not any("gate_up" in k for k in held)

    cfg = ModelConfig.from_dir(out)
    assert cfg.is_moe and cfg.moe_layers == (0, 1) and cfg.experts == 8 and cfg.norm_topk_prob
    model = DecoderModel(cfg, None, None, torch.bfloat16, "cpu")
    load_weights(model, out)
    drawn = random_weights(cfg, torch.bfloat16, "cpu", seed=1)
    assert model.weights().keys() == drawn.keys()
    assert all(torch.equal(model.weights()[k], drawn[k]) for k in drawn)

    engine = LLMEngine(EngineConfig(model_dir=out, dtype="fp32", device="cpu", max_num_seqs=1, max_model_len=64))
    seq = engine.generate(["Hello world, how are you?"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    oracle = HFOracle(hf_model(out))
    assert oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 8) == seq.completion_token_ids


def test_usage_errors_are_one_line(capsys, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    (out / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "engine", "random-checkpoint", "--preset", "tiny", "--out", str(out))
    assert code == 2 and err == f"infersmith: --out {out} is not empty (--force writes over its checkpoint)\n"
    code, _, err = run(capsys, "engine", "random-checkpoint", "--preset", "qwen4", "--out", str(tmp_path / "new"))
    assert code == 2 and err == (f"infersmith: 'qwen4' is neither a model preset ({', '.join([*PRESETS, *SAM3_PRESETS])}) nor a "
                                 f"model's config.json (no such file or directory)\n")
    code, _, err = run(capsys, "engine", "random-checkpoint", "--preset", "tiny", "--layers", "0",
                       "--out", str(tmp_path / "new"))
    assert code == 2 and err == "infersmith: --layers must be at least 1, got 0\n"
    assert not (tmp_path / "new").exists()

    # --force: the stale shard goes (it would be read with the new one), other files stay.
    code, _, err = run(capsys, "engine", "random-checkpoint", "--preset", "tiny", "--out", str(out), "--force",
                       "--device", "cpu")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json",
        "tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == SPECIAL[2]
