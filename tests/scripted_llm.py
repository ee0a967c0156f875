"""A scripted LLM provider on loopback, speaking OpenAI's chat-completions API and Anthropic's
messages API, for the real `openai` and `anthropic` clients. It stands for a paid service this
machine cannot reach: the one test double the project allows. Each request, retries included,
takes the script's next turn; past the end, it stops answering (the request hangs)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from aiohttp import web


@dataclass(frozen=True)
class Turn:
    text: str = ""
    input_tokens: int = 0  # not cached
    cached_tokens: int = 0
    output_tokens: int = 0
    status: int = 200  # not 200: an error answer, e.g. 429 (with a short Retry-After)

    @classmethod
    def error(cls, status: int) -> Turn:
        return cls(status=status)


class ScriptedLLM:
    def __init__(self, script: list[Turn]):
        self.script: Iterator[Turn] = iter(script)
        self.requests: list[dict] = []  # path, headers (any case) and body of every request, in order
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def _next(self, request: web.Request, body: dict) -> Turn | None:
        self.requests.append({"path": request.path, "headers": request.headers.copy(), "body": body})
        return next(self.script, None)

    async def _turn(self, request: web.Request) -> tuple[Turn | None, web.Response | None]:
        turn = self._next(request, await request.json())
        if turn is None:  # stopped answering: the client's timeout ends the request
            await asyncio.sleep(3600)
            raise web.HTTPServiceUnavailable()
        if turn.status != 200:
            return turn, web.json_response({"error": {"message": f"scripted {turn.status}", "type": "rate_limit"}},
                                           status=turn.status, headers={"retry-after-ms": "20"})
        return turn, None

    async def chat(self, request: web.Request) -> web.Response:
        turn, error = await self._turn(request)
        if error:
            return error
        prompt = turn.input_tokens + turn.cached_tokens
        return web.json_response({
            "id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
            "model": self.requests[-1]["body"]["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": turn.output_tokens,
                      "total_tokens": prompt + turn.output_tokens,
                      "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}})

    async def messages(self, request: web.Request) -> web.Response:
        turn, error = await self._turn(request)
        if error:
            return error
        return web.json_response({
            "id": "msg_scripted", "type": "message", "role": "assistant", "model": self.requests[-1]["body"]["model"],
            "content": [{"type": "text", "text": turn.text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": turn.input_tokens, "output_tokens": turn.output_tokens,
                      "cache_read_input_tokens": turn.cached_tokens, "cache_creation_input_tokens": 0}})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    def __enter__(self) -> ScriptedLLM:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        started = threading.Event()

        async def serve():
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            started.set()

        self.runner = runner
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.runner.cleanup()
            hung = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in hung:  # requests still waiting on an answer that never comes
                t.cancel()
            await asyncio.gather(*hung, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
