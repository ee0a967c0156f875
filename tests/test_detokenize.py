"""Incremental detokenization (Tokenizer.decode_more, through LLMEngine.postprocess): after every
token, a sequence's text is exactly what decoding its whole completion gives, and stop strings
cut it where searching the whole text cuts it.

The engine is real (the tiny dense checkpoint's weights); tokens are handed to `postprocess` as
the model runner hands them over, drawn at random (seeded) to reach what a model rarely emits:
the bytes of multi-byte characters split over tokens and left unfinished, special tokens between
them, the random checkpoint's plain added tokens, ids past the tokenizer's vocabulary.
"""
from __future__ import annotations

import json
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tiny_checkpoints import CORPUS, VOCAB, checkpoint  # noqa: E402

from engine_templates.engine.config import EngineConfig  # noqa: E402
from engine_templates.engine.engine import LLMEngine  # noqa: E402
from engine_templates.engine.random_checkpoint import train_tokenizer  # noqa: E402
from engine_templates.engine.sequence import SamplingParams  # noqa: E402
from engine_templates.engine.tokenizer import DecodedPrefix  # noqa: E402

WIDE = ["héllo wörld, naïve café", "€ 5 · ½ — “quotes”", "日本語のテキスト", "emoji 😀🎉 and 👍🏽",
        "Ελληνικά и русский"]


def byte_chars() -> dict[int, str]:
    """The byte-level alphabet: each byte as the character that stands for it in a token."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def model_dir(tmp_path, tokenizer: str):
    """The tiny dense checkpoint's weights with a tokenizer: `tiny` (its own: fewer ids than the
    model's vocabulary), `padded` (random_checkpoint's, trained with multi-byte text and padded
    with plain added tokens to the model's vocabulary), or `metaspace` (padded, with a
    SentencePiece-style decoder)."""
    if tokenizer == "tiny":
        return checkpoint("dense")
    out = tmp_path / tokenizer
    out.mkdir()
    for f in checkpoint("dense").iterdir():
        if not f.name.startswith("tokenizer"):
            (out / f.name).symlink_to(f)
    train_tokenizer(out, CORPUS + WIDE * 5, bpe_vocab=VOCAB - 40, pad_to=VOCAB)
    if tokenizer == "metaspace":
        spec = json.loads((out / "tokenizer.json").read_text())
        spec["decoder"] = {"type": "Metaspace", "replacement": "Ġ", "prepend_scheme": "always",
                           "split": True}
        (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def make_engine(path, max_model_len: int = 512) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=path, dtype="fp32", device="cpu", max_num_seqs=8,
                                  max_model_len=max_model_len, max_num_batched_tokens=64, block_size=4))


def random_completion(rng: random.Random, eng: LLMEngine, length: int) -> list[int]:
    """Token ids, mostly the bytes of multi-byte characters one token each (in order, sometimes
    cut short or interrupted), the rest whole words, special and added tokens, any id."""
    tok = eng.tokenizer._tok
    byte_ids = {b: tok.token_to_id(c) for b, c in byte_chars().items()}
    added = [i for i in range(tok.get_vocab_size(), VOCAB)] or \
            [i for i in range(3, VOCAB) if (t := tok.id_to_token(i)) and t.startswith("<|r")]
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.45:
            char = rng.choice(rng.choice(WIDE)).encode()
            cut = len(char) if rng.random() < 0.8 else rng.randrange(1, len(char) + 1)
            ids += [byte_ids[b] for b in char[:cut]]
        elif kind < 0.65:
            ids += tok.encode(rng.choice(WIDE + CORPUS[:6])[:rng.randrange(1, 12)]).ids
        elif kind < 0.75:
            ids.append(rng.choice((0, 1, 2)))  # <|endoftext|>, <|im_start|>, <|im_end|>
        elif kind < 0.85 and added:
            ids.append(rng.choice(added))
        else:
            ids.append(rng.randrange(VOCAB))
    return ids[:length]


def full_decode_steps(eng: LLMEngine, params: SamplingParams, completion: list[int]):
    """(text, finish reason) after each token, as the engine computed them before detokenizing
    incrementally: the whole completion decoded (less a stopping token), searched for each stop
    string from the start, cut at the first hit."""
    steps = []
    for n in range(1, len(completion) + 1):
        token = completion[n - 1]
        on_token = token in params.stop_token_ids or (token in eng.eos_token_ids and not params.ignore_eos)
        text = eng.tokenizer.decode(completion[:n - 1] if on_token else completion[:n])
        hits = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
        if hits:
            steps.append((text[:min(hits)[0]], "stop"))
            break
        if on_token:
            steps.append((text, "stop"))
            break
        steps.append((text, "length" if n == params.max_tokens else None))
    return steps


def random_params(rng: random.Random, eng: LLMEngine, completion: list[int]) -> SamplingParams:
    """Stop strings drawn from the texts the completion passes through (unfinished characters
    included), or absent; sometimes a stop token; EOS honoured or not."""
    stop = []
    if rng.random() < 0.6:
        n = rng.randrange(1, len(completion) + 1)
        text = eng.tokenizer.decode(completion[:n])
        for _ in range(rng.randrange(1, 4)):
            if text and rng.random() < 0.8:
                i = rng.randrange(len(text))
                stop.append(text[i:i + rng.randrange(1, 5)])
            else:
                stop.append(rng.choice(["\ufffd", "zz", "😀", "é,"]))
    stop_ids = (rng.choice(completion),) if rng.random() < 0.2 else ()
    return SamplingParams(max_tokens=len(completion), stop=tuple(stop), stop_token_ids=stop_ids,
                          ignore_eos=rng.random() < 0.7)


def check_random_sequences(eng: LLMEngine, seed: int, count: int) -> dict[str, int]:
    rng = random.Random(seed)
    reasons = {"stop": 0, "length": 0, "stop-string": 0}
    for _ in range(count):
        completion = random_completion(rng, eng, rng.randrange(1, 60))
        params = random_params(rng, eng, completion)
        expected = full_decode_steps(eng, params, completion)
        # A few sequences at once, as a batch: their states must not mix.
        seqs = [eng.add_request([5, 6, 7][:rng.randrange(1, 4)], params) for _ in range(3)]
        for n, (text, reason) in enumerate(expected):
            assert eng.postprocess(seqs, [[(completion[n], -1.0)]] * len(seqs)) == seqs
            for seq in seqs:
                assert (seq.text, seq.finish_reason) == (text, reason), (completion[:n + 1], params)
        assert all(s.is_finished for s in seqs)
        reasons[reason] += 1
        last = completion[len(expected) - 1]  # a stop token leaves the text as it was: no new hit
        on_token = last in params.stop_token_ids or (last in eng.eos_token_ids and not params.ignore_eos)
        reasons["stop-string"] += reason == "stop" and not on_token
    return reasons


@pytest.mark.parametrize("tokenizer", ["padded", "tiny"])
def test_incremental_text_equals_the_whole_decode_after_every_token(tmp_path, tokenizer):
    eng = make_engine(model_dir(tmp_path, tokenizer))
    assert eng.tokenizer.incremental
    reasons = check_random_sequences(eng, seed=sum(map(ord, tokenizer)), count=150)
    # The draw reaches every way to finish.
    assert reasons["stop-string"] > 10 and reasons["length"] > 10
    assert reasons["stop"] - reasons["stop-string"] > 5  # on a stop token or EOS


def test_a_decoder_that_looks_at_neighbours_is_decoded_whole(tmp_path):
    """A SentencePiece-style decoder drops the first token's leading space, so the text of a
    completion is not the text of its parts: decode_more falls back to decoding it whole."""
    eng = make_engine(model_dir(tmp_path, "metaspace"))
    assert not eng.tokenizer.incremental
    space_word = eng.tokenizer.encode(" the")
    assert eng.tokenizer.decode(space_word * 2) != eng.tokenizer.decode(space_word) * 2
    check_random_sequences(eng, seed=3, count=40)


def test_unfinished_characters_hold_the_decoded_prefix_back(tmp_path):
    """The final prefix moves past a multi-byte character only once its last byte is in."""
    eng = make_engine(model_dir(tmp_path, "padded"))
    tok = eng.tokenizer
    chars = byte_chars()
    ids = [tok._tok.token_to_id(chars[b]) for b in "a€😀".encode()]  # 1 + 3 + 4 bytes
    done, held = DecodedPrefix(), []
    for n in range(1, len(ids) + 1):
        assert tok.decode_more(ids, 0, n, done) == tok.decode(ids[:n])
        held.append(done.tokens)
    assert held == [1, 1, 1, 4, 4, 4, 4, 8]
    assert done.text == "a€😀"


def test_real_generation_keeps_the_text_of_every_step(tmp_path):
    """Sampled from the model, a batch: every step's text is the whole completion decoded."""
    eng = make_engine(model_dir(tmp_path, "padded"))
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=24, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in ("Hello world!", "日本語", "The quick brown fox")]
    while eng.has_unfinished():
        for seq in eng.step():
            assert seq.text == eng.tokenizer.decode(seq.completion_token_ids)
    assert all(s.num_completion_tokens == 24 for s in seqs)


def test_each_step_decodes_only_the_tokens_of_an_unfinished_character(tmp_path):
    """On valid text, however long, the tokens past the final prefix are at most the first
    three bytes of one character: what a step decodes does not grow with the completion."""
    eng = make_engine(model_dir(tmp_path, "padded"), max_model_len=4096)
    chars = byte_chars()
    rng = random.Random(5)
    text = "".join(rng.choice(WIDE + CORPUS[:6]) for _ in range(40))
    words = eng.tokenizer.encode(text)
    split = [eng.tokenizer._tok.token_to_id(chars[b]) for b in text.encode()]
    for ids in (words, split):
        seq = eng.add_request([5], SamplingParams(max_tokens=len(ids), ignore_eos=True))
        for t in ids:
            eng.postprocess([seq], [[(t, 0.0)]])
            assert seq.num_completion_tokens - seq.decoded.tokens <= 3
        assert seq.text == text and seq.decoded.tokens == len(ids) and len(ids) > 400
