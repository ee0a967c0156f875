"""Vision targets (engine_templates/vision.py): the SAM 3 presets at transformers' shape, a SAM 3
config.json as --model, the target's modality, images per batch and key, a random SAM 3 checkpoint,
the refusals (one line, exit 2), and `optimize` of a vision op end to end on this machine."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cli.main import main
from engine_templates.hf_config import ConfigError
from engine_templates.ops import get_op
from engine_templates.vision import SAM3_PRESETS, is_vision_model, sam3_dims, sam3_hf_config, target_dims
from targets import Target


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_sam3_preset_is_transformers_default_sam3():
    from transformers import Sam3Config

    want, got = Sam3Config().to_dict(), sam3_hf_config("sam3").to_dict()
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size", "image_size",
            "pretrain_image_size", "window_size", "global_attn_indexes", "layer_norm_eps", "rope_parameters",
            "hidden_act")
    backbone = want["vision_config"]["backbone_config"]
    assert {k: got["vision_config"]["backbone_config"][k] for k in keys} == {k: backbone[k] for k in keys}
    for section in ("text_config", "detr_decoder_config", "detr_encoder_config", "geometry_encoder_config",
                    "mask_decoder_config"):
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_layers", "num_attention_heads",
                  "num_queries", "vocab_size"):
            assert got[section].get(k) == want[section].get(k), (section, k)
    assert got["vision_config"]["backbone_feature_sizes"] == want["vision_config"]["backbone_feature_sizes"]
    d = SAM3_PRESETS["sam3"]
    assert (d.grid, d.tokens_per_image, d.windows_per_image, d.window_tokens, d.head_dim) == (72, 5184, 9, 576, 64)


def test_the_tiny_preset_builds_a_sam3_that_segments_on_a_cpu():
    from transformers import Sam3Model

    d = SAM3_PRESETS["sam3-tiny"]
    torch.manual_seed(0)
    model = Sam3Model(sam3_hf_config("sam3-tiny")).eval()
    with torch.no_grad():
        out = model(pixel_values=torch.randn(2, 3, d.image_size, d.image_size), input_ids=torch.randint(0, 999, (2, 5)))
    assert out.pred_masks.shape[:2] == (2, d.queries) and torch.isfinite(out.pred_masks).all()
    assert sum(p.numel() for p in model.parameters()) < 3_000_000


def test_a_sam3_config_file_is_a_vision_target(tmp_path):
    (tmp_path / "config.json").write_text(sam3_hf_config("sam3").to_json_string())
    d = sam3_dims(str(tmp_path))
    assert dataclasses.replace(d, name="sam3", config_sha256="") == SAM3_PRESETS["sam3"] and len(d.config_sha256) == 64
    assert is_vision_model(str(tmp_path / "config.json")) and not is_vision_model("tiny")
    target = Target(model=str(tmp_path))
    assert (target.modality, target.architecture, target.config_sha256) == ("vision", "sam3", d.config_sha256)
    assert target.key() == f"sam3-{d.config_sha256[:12]}/bf16/i1-8"
    assert target.op_shapes(get_op("gelu")) == get_op("gelu").shapes(SAM3_PRESETS["sam3"], [1, 8])
    held = target.held_out_shapes(get_op("layernorm"))
    assert held and all(s.label.startswith("held_out_images_") and s.dims["tokens"] % 5184 == 0 for s in held)


def test_tiny_vision_target_takes_the_tiny_workload_and_text_keys_stay_as_they_were():
    t = Target(model="sam3-tiny")
    assert t.workload.images == [1, 2] and t.key() == "sam3-tiny/bf16/i1-2" and t.modality == "vision"
    assert Target(model="tiny").key() == "tiny/bf16/d1-4/p40/c48" and Target(model="tiny").modality == "text"
    assert [s.label for s in t.op_shapes(get_op("vision_attention"))] == ["window_i1", "window_i2", "global_i1",
                                                                         "global_i2"]


@pytest.mark.parametrize("edit, message", [
    ({"vision_config": {"backbone_config": {"hidden_act": "relu"}}}, "hidden_act \"relu\" is not supported"),
    ({"vision_config": {"backbone_config": {"num_attention_heads": 5}}}, "num_attention_heads 5 must divide"),
    ({"vision_config": {"backbone_config": {"global_attn_indexes": [40]}}}, "global_attn_indexes"),
    ({"vision_config": {"backbone_config": {"rope_parameters": {"rope_type": "default"}}}}, "rope_type \"default\""),
    ({"text_config": {"hidden_size": "wide"}}, "hidden_size: expected an integer"),
])
def test_a_sam3_config_the_ops_cannot_take_is_one_line(tmp_path, edit, message):
    raw = {"model_type": "sam3"}
    for section, fields in edit.items():
        raw[section] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message) as e:
        target_dims(str(tmp_path))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_the_unknown_model_error_names_the_vision_presets():
    with pytest.raises(ConfigError, match=r"neither a model preset \(.*tiny-moe, .*sam3, sam3-tiny\)"):
        target_dims("sam4")


@pytest.mark.parametrize("argv, message", [
    (["optimize", "--op", "rmsnorm", "--model", "sam3-tiny"], "rmsnorm is a text op and sam3-tiny a vision model"),
    (["optimize", "--op", "vision_attention", "--model", "tiny"], "vision_attention is a vision op and tiny a text"),
    (["evaluate", "--op", "gelu", "--model", "qwen3-8b", "--candidate", "x.py"], "gelu is a vision op"),
    (["optimize", "--op", "layernorm", "--model", "sam3-tiny", "--images", "0"], "images.0: Input should be greater"),
    (["optimize", "--op", "layernorm", "--model", "sam3-tiny", "--images", "1,a"], "comma-separated integers"),
    (["engine", "random-checkpoint", "--preset", "sam3-tiny", "--layers", "1", "--out", "/tmp/x"],
     "--layers is for a language model"),
])
def test_mismatched_ops_and_bad_vision_options_are_one_line_and_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_random_sam3_checkpoint_loads_in_transformers_and_is_its_seeds(capsys, tmp_path):
    from safetensors.torch import load_file
    from transformers import Sam3Model

    code, out, err = run(capsys, "engine", "random-checkpoint", "--preset", "sam3-tiny", "--out", str(tmp_path / "a"),
                         "--seed", "5", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("sam3-tiny: 1,862,422 parameters, 3.7 MB in 1 shard(s)") and "random bf16 weights" in err
    assert sam3_dims(str(tmp_path / "a")) == dataclasses.replace(SAM3_PRESETS["sam3-tiny"], name=str(tmp_path / "a"),
                                                                  config_sha256=sam3_dims(str(tmp_path / "a")).config_sha256)
    model, info = Sam3Model.from_pretrained(str(tmp_path / "a"), output_loading_info=True)
    assert not any(info.values()), info
    # the SAM 3 engine's model directory: a tokenizer.json over the whole text vocabulary, whose
    # special ids (<|endoftext|>, <|im_start|>, <|im_end|>) the config names
    from tokenizers import Tokenizer

    text = model.config.text_config
    assert Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).get_vocab_size() == text.vocab_size
    assert (text.pad_token_id, text.bos_token_id, text.eos_token_id) == (0, 1, 2)
    # from the config file it wrote, with the same seed: the same weights; another seed, others
    assert run(capsys, "engine", "random-checkpoint", "--config", str(tmp_path / "a"), "--out", str(tmp_path / "b"),
               "--seed", "5", "--device", "cpu")[0] == 0
    assert run(capsys, "engine", "random-checkpoint", "--preset", "sam3-tiny", "--out", str(tmp_path / "c"),
               "--seed", "6", "--device", "cpu")[0] == 0
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a) and {t.dtype for t in a.values()} == {torch.bfloat16}
    code, _, err = run(capsys, "engine", "random-checkpoint", "--preset", "sam3-tiny", "--out", str(tmp_path / "a"))
    assert code == 2 and "is not empty" in err


def test_optimize_a_vision_op_end_to_end(prefect_server, tracking_home, capsys):
    """`infersmith optimize --op layernorm --model sam3-tiny`: the template's candidate passes every
    stage on this machine (Triton's interpreter without a GPU) on the vision preset's shapes."""
    from tracking.history import search
    from tracking.schema import T, Tracker
    from tracking.store import TrackingConfig

    code = main(["optimize", "--op", "layernorm", "--model", "sam3-tiny", "--proposer", "random", "--budget", "1",
                 "--seed", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    runs = [r for r in search(Tracker(TrackingConfig.from_env()), "layernorm") if f"{T}candidate_id" in r.data.tags]
    assert len(runs) == 1
    for r in runs:
        assert r.data.tags[f"{T}status"] == "pass", r.data.tags.get(f"{T}failing_gate")
        assert r.data.tags[f"{T}model"] == "sam3-tiny" and r.data.metrics["images_2/latency_us"] > 0
