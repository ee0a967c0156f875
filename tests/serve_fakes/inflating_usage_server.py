"""A server that claims more work than it streams: each completion streams `max_tokens` chunks of
one word, and its `usage` claims CLAIM times as many completion tokens. Counted from the usage,
its output throughput would be CLAIM times what it delivers.
Usage: python inflating_usage_server.py PORT"""
import json
import sys
import time

from aiohttp import web

CLAIM = 40
WORD = " the"


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "any", "object": "model"}]})


def usage(n: int) -> dict:
    return {"prompt_tokens": 1, "completion_tokens": CLAIM * n, "total_tokens": CLAIM * n + 1}


async def complete(request):
    body = await request.json()
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    chat = request.path.endswith("/chat/completions")
    head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": body.get("model", "any")}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(n):
        choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
        choice |= {"delta": {"content": WORD}} if chat else {"text": WORD}
        await response.write(f"data: {json.dumps(head | {'choices': [choice], 'usage': usage(i + 1)})}\n\n".encode())
    await response.write(f"data: {json.dumps(head | {'choices': [], 'usage': usage(n)})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


app = web.Application()
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", complete)
app.router.add_post("/v1/chat/completions", complete)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
