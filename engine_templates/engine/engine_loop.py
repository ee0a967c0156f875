"""The engine on a background thread, fed from the server's asyncio loop.

The engine is not thread-safe, so only this thread touches it: requests and aborts arrive in
an inbox, and each step's news goes back to the waiting handler as an immutable Update through
loop.call_soon_threadsafe. While the engine has work the thread steps without waiting; when it
has none it blocks on the inbox. With async decode a step returns the tokens of the step before
it as soon as they are read, while the next one computes, and they are delivered then.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass

from engine_templates.engine.engine import LLMEngine, stream_safe_text
from engine_templates.engine.sequence import SamplingParams, Sequence

log = logging.getLogger("infersmith.engine")


@dataclass(frozen=True)
class Update:
    text: str  # new text since the last update
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # the request was refused (a client error) or the engine failed
    server_error: bool = False
    token_ids: tuple[int, ...] = ()  # on the last update only: every completion token
    logprobs: tuple[float, ...] = ()  # and the log-probability of each


class Request:
    def __init__(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 arrived: float | None = None):
        self.prompt = prompt
        self.params = params
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self._loop = loop
        self.seq: Sequence | None = None
        self.sent = 0  # characters of text already delivered
        # perf_counter times: the HTTP request read, handed to the engine thread, taken by it,
        # its first token sampled (for the request log)
        self.arrived = arrived if arrived is not None else time.perf_counter()
        self.submitted = self.added = self.first_token = 0.0

    def timing_line(self, now: float) -> str:
        ms = lambda a, b: f"{(b - a) * 1e3:.1f}"  # noqa: E731
        seq = self.seq
        return (f"request {seq.seq_id}: {seq.num_prompt_tokens} prompt tokens, {seq.num_completion_tokens} "
                f"generated ({seq.finish_reason}); ms after arrival: handed to the engine {ms(self.arrived, self.submitted)}, "
                f"taken {ms(self.arrived, self.added)}, first token {ms(self.arrived, self.first_token)}, "
                f"done {ms(self.arrived, now)}")

    def push(self, update: Update) -> None:
        self._loop.call_soon_threadsafe(self.updates.put_nowait, update)


class EngineLoop:
    def __init__(self, engine: LLMEngine, request_log: bool = False):
        self.engine = engine
        self.request_log = request_log  # one line of timings per finished request, on stderr
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[int, Request] = {}
        self._thread = threading.Thread(target=self._run, name="infersmith-engine", daemon=True)
        self.failure: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> None:
        request.submitted = time.perf_counter()
        self._inbox.put(("add", request))

    def abort(self, request: Request) -> None:
        self._inbox.put(("abort", request))

    def _run(self) -> None:
        while True:
            for kind, request in self._drain_inbox(wait=not self.engine.has_unfinished()):
                if kind == "stop":
                    return
                self._handle(kind, request)
            if self.engine.has_unfinished():
                try:
                    updated = self.engine.step()
                except Exception as e:  # the engine's state is unknown now: fail everything, stop
                    log.exception("engine step failed")
                    self.failure = f"engine step failed: {type(e).__name__}: {e}"
                    for req in self._active.values():
                        req.push(Update("", error=self.failure, server_error=True))
                    return
                for seq in updated:
                    self._deliver(seq)

    def _drain_inbox(self, wait: bool) -> list:
        messages = [self._inbox.get()] if wait else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, kind: str, request: Request) -> None:
        if kind == "add":
            try:
                request.seq = self.engine.add_request(request.prompt, request.params)
            except ValueError as e:
                request.push(Update("", error=str(e)))
                return
            self._active[request.seq.seq_id] = request
            request.added = time.perf_counter()
        elif kind == "abort" and request.seq is not None:
            self.engine.abort(request.seq)
            self._active.pop(request.seq.seq_id, None)

    def _deliver(self, seq: Sequence) -> None:
        request = self._active.get(seq.seq_id)
        if request is None:
            return
        if not request.first_token and seq.num_completion_tokens:
            request.first_token = time.perf_counter()
        text = stream_safe_text(seq)
        delta, request.sent = text[request.sent:], len(text)
        if seq.is_finished:
            del self._active[seq.seq_id]
            if self.request_log:  # straight to stderr: `infersmith engine serve` sets up no logging
                print(request.timing_line(time.perf_counter()), file=sys.stderr, flush=True)
        if seq.is_finished:
            request.push(Update(delta, seq.finish_reason, seq.num_prompt_tokens, seq.num_completion_tokens,
                                token_ids=tuple(seq.completion_token_ids), logprobs=tuple(seq.logprobs)))
        elif delta:
            request.push(Update(delta, None, seq.num_prompt_tokens, seq.num_completion_tokens))
