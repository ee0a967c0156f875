"""Speculative decoding by prompt lookup on the tiny checkpoints: greedy tokens identical to plain
decoding (eagerly and on the CUDA-graph path, dense and MoE, with a cache short enough to
preempt), drafts accepted on repetitive text, requests ending exactly where they would (max_tokens,
EOS, stop strings), sampled requests untouched; the n-gram lookup itself; /stats of a real server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from tiny_checkpoints import checkpoint

from engine_templates.engine.config import EngineConfig, EngineSetupError
from engine_templates.engine.cuda_graphs import DecodeGraphs
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.sequence import SamplingParams
from engine_templates.engine.speculative import FIRST_PAUSE, LONGEST_PAUSE, MISS_STREAK, Backoff, NgramIndex, accept

ROOT = Path(__file__).resolve().parent.parent
REPETITIVE = ["id,name,city\n1,ann,oslo\n2,bob,rome\n3,cid,oslo\n4,dan,rome\n5,eve,oslo\n6,",
              "a b c d e f g h a b c d e f g h a b c d e f g h a b c"]
PLAIN = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog."]


def engine(kind: str, spec_tokens: int = 0, graphs: bool = False, **settings) -> LLMEngine:
    config = dict(model_dir=checkpoint(kind), dtype="fp32", device="cpu", max_model_len=256, max_num_seqs=4,
                  spec_tokens=spec_tokens) | settings
    eng = LLMEngine(EngineConfig(**config))
    if graphs:  # the graph path's static buffers, padding and sizes, run without capture (a CPU has none)
        eng.runner.graphs = DecodeGraphs(eng.runner, eng.model_config, capture=False)
    return eng


def answers(eng: LLMEngine, prompts, params) -> list[tuple[list[int], str, str]]:
    return [(s.completion_token_ids, s.text, s.finish_reason) for s in eng.generate(prompts, params)]


def test_ngram_lookup():
    index = NgramIndex(3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.lookup(tokens, 2) == [7, 5]  # the latest earlier occurrence of (1, 2, 3)
    assert index.lookup(tokens + [8], 4) == []  # nothing ever followed 3, 8 or 8
    tokens += [8, 4, 2, 3]
    assert index.lookup(tokens, 5) == [8, 4, 2, 3]  # (4, 2, 3) unseen: (2, 3) at 10, then the end
    assert index.lookup([6], 3) == []
    assert accept([7, 5, 1], [(7, -0.1), (5, -0.2), (4, -0.3), (9, -0.4)]) == [(7, -0.1), (5, -0.2), (4, -0.3)]
    assert accept([7, 5], [(6, -0.1), (5, -0.2), (9, -0.3)]) == [(6, -0.1)]
    assert accept([7], [(7, -0.1), (8, -0.2)]) == [(7, -0.1), (8, -0.2)]  # all accepted: one more comes free


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_tokens_are_those_of_plain_decoding_and_drafts_are_accepted(kind):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = REPETITIVE + PLAIN[:1]
    plain = engine(kind).generate(prompts, params)
    for spec_tokens, graphs in ((4, False), (3, True)):
        eng = engine(kind, spec_tokens, graphs)
        got = eng.generate(prompts, params)
        assert [s.completion_token_ids for s in got] == [s.completion_token_ids for s in plain]
        assert max(abs(a - b) for g, p in zip(got, plain) for a, b in zip(g.logprobs, p.logprobs)) < 1e-4
        stats = eng.spec_stats.as_dict()
        assert stats["accepted_tokens"] > 0 and 0 < stats["acceptance_rate"] <= 1, stats
        # fewer steps than tokens: accepted drafts came several to a step
        assert stats["verify_steps"] < sum(s.num_completion_tokens for s in got)
    assert not graphs or eng.runner.graphs.sizes  # the graph path was there to take


def test_a_short_cache_preempts_and_shortens_drafts_without_changing_a_token():
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = answers(engine("dense", num_kv_blocks=14), REPETITIVE * 2, params)
    eng = engine("dense", 6, num_kv_blocks=14)
    assert answers(eng, REPETITIVE * 2, params) == plain
    assert eng.scheduler.preemptions > 0 and eng.spec_stats.accepted > 0


def test_requests_end_where_they_would_without_drafts():
    eng, plain = engine("dense", 5), engine("dense")
    eos = next(iter(eng.eos_token_ids))
    first = plain.generate(REPETITIVE[:1], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = plain.tokenizer.decode(first.completion_token_ids[12:14])  # text the answer reaches mid-way
    for params in (SamplingParams(max_tokens=30, stop=(stop,)),
                   SamplingParams(max_tokens=30, stop_token_ids=(first.completion_token_ids[9], eos))):
        assert answers(eng, REPETITIVE, params) == answers(plain, REPETITIVE, params), params
    assert answers(eng, REPETITIVE, SamplingParams(max_tokens=7, ignore_eos=True))[0][0] == \
        first.completion_token_ids[:7]
    assert eng.spec_stats.accepted > 0


def test_sampled_requests_are_not_drafted():
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    eng = engine("dense", 4)
    assert answers(eng, REPETITIVE, seeded) == answers(engine("dense"), REPETITIVE, seeded)
    assert eng.spec_stats.drafted == 0


def test_drafting_pauses_after_a_streak_of_misses_doubling_up_to_a_cap_and_resumes_on_a_hit():
    b = Backoff()
    pauses = []
    for _ in range(8):
        for _ in range(MISS_STREAK - 1):
            b.miss()
            assert b.pause == 0
        b.miss()
        pauses.append(b.pause)
        b.pause = 0  # the pause spent
    assert pauses[0] == FIRST_PAUSE and pauses[-1] == LONGEST_PAUSE
    assert all(b == min(2 * a, LONGEST_PAUSE) for a, b in zip(pauses, pauses[1:]))
    b.miss()
    b.hit()  # an accepted draft: the streak and the pause length start again
    for _ in range(MISS_STREAK):
        b.miss()
    assert b.pause == FIRST_PAUSE


def test_while_drafting_is_paused_decode_steps_go_ahead_and_no_token_changes():
    """A step that drafts waits for the tokens of the one before; one whose sequences are all
    paused (after drafts that gained nothing) is queued ahead, as without speculation."""
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    plain = engine("dense", graphs=True)
    expected = [s.completion_token_ids for s in plain.generate(PLAIN, params)]
    eng = engine("dense", 3, graphs=True)
    assert [s.completion_token_ids for s in eng.generate(PLAIN, params)] == expected
    stats = eng.spec_stats
    assert stats.drafted > stats.accepted > 0  # drafts were tried, some rejected
    assert 0 < eng.steps_ahead < plain.steps_ahead  # paused stretches went ahead; drafting ones did not
    # sampled requests are never drafted: their steps go ahead exactly as without speculation
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    plain, eng = engine("dense", graphs=True), engine("dense", 3, graphs=True)
    assert answers(eng, PLAIN, seeded) == answers(plain, PLAIN, seeded)
    assert eng.steps_ahead == plain.steps_ahead > 0 and eng.spec_stats.drafted == 0


def test_settings_are_checked():
    with pytest.raises(EngineSetupError, match="--spec-tokens must be at least 0"):
        EngineConfig(spec_tokens=-1)
    with pytest.raises(EngineSetupError, match="--spec-ngram must be at least 1"):
        EngineConfig(spec_tokens=2, spec_ngram=0)


def test_the_server_reports_speculation_in_stats(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine_templates.engine", "serve", "--model-dir",
                                 str(checkpoint("dense")), "--dtype", "fp32", "--port", "0", "--max-model-len", "256",
                                 "--served-model-name", "tiny", "--spec-tokens", "4", "--spec-ngram", "2"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving tiny on "), log.read_text()[-2000:]
        url = line.split()[3]

        def stats() -> dict:
            with urllib.request.urlopen(url + "/stats") as r:
                return json.loads(r.read())["speculative"]

        assert stats() == {"spec_tokens": 4, "spec_ngram": 2, "verify_steps": 0, "drafted_tokens": 0,
                           "accepted_tokens": 0, "acceptance_rate": None}
        body = {"model": "tiny", "prompt": REPETITIVE[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 40
        after = stats()
        assert after["drafted_tokens"] > 0 and after["accepted_tokens"] > 0
        assert after["acceptance_rate"] == after["accepted_tokens"] / after["drafted_tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
