"""A load balancer in front of the replicas of one OpenAI-compatible server: each request goes
to the backend with the fewest requests in flight (round-robin among ties), and its response,
server-sent events included, is written on chunk by chunk as it arrives, so the latencies
AIPerf measures through it are the replicas' own plus one local hop. `/health` and
`/v1/models` answer 200 only while every backend answers `/v1/models`.

It runs as its own process (`python -m harness.serve.balancer --port P --backend URL ...`),
started and stopped like a server: its event loop shares no interpreter lock with the
controller's threads (Prefect, MLflow), which would add their pauses to every token it relays.
A backend failing is never hidden: no retry on another backend, the client gets a 502, or a
stream cut short. Worker side: the standard library and aiohttp (the engine's server uses it)."""
from __future__ import annotations

import argparse
import asyncio
import logging

import aiohttp
from aiohttp import web

log = logging.getLogger("infersmith.balancer")
BALANCER = web.AppKey("balancer", object)
# Per connection, not per message: the proxy sets its own framing (chunked) and connection.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length"})
PROBE_S = 5.0


class Balancer:
    def __init__(self, backends: list[str]):
        self.backends = [b.rstrip("/") for b in backends]
        self.in_flight = [0] * len(backends)
        self.served = [0] * len(backends)
        self._next = 0
        self.session: aiohttp.ClientSession | None = None

    def pick(self) -> int:
        """The backend with the fewest requests in flight, the first after the last pick among ties."""
        n = len(self.backends)
        i = min(((self._next + k) % n for k in range(n)), key=lambda b: self.in_flight[b])
        self._next = (i + 1) % n
        return i

    async def down(self) -> list[str]:
        """Why each backend that does not answer /v1/models with 200 is down; empty when all are up."""
        async def probe(i: int, url: str) -> str | None:
            try:
                async with self.session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=PROBE_S)) as r:
                    return None if r.status == 200 else f"backend {i} ({url}): /v1/models answered {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                return f"backend {i} ({url}): {type(e).__name__}: {e}"
        return [p for p in await asyncio.gather(*(probe(i, u) for i, u in enumerate(self.backends))) if p]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                             status=status)


async def health(request: web.Request) -> web.Response:
    lb: Balancer = request.app[BALANCER]
    problems = await lb.down()
    if problems:
        return _error(503, "; ".join(problems))
    return web.json_response({"status": "ok", "backends": [
        {"url": url, "in_flight": lb.in_flight[i], "served": lb.served[i]} for i, url in enumerate(lb.backends)]})


async def models(request: web.Request) -> web.StreamResponse:
    lb: Balancer = request.app[BALANCER]
    problems = await lb.down()
    if problems:
        return _error(503, "; ".join(problems))
    return await relay(request, 0)  # a probe: not counted, not part of the rotation


async def forward(request: web.Request) -> web.StreamResponse:
    lb: Balancer = request.app[BALANCER]
    i = lb.pick()
    lb.in_flight[i] += 1
    try:
        return await relay(request, i)
    finally:
        lb.in_flight[i] -= 1
        lb.served[i] += 1


async def relay(request: web.Request, i: int) -> web.StreamResponse:
    """The request to backend i, its response back as it arrives."""
    lb: Balancer = request.app[BALANCER]
    body = await request.read()  # requests are small; only responses are streamed
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    try:
        upstream = await lb.session.request(request.method, lb.backends[i] + request.rel_url.path_qs,
                                            headers=headers, data=body)
    except (aiohttp.ClientError, OSError) as e:
        log.warning("backend %d (%s) did not answer %s: %s", i, lb.backends[i], request.path, e)
        return _error(502, f"backend {i} ({lb.backends[i]}) did not answer: {type(e).__name__}: {e}")
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, OSError) as e:
            # The headers are gone: end the connection without the last chunk, so that the
            # client sees a broken response rather than a short one that looks whole.
            log.warning("backend %d (%s) broke off %s: %s", i, lb.backends[i], request.path, e)
            request.transport.close()
            return response
        await response.write_eof()
        return response


def make_app(backends: list[str]) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # long prompts as token ids
    lb = Balancer(backends)
    app[BALANCER] = lb

    async def client(app: web.Application):
        # No pool limit (aiohttp's default, 100, would cap the load), no total timeout (a long
        # generation is not a failure), the body passed on as the backend encoded it.
        lb.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await lb.session.close()
        for i, url in enumerate(lb.backends):
            log.info("backend %d (%s): %d requests", i, url, lb.served[i])

    app.cleanup_ctx.append(client)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.serve.balancer", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--backend", action="append", required=True, help="a replica's base URL; repeat for each")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info("balancing %s on port %d", ", ".join(args.backend), args.port)
    web.run_app(make_app(args.backend), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
