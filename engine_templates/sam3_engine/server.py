"""The SAM 3 HTTP API, one shape for the engine and the reference server:

    POST /v1/segment  {"image": "<base64 PNG or JPEG>", "prompts": ["a cat", ...],
                       "threshold": 0.3, "raw": false, "raw_queries": null, "model": optional}
    -> {"id", "model", "width", "height",
        "results": [{"prompt", "detections": [{"query", "score", "box": [x1, y1, x2, y2], "mask": RLE}],
                     "raw": {...} only when asked}]}
    GET /health, GET /v1/models (ready), GET /stats (engine: batching and prompt cache)

A detection is a query whose score passes `threshold`; its box is in the image's pixels and its
mask is the image's size, run-length encoded row by row ({"size": [h, w], "counts": [...]},
alternating out and in, starting with out). `raw` adds every query's score and box ([0, 1]) and
the mask logits of `raw_queries` (default: the 4 best scores) at the mask decoder's resolution,
float32 little-endian in base64: what the accuracy gate compares.

Errors are {"error": {"message", "type", "param", "code"}}: 400 for a request that is not
JSON, not an image, an image too large, an empty prompt; a request's error never touches another's.
The engine's requests wait in one queue; the engine thread takes every image waiting (up to
max_batch_images) as one step, so requests that arrive together are batched."""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from engine_templates.engine.server import serve_app
from engine_templates.sam3_engine.images import (
    BadInput,
    PromptOutput,
    check_prompts,
    check_raw_queries,
    decode_image,
    pixel_values,
    reply,
)
from engine_templates.sam3_engine.model import Image

log = logging.getLogger("infersmith.sam3")
STATE = web.AppKey("sam3", object)
MAX_BODY = 64 * 2**20  # base64 of the largest image with room; larger bodies are refused with 413


@dataclass
class Pending:
    image: Image
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(default=None)


class Batcher:
    """One engine thread; requests queue, and each step takes every one waiting (up to max_images)."""

    def __init__(self, engine, max_images: int):
        self.engine, self.max_images = engine, max_images
        self.queue: queue.Queue[Pending | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="sam3-engine", daemon=True)
        self.steps = self.images = 0
        self.image_size, self.num_queries = engine.image_size, engine.num_queries

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    async def submit(self, image: Image) -> list[PromptOutput]:
        loop = asyncio.get_running_loop()
        pending = Pending(image, loop, loop.create_future())
        self.queue.put(pending)
        return await pending.future

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_images:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)
                    break
                batch.append(nxt)
            self._step(batch)

    def _step(self, batch: list[Pending]) -> None:
        try:
            outs = self.engine.segment([p.image for p in batch])
        except Exception:  # one request's failure must not fail the others: each alone
            if len(batch) == 1:
                log.exception("segment failed")
                self._answer(batch[0], RuntimeError("the engine failed on this request"))
                return
            for p in batch:
                self._step([p])
            return
        self.steps += 1
        self.images += len(batch)
        for p, out in zip(batch, outs):
            self._answer(p, out)

    @staticmethod
    def _answer(p: Pending, value) -> None:
        def set_it():
            if not p.future.done():
                (p.future.set_exception if isinstance(value, Exception) else p.future.set_result)(value)
        p.loop.call_soon_threadsafe(set_it)


class ReferenceRunner:
    """transformers' Sam3Model as a user calls it: one request at a time, every prompt its own
    forward over pixel_values and input_ids, no cache, no batching."""

    def __init__(self, model_dir, dtype: str, device: str):
        import torch

        from engine_templates.sam3_engine.images import PromptTokenizer
        from engine_templates.sam3_engine.model import DTYPES, load_model

        self.torch = torch
        self.model = load_model(model_dir, dtype, device)
        config = self.model.config
        self.image_size = config.vision_config.backbone_config.image_size
        self.num_queries = config.detr_decoder_config.num_queries
        self.tokenizer = PromptTokenizer(model_dir, config.text_config.pad_token_id or 0)
        self.dtype, self.device = DTYPES[dtype], device
        self.lock = asyncio.Lock()

    def segment_one(self, image: Image) -> list[PromptOutput]:
        from engine_templates.sam3_engine.model import split

        torch = self.torch
        outs = []
        with torch.inference_mode():
            pixels = image.pixels[None].to(self.device, self.dtype)
            for prompt in image.prompts:
                ids, mask = self.tokenizer(prompt)
                out = self.model(pixel_values=pixels, input_ids=torch.tensor([ids], device=self.device),
                                 attention_mask=torch.tensor([mask], device=self.device))
                outs.extend(split(out, [1])[0])
        return outs

    async def submit(self, image: Image) -> list[PromptOutput]:
        async with self.lock:
            return await asyncio.to_thread(self.segment_one, image)


class State:
    def __init__(self, runner, model_name: str, kind: str):
        self.runner, self.model_name, self.kind = runner, model_name, kind
        self.requests = 0
        self.created = int(time.time())


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return web.json_response({"error": {"message": message, "type": type_, "param": param, "code": None}},
                             status=status)


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadInput as e:
        return _error(400, str(e))
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"request body too large: at most {MAX_BODY} bytes")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, f"{request.method} {request.path}: {e.reason}")


async def segment(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadInput("the request body must be a JSON object")
    if body.get("model") not in (None, state.model_name):
        return _error(404, f"the model {body['model']!r} does not exist; this server has {state.model_name!r}",
                      "model")
    prompts = check_prompts(body.get("prompts"))
    threshold = body.get("threshold", 0.3)
    if not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise BadInput("threshold must be a number in [0, 1]")
    raw_queries = check_raw_queries(body.get("raw_queries"), state.runner.num_queries)
    picture = await asyncio.to_thread(decode_image, body.get("image"))
    width, height = picture.size
    image = Image(await asyncio.to_thread(pixel_values, picture, state.runner.image_size), prompts)
    try:
        outs = await state.runner.submit(image)
    except RuntimeError as e:
        return _error(500, str(e), type_="server_error")
    state.requests += 1
    results = await asyncio.to_thread(lambda: [reply(p, o, width, height, threshold, bool(body.get("raw")),
                                                     raw_queries) for p, o in zip(prompts, outs)])
    return web.json_response({"id": "seg-" + uuid.uuid4().hex, "model": state.model_name, "width": width,
                              "height": height, "results": results})


async def health(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    body = {"status": "ok", "model": state.model_name, "server": state.kind}
    if state.kind == "engine":
        body |= {"kernels": state.runner.engine.kernels.choices, "cuda_graphs": state.runner.engine.graphed}
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    return web.json_response({"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                          "created": state.created, "owned_by": "infersmith"}]})


async def stats(request: web.Request) -> web.Response:
    state: State = request.app[STATE]
    if state.kind != "engine":
        return web.json_response({"requests": state.requests})
    b, e = state.runner, state.runner.engine
    return web.json_response({"requests": state.requests, "steps": b.steps, "images": b.images,
                              "largest_batch": e.largest_batch,
                              "prompt_cache": {"hits": e.cache.hits, "misses": e.cache.misses,
                                               "size": len(e.cache.entries)}})


def create_app(runner, model_name: str, kind: str) -> web.Application:
    """kind: "engine" (runner a Batcher over a Sam3Engine) or "reference" (a ReferenceRunner)."""
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[STATE] = State(runner, model_name, kind)
    if kind == "engine":
        app.on_startup.append(lambda _app: _run(runner.start))
        app.on_cleanup.append(lambda _app: _run(runner.stop))
    app.router.add_post("/v1/segment", segment)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    return app


async def _run(fn) -> None:
    fn()


async def serve(runner, model_name: str, kind: str, host: str, port: int) -> None:
    await serve_app(create_app(runner, model_name, kind), host, port,
                    lambda real: f"serving {model_name} on http://{host}:{real} ({kind}: SAM 3)")
