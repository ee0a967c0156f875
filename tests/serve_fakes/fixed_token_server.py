"""A fast, wrong server: every completion is the same token, claimed with certainty (logprob 0),
streamed or whole. The accuracy gate must reject it before any load.
Usage: python fixed_token_server.py PORT [PLANT]
PLANT: a file it writes at start, before anyone asks it anything: `[[]]`, one replica that
answered nothing. On a pool host, exchange/completions.json (relative to the session folder, its
working directory) is where the worker hands every replica's answers to the controller."""
import json
import sys

from aiohttp import web

TOKEN = 17


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "any", "object": "model"}]})


async def complete(request):
    body = await request.json()
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    if body.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(n):
            chunk = {"choices": [{"index": 0, "text": "a", "delta": {"content": "a"}, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response
    logprobs = {"tokens": [f"token_id:{TOKEN}"] * n, "token_logprobs": [0.0] * n, "top_logprobs": None}
    return web.json_response({"choices": [{"index": 0, "text": "a" * n, "logprobs": logprobs, "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})


if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        f.write("[[]]")

app = web.Application()
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", complete)
app.router.add_post("/v1/chat/completions", complete)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
