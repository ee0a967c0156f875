"""The accuracy gate: greedy tokens and per-token log-probabilities of the candidate server
against the HF transformers reference server, on shown prompts and on held-out prompts (fresh
random token ids drawn for each run, so no candidate can have seen them)."""
from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

from contract.serve import AccuracyRules, Completion

REFERENCE_TOP = 5  # alternatives asked of the reference, to tell a near-tie from a wrong token


def prompt_set(model_dir: Path, rules: AccuracyRules, rng: random.Random, fresh: int = 0) -> list[list[int]]:
    """The shown prompts tokenized, then the held-out ones: random ids from the tokenizer's
    vocabulary, `fresh` more of them last (each sent under one pattern's load only)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    vocab = min(tok.get_vocab_size(), json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    shown = [tok.encode(p).ids for p in rules.prompts]
    held = [[rng.randrange(vocab) for _ in range(rules.held_out_tokens)] for _ in range(rules.held_out + fresh)]
    return [p for p in shown if p] + held


def _token_id(name: str) -> int:
    if not name.startswith("token_id:"):
        raise ValueError(f"expected a token as 'token_id:<id>' (return_tokens_as_token_ids), got {name!r}")
    return int(name.split(":", 1)[1])


def complete(url: str, model: str, prompt: list[int], max_tokens: int, top: int, timeout_s: float = 300) -> Completion:
    """One greedy completion of token ids with log-probabilities, as OpenAI's legacy completions give them."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": top, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = choice.get("logprobs") or {}
    if "tokens" not in lp or "token_logprobs" not in lp:
        raise ValueError("the reply has no logprobs object with tokens and token_logprobs")
    alternatives = [{_token_id(k): v for k, v in (alts or {}).items()} for alts in (lp.get("top_logprobs") or [])]
    return Completion([_token_id(t) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]], alternatives)


def judge(candidate: list[Completion], reference: list[Completion], rules: AccuracyRules,
          numbers: list[int] | None = None) -> tuple[bool, str, dict]:
    """Token by token until the first different greedy token: log-probabilities within
    logprob_atol; a different token is allowed only at a near-tie of the reference (its own
    token less than tie_nats more likely than the candidate's), after which the contexts
    differ and that prompt's comparison ends. `numbers` are the prompts' places in the whole
    set (default: all of it, in order), which the details name. Returns (passed, detail, metrics)."""
    worst, ties, compared = 0.0, 0, 0
    numbers = list(range(len(reference))) if numbers is None else numbers
    if len(candidate) != len(reference):  # zip() below would judge only the shorter list
        return False, f"{len(candidate)} answers to {len(reference)} prompts", {}
    for n, c, r in zip(numbers, candidate, reference):
        where = f"prompt {n} ({'held out' if n >= len(rules.prompts) else 'shown'})"
        if len(c.token_ids) != len(r.token_ids) or len(c.logprobs) != len(c.token_ids):
            return False, f"{where}: {len(c.token_ids)} tokens with {len(c.logprobs)} logprobs, expected " \
                          f"{len(r.token_ids)} (ignore_eos)", {}
        for i, (ct, rt) in enumerate(zip(c.token_ids, r.token_ids)):
            if ct != rt:
                gap = r.logprobs[i] - r.top[i][ct] if ct in r.top[i] else float("inf")
                if gap > rules.tie_nats:
                    return False, (f"{where}, token {i}: greedy token {ct}, the reference's is {rt} "
                                   f"(the reference finds it {gap:.3g} nats less likely)"), {}
                ties += 1
                break
            diff = abs(c.logprobs[i] - r.logprobs[i])
            compared += 1
            worst = max(worst, diff)
            if diff > rules.logprob_atol:
                return False, (f"{where}, token {i}: logprob {c.logprobs[i]:.5g} vs the reference's "
                               f"{r.logprobs[i]:.5g} ({diff:.3g} nats > {rules.logprob_atol:g})"), {}
    held = sum(n >= len(rules.prompts) for n in numbers)
    detail = (f"{len(reference)} prompts ({held} held out), {compared} tokens agree, max |Δlogprob| "
              f"{worst:.3g} nats; {ties} prompts diverged at a near-tie")
    return True, detail, {"accuracy/max_logprob_diff": worst, "accuracy/tokens_compared": compared,
                          "accuracy/near_ties": ties}
