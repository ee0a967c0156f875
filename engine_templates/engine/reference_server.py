"""The HF transformers reference server: the same OpenAI API as the engine's server, served by
transformers on the same checkpoint, one request at a time, greedy.

It is the yardstick of the end-to-end stage twice over: its greedy tokens and log-probabilities
are what a candidate engine's must match, and its speed is the baseline every engine
configuration must beat when no faster server (vLLM, SGLang) is named. No batching, no
sampling: a request asking for temperature > 0 or stop strings is refused with a 400.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from aiohttp import web

from engine_templates.engine.config import ModelConfig
from engine_templates.engine.engine_loop import Update
from engine_templates.engine.oracle import HFOracle
from engine_templates.engine.request_params import (
    APIError,
    chat_prompt,
    completion_prompt,
    requested_logprobs,
    sampling_params,
)
from engine_templates.engine.server import STATE, _body, _Reply, _send, openai_errors, serve_app, token_logprobs
from engine_templates.engine.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20


class ReferenceState:
    def __init__(self, model_dir: Path, model_name: str, dtype: str, device: str, max_model_len: int):
        self.model_name = model_name
        self.tokenizer = Tokenizer(model_dir)
        eos = set(ModelConfig.from_dir(model_dir).eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = max_model_len
        # sdpa: what a user of transformers gets by default, the fair baseline for speed.
        self.model = HFOracle.from_dir(model_dir, dtype, device, attention="sdpa").model
        self.device = device
        self.lock = asyncio.Lock()  # one decode at a time: transformers' generate() has no scheduler
        self.created = int(time.time())

    @torch.inference_mode()
    def step(self, ids: list[int], cache, top: int):
        """One forward pass over `ids` after `cache`: the greedy token, its log-probability,
        the top alternatives {token: logprob}, and the grown cache."""
        out = self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True)
        logp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
        token = int(logp.argmax())
        alternatives = {}
        if top:
            values, indices = logp.topk(top)
            alternatives = dict(zip(indices.tolist(), values.tolist()))
        return token, float(logp[token]), alternatives, out.past_key_values


async def _tokens(state: ReferenceState, prompt: list[int], max_tokens: int, ignore_eos: bool,
                  stop_ids: tuple[int, ...], top: int):
    """Yields (token, logprob, alternatives, finish_reason or None), greedy, one at a time."""
    cache, feed = None, prompt
    for n in range(1, max_tokens + 1):
        token, lp, alternatives, cache = await asyncio.to_thread(state.step, feed, cache, top)
        stopped = token in stop_ids or (token in state.eos_token_ids and not ignore_eos)
        finish = "stop" if stopped else "length" if n == max_tokens else None
        yield token, lp, alternatives, finish
        if finish:
            return
        feed = [token]


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "model": request.app[STATE].model_name, "server": "reference"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "infersmith",
        "max_model_len": state.max_model_len}]})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    return await _generate(request, body, completion_prompt(body, request.app[STATE].tokenizer), chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    return await _generate(request, body, chat_prompt(body, request.app[STATE].tokenizer), chat=True)


async def _generate(request: web.Request, body: dict, prompt: list[int], chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if body.get("temperature") not in (None, 0):
        raise APIError("the reference server decodes greedily: temperature must be 0", param="temperature")
    limit = state.max_model_len
    params = sampling_params(body, chat, 16 if not chat else max(1, limit - len(prompt)))
    if params.stop:
        raise APIError("the reference server does not support stop strings", param="stop")
    top = requested_logprobs(body, chat, max_top=MAX_TOP_LOGPROBS)
    if any(not 0 <= t < state.model.config.vocab_size for t in prompt):
        raise APIError(f"prompt token ids must be in [0, {state.model.config.vocab_size})", param="prompt")
    if len(prompt) + params.max_tokens > limit:
        raise APIError(f"this model's maximum context length is {limit} tokens; the prompt has "
                       f"{len(prompt)} and max_tokens is {params.max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    reply = _Reply(state.model_name, chat, body)
    ids, lps, tops, sent, finish = [], [], [], 0, None
    stream = None
    async with state.lock:
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await stream.prepare(request)
            if chat:
                await _send(stream, reply.chunk({"role": "assistant", "content": ""}, None))
        async for token, lp, alternatives, finish in _tokens(state, prompt, params.max_tokens, params.ignore_eos,
                                                             params.stop_token_ids, top or 0):
            ids.append(token)
            lps.append(lp)
            tops.append(alternatives)
            if stream is None:
                continue
            text = _text(state, ids, finish)
            delta, sent = text[sent:], len(text)
            if delta or finish:
                await _send(stream, reply.chunk({"content": delta} if chat and delta else {} if chat else delta, finish))
    done = Update("", finish, len(prompt), len(ids))
    if stream is not None:
        if reply.usage_in_chunks:
            await _send(stream, reply.usage_chunk(done))
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream
    choice_logprobs = None if top is None else token_logprobs(state.tokenizer, ids, lps, body,
                                                              top=tops if top else None)
    return web.json_response(reply.whole(_text(state, ids, finish), done, choice_logprobs))


def _text(state: ReferenceState, ids: list[int], finish: str | None) -> str:
    """The completion's text so far; a final EOS is not text, a trailing partial character waits."""
    if finish == "stop":
        return state.tokenizer.decode(ids[:-1])
    text = state.tokenizer.decode(ids)
    return text if finish else text.rstrip("\ufffd")


def create_reference_app(state: ReferenceState) -> web.Application:
    app = web.Application(middlewares=[openai_errors])
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


async def serve(state: ReferenceState, host: str, port: int) -> None:
    await serve_app(create_reference_app(state), host, port,
                    lambda real: f"serving {state.model_name} on http://{host}:{real} (reference: transformers)")
