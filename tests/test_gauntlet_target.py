"""The model a gauntlet case runs on: an op that takes a model's experts moves to the
mixture-of-experts preset of the size class; an op whose shapes fail is an error, not a move."""
from __future__ import annotations

import pytest

from engine_templates.ops import OPS
from engine_templates.ops.rmsnorm import RMSNorm, token_shapes
from flows.gauntlet import target_for
from gauntlet import Case
from targets import Target


class MisreadNorm(RMSNorm):
    """rmsnorm with a bug in its shapes: the width parsed from a string it formats wrong."""

    name = "misread_norm"

    def shapes(self, model, decode_batches, prefill_tokens, contexts):
        return token_shapes({"hidden": int(f"{model.hidden}px")}, decode_batches, prefill_tokens)


def case(op: str) -> Case:
    return Case(op=op, vector="honest", expect="pass", gate="", template="rows", point="default")


def test_an_op_taking_experts_moves_to_the_moe_preset_of_the_size_class():
    assert target_for(case("fused_moe"), Target(model="tiny")).model == "tiny-moe"
    assert target_for(case("fused_moe"), Target(model="qwen3-8b")).model == "qwen3-30b-a3b"
    assert target_for(case("fused_moe"), Target(model="qwen3-30b-a3b")).model == "qwen3-30b-a3b"
    assert target_for(case("rmsnorm"), Target(model="tiny")).model == "tiny"


def test_an_op_taking_a_window_moves_to_the_windowed_preset_of_the_size_class():
    assert target_for(case("decode_attention_swa"), Target(model="tiny")).model == "tiny-swa"
    assert target_for(case("prefill_attention_swa"), Target(model="tiny-moe")).model == "tiny-swa"
    assert target_for(case("prefill_attention_swa"), Target(model="qwen3-8b")).model == "mistral-7b-v0.1"
    assert target_for(case("decode_attention_swa"), Target(model="tiny-swa")).model == "tiny-swa"
    assert target_for(case("decode_attention"), Target(model="tiny")).model == "tiny"


def test_an_ops_own_value_error_surfaces_instead_of_moving_the_case(monkeypatch):
    monkeypatch.setitem(OPS, MisreadNorm.name, MisreadNorm())
    with pytest.raises(ValueError, match="invalid literal for int"):
        target_for(case(MisreadNorm.name), Target(model="tiny"))
