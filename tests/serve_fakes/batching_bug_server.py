"""A server right alone and wrong in company, like an engine whose batching is broken: it starts the
real engine (fp32) behind it and relays every request, but a whole (non-streamed) completion that
shared the server with another request at any moment comes back with every greedy token id one
higher. The accuracy prompts asked one at a time before any load are answered right; those asked
while AIPerf loads it are not. Streams are relayed line by line, each event a little late, so
that a short AIPerf load lasts long enough to be shared.
With `cache`, it also remembers each whole completion it answered right and gives it again for the
same request, crowded or not: only a prompt it has not answered before can show its fault.
With `peek`, it caches too, and first, alone, answers every prompt it finds in a pool host's
session file (job.json in its working directory) as the accuracy check asks them: a fresh prompt
it found there would pass under load.
Usage: python batching_bug_server.py PORT MODEL_DIR NAME [cache|peek]"""
import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

EVENT_DELAY_S = 0.15
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}
SESSION = web.AppKey("session", aiohttp.ClientSession)

port, model_dir, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
MODE = sys.argv[4] if len(sys.argv) > 4 else ""
CACHE: dict[str, dict] | None = {} if MODE in ("cache", "peek") else None
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    engine_port = s.getsockname()[1]
ENGINE = f"http://127.0.0.1:{engine_port}"
engine = subprocess.Popen([sys.executable, "-m", "engine_templates.engine", "serve", "--model-dir", model_dir,
                           "--port", str(engine_port), "--served-model-name", name, "--dtype", "fp32",
                           "--max-model-len", "512"])  # in this process's group: stopped with it
active: set = set()  # one marker per request in flight
crowded: set = set()  # the markers of those that have shared the server with another


def enter() -> object:
    me = object()
    if active:
        crowded.update(active | {me})
    active.add(me)
    return me


async def models(request):
    try:
        async with request.app[SESSION].get(ENGINE + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)
    except aiohttp.ClientError:
        return web.json_response({"error": "the engine is starting"}, status=503)


async def relay(request):
    body = await request.json()
    key = json.dumps(body, sort_keys=True)
    if CACHE is not None and key in CACHE:
        return web.json_response(CACHE[key])
    me = enter()
    try:
        async with request.app[SESSION].post(ENGINE + request.path, json=body) as r:
            if body.get("stream"):
                out = web.StreamResponse(status=r.status, headers={k: v for k, v in r.headers.items()
                                                                   if k.lower() not in HOP_BY_HOP})
                await out.prepare(request)
                async for line in r.content:  # server-sent events: one per `data:` line
                    if line.strip():
                        await asyncio.sleep(EVENT_DELAY_S)
                    await out.write(line)
                await out.write_eof()
                return out
            reply = await r.json()
        if me in crowded:
            for choice in reply.get("choices", []):
                lp = choice.get("logprobs") or {}
                lp["tokens"] = [f"token_id:{int(t.split(':', 1)[1]) + 1}" for t in lp.get("tokens", [])]
        elif CACHE is not None and r.status == 200:
            CACHE[key] = reply
        return web.json_response(reply, status=r.status)
    finally:
        active.discard(me)
        crowded.discard(me)


async def peek(client: aiohttp.ClientSession) -> None:
    """Every prompt of the session file answered alone, before this server listens, into the cache."""
    try:
        spec = json.loads(Path("job.json").read_text())
    except (OSError, ValueError):
        return
    max_tokens = spec["job"]["accuracy"]["max_tokens"]
    while True:  # the engine behind is up when it lists its model
        try:
            async with client.get(ENGINE + "/v1/models") as r:
                if r.status == 200:
                    break
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    for prompt in spec.get("prompts", []):
        if prompt is None:
            continue
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        async with client.post(ENGINE + "/v1/completions", json=body) as r:
            CACHE[json.dumps(body, sort_keys=True)] = await r.json()


async def session(app):
    app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    if MODE == "peek":
        await peek(app[SESSION])
    yield
    await app[SESSION].close()
    engine.terminate()


app = web.Application()
app.cleanup_ctx.append(session)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", relay)
app.router.add_post("/v1/chat/completions", relay)
web.run_app(app, host="127.0.0.1", port=port, print=None)
