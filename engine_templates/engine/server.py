"""OpenAI-compatible HTTP API over one engine: /v1/completions and /v1/chat/completions
(streamed as server-sent events or whole, with usage counts), /v1/models, /health, and /stats
(the engine's counters since it started: batching, preemptions, speculative decoding).

aiohttp rather than FastAPI: it is on the GPU hosts already, and the API is four routes
whose request checking fits in this file. Errors are OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Callable

from aiohttp import web

from engine_templates.engine.config import EngineSetupError
from engine_templates.engine.engine import LLMEngine
from engine_templates.engine.engine_loop import EngineLoop, Request, Update
from engine_templates.engine.request_params import (
    APIError,
    chat_prompt,
    completion_prompt,
    requested_logprobs,
    sampling_params,
)

log = logging.getLogger("infersmith.engine")
STATE = web.AppKey("state", object)


class ServerState:
    def __init__(self, engine: LLMEngine, model_name: str, request_log: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.loop = EngineLoop(engine, request_log)
        self.created = int(time.time())


def _error_body(status: int, message: str, type_: str, param=None, code=None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param,
                                        "code": code}}, status=status)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return _error_body(e.status, e.message, e.type, e.param, e.code)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_body(e.status, f"{request.method} {request.path}: {e.reason}",
                           "invalid_request_error", code="not_found" if e.status == 404 else None)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.loop.failure:
        return _error_body(503, state.loop.failure, "server_error")
    return web.json_response({"status": "ok", "model": state.model_name,
                              "kernels": state.engine.kernel_choices,
                              "largest_batch": state.engine.largest_batch})


async def stats(request: web.Request) -> web.Response:
    """Counters since the engine started; a client diffs two readings for the traffic between them
    (the serve stage does, per traffic pattern). Read while the engine thread steps: each number
    is current, the set not one instant's."""
    engine = request.app[STATE].engine
    return web.json_response({"largest_batch": engine.largest_batch, "steps_ahead": engine.steps_ahead,
                              "rows_discarded": engine.rows_discarded,
                              "preemptions": engine.scheduler.preemptions,
                              "mixed_steps": engine.scheduler.mixed_steps_run,
                              "speculative": {"spec_tokens": engine.config.spec_tokens,
                                              "spec_ngram": engine.config.spec_ngram,
                                              **engine.spec_stats.as_dict()}})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "infersmith",
        "max_model_len": state.engine.config.max_model_len}]})


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    state = request.app[STATE]
    if body.get("model") not in (None, state.model_name):
        raise APIError(f"the model {body['model']!r} does not exist; this server has "
                       f"{state.model_name!r}", status=404, param="model", code="model_not_found")
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    body = await _body(request)
    state = request.app[STATE]
    prompt = completion_prompt(body, state.engine.tokenizer)
    return await _generate(request, body, prompt, chat=False, default_max_tokens=16, arrived=arrived)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    body = await _body(request)
    state = request.app[STATE]
    prompt = chat_prompt(body, state.engine.tokenizer)
    return await _generate(request, body, prompt, chat=True, default_max_tokens=None, arrived=arrived)


async def _generate(request, body, prompt: list[int], chat: bool, default_max_tokens, arrived: float):
    state = request.app[STATE]
    if state.loop.failure:
        raise APIError(state.loop.failure, status=503, type_="server_error")
    limit = state.engine.config.max_model_len
    params = sampling_params(body, chat, default_max_tokens or max(1, limit - len(prompt)))
    # The engine keeps the chosen token's log-probability only, so no alternatives (logprobs=0).
    logprobs = requested_logprobs(body, chat, max_top=0)
    if len(prompt) + params.max_tokens > limit:
        raise APIError(f"this model's maximum context length is {limit} tokens; the prompt has "
                       f"{len(prompt)} and max_tokens is {params.max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    req = Request(prompt, params, asyncio.get_running_loop(), arrived)
    state.loop.submit(req)
    reply = _Reply(state.model_name, chat, body)
    finished = False
    try:
        if body.get("stream"):
            first = await req.updates.get()  # a refused request is still an ordinary error reply
            _raise_if_error(first)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
            update = first
            if chat:
                await _send(response, reply.chunk({"role": "assistant", "content": ""}, None))
            while True:
                if update.error:
                    await _send(response, {"error": {"message": update.error, "type": "server_error",
                                                     "param": None, "code": None}})
                    break
                if update.text or update.finish_reason:
                    delta = {"content": update.text} if chat else update.text
                    await _send(response, reply.chunk(delta if update.text or not chat else {},
                                                      update.finish_reason))
                if update.finish_reason:
                    finished = True
                    if (body.get("stream_options") or {}).get("include_usage"):
                        await _send(response, reply.usage_chunk(update))
                    break
                update = await req.updates.get()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        text = []
        while True:
            update = await req.updates.get()
            _raise_if_error(update)
            text.append(update.text)
            if update.finish_reason:
                finished = True
                choice_logprobs = None if logprobs is None else token_logprobs(
                    state.engine.tokenizer, update.token_ids, update.logprobs, body)
                return web.json_response(reply.whole("".join(text), update, choice_logprobs))
    finally:
        if not finished:  # the client went away, or the request failed: free its cache blocks
            state.loop.abort(req)


def _raise_if_error(update: Update) -> None:
    if update.error:
        raise APIError(update.error, status=500 if update.server_error else 400,
                       type_="server_error" if update.server_error else "invalid_request_error")


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


class _Reply:
    """The response objects of one request, in OpenAI's shapes."""

    def __init__(self, model: str, chat: bool, body: dict):
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.usage_in_chunks = bool((body.get("stream_options") or {}).get("include_usage"))

    def _head(self, streaming: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + \
            (".chunk" if self.chat and streaming else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def _usage(update: Update) -> dict:
        return {"prompt_tokens": update.prompt_tokens, "completion_tokens": update.completion_tokens,
                "total_tokens": update.prompt_tokens + update.completion_tokens}

    def chunk(self, delta, finish_reason) -> dict:
        choice = ({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                  if self.chat else
                  {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason})
        out = {**self._head(True), "choices": [choice]}
        if self.usage_in_chunks:
            out["usage"] = None
        return out

    def usage_chunk(self, update: Update) -> dict:
        return {**self._head(True), "choices": [], "usage": self._usage(update)}

    def whole(self, text: str, update: Update, logprobs: dict | None = None) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": update.finish_reason}
                  if self.chat else
                  {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": update.finish_reason})
        return {**self._head(False), "choices": [choice], "usage": self._usage(update)}


def token_logprobs(tokenizer, token_ids, logprobs, body: dict, top: list[dict] | None = None) -> dict:
    """OpenAI's legacy completions `logprobs` object. Tokens are their text, or "token_id:<id>"
    when the request sets vLLM's `return_tokens_as_token_ids` (text cannot tell ids apart)."""
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else tokenizer.decode([t])

    out = {"tokens": [name(t) for t in token_ids], "token_logprobs": list(logprobs),
           "top_logprobs": None, "text_offset": []}
    if top is not None:
        out["top_logprobs"] = [{name(t): lp for t, lp in alternatives.items()} for alternatives in top]
    offset = 0
    for t in token_ids:
        out["text_offset"].append(offset)
        offset += len(tokenizer.decode([t]))
    return out


def create_app(engine: LLMEngine, model_name: str, request_log: bool = False) -> web.Application:
    """`request_log`: one line on stderr per finished request with where its time went (see
    engine_loop.Request.timing_line)."""
    app = web.Application(middlewares=[openai_errors])
    state = ServerState(engine, model_name, request_log)
    app[STATE] = state

    async def start(_app):
        state.loop.start()

    async def stop(_app):
        state.loop.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def check_listen(host: str, port: int) -> None:
    """Refuses, before a model loads, an address this machine cannot listen on: an unknown host,
    a port in use (serve_app refuses the same if the port is taken meanwhile)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's listener does
            s.bind(address)
    except OSError as e:
        raise _cannot_listen(host, port, e) from None


def _cannot_listen(host: str, port: int, e: OSError) -> EngineSetupError:
    # the errno's own words: asyncio rewords a failed bind ("error while attempting to bind ...")
    why = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or str(e)
    return EngineSetupError(f"cannot listen on {host}:{port}: {why}")


async def serve_app(app: web.Application, host: str, port: int, banner: Callable[[int], str]) -> None:
    """Serves `app` until cancelled; prints banner(port) once it listens (the real port when 0
    asked for any)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise _cannot_listen(host, port, e) from None
        print(banner(runner.addresses[0][1]), flush=True)
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()
