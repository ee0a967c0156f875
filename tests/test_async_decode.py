"""Async decode (engine.py) against the synchronous engine on the tiny dense and MoE checkpoints.

The overlapped path runs only through DecodeGraphs, so each engine here gets DecodeGraphs
without capture (a CPU has no graphs): the same static buffers, the step queued behind the one
in flight with its input ids gathered from that step's tokens, the discarded rows. Every test
checks that the overlap happened (steps queued ahead, rows discarded) and that the answers are
the synchronous engine's: tokens, log-probabilities, text, finish reasons, and no block left.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio  # noqa: E402

import pytest  # noqa: E402
from tiny_checkpoints import checkpoint  # noqa: E402

from engine_templates.engine.config import EngineConfig  # noqa: E402
from engine_templates.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.engine_loop import EngineLoop, Request  # noqa: E402
from engine_templates.engine.sequence import SamplingParams, Sequence  # noqa: E402

PROMPTS = ["Hello world!", "The quick brown fox jumps", "Paged attention keeps the cache in blocks; " * 6,
           "A", "Continuous batching lets"]


def engine(kind: str, async_decode: bool, **options) -> LLMEngine:
    settings = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, block_size=4)
    settings.update(options)
    eng = LLMEngine(EngineConfig(model_dir=checkpoint(kind), dtype="fp32", device="cpu",
                                 async_decode=async_decode, **settings))
    eng.runner.graphs = DecodeGraphs(eng.runner, eng.model_config, capture=False)
    return eng


def answers(seqs: list[Sequence]) -> list[tuple]:
    return [(s.completion_token_ids, s.text, s.finish_reason) for s in seqs]


def assert_same(got: list[Sequence], expected: list[Sequence]) -> None:
    assert answers(got) == answers(expected)
    for g, e in zip(got, expected):
        assert max((abs(a - b) for a, b in zip(g.logprobs, e.logprobs)), default=0) < 1e-5


def stops(sync: LLMEngine, prompt: str) -> tuple[str, int]:
    """A stop string and a stop token that first appear mid-way through the greedy answer."""
    full = sync.generate([prompt], SamplingParams(max_tokens=14, ignore_eos=True))[0]
    ids = full.completion_token_ids
    token = next(t for k, t in enumerate(ids) if k >= 4 and t not in ids[:k])
    for k in range(5, 12):
        piece = sync.tokenizer.decode(ids[:k])
        stop = piece[-2:]
        if "\ufffd" not in stop and full.text.find(stop) == len(piece) - 2:
            return stop, token
    raise AssertionError(f"no stop string in {full.text!r}")


def requests(sync: LLMEngine) -> list[tuple[str, SamplingParams]]:
    """Greedy and seeded, each its own max_tokens, and a stop string and a stop token met in the
    middle of the batch (from the synchronous engine's own answer), so that sequences end at
    different steps, foreseen (length) and not (stop)."""
    stop, token = stops(sync, PROMPTS[0])
    return [(PROMPTS[1], SamplingParams(max_tokens=11, ignore_eos=True)),
            (PROMPTS[0], SamplingParams(max_tokens=14, ignore_eos=True, stop=(stop,))),
            (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True)),
            (PROMPTS[0], SamplingParams(max_tokens=14, stop_token_ids=(token,))),
            (PROMPTS[3], SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=4, ignore_eos=True)),
            (PROMPTS[4], SamplingParams(temperature=1.2, seed=9, max_tokens=13, ignore_eos=True))]


def run(eng: LLMEngine, work: list[tuple[str, SamplingParams]]) -> list[Sequence]:
    seqs = [eng.add_request(prompt, params) for prompt, params in work]
    while eng.has_unfinished():
        eng.step()
    return seqs


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_async_decode_gives_the_synchronous_answers(kind):
    # every prompt in the first step: the steps after are pure decode steps, each ahead but the first
    sync, overlapped = engine(kind, False, max_num_batched_tokens=256), engine(kind, True, max_num_batched_tokens=256)
    # as many as one graph takes (the eager MoE's graphs stop at 4 rows), so that every decode step can overlap
    work = requests(sync)[:overlapped.runner.graphs.sizes[-1]]
    expected, got = run(sync, work), run(overlapped, work)
    assert_same(got, expected)
    reasons = [s.finish_reason for s in got]
    assert reasons == ["length", "stop", "length", "stop", "length", "length"][:len(work)]
    assert 4 <= got[1].num_completion_tokens < 14 and 4 <= got[3].num_completion_tokens < 14
    steps = max(s.num_completion_tokens for s in got)
    assert sync.steps_ahead == 0 and overlapped.steps_ahead == steps - 2
    assert overlapped.rows_discarded == 2  # the stops, unforeseen: each one's row in the step ahead
    for eng in (sync, overlapped):
        assert eng.scheduler.block_manager.num_free == eng.runner.num_blocks and eng._in_flight is None


def test_async_decode_falls_back_for_arrivals_and_preemption_and_answers_the_same():
    """A short cache (preemption) and prompts arriving while others decode (a step ahead would
    keep them waiting): the synchronous step there, the overlap again after."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def staggered(eng: LLMEngine) -> tuple[list[Sequence], int]:
        first = [eng.add_request(p, params) for p in PROMPTS[:2]]
        for _ in range(4):
            eng.step()
        assert all(s.num_completion_tokens == 4 for s in first)
        before = eng.steps_ahead
        return first + run(eng, [(p, params) for p in PROMPTS[2:]]), before

    # 40 blocks of 4 positions: the long prompt (114 tokens) and the others do not fit together
    (expected, _), (got, before) = staggered(engine("dense", False, num_kv_blocks=40)), \
        staggered(overlapped := engine("dense", True, num_kv_blocks=40))
    assert_same(got, expected)
    assert before > 0 and overlapped.steps_ahead > before and overlapped.scheduler.preemptions > 0
    assert overlapped.scheduler.block_manager.num_free == 40


def test_an_abort_mid_stream_through_the_engine_thread():
    """Through EngineLoop, as the server drives it: a long request aborted after its first
    streamed tokens, while the step in flight has its row (discarded then); the others' answers
    are unchanged, each token is delivered once (counts rise from update to update), and no
    block is left."""
    short, long = SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=200, ignore_eos=True)
    expected = run(engine("dense", False, max_num_batched_tokens=256), [(p, short) for p in PROMPTS[:3]])
    eng = engine("dense", True, max_num_batched_tokens=256)
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]

    async def scenario():
        loop = EngineLoop(eng)
        loop.start()
        reqs = [Request(p, long if i == 1 else short, asyncio.get_running_loop()) for i, p in enumerate(prompts)]
        for r in reqs:
            loop.submit(r)
        finals, counts = {}, {i: [] for i in range(3)}

        async def follow(i: int):
            while True:
                update = await reqs[i].updates.get()
                counts[i].append(update.completion_tokens)
                if i == 1 and update.completion_tokens >= 3:
                    loop.abort(reqs[1])
                    return
                if update.finish_reason:
                    finals[i] = update
                    return

        await asyncio.wait_for(asyncio.gather(*(follow(i) for i in range(3))), timeout=120)
        while eng.has_unfinished():  # the abort reaches the engine thread, which then goes idle
            await asyncio.sleep(0.05)
        loop.stop()
        return reqs, finals, counts

    reqs, finals, counts = asyncio.run(scenario())
    for i in (0, 2):
        assert list(finals[i].token_ids) == expected[i].completion_token_ids
        assert counts[i] == sorted(set(counts[i])) and counts[i][-1] == 16
    aborted = reqs[1].seq
    assert aborted.finish_reason == "abort" and 3 <= aborted.num_completion_tokens < 200
    assert aborted.completion_token_ids[:16] == expected[1].completion_token_ids[:aborted.num_completion_tokens]
    assert eng.steps_ahead > 0 and eng.rows_discarded == 1 and eng._in_flight is None
    assert eng.scheduler.block_manager.num_free == eng.runner.num_blocks


@pytest.mark.parametrize("async_decode", [False, True])
def test_a_sequence_that_fills_the_whole_cache_ends_with_length(async_decode):
    # 8 blocks of 4 positions: the prompt fits, its answer cannot. Preempting it (the only
    # sequence) would bring it back to the same point forever; it ends where the cache does,
    # and the step that ends it reports it, so a server answers the request.
    eng = engine("dense", async_decode, num_kv_blocks=8)
    prompt = list(range(3, 23))  # 20 token ids
    short = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    seq = eng.add_request(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    reported = []
    for _ in range(200):
        if not eng.has_unfinished():
            break
        reported += eng.step()
    assert not eng.has_unfinished()
    assert short.finish_reason == "length" and short.num_completion_tokens == 3
    assert seq.finish_reason == "length" and seq in reported
    assert seq.num_tokens == 8 * 4 + 1  # the token that would need a ninth block is its last
    assert eng.scheduler.block_manager.num_free == 8


def test_a_prompt_waiting_for_cache_blocks_does_not_stop_the_overlap():
    # A cache one block short of the long prompt beside two decoding sequences: it waits until
    # they end. Meanwhile the synchronous scheduler runs the same pure
    # decode steps, so those steps go ahead; the answers are the same.
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    work = [(PROMPTS[1], params), (PROMPTS[0], params), (PROMPTS[2], params)]
    probe = engine("dense", False)
    bm = probe.scheduler.block_manager
    lengths = [len(probe.tokenizer.encode(p)) for p, _ in work]
    # the two hold their blocks for 2 more tokens when the long prompt arrives (after 2 steps)
    cache = bm.blocks_for(lengths[0] + 2) + bm.blocks_for(lengths[1] + 2) + bm.blocks_for(lengths[2]) - 1

    def staggered(eng: LLMEngine) -> tuple[list[Sequence], int]:
        first = [eng.add_request(p, q) for p, q in work[:2]]
        for _ in range(2):
            eng.step()
        late = eng.add_request(*work[2])
        before = eng.steps_ahead
        while late.status.name == "WAITING" and eng.has_unfinished():
            eng.step()
        ahead_while_waiting = eng.steps_ahead - before
        while eng.has_unfinished():
            eng.step()
        return first + [late], ahead_while_waiting

    sync, overlapped = engine("dense", False, num_kv_blocks=cache), engine("dense", True, num_kv_blocks=cache)
    expected, _ = staggered(sync)
    got, ahead = staggered(overlapped)
    assert_same(got, expected)
    assert ahead > 0
    assert overlapped.scheduler.block_manager.num_free == cache
