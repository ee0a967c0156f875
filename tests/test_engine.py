"""The engine against HF transformers on tiny random Qwen3 and Qwen3-MoE checkpoints: greedy
tokens equal, log-probabilities close; batching, chunked prefill, preemption, sampling, stops,
kernel choice and model-directory errors.

Tolerances: in float32 the engine and transformers differ only in summation order, so
log-probabilities agree to 1e-4 (observed ~3e-6). In bf16 both round every activation to 8 bits
of mantissa along different paths; on these 2-layer models the gap stays under 0.1 nats.
"""
from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from counted_kernels import calls, count_calls, counting_kernels  # noqa: E402
from tiny_checkpoints import checkpoint  # noqa: E402

from engine_templates.engine.config import EngineConfig, KernelSpec, ModelConfig, ModelDirError  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.kernels import ENGINE_OPS, KernelFileError, parse_kernels_file  # noqa: E402
from engine_templates.engine.sampler import Sampler  # noqa: E402
from engine_templates.engine.sequence import SamplingParams, Sequence  # noqa: E402
from engine_templates.ops import OPS  # noqa: E402

PROMPTS = ["Hello world!", "The quick brown fox jumps", "Paged attention keeps the cache in blocks; " * 6,
           "A"]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def engine(kind: str, dtype: str = "fp32", **options) -> LLMEngine:
    settings = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, block_size=4)
    settings.update(options)
    return LLMEngine(EngineConfig(model_dir=checkpoint(kind), dtype=dtype, device="cpu", **settings))


@pytest.fixture(scope="module", params=["dense", "moe"])
def oracle_run(request):
    from engine_templates.engine.oracle import HFOracle

    eng = engine(request.param)
    seqs = eng.generate(PROMPTS, GREEDY)
    return request.param, eng, seqs, HFOracle.from_dir(checkpoint(request.param), "fp32")


def test_greedy_tokens_equal_transformers(oracle_run):
    kind, eng, seqs, oracle = oracle_run
    assert any(s.num_prompt_tokens > 32 for s in seqs), "one prompt is chunked over several steps"
    for seq in seqs:
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == oracle.greedy(prompt, GREEDY.max_tokens), (kind, seq)
        assert seq.finish_reason == "length"


def test_logprobs_agree_with_transformers(oracle_run):
    kind, eng, seqs, oracle = oracle_run
    for seq in seqs:
        expected = oracle.logprobs(seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids)
        worst = max(abs(a - b) for a, b in zip(seq.logprobs, expected))
        assert worst < 1e-4, (kind, worst)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_logprobs_within_tolerance(kind):
    from engine_templates.engine.oracle import HFOracle

    eng = engine(kind, "bf16")
    oracle = HFOracle.from_dir(checkpoint(kind), "bf16")
    for seq in eng.generate(PROMPTS[:2], GREEDY):
        expected = oracle.logprobs(seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 0.1


def test_batched_answers_equal_single_answers_even_when_the_cache_is_short():
    single = [engine("dense").generate([p], GREEDY)[0].completion_token_ids for p in PROMPTS]
    # 40 blocks of 4 positions cannot hold all four sequences at once: decode preempts and
    # recomputes, and each answer must still be its own, with mixed steps and without.
    for mixed in (True, False):
        small = engine("dense", num_kv_blocks=40, mixed_steps=mixed)
        assert [s.completion_token_ids for s in small.generate(PROMPTS, GREEDY)] == single, mixed
        assert small.scheduler.preemptions > 0, mixed
        assert (small.scheduler.mixed_steps_run > 0) == mixed
        assert small.scheduler.block_manager.num_free == 40


def _staggered(eng: LLMEngine) -> tuple[list[list[int]], int]:
    """A short prompt that is already decoding when a long one (several chunks of a 16-token
    budget) and a short one arrive. Returns each sequence's tokens, and how many steps ran a
    decode (a sampled token's) and a prompt chunk together, as seen from the sequences."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = eng.add_request(PROMPTS[0], params)
    for _ in range(3):
        eng.step()
    assert first.num_completion_tokens == 3  # the prompt's step, then two decode steps
    seqs = [first, eng.add_request(PROMPTS[2], params), eng.add_request(PROMPTS[1], params)]
    assert seqs[1].num_prompt_tokens > 3 * 16, "the long prompt needs several chunks"
    both = 0
    while any(not s.is_finished for s in seqs):
        before = {s: (s.num_computed_tokens, s.num_tokens) for s in seqs if not s.is_finished}
        eng.step()
        ran = [(computed, tokens, s.num_prompt_tokens) for s, (computed, tokens) in before.items()
               if s.num_computed_tokens > computed]
        decode = any(tokens - computed == 1 and computed >= prompt for computed, tokens, prompt in ran)
        chunk = any(tokens - computed > 1 for computed, tokens, _ in ran)
        both += decode and chunk
    return [s.completion_token_ids for s in seqs], both


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mixed_steps_decode_while_a_prompt_is_chunked_and_change_no_token(kind):
    from engine_templates.engine.oracle import HFOracle

    mixed = engine(kind, max_num_batched_tokens=16)
    tokens, both = _staggered(mixed)
    assert both > 0 and mixed.scheduler.mixed_steps_run >= both
    plain = engine(kind, max_num_batched_tokens=16, mixed_steps=False)
    plain_tokens, plain_both = _staggered(plain)
    assert plain_both == 0 and plain.scheduler.mixed_steps_run == 0
    assert tokens == plain_tokens
    oracle = HFOracle.from_dir(checkpoint(kind), "fp32")
    prompts = [mixed.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])]
    assert tokens == [oracle.greedy(p, 12) for p in prompts]


def test_a_mixed_step_takes_decodes_first_and_preempts_a_prompt_mid_way():
    from engine_templates.engine.oracle import HFOracle
    from engine_templates.engine.sequence import Status

    def step():  # LLMEngine.step, with the scheduled batch in view
        seqs, is_prefill = eng.scheduler.schedule()
        eng.postprocess(seqs, eng.runner.run(seqs, is_prefill))
        return seqs, is_prefill

    # 6 blocks of 4 positions, 3 tokens a step: the long prompt (16 tokens, 4 blocks) is
    # admitted beside the short one and is still mid-way when the short one needs a third block.
    eng = engine("dense", num_kv_blocks=6, max_num_batched_tokens=3, max_model_len=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    short = eng.add_request(list(range(10, 14)), params)
    assert step() == ([short], True) and step() == ([short], False)  # 3 prompt tokens, then 1
    long = eng.add_request(list(range(20, 36)), params)
    for computed in (2, 4, 6, 8):
        assert step() == ([short, long], True)  # the decode first, then 2 of long's tokens
        assert long.num_computed_tokens == computed and long.num_completion_tokens == 0
    assert eng.scheduler.mixed_steps_run == 4 and eng.scheduler.block_manager.num_free == 0
    assert short.num_tokens == 9  # its next position is in a third block: long makes room
    assert step() == ([short], False)
    assert eng.scheduler.preemptions == 1 and long.status is Status.WAITING
    assert long.num_computed_tokens == 0 and long.block_table == []
    while not long.is_finished:
        step()
    oracle = HFOracle.from_dir(checkpoint("dense"), "fp32")
    for seq in (short, long):
        assert seq.completion_token_ids == oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 8)
    assert eng.scheduler.block_manager.num_free == 6


def test_sampling_is_seeded_per_request_and_top_k_1_is_greedy():
    eng = engine("dense")
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    a, b = eng.generate([PROMPTS[0], PROMPTS[0]], sampled)
    assert a.completion_token_ids == b.completion_token_ids
    other = eng.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))
    assert other[0].completion_token_ids != a.completion_token_ids
    greedy = eng.generate([PROMPTS[1]], GREEDY)[0].completion_token_ids
    top1 = SamplingParams(temperature=2.0, top_k=1, max_tokens=10, ignore_eos=True)
    assert eng.generate([PROMPTS[1]], top1)[0].completion_token_ids == greedy
    cold = SamplingParams(temperature=1e-3, max_tokens=10, ignore_eos=True)
    assert eng.generate([PROMPTS[1]], cold)[0].completion_token_ids == greedy


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)


def tempered(temperature: float, kept: int = len(PROBS)) -> list[float]:
    """PROBS under a temperature, renormalized over the first `kept` tokens."""
    p = PROBS ** (1 / temperature)
    p[kept:] = 0
    return (p / p.sum()).tolist()


SAMPLING_CASES = [
    (dict(temperature=1.0), PROBS.tolist()),
    (dict(temperature=0.5), tempered(0.5)),  # [.53, .30, .13, .03]
    (dict(temperature=2.0), tempered(2.0)),  # [.33, .28, .23, .16]
    (dict(temperature=1e-3), [1, 0, 0, 0]),  # a temperature near 0 is greedy
    # token 3 dropped: the tokens above it hold 0.9 > top_p; token 2 stays (0.7 above it)
    (dict(temperature=1.0, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0]),
    (dict(temperature=1.0, top_p=0.35), [1, 0, 0, 0]),  # the best token always stays
    # top_p over the tempered distribution [.33, .28, .23, .16]: 0.61 above token 2, which stays
    # (over PROBS 0.7 would drop it)
    (dict(temperature=2.0, top_p=0.65), tempered(2.0, kept=3)),
    (dict(temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0, 0]),
]


@pytest.mark.parametrize("params, expected", SAMPLING_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in p.items()) for p, _ in SAMPLING_CASES])
def test_sampled_frequencies_follow_temperature_top_p_and_top_k(params, expected):
    """8000 rows of one crafted distribution: each token's share within 0.03 of what the settings
    give (5 standard deviations at most), and a dropped token never drawn."""
    rows = 8000
    logits = PROBS.log().float().repeat(rows, 1)
    seqs = [Sequence([1], SamplingParams(**params)) for _ in range(rows)]
    tokens, _ = Sampler("cpu", seed=0)(logits, seqs)
    share = (torch.bincount(tokens, minlength=len(PROBS)).double() / rows).tolist()
    assert max(abs(a - b) for a, b in zip(share, expected)) < 0.03, (share, expected)
    assert [s == 0 for s in share] == [e == 0 for e in expected], share


def test_stop_string_eos_and_max_tokens():
    eng = engine("dense")
    full = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert full.finish_reason == "length" and full.num_completion_tokens == 20
    stop = full.text[3:6]
    cut = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    token = full.completion_token_ids[4]
    at = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=20, stop_token_ids=(token,)))[0]
    assert at.finish_reason == "stop"
    assert at.completion_token_ids == full.completion_token_ids[:full.completion_token_ids.index(token) + 1]
    eos_eng = engine("dense")
    eos_eng.eos_token_ids = frozenset({token})
    assert eos_eng.generate([PROMPTS[1]], SamplingParams(max_tokens=20))[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_template_kernel_is_wired_in_and_recorded(tmp_path, kind):
    """The q/k norm and RoPE template (eager: test_greedy_tokens_equal_transformers) in a batch,
    prefill and decode, gives transformers' greedy tokens."""
    from engine_templates.engine.oracle import HFOracle

    # odd token counts leave a block's last token past the end; 4 q + 2 k heads, a block's last heads
    point = {"tokens_per_program": 2, "heads_per_program": 4, "num_warps": 1}
    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"qk_norm_rope": {"impl": "template", "template": "heads", "point": point},
                                   "silu_mul": {"impl": "reference"}}))
    eng = LLMEngine(EngineConfig(model_dir=checkpoint(kind), dtype="fp32", device="cpu",
                                 max_model_len=64, max_num_seqs=2, kernels=parse_kernels_file(kernels)))
    assert eng.kernel_choices["qk_norm_rope"] == {"impl": "template", "template": "heads", "point": point}
    assert eng.kernel_choices["silu_mul"] == {"impl": "reference"}
    assert eng.kernel_choices["decode_attention"] == {"impl": "eager"}
    # what the model calls is the template's launcher, every layer of every step
    assert eng.kernels.qk_norm_rope.__module__ == OPS["qk_norm_rope"].templates["heads"].module
    counted = count_calls(eng.kernels, "qk_norm_rope")
    oracle = HFOracle.from_dir(checkpoint(kind), "fp32")
    for seq in eng.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True)):
        assert seq.completion_token_ids == oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 4), kind
    assert counted["qk_norm_rope"] >= 2 * 4  # 2 layers; a prefill step, then 3 decode steps at least


def test_moe_template_kernel_gives_transformers_greedy_tokens(tmp_path):
    from engine_templates.engine.oracle import HFOracle

    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"fused_moe": {"impl": "template", "template": "gemv"}}))
    eng = engine("moe", max_model_len=64, max_num_seqs=2, kernels=parse_kernels_file(kernels))
    assert eng.kernel_choices["fused_moe"]["template"] == "gemv"
    oracle = HFOracle.from_dir(checkpoint("moe"), "fp32")
    for seq in eng.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True)):
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == oracle.greedy(prompt, 4), seq
        expected = oracle.logprobs(prompt, seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4
    # float32: no grouped path, so the template ran every step's call (one MoE layer)
    assert eng.kernels.fused_moe.calls["eager"] == 0 and eng.kernels.fused_moe.calls["template"] >= 4


def test_moe_template_hands_prefill_over_its_token_limit_to_the_eager_grouped_path(caplog):
    """With the decode-shaped gemv template chosen, a bf16 call of more tokens than the template's
    MAX_TOKENS runs the op's eager (its grouped path), a decode-sized one the template; greedy
    tokens stay transformers' and those of the template run on every call."""
    from engine_templates.engine.config import EngineConfig
    from engine_templates.engine.kernels import MoEPrefillRoute
    from engine_templates.engine.oracle import HFOracle
    from engine_templates.ops.fused_moe import grouped_mm_device
    from engine_templates.ops.fused_moe.templates import MAX_TOKENS

    if not grouped_mm_device(torch.device("cpu")):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    assert MAX_TOKENS == max(EngineConfig().cuda_graph_batch_sizes)
    # one program per (token, slot) pair in each pass at hidden 64, intermediate 32: the interpreter's cost
    point = {"block_i": 32, "block_h": 64, "block_o": 64, "block_k": 32, "num_warps": 1}
    gemv = {"fused_moe": KernelSpec(impl="template", template="gemv", point=point)}
    with caplog.at_level("INFO", logger="infersmith.engine"):
        eng = engine("moe", "bf16", max_num_seqs=2, max_num_batched_tokens=256, kernels=gemv)
    assert sum("grouped GEMMs" in r.getMessage() for r in caplog.records) == 1
    assert eng.kernel_choices["fused_moe"]["prefill"] == {"impl": "eager", "path": "grouped",
                                                          "above_tokens": MAX_TOKENS}
    route = eng.kernels.fused_moe
    assert isinstance(route, MoEPrefillRoute) and route.max_tokens == MAX_TOKENS
    layer = next(layer for layer in eng.runner.model.layers if layer.is_moe)
    x, logits = torch.zeros(MAX_TOKENS + 1, 64, dtype=torch.bfloat16), torch.zeros(MAX_TOKENS + 1, 8)
    assert route.choose(x, logits, layer.w_gate_up, layer.w_down, 2, True) is route.eager
    assert route.choose(x[:MAX_TOKENS], logits, layer.w_gate_up, layer.w_down, 2, True) is route.template

    prompts = ["Paged attention keeps the cache in blocks; the scheduler batches requests. " * 3, "Hello world!"]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    seqs = eng.generate(prompts, params)
    assert seqs[0].num_prompt_tokens > MAX_TOKENS
    # one MoE layer (layer 1 is dense): the prompts' step went to eager, the 2 decode steps to the template
    assert route.calls == {"eager": 1, "template": 2}
    oracle = HFOracle.from_dir(checkpoint("moe"), "bf16")
    template_only = engine("moe", "bf16", max_num_seqs=2, max_num_batched_tokens=256, kernels=gemv)
    template_only.kernels.fused_moe = template_only.kernels.fused_moe.template
    for seq, before in zip(seqs, template_only.generate(prompts, params)):
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.completion_token_ids == before.completion_token_ids == oracle.greedy(prompt, 3)
        expected = oracle.logprobs(prompt, seq.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 0.1


def test_moe_template_keeps_every_call_where_the_grouped_path_cannot_run():
    from engine_templates.engine.kernels import KernelSet, MoEPrefillRoute

    kernels = KernelSet({"fused_moe": KernelSpec(impl="template", template="gemv")})
    w_gate_up, w_down = torch.zeros(8, 64, 64), torch.zeros(8, 64, 32)  # float32: no grouped path
    assert not kernels.settle_moe_prefill(w_gate_up, w_down, 2, torch.float32)
    assert "prefill" not in kernels.choices["fused_moe"]
    route = kernels.fused_moe
    assert route.choose(torch.zeros(500, 64), torch.zeros(500, 8), w_gate_up, w_down, 2, True) is route.template
    # eager and the other impls are what they were: no route around them
    assert not isinstance(KernelSet({}).fused_moe, MoEPrefillRoute)
    assert not isinstance(KernelSet({"fused_moe": KernelSpec(impl="reference")}).fused_moe, MoEPrefillRoute)


def test_moe_route_hands_eager_only_calls_it_would_group():
    """Many experts for top_k: eager gathers up to experts / top_k tokens, and the template keeps
    those calls even above its limit; the recorded threshold says so."""
    from engine_templates.engine.kernels import KernelSet
    from engine_templates.ops.fused_moe import grouped_mm_device

    if not grouped_mm_device(torch.device("cpu")):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    kernels = KernelSet({"fused_moe": KernelSpec(impl="template", template="gemv")})
    w_gate_up = torch.zeros(256, 32, 64, dtype=torch.bfloat16)
    w_down = torch.zeros(256, 64, 16, dtype=torch.bfloat16)
    assert kernels.settle_moe_prefill(w_gate_up, w_down, 2, torch.bfloat16)
    assert kernels.choices["fused_moe"]["prefill"]["above_tokens"] == 128
    route = kernels.fused_moe
    x, logits = torch.zeros(129, 64, dtype=torch.bfloat16), torch.zeros(129, 256, dtype=torch.bfloat16)
    assert route.choose(x[:128], logits[:128], w_gate_up, w_down, 2, True) is route.template
    assert route.choose(x, logits, w_gate_up, w_down, 2, True) is route.eager


def test_the_model_calls_the_free_kernel_named_for_every_op_and_uses_its_output(tmp_path):
    """A counting kernel (eager's work; counted_kernels.py) named for every op the engine takes a
    kernel for, on the MoE checkpoint (layer 0 MoE, layer 1 dense: every op in use). Each forward
    calls each kernel once per place the model has for it, and scaling one kernel's output moves
    the answers: the model uses what the named kernel returns."""
    from engine_templates.engine.oracle import HFOracle

    free = tmp_path / "free"
    (tmp_path / "k.json").write_text(json.dumps({op: {"impl": "free", "path": f"free/{op}.py"}
                                                 for op in counting_kernels(free, ENGINE_OPS)}))
    specs = parse_kernels_file(tmp_path / "k.json")
    assert specs["silu_mul"] == KernelSpec(impl="free", path=str(free / "silu_mul.py"))
    eng = engine("moe", max_model_len=64, max_num_seqs=2, kernels=specs)
    assert all(eng.kernel_choices[op] == {"impl": "free", "path": str(free / f"{op}.py")} for op in ENGINE_OPS)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    honest = eng.generate(PROMPTS[:2], params)
    oracle = HFOracle.from_dir(checkpoint("moe"), "fp32")
    for seq in honest:
        assert seq.completion_token_ids == oracle.greedy(seq.token_ids[:seq.num_prompt_tokens], 3)

    n = {op: calls(free, op) for op in ENGINE_OPS}
    forwards = n["rmsnorm"]  # layer 0's input norm: the one call with no residual yet
    assert forwards >= 3, n  # a prefill step, then two decode steps at least
    assert n["fused_add_rmsnorm"] == 4 * forwards, n  # layer 1's input norm, 2 post-attention, the final
    assert n["qk_norm_rope"] == n["prefill_attention"] + n["decode_attention"] == 2 * forwards, n
    assert n["prefill_attention"] > 0 and n["decode_attention"] > 0, n
    assert n["fused_moe"] == n["silu_mul"] == forwards, n  # one MoE layer, one dense

    assert n["rope"] == 0, n  # Qwen3 rotates in qk_norm_rope; Llama and the others in rope
    # no sliding window: the *_swa ops are tests/test_architectures.py's (a windowed Mistral)
    unused = {"rope", "prefill_attention_swa", "decode_attention_swa"}
    assert all(n[op] == 0 for op in unused), n
    for op in set(ENGINE_OPS) - unused:
        module = getattr(eng.kernels, op).__globals__
        module["SCALE"] = 1.5
        try:
            scaled = eng.generate(PROMPTS[:2], params)
        finally:
            module["SCALE"] = 1.0
        assert any(a.completion_token_ids != b.completion_token_ids
                   or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
                   for a, b in zip(honest, scaled)), op


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    ('{"matmul": {"impl": "eager"}}', "not an op the engine uses"),
    ('{"rmsnorm": {"impl": "fast"}}', "expected {\"impl\""),
    ('{"rmsnorm": {"impl": "template", "template": "nope"}}', "no template 'nope'"),
    ('{"rmsnorm": {"impl": "template", "point": {"block_n": 3}}}', "does not match the space"),
    ('{"rmsnorm": {"impl": "free", "path": "absent.py"}}', "no such candidate file"),
])
def test_bad_kernels_files_are_one_line_errors(tmp_path, content, message):
    from engine_templates.engine.kernels import KernelSet

    (tmp_path / "k.json").write_text(content)
    with pytest.raises(KernelFileError, match=message.replace("{", r"\{").replace("(", r"\(")):
        KernelSet(parse_kernels_file(tmp_path / "k.json"))


def test_model_dir_errors_are_one_line(tmp_path):
    with pytest.raises(ModelDirError, match="no such model directory"):
        ModelConfig.from_dir(tmp_path / "absent")
    with pytest.raises(ModelDirError, match="has no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gemma"}')
    with pytest.raises(ModelDirError, match='model_type "gemma" is not supported'):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96}')
    with pytest.raises(ModelDirError, match="missing field 'num_attention_heads'"):
        ModelConfig.from_dir(tmp_path)
    config = json.loads((checkpoint("dense") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="no tokenizer.json"):
        LLMEngine(EngineConfig(model_dir=tmp_path, device="cpu"))


def test_prompt_longer_than_the_model_is_refused():
    eng = engine("dense", max_model_len=16)
    with pytest.raises(ValueError, match="exceeds the model length of 16"):
        eng.add_request(PROMPTS[2], GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cuda_graph_decode_equals_eager_decode_on_a_gpu(kind):
    # num_kv_blocks: two engines in one process; from gpu_memory_utilization the first would
    # take the GPU's memory and leave the second none (what the H200 run of 2026-12-03 hit)
    settings = dict(model_dir=checkpoint(kind), dtype="fp32", device="cuda", max_num_seqs=8,
                    max_model_len=256, block_size=16, num_kv_blocks=128, cuda_graph_batch_sizes=(1, 2, 4, 8))
    graphs = LLMEngine(EngineConfig(**settings))
    eager = LLMEngine(EngineConfig(**settings, enforce_eager=True))
    # the eager MoE is captured only while tokens * top_k <= experts (2 * 4 <= 8)
    assert graphs.runner.graphs.sizes == ([1, 2, 4, 8] if kind == "dense" else [1, 2, 4])
    assert eager.runner.graphs is None
    for a, b in zip(graphs.generate(PROMPTS, GREEDY), eager.generate(PROMPTS, GREEDY)):
        assert a.completion_token_ids == b.completion_token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert graphs.steps_ahead > 0  # the graph path queued decode steps ahead (async decode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_route_on_a_gpu_groups_outside_graphs_and_keeps_the_template_under_capture():
    """On a GPU: the eager grouped path (torch._grouped_mm) runs where `grouped_usable` says so and
    agrees with the per-expert loop; a call over the template's token limit goes to it, except
    under CUDA graph capture, where the template keeps the call."""
    from engine_templates.engine.kernels import KernelSet
    from engine_templates.ops.fused_moe import grouped_moe, grouped_usable, loop_moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, top_k, tokens = 16, 256, 128, 4, 96
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.05).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.05).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=gen).bfloat16()
    if not grouped_usable(w_gate_up, w_down, torch.bfloat16):
        pytest.skip("torch._grouped_mm has no sync-free kernel on this GPU")
    grouped = grouped_moe(x, logits, w_gate_up, w_down, top_k, True)
    loop = loop_moe(x, logits, w_gate_up, w_down, top_k, True)
    assert torch.allclose(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)

    kernels = KernelSet({"fused_moe": KernelSpec(impl="template", template="gemv")})
    assert kernels.settle_moe_prefill(w_gate_up, w_down, top_k, torch.bfloat16)
    route = kernels.fused_moe
    assert route.choose(x, logits, w_gate_up, w_down, top_k, True) is route.eager
    out = torch.empty_like(x)
    route(x, logits, w_gate_up, w_down, top_k, True)  # outside capture: the eager grouped path
    route.template(x, logits, w_gate_up, w_down, top_k, True)  # compiles the template's kernels before capture
    torch.cuda.synchronize()
    assert route.calls["eager"] == 1
    calls = dict(route.calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(route(x, logits, w_gate_up, w_down, top_k, True))
    assert route.calls == calls | {"template": calls["template"] + 1}  # captured: the template
    graph.replay()
    torch.cuda.synchronize()
    template = route.template(x, logits, w_gate_up, w_down, top_k, True)
    assert torch.equal(out, template)  # the template is deterministic, bit for bit
