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
    # a window no sequence of max_model_len reaches: the full-attention ops serve it
    "mistral-window": {"model_type": "mistral", **COMMON, "sliding_window": 4096},
    # windows shorter than every prompt but "A" plus its completion: prefill (chunked too) and
    # decode steps past the window, through the *_swa ops
    "mistral-swa": {"model_type": "mistral", **COMMON, "sliding_window": 6},
    "mixtral-swa": {"model_type": "mixtral", **COMMON, "intermediate_size": 32, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "sliding_window": 5},
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
    assert cfg.is_moe == (cfg.model_type in ("qwen3_moe", "mixtral"))
    seqs = eng.generate(PROMPTS, GREEDY)
    assert any(s.num_prompt_tokens > 32 for s in seqs), "one prompt is chunked over several steps"
    if kind.endswith("-swa"):  # every sequence decodes past its window
        assert all(s.num_prompt_tokens + 1 > cfg.sliding_window for s in seqs[:2])
        assert seqs[2].num_prompt_tokens < cfg.sliding_window < len(seqs[2].token_ids)
    for seq in seqs:
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == oracle.greedy(prompt, GREEDY.max_tokens), (kind, seq)
        expected = oracle.logprobs(prompt, seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4, kind
    # The tokens are the model's own: a plain greedy run of each prompt differs between prompts.
    assert len({tuple(s.completion_token_ids) for s in seqs}) > 1
    if kind.endswith("-swa"):  # the window matters: full attention over the same cache gives other answers
        eng.runner.model.window = None
        try:
            full = eng.generate(PROMPTS[:2], GREEDY)
        finally:
            eng.runner.model.window = cfg.sliding_window
        assert all(max(abs(a - b) for a, b in zip(f.logprobs, s.logprobs)) > 1e-3 for f, s in zip(full, seqs))


def test_the_calls_of_rope_or_qk_norm_rope_and_of_the_attention_ops_follow_the_architecture(pair):
    kind, _, eng, _ = pair
    calls = {}
    for op in ("rope", "qk_norm_rope", "prefill_attention", "decode_attention", "prefill_attention_swa",
               "decode_attention_swa"):
        fn = getattr(eng.kernels, op)
        calls[op] = 0

        def counted(*args, _fn=fn, _op=op):
            calls[_op] += 1
            return _fn(*args)
        setattr(eng.kernels, op, counted)
    eng.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    used, unused = ("qk_norm_rope", "rope") if kind.startswith("qwen3") else ("rope", "qk_norm_rope")
    assert calls[used] > 0 and calls[unused] == 0, calls
    # a window shorter than the served context: the *_swa ops (mistral-window's covers it)
    windowed = ("prefill_attention_swa", "decode_attention_swa")
    full = ("prefill_attention", "decode_attention")
    used, unused = (windowed, full) if kind.endswith("-swa") else (full, windowed)
    assert all(calls[op] > 0 for op in used) and all(calls[op] == 0 for op in unused), calls


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_target_takes_its_op_shapes_from_the_config(kind, tmp_path):
    from engine_templates.ops import get_op
    from targets import Target

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[kind]))
    for model in (tmp_path, tmp_path / "config.json"):
        target = Target(model=str(model))
        dims = target.dims
        assert dims.arch == CONFIGS[kind]["model_type"] and len(dims.config_sha256) == 64
        moe = dims.arch in ("qwen3_moe", "mixtral")
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
        window = CONFIGS[kind].get("sliding_window")
        for op in ("decode_attention_swa", "prefill_attention_swa"):
            if window is None:
                with pytest.raises(ValueError, match="needs a model with a sliding_window"):
                    get_op(op).shapes(dims, [1], [40], [64])
            else:
                assert {s.dims["window"] for s in get_op(op).shapes(dims, [1], [40], [64])} == {window}
    # Two paths to one config are the same target; a changed config is another.
    assert Target(model=str(tmp_path)).key() == Target(model=str(tmp_path / "config.json")).key()
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS[kind], "rms_norm_eps": 1e-5}))
    assert Target(model=str(tmp_path)).key() != target.key()


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "mistral-swa", "qwen2", "mixtral"])
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
    assert cfg.sliding_window == CONFIGS[kind].get("sliding_window")
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


LLAMA = CONFIGS["llama"]
BAD = [  # (config, what the one line says)
    ({**LLAMA, "model_type": "gemma"}, 'model_type "gemma" is not supported (supported: llama, mistral, qwen2, '
                                       'qwen3, qwen3_moe, mixtral)'),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "missing field 'hidden_size'"),
    ({**LLAMA, "num_attention_heads": 6}, "num_attention_heads 6 does not divide hidden_size 64"),
    ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     'rope_scaling.rope_type "yarn" is not supported (supported: default, llama3)'),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling: missing field 'low_freq_factor' of rope_type llama3"),
    ({**LLAMA, "quantization_config": {"quant_method": "awq", "bits": 4}},
     'quantization_config.quant_method "awq" is not supported (supported: fp8)'),
    ({**LLAMA, "attention_bias": True}, "attention_bias: true is not supported"),
    ({**CONFIGS["qwen2"], "use_sliding_window": True}, "use_sliding_window: true is not supported for qwen2"),
    ({**CONFIGS["mixtral"], "num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
]


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    dirs = []
    for i, (config, _) in enumerate(BAD):
        d = tmp_path_factory.mktemp(f"bad{i}")
        (d / "config.json").write_text(json.dumps(config))
        dirs.append(d)
    return dirs


def _one_line(capsys, argv) -> str:
    from cli.main import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
    return err


@pytest.mark.parametrize("case", range(len(BAD)))
def test_a_bad_config_is_one_line_naming_the_field_and_exit_2(case, bad_dirs, capsys, tmp_path):
    d, message = bad_dirs[case], BAD[case][1]
    assert message in _one_line(capsys, ["engine", "random-checkpoint", "--config", str(d), "--out",
                                         str(tmp_path / "ckpt"), "--device", "cpu"])
    assert not (tmp_path / "ckpt").exists()
    assert message in _one_line(capsys, ["engine", "generate", "--model-dir", str(d), "--prompt", "hi",
                                         "--device", "cpu"])
    assert message in _one_line(capsys, ["optimize", "--op", "rmsnorm", "--model", str(d / "config.json")])
    # the end-to-end commands take the model from the checkpoint they serve, where it is on this machine
    assert message in _one_line(capsys, ["serve-bench", "--model-dir", str(d)])


def test_a_bad_config_logs_no_candidate(bad_dirs, capsys, tracking_home):
    from conftest import CANDIDATES

    from tracking.store import TrackingConfig, client

    def runs() -> int:
        mlflow = client(TrackingConfig.from_env())
        experiments = [e.experiment_id for e in mlflow.search_experiments()]
        return len(mlflow.search_runs(experiments)) if experiments else 0

    before = runs()  # the store is the session's: other tests' runs may be there
    capsys.readouterr()  # MLflow's lines on making a fresh store
    for d, (_, message) in zip(bad_dirs, BAD):
        assert message in _one_line(capsys, ["evaluate", "--op", "rmsnorm", "--model", str(d), "--candidate",
                                             str(CANDIDATES / "rmsnorm" / "honest_torch.py")])
    assert runs() == before


def test_a_sliding_window_shorter_than_the_context_serves_from_the_command_line(tmp_path, capsys):
    from cli.main import main

    out = save_hf_model("mistral-swa", tmp_path / "m")
    capsys.readouterr()  # transformers' progress bar of the save
    from engine_templates.engine.oracle import HFOracle

    assert main(["engine", "generate", "--model-dir", str(out), "--prompt", "Hello world! How are you today?",
                 "--device", "cpu", "--max-model-len", "256", "--max-tokens", "8", "--dtype", "fp32",
                 "--ignore-eos", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["prompt_token_ids"]) + 8 > 6  # the window
    assert got["token_ids"] == HFOracle.from_dir(out, "fp32").greedy(got["prompt_token_ids"], 8)


def test_a_window_holds_for_drafts_verified_and_on_the_graph_path(tmp_path):
    """Speculative decoding verifies each draft row as a decode query at its own length, and the
    decode graphs' padded batches (run without capture on a CPU): both within the window."""
    from engine_templates.engine.cuda_graphs import DecodeGraphs
    from engine_templates.engine.oracle import HFOracle

    out = save_hf_model("mistral-swa", tmp_path / "m")
    oracle = HFOracle.from_dir(out, "fp32")
    prompts, params = [PROMPTS[0], "a b c d e f a b c"], SamplingParams(max_tokens=16, ignore_eos=True)
    for spec_tokens, graphs in ((4, False), (0, True)):
        eng = LLMEngine(EngineConfig(model_dir=out, dtype="fp32", device="cpu", max_num_seqs=2, max_model_len=64,
                                     block_size=4, spec_tokens=spec_tokens))
        if graphs:
            eng.runner.graphs = DecodeGraphs(eng.runner, eng.model_config, capture=False)
        for seq in eng.generate(prompts, params):
            assert seq.completion_token_ids == oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 16), spec_tokens
        assert spec_tokens == 0 or eng.spec_stats.as_dict()["drafted_tokens"] > 0  # the model repeats a token


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral", "mistral-swa"])
def test_the_shipped_templates_serve_each_architecture_as_transformers_does(kind, tmp_path):
    """Every op from its Triton template (the interpreter on a CPU): rope's on views of the fused
    qkv projection, after Qwen2's biases; Mixtral's routing through fused_moe's template; a
    sliding window through the attention templates' windowed kernels."""
    from pathlib import Path

    from engine_templates.engine.kernels import parse_kernels_file
    from engine_templates.engine.oracle import HFOracle

    out = save_hf_model(kind, tmp_path / kind)
    kernels = parse_kernels_file(Path(__file__).resolve().parent.parent / "engine_templates" / "engine" / "bench"
                                 / "templates.json")
    eng = LLMEngine(EngineConfig(model_dir=out, dtype="fp32", device="cpu", max_num_seqs=2, max_model_len=128,
                                 block_size=4, kernels=kernels))
    assert eng.kernel_choices["rope"]["impl"] == "template"
    oracle = HFOracle.from_dir(out, "fp32")
    for seq in eng.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True)):
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == oracle.greedy(prompt, 3), kind
        expected = oracle.logprobs(prompt, seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-3, kind


def test_a_run_records_the_config_architecture_and_digest(tmp_path, capsys, prefect_server, tracking_home):
    from conftest import CANDIDATES

    from cli.main import main
    from engine_templates.hf_config import digest
    from tracking.store import TrackingConfig, client

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["mixtral"]))
    code = main(["evaluate", "--op", "rmsnorm", "--model", str(tmp_path), "--decode-batches", "1,3",
                 "--prefill-tokens", "20", "--contexts", "24", "--dtype", "fp32", "--json",
                 "--candidate", str(CANDIDATES / "rmsnorm" / "honest_torch.py")])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    run = client(TrackingConfig.from_env()).get_run(result["parent_run_id"])
    params = run.data.params
    assert params["target.model"] == str(tmp_path.resolve())
    assert params["target.architecture"] == "mixtral"
    assert params["target.config_sha256"] == digest(CONFIGS["mixtral"])
    assert run.data.tags["infersmith.target"].startswith(f"mixtral-{digest(CONFIGS['mixtral'])[:12]}/fp32/")


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "mistral-7b-v0.3", "mistral-7b-v0.1", "qwen2.5-7b",
                                    "mixtral-8x7b", "qwen3-8b", "qwen3-30b-a3b", "tiny-swa"])
def test_a_preset_is_the_model_its_written_config_describes(preset):
    """The config.json a random checkpoint of the preset carries reads back as the preset."""
    import dataclasses

    from engine_templates.engine.random_checkpoint import config_json
    from engine_templates.hf_config import parse_config
    from engine_templates.models import PRESETS

    dims = PRESETS[preset]
    raw = config_json(ModelConfig.from_preset(dims), bos=0, eos=2)
    assert raw["architectures"] == [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                     "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[dims.arch]]
    back = parse_config(raw, preset)
    assert dataclasses.replace(back, config_sha256="") == dims


def test_quantize_writes_mixtrals_experts_in_fp8_and_the_engine_reads_them_back(tmp_path):
    from safetensors.torch import load_file

    from engine_templates.engine.fp8 import FP8
    from engine_templates.engine.quantize import quantize_checkpoint

    src, dst = save_hf_model("mixtral", tmp_path / "bf16"), tmp_path / "fp8"
    quantize_checkpoint(src, dst, block=0, device="cpu", log=lambda _: None)
    after = load_file(dst / "model.safetensors")
    experts = [k for k in after if ".block_sparse_moe.experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 8 * 3  # layers x experts x (w1, w3, w2)
    assert all(after[k].dtype == FP8 and after[k + "_scale_inv"].dtype == torch.float32 for k in experts)
    assert after["model.layers.0.block_sparse_moe.gate.weight"].dtype != FP8  # the router stays as it was
    fp8 = LLMEngine(EngineConfig(model_dir=dst, dtype="fp32", device="cpu", max_num_seqs=1, max_model_len=64))
    at_load = LLMEngine(EngineConfig(model_dir=src, dtype="fp32", device="cpu", max_num_seqs=1, max_model_len=64,
                                     quantization="fp8"))  # per channel, as block=0
    assert [s.completion_token_ids for s in fp8.generate(PROMPTS[:1], GREEDY)] == \
        [s.completion_token_ids for s in at_load.generate(PROMPTS[:1], GREEDY)]
