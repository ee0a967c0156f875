"""The load balancer in front of replicas: real aiohttp backends on loopback ports, the
balancer's own app in front of them (fewest in flight, round-robin among ties, streamed
responses passed on as they arrive, a dead backend never hidden), then the real balancer
process in front of two real server processes, one of which is killed."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from harness.serve.balancer import make_app
from harness.serve.server import Replicas, free_ports

FAKES = Path(__file__).resolve().parent / "serve_fakes"
WITHIN_S = 60  # for what a working balancer does at once: only a broken one gets near it


class Gate:
    """What the test lets through, counted: each request (or streamed chunk) that `cross`es it takes
    a ticket and waits until the test has `open`ed that many. The order of events is the test's, so
    nothing is asserted of how long anything took."""

    def __init__(self) -> None:
        self.reached = self.opened = 0
        self._changed = asyncio.Condition()

    async def cross(self) -> None:
        async with self._changed:
            self.reached += 1
            ticket = self.reached
            self._changed.notify_all()
            await self._changed.wait_for(lambda: self.opened >= ticket)

    async def until_reached(self, n: int) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.reached >= n), WITHIN_S)

    async def open(self, n: int) -> None:
        async with self._changed:
            self.opened = max(self.opened, n)
            self._changed.notify_all()


def backend(k: int, gates: dict[str, Gate]) -> web.Application:
    """Says which backend it is; with `hold`, holds the request at that gate; streams `chunks` SSE
    events, each after the first crossing the `gate` named so (if any); with `break_after`, drops
    the connection after that many events."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": f"model-{k}"}]})

    async def complete(request):
        body = await request.json()
        if "hold" in body:
            await gates[body["hold"]].cross()
        if not body.get("stream"):
            return web.json_response({"backend": k})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["chunks"]):
            if i == body.get("break_after"):
                request.transport.close()
                return response
            if i and "gate" in body:
                await gates[body["gate"]].cross()
            await response.write(f"data: {json.dumps({'backend': k, 'i': i})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    return app


@asynccontextmanager
async def serving(app: web.Application, port: int):
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def balanced(live: int, dead: int = 0, gates: dict[str, Gate] | None = None):
    """`live` backends and `dead` ports no one listens on, behind a balancer; yields its URL. The
    backends hold requests at `gates` (by name) when asked to."""
    ports = free_ports(live + dead + 1)
    urls = [f"http://127.0.0.1:{p}" for p in ports[:live + dead]]
    gates = gates if gates is not None else {}
    async with serving(backend(0, gates), ports[0]) if live > 0 else _nothing(), \
            serving(backend(1, gates), ports[1]) if live > 1 else _nothing():
        async with serving(make_app(urls), ports[-1]) as url:
            yield url


@asynccontextmanager
async def _nothing():
    yield None


async def post(session, url, **body):
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def test_fewest_in_flight_round_robin_among_ties_and_streams_passed_on_as_they_arrive():
    """Requests are held at gates the test opens, so which requests are in flight together is
    known, not hoped for; and a streamed chunk is written only once the client has the one before,
    which only a balancer that passes each on as it arrives lets happen."""
    async def scenario():
        gates = {name: Gate() for name in ("long", "four", "stream")}
        async with balanced(2, gates=gates) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200 and [b["served"] for b in (await r.json())["backends"]] == [0, 0]
            async with s.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "model-0"
            # one at a time every backend is idle: they take turns
            alone = [(await post(s, url))[1]["backend"] for _ in range(4)]
            assert alone == [0, 1, 0, 1]
            # a long request held on 0: the short ones meanwhile all go to 1, the idle one
            long = asyncio.ensure_future(post(s, url, hold="long"))
            await gates["long"].until_reached(1)
            meanwhile = [(await post(s, url))[1]["backend"] for _ in range(3)]
            await gates["long"].open(1)
            assert (await long)[1]["backend"] == 0 and meanwhile == [1, 1, 1]
            # four in flight at once: two each
            together = asyncio.gather(*(post(s, url, hold="four") for _ in range(4)))
            await gates["four"].until_reached(4)
            await gates["four"].open(4)
            assert sorted(b["backend"] for _, b in await together) == [0, 0, 1, 1]

            async def stream() -> list[str]:
                async with s.post(url + "/v1/completions", json={"stream": True, "chunks": 4, "gate": "stream"}) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    text = b""
                    async for chunk in r.content.iter_any():
                        text += chunk
                        await gates["stream"].open(text.count(b"\n\n"))  # the next may be written now
                    return [line for line in text.decode().split("\n\n") if line]

            # each event reached the client before the backend wrote the next: a balancer that
            # held them back would leave the backend waiting at chunk 1, and this timing out
            events = await asyncio.wait_for(stream(), WITHIN_S)
            assert len(events) == 5 and events[-1] == "data: [DONE]" and gates["stream"].reached == 3

            async with s.get(url + "/health") as r:
                # the stream went to 0, next in turn
                assert [b["served"] for b in (await r.json())["backends"]] == [6, 7]

    asyncio.run(scenario())


def test_a_dead_backend_is_never_hidden():
    async def scenario():
        async with balanced(live=1, dead=1) as url, aiohttp.ClientSession() as s:
            for probe in ("/health", "/v1/models"):
                async with s.get(url + probe) as r:
                    assert r.status == 503 and "backend 1" in (await r.json())["error"]["message"]
            answers = [await post(s, url) for _ in range(2)]
            assert answers[0] == (200, {"backend": 0})
            assert answers[1][0] == 502 and "backend 1" in answers[1][1]["error"]["message"]
            # a backend that drops a stream midway: the client sees a broken response, not a short whole one
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.post(url + "/v1/completions", json={"stream": True, "chunks": 4, "break_after": 2}) as r:
                    async for _ in r.content.iter_any():
                        pass

    asyncio.run(scenario())


def test_replicas_behind_the_balancer_process_and_one_killed(tmp_path):
    argv = lambda i, port: [sys.executable, str(FAKES / "fixed_token_server.py"), str(port)]  # noqa: E731
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with Replicas("candidate", argv, [env, env], tmp_path, sys.executable) as group:
        group.start(30)
        body = json.dumps({"prompt": [1], "max_tokens": 2}).encode()
        for _ in range(2):
            req = urllib.request.Request(group.url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.loads(r.read())["choices"][0]["logprobs"]["tokens"] == ["token_id:17"] * 2
        assert group.alive and group.death("now") is None
        group.servers[1].proc.send_signal(signal.SIGKILL)
        group.servers[1].proc.wait()
        assert not group.alive
        assert group.death("during pattern x") == ("the candidate replica 1 (of 2) exited with code -9 during "
                                                   "pattern x; its log is kept (server-1.log)")
    # each process's log, and beside it the exact command line it was started with
    assert {p.name for p in tmp_path.iterdir()} == {f"{name}.{kind}" for name in ("server-0", "server-1", "balancer")
                                                    for kind in ("log", "command")}
    assert (tmp_path / "balancer.command").read_text().split()[1:3] == ["-m", "harness.serve.balancer"]
    # stopped with SIGTERM, the balancer says what each replica served: one request each, in turn
    served = re.findall(r"backend (\d+) \(.*\): (\d+) requests", (tmp_path / "balancer.log").read_text())
    assert served == [("0", "1"), ("1", "1")], (tmp_path / "balancer.log").read_text()
