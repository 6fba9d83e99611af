"""The router against real simulated engines, driven by the real ``openai`` client.

Two ``python -m agent.engines.sim`` processes are started once for the module on ports the kernel
picks; tests that count engine-side events compare before and after, so they can share them. The
router runs in the test's trio loop (``nursery.start(router.serve, ...)``) and the synchronous
``openai`` client runs in a worker thread against it. Every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import h11
import httpx
import openai
import pytest
import trio

from router.config import RouterConfig
from router.framing import ChunkedScanner, parse_response_head
from router.policies import Candidate, PolicyRequest, prompt_prefix
from router.policies.prefix_hash import PrefixHash, prefix_digest, rendezvous_score
from router.retry import Ejection
from router.routes import ModelRoutes, Upstream, static_routes
from router.server import Router
from tests.support import apoll, free_port, poll

REPO = Path(__file__).resolve().parent.parent
MODEL = "sim-model"


@attrs.define
class Engine:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} missing from the engine's /metrics"
        return float(match.group(1))

    def requests(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(v) for v in re.findall(r"^llmgw_sim_requests_total\{[^}]*\} (\S+)$", text, re.M))


def start_engine(
    tmp: Path,
    name: str,
    env: Mapping[str, str] | None = None,
    *,
    ready: bool = True,
    port: int = 0,
    extra: Sequence[str] = (),
) -> Engine:
    log = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "agent.engines.sim", "serve", "org/sim", "--served-model-name", MODEL]
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra]
    full_env = {
        **os.environ,
        "LLMGW_SIM_LOAD_SECONDS": "0",
        "LLMGW_SIM_TTFT_MS": "5",
        "LLMGW_SIM_ITL_MS": "20",
        **(env or {}),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
    engine = Engine(proc, log)

    def port() -> int | None:
        m = re.search(r"listening on [^ ]+:(\d+)", log.read_text())
        if m is None and proc.poll() is not None:
            raise AssertionError(f"engine {name} exited {proc.returncode}:\n{log.read_text()}")
        return int(m.group(1)) if m else None

    engine.port = poll(f"engine {name} to listen", port)
    if ready:

        def healthy() -> bool:
            try:
                return httpx.get(f"{engine.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        poll(f"engine {name} /health to answer 200", healthy)
    return engine


def stop_engines(engines: list[Engine]) -> None:
    for e in engines:
        if e.proc.poll() is None:
            e.proc.kill()
        e.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    tmp = tmp_path_factory.mktemp("engines")
    started = [start_engine(tmp, "a"), start_engine(tmp, "b")]
    yield started[0], started[1]
    stop_engines(started)


def closed_port_url() -> str:
    """A loopback port nothing listens on (bound, then released: connecting is refused)."""
    return f"http://127.0.0.1:{free_port()}"


def routes_of(table: dict[str, ModelRoutes]) -> Callable[[], Mapping[str, ModelRoutes]]:
    return lambda: table


def two(engines: tuple[Engine, Engine]) -> ModelRoutes:
    return ModelRoutes(
        upstreams=(Upstream("sim-model-r0", engines[0].url), Upstream("sim-model-r1", engines[1].url))
    )


async def serve(nursery: trio.Nursery, router: Router) -> str:
    port = await nursery.start(router.serve, "127.0.0.1", 0)
    return f"http://127.0.0.1:{port}"


def client(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def metrics_of(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=5).text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, matching the given labels (0 when absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metrics_once(base: str, name: str, at_least: float, **labels: str) -> str:
    """/metrics once ``name`` has reached ``at_least``. A request's counters follow its last byte,
    which the client may have read first, so a check right after a response must wait for them."""

    def reached() -> str | None:
        text = metrics_of(base)
        return text if sample(text, name, **labels) >= at_least else None

    return poll(f"{name}{labels} >= {at_least:g} in /metrics", reached)


def sample_plain(text: str, name: str) -> float:
    """The value of a sample without labels."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def normal_ids(b: bytes) -> bytes:
    """A response body without its per-request id and creation time."""
    return re.sub(rb'"created":\d+', b"", re.sub(rb"chatcmpl-[0-9a-f]+", b"ID", b))


CHAT: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]


# ---------------------------------------------------------------------------------------------
# The OpenAI API through the router


async def test_openai_client_plain_and_streamed(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    direct = openai.OpenAI(base_url=f"{engines[0].url}/v1", api_key="x", max_retries=0)

    def sync_calls() -> None:
        c = client(base)
        assert [m.id for m in c.models.list().data] == [MODEL]
        reply = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        text = reply.choices[0].message.content
        # Deterministic engines: the same words as asking an engine directly.
        expected = direct.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        assert text == expected.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        stream = c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        deltas, usage = [], None
        for chunk in stream:
            usage = chunk.usage or usage
            deltas += [ch.delta.content or "" for ch in chunk.choices]
        assert "".join(deltas) == text
        assert usage is not None and usage.completion_tokens == 6
        plain = c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4, stream=True)
            if ch.choices
        )
        assert streamed == plain.choices[0].text

    await trio.to_thread.run_sync(sync_calls)

    def async_client_in_asyncio() -> str:
        async def go() -> str:
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as ac:
                parts = []
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=5, stream=True
                )
                async for chunk in stream:
                    parts += [ch.delta.content or "" for ch in chunk.choices]
                return "".join(parts)

        return asyncio.run(go())

    words = await trio.to_thread.run_sync(async_client_in_asyncio)
    assert len(words.split()) == 5


async def test_stream_is_relayed_byte_for_byte(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], relay_kind: str
) -> None:
    """The SSE body through the router equals the engine's, apart from the per-request id and time."""
    base = await serve(
        nursery, Router(routes_of({MODEL: ModelRoutes((Upstream("r0", engines[0].url),))}), RouterConfig())
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "bytes"}],
        "max_tokens": 5,
        "stream": True,
    }

    async def fetch(url: str) -> tuple[bytes, httpx.Headers]:
        async with httpx.AsyncClient() as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            return b"".join([chunk async for chunk in r.aiter_raw()]), r.headers

    via, headers = await fetch(base)
    direct, _ = await fetch(engines[0].url)

    assert normal_ids(via) == normal_ids(direct)
    assert headers["content-type"] == "text/event-stream"
    assert headers["x-llmgw-replica"] == "r0"


async def test_client_disconnect_cancels_the_engine_request(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], relay_kind: str
) -> None:
    a = engines[0]
    base = await serve(
        nursery, Router(routes_of({MODEL: ModelRoutes((Upstream("r0", a.url),))}), RouterConfig())
    )
    before = await trio.to_thread.run_sync(a.metric, "llmgw_sim_requests_cancelled_total")

    def start_and_leave() -> None:
        stream = client(base).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=500, stream=True)
        next(iter(stream))  # the engine is generating (500 tokens at 20 ms: 10 s)
        stream.close()  # the client goes away mid-stream

    await trio.to_thread.run_sync(start_and_leave)

    async def cancelled() -> float:
        return await trio.to_thread.run_sync(a.metric, "llmgw_sim_requests_cancelled_total")

    deadline = trio.current_time() + 5
    while (now := await cancelled()) <= before:
        assert trio.current_time() < deadline, "the engine never saw the client's disconnect"
        await trio.sleep(0.02)  # poll interval; the deadline above bounds the wait
    assert now == before + 1
    # Closing the engine's connection comes first; the disconnect is counted just after.
    text = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_client_disconnects_total", 1, model=MODEL)
    )
    assert sample(text, "llmgw_router_client_disconnects_total", model=MODEL) == 1
    assert sample(text, "llmgw_router_in_flight", replica="r0") == 0
    # The client had its first byte before it left: that counts for the histogram.
    assert sample(text, "llmgw_router_time_to_first_byte_seconds_count", model=MODEL) == 1


async def test_client_hanging_up_before_the_first_byte_cancels_the_engine_request(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    """A client that leaves while the engine has not answered yet (a non-streamed request: 500
    tokens at 20 ms, 10 s before any byte) cancels the engine's request at once."""
    a = engines[0]
    base = await serve(
        nursery, Router(routes_of({MODEL: ModelRoutes((Upstream("r0", a.url),))}), RouterConfig())
    )
    before = await trio.to_thread.run_sync(a.metric, "llmgw_sim_requests_cancelled_total")
    sock = await raw_connect(base)
    await sock.send(post(b"/v1/completions", {"model": MODEL, "prompt": "leave", "max_tokens": 500}))

    async def metric(name: str) -> float:
        return await trio.to_thread.run_sync(a.metric, name)

    deadline = trio.current_time() + 10
    while await metric("llmgw_sim_requests_running") < 1:
        assert trio.current_time() < deadline, "the request never reached the engine"
        await trio.sleep(0.02)  # poll interval; the deadline above bounds the wait
    sock.close()
    deadline = trio.current_time() + 5
    while (now := await metric("llmgw_sim_requests_cancelled_total")) <= before:
        assert trio.current_time() < deadline, "the engine never saw the client hang up"
        await trio.sleep(0.02)  # poll interval; the deadline above bounds the wait
    assert now == before + 1
    text = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_requests_total", 1, model=MODEL, status="499")
    )
    assert sample(text, "llmgw_router_requests_total", model=MODEL, status="499") == 1
    assert sample(text, "llmgw_router_in_flight", replica="r0") == 0


async def test_slow_client_pauses_its_stream_and_loses_nothing(
    nursery: trio.Nursery, tmp_path: Path, relay_kind: str
) -> None:
    """A client that does not read: its stream waits (the engine is not read meanwhile), shows in
    /metrics, and once the client reads, every byte arrives as the engine sent it."""
    fast = await trio.to_thread.run_sync(start_engine, tmp_path, "fast", {"LLMGW_SIM_ITL_MS": "0"})
    try:
        router = Router(routes_of({MODEL: ModelRoutes((Upstream("r0", fast.url),))}), RouterConfig())
        base = await serve(nursery, router)
        assert router.pump.kind == relay_kind
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "slow"}],
                "max_tokens": 6000,
                "stream": True,
            }
        ).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        await sock.send(request)
        await apoll("the stream to wait for its slow client", lambda: router.pump.stats() == (1, 1))
        text = await trio.to_thread.run_sync(metrics_of, base)
        assert sample_plain(text, "llmgw_router_streams_client_blocked") == 1
        received = b""
        with trio.fail_after(30):
            while not received.endswith(b"\r\n0\r\n\r\n"):
                data = await sock.recv(65536)
                assert data, "the router closed the connection mid-stream"
                received += data
        sock.close()
        direct = await trio.to_thread.run_sync(
            lambda: httpx.post(f"{fast.url}/v1/chat/completions", content=body, timeout=30).content
        )
        events = received.split(b"\r\n\r\n", 1)[1]
        scanner = ChunkedScanner(decode=True)
        assert scanner.feed(events) == len(events) and scanner.done
        relayed = b"".join(scanner.payloads)
        assert len(relayed) > 1_000_000  # well past the sockets' buffers: the pause was needed
        assert normal_ids(relayed) == normal_ids(direct)
        assert router.pump.stats() == (0, 0)
    finally:
        stop_engines([fast])


async def test_engine_dying_mid_stream_ends_the_client_response(
    nursery: trio.Nursery, tmp_path: Path, relay_kind: str
) -> None:
    """The engine's connection breaks after the first events: the client's response ends at once as
    incomplete (not hanging, not looking complete), and the failure is counted."""
    doomed = await trio.to_thread.run_sync(start_engine, tmp_path, "doomed")
    router = Router(routes_of({MODEL: ModelRoutes((Upstream("r0", doomed.url),))}), RouterConfig())
    base = await serve(nursery, router)
    assert router.pump.kind == relay_kind
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "die"}],
        "max_tokens": 500,
        "stream": True,
    }
    events = 0
    with trio.fail_after(15):
        async with httpx.AsyncClient() as c, c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in r.aiter_raw():
                    events += chunk.count(b"data: ")
                    if events >= 3 and doomed.proc.poll() is None:
                        doomed.proc.kill()  # 3 events in: the rest (500 tokens at 20 ms) is 10 s away
    doomed.proc.wait(timeout=10)
    assert 3 <= events < 500
    text = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_upstream_errors_total", 1, kind="mid_stream")
    )
    assert sample(text, "llmgw_router_upstream_errors_total", replica="r0", kind="mid_stream") == 1
    assert sample(text, "llmgw_router_in_flight", replica="r0") == 0
    assert router.pump.stats() == (0, 0)


# ---------------------------------------------------------------------------------------------
# The client's side of HTTP/1.1: raw bytes in, h11 (an independent parser) reading what comes back


async def raw_connect(base: str) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    return sock


def post(path: bytes, doc: dict[str, object], version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    body = json.dumps(doc).encode()
    return (
        b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (
            path,
            version,
            len(body),
            extra,
            body,
        )
    )


async def recv_until_closed(sock: trio.socket.SocketType, have: bytes = b"") -> bytes:
    """Everything until the router closes the connection (failing if it does not within 15 s)."""
    with trio.fail_after(15):
        while data := await sock.recv(65536):
            have += data
    return have


async def read_responses(
    sock: trio.socket.SocketType, methods: list[bytes], have: bytes = b""
) -> tuple[list[tuple[h11.Response, bytes]], bytes]:
    """Read one response per method, in order, each with a fresh h11 client that believes it sent
    that request; returns them with the bytes left over."""
    out: list[tuple[h11.Response, bytes]] = []
    with trio.fail_after(15):
        for method in methods:
            conn = h11.Connection(h11.CLIENT)
            conn.send(
                h11.Request(method=method, target="/", headers=[("host", "x"), ("content-length", "0")])
            )
            conn.send(h11.EndOfMessage())
            if have:  # (h11 takes empty data for the end of the connection)
                conn.receive_data(have)
            response: h11.Response | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await sock.recv(65536))
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise AssertionError(
                        f"the router closed the connection before the response to {method!r} ended"
                    )
            assert response is not None
            out.append((response, body))
            have = conn.trailing_data[0]
    return out, have


def header(response: h11.Response, name: bytes) -> bytes | None:
    return next((v for k, v in response.headers if k == name), None)


STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "pipelined"}],
    "max_tokens": 3,
    "stream": True,
}


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], relay_kind: str
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    sock = await raw_connect(base)
    await sock.send(
        b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n"
        + post(b"/v1/chat/completions", STREAM)
        + post(b"/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    methods = [b"HEAD", b"POST", b"POST", b"GET"]
    (head, stream, plain, models), rest = await read_responses(sock, methods)
    assert head[0].status_code == 200 and head[1] == b"" and header(head[0], b"content-length") == b"16"
    assert stream[0].status_code == 200 and header(stream[0], b"transfer-encoding") == b"chunked"
    assert stream[1].count(b"data: ") == 6 and stream[1].endswith(b"data: [DONE]\n\n")
    assert plain[0].status_code == 200 and len(json.loads(plain[1])["choices"]) == 1
    assert [m["id"] for m in json.loads(models[1])["data"]] == [MODEL]
    # Still open and in step.
    await sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    ((health, body),), rest = await read_responses(sock, [b"GET"], rest)
    assert health.status_code == 200 and body == b'{"status":"ok"}\n' and rest == b""
    sock.close()


async def test_an_http10_client_gets_the_stream_unchunked_then_a_close(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], relay_kind: str
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    sock = await raw_connect(base)
    await sock.send(post(b"/v1/chat/completions", STREAM, version=b"1.0"))
    raw = await recv_until_closed(sock)
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower()
    assert body.startswith(b"data: {") and body.count(b"data: ") == 6 and body.endswith(b"data: [DONE]\n\n")


async def test_expect_100_continue_and_a_chunked_request_body(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    sock = await raw_connect(base)
    body = json.dumps({"model": MODEL, "prompt": "continue", "max_tokens": 2}).encode()
    await sock.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nexpect: 100-continue\r\n\r\n"
        % len(body)
    )
    interim = b""
    with trio.fail_after(15):
        while b"\r\n\r\n" not in interim:
            interim += await sock.recv(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await sock.send(body)
    ((done, answer),), rest = await read_responses(sock, [b"POST"], interim.partition(b"\r\n\r\n")[2])
    assert done.status_code == 200 and json.loads(answer)["choices"]
    # The same request with its body sent in chunks, split mid-JSON.
    pieces = [body[:7], body[7:20], body[20:]]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    await sock.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
    )
    ((done, answer),), _ = await read_responses(sock, [b"POST"], rest)
    assert done.status_code == 200 and json.loads(answer)["choices"]
    sock.close()


async def test_connection_close_is_honoured_and_idle_clients_are_closed(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    base = await serve(
        nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig(client_idle_timeout=0.3))
    )
    sock = await raw_connect(base)
    await sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    raw = await recv_until_closed(sock)
    sock.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close\r\n" in raw.lower()
    # An upgrade the router does not take: answered as plain HTTP/1.1, then the connection ends
    # (what follows the request would be the other protocol's bytes).
    sock = await raw_connect(base)
    await sock.send(
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\nPRI * HTTP/2.0"
    )
    raw = await recv_until_closed(sock)
    sock.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b'{"status":"ok"}\n')
    assert b"\r\nconnection: close\r\n" in raw.lower()
    idle = await raw_connect(base)
    assert await recv_until_closed(idle) == b""  # nothing sent: closed after client_idle_timeout
    idle.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "words"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed HTTP request"),
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n" + b"x" * 2000,
            413,
            "over 1000 bytes",
        ),
        (b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 70000 + b"\r\n\r\n", 431, "header"),
    ],
    ids=["garbage", "body-too-large", "headers-too-large"],
)
async def test_a_request_that_cannot_be_read_gets_an_error_and_a_close(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], request_bytes: bytes, status: int, words: str
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig(max_body_bytes=1000)))
    sock = await raw_connect(base)
    await sock.send(request_bytes)
    raw = await recv_until_closed(sock)
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:200]
    assert b"\r\nconnection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]


# ---------------------------------------------------------------------------------------------
# Choosing replicas


def prompt_ranked_first(first: str, other: str) -> str:
    """A prompt whose rendezvous ranking puts ``first`` ahead of ``other``."""
    for i in range(1000):
        text = f"prompt {i}"
        digest = prefix_digest(prompt_prefix({"messages": [{"role": "user", "content": text}]}, 256))
        if rendezvous_score(digest, first) > rendezvous_score(digest, other):
            return text
    raise AssertionError("no prompt ranks the URL first")


async def test_refused_replica_is_skipped_before_the_first_byte(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    dead = closed_port_url()
    table = {MODEL: ModelRoutes((Upstream("dead-r0", dead), Upstream("live-r1", engines[0].url)))}
    base = await serve(nursery, Router(routes_of(table), RouterConfig()))
    text = prompt_ranked_first(dead, engines[0].url)

    def ask() -> str | None:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": text}]
        raw = client(base).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=3
        )
        assert raw.headers["x-llmgw-replica"] == "live-r1"
        return raw.parse().choices[0].message.content

    assert await trio.to_thread.run_sync(ask)
    metrics = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_requests_total", 1, model=MODEL, status="200")
    )
    assert sample(metrics, "llmgw_router_upstream_errors_total", replica="dead-r0", kind="connect") == 1
    assert sample(metrics, "llmgw_router_retries_total", model=MODEL) == 1
    assert sample(metrics, "llmgw_router_requests_total", model=MODEL, status="200") == 1


async def test_all_replicas_failing_is_a_502_naming_each(nursery: trio.Nursery) -> None:
    dead = [closed_port_url(), closed_port_url()]
    table = {MODEL: ModelRoutes((Upstream("x-r0", dead[0]), Upstream("x-r1", dead[1])))}
    base = await serve(nursery, Router(routes_of(table), RouterConfig()))

    def ask() -> httpx.Response:
        return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)

    r = await trio.to_thread.run_sync(ask)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "x-r0" in error["message"] and "x-r1" in error["message"] and "refused" in error["message"]


async def test_loading_engine_503_moves_to_another_replica(
    nursery: trio.Nursery, engines: tuple[Engine, Engine], tmp_path: Path
) -> None:
    loading = start_engine(tmp_path, "loading", {"LLMGW_SIM_LOAD_SECONDS": "600"}, ready=False)
    try:
        table = {MODEL: ModelRoutes((Upstream("loading-r0", loading.url), Upstream("ok-r1", engines[1].url)))}
        base = await serve(nursery, Router(routes_of(table), RouterConfig()))
        text = prompt_ranked_first(loading.url, engines[1].url)

        def ask() -> httpx.Response:
            doc = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
            return httpx.post(f"{base}/v1/chat/completions", json=doc, timeout=10)

        r = await trio.to_thread.run_sync(ask)
        assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "ok-r1"
        metrics = await trio.to_thread.run_sync(metrics_of, base)
        assert (
            sample(metrics, "llmgw_router_upstream_errors_total", replica="loading-r0", kind="unavailable")
            == 1
        )
    finally:
        stop_engines([loading])


async def test_an_engine_restarted_on_its_port_costs_no_request(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Pooled keep-alive connections to the old process are found dead and replaced, unseen."""
    first = start_engine(tmp_path, "first")
    port = first.port
    table = {MODEL: ModelRoutes((Upstream("r0", first.url),))}
    base = await serve(nursery, Router(routes_of(table), RouterConfig(pool_idle_timeout=60)))

    def ask() -> int:
        doc = {"model": MODEL, "prompt": "again", "max_tokens": 1}
        return httpx.post(f"{base}/v1/completions", json=doc, timeout=10).status_code

    assert await trio.to_thread.run_sync(ask) == 200
    stop_engines([first])
    second = await trio.to_thread.run_sync(lambda: start_engine(tmp_path, "second", port=port))
    try:
        assert await trio.to_thread.run_sync(ask) == 200
        metrics = await trio.to_thread.run_sync(metrics_of, base)
        assert sample(metrics, "llmgw_router_upstream_errors_total") == 0
    finally:
        stop_engines([second])


async def hanging_up_engine(nursery: trio.Nursery, *, reset: bool) -> tuple[str, list[int]]:
    """An engine written here: it streams a chunked SSE answer to each request, except that on
    its first connection it hangs up on the second request without answering (closing, or
    resetting with ``reset``), as an engine closing an idle keep-alive connection just as a
    request arrives does. Returns its URL and the requests answered per connection."""
    answered: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        index = len(answered)
        answered.append(0)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            match = re.search(rb"content-length: *(\d+)", head, re.I)
            length = int(match.group(1)) if match else 0
            while len(buf) < length:
                buf += await stream.receive_some(65536)
            buf = buf[length:]
            if index == 0 and answered[0] == 1:
                if reset:
                    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                await stream.aclose()
                return
            events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: one\n\n", b"data: [DONE]\n\n"))
            answered[index] += 1  # before the answer: the client may read it before this task resumes
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + events
                + b"0\r\n\r\n"
            )

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}", answered


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_pooled_connection_the_engine_drops_unanswered_is_redone_unseen(
    nursery: trio.Nursery, relay_kind: str, reset: bool
) -> None:
    """A request sent on a pooled connection that the engine then closes (or resets) without a
    byte of answer is sent again on a new connection: the client sees nothing of it, and no
    upstream error is counted. With the native pump the failure is seen by its thread, before
    the head (relay.EngineFailedEarly)."""
    url, answered = await hanging_up_engine(nursery, reset=reset)
    base = await serve(
        nursery, Router(routes_of({MODEL: ModelRoutes((Upstream("r0", url),))}), RouterConfig())
    )

    def ask() -> httpx.Response:
        doc = {"model": MODEL, "prompt": "again", "max_tokens": 1, "stream": True}
        return httpx.post(f"{base}/v1/completions", json=doc, timeout=10)

    for _ in range(2):
        response = await trio.to_thread.run_sync(ask)
        assert response.status_code == 200
        assert response.text == "data: one\n\ndata: [DONE]\n\n"
    assert answered == [1, 1]  # the second request was redone on a second connection
    metrics = await trio.to_thread.run_sync(metrics_of, base)
    assert sample(metrics, "llmgw_router_upstream_errors_total") == 0


async def test_least_outstanding_spreads_concurrent_requests(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    # Slack 0: affinity yields as soon as its replica is busier than the other, so eight concurrent
    # streams with the same prompt must split four and four.
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig(affinity_slack=0)))
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 150, "stream": True}
    first_chunks = 0
    release = trio.Event()
    replicas: list[str] = []

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal first_chunks
        async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            replicas.append(r.headers["x-llmgw-replica"])
            chunks = r.aiter_raw()  # held, not broken out of: a dropped iterator closes the response
            await chunks.__anext__()
            first_chunks += 1
            await release.wait()

    running = [e.metric("llmgw_sim_requests_running") for e in engines]
    assert running == [0, 0]
    async with httpx.AsyncClient(timeout=30) as c, trio.open_nursery() as inner:
        for _ in range(8):
            inner.start_soon(one, c)
        await apoll("eight streams to begin", lambda: first_chunks == 8)
        per_engine = [await trio.to_thread.run_sync(e.metric, "llmgw_sim_requests_running") for e in engines]
        text = await trio.to_thread.run_sync(metrics_of, base)
        release.set()
    assert per_engine == [4, 4]
    assert sorted(replicas) == ["sim-model-r0"] * 4 + ["sim-model-r1"] * 4
    assert sample(text, "llmgw_router_in_flight", replica="sim-model-r0") == 4
    assert sample(text, "llmgw_router_in_flight", replica="sim-model-r1") == 4


async def test_prefix_affinity_keeps_a_prefix_on_one_replica(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    system = "You are a careful assistant. " * 12  # over 256 characters: the whole affinity key

    def replicas(prompts: list[tuple[str, str]]) -> list[str]:
        out = []
        with httpx.Client(timeout=10) as c:
            for sys_prompt, question in prompts:
                doc = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": sys_prompt},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 1,
                }
                r = c.post(f"{base}/v1/chat/completions", json=doc)
                assert r.status_code == 200
                out.append(r.headers["x-llmgw-replica"])
        return out

    same = await trio.to_thread.run_sync(replicas, [(system, f"question {i}") for i in range(12)])
    assert len(set(same)) == 1, same
    # Different prefixes hash to both replicas (16 distinct prefixes all on one: p = 2**-15).
    spread = await trio.to_thread.run_sync(replicas, [(f"system prompt {i}", "q") for i in range(16)])
    assert set(spread) == {"sim-model-r0", "sim-model-r1"}


# ---------------------------------------------------------------------------------------------
# Errors, keys, metrics, router-only runs


async def test_unknown_model_404_and_no_ready_replica_503(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    reason = "0/3 nodes fit: 3 have too few free GPUs (need 8)"
    table = {MODEL: two(engines), "big-model": ModelRoutes((), reason=reason)}
    base = await serve(nursery, Router(routes_of(table), RouterConfig()))

    def calls() -> None:
        c = client(base)
        with pytest.raises(openai.NotFoundError) as nf:
            c.chat.completions.create(model="nope", messages=CHAT)
        assert nf.value.status_code == 404
        message = str(nf.value)
        assert "nope" in message and MODEL in message and "big-model" in message
        with pytest.raises(openai.APIStatusError) as unavailable:
            c.chat.completions.create(model="big-model", messages=CHAT)
        assert unavailable.value.status_code == 503
        assert reason in str(unavailable.value)
        # Only models with a ready replica are listed.
        assert [m.id for m in c.models.list().data] == [MODEL]
        bad = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        nomodel = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=5)
        assert nomodel.status_code == 400 and "model" in nomodel.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/nothing", timeout=5).status_code == 404

    await trio.to_thread.run_sync(calls)


async def test_api_keys(nursery: trio.Nursery, engines: tuple[Engine, Engine]) -> None:
    base = await serve(
        nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig(api_keys=("k-one", "k-two")))
    )

    def calls() -> None:
        with pytest.raises(openai.AuthenticationError) as wrong:
            client(base, "k-three").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        assert wrong.value.status_code == 401
        missing = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=5)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert client(base, "k-two").completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200  # scrapes need no key

    await trio.to_thread.run_sync(calls)


async def test_metrics_show_the_counters(nursery: trio.Nursery, engines: tuple[Engine, Engine]) -> None:
    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))

    elapsed = 0.0

    def calls() -> str:
        nonlocal elapsed
        c = client(base)
        started = time.monotonic()
        for _ in range(3):
            c.completions.create(model=MODEL, prompt="count me", max_tokens=1)
        with httpx.Client(base_url=base, timeout=30) as h:  # streamed, read to the end of the body
            for _ in range(2):  # relayed from its head on by the native pump's thread
                doc = {"model": MODEL, "prompt": "count me", "max_tokens": 2, "stream": True}
                r = h.post("/v1/completions", json=doc)
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        elapsed = time.monotonic() - started
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="missing", prompt="x")
        # A response's bookkeeping follows its last byte: the client may be quicker. Its time to
        # first byte is recorded when the head goes out, its count when the body ends: wait for both.

        def answered() -> str | None:
            text = metrics_of(base)
            done = sample(text, "llmgw_router_requests_total", model=MODEL, status="200") >= 5
            timed = sample(text, "llmgw_router_time_to_first_byte_seconds_count", model=MODEL) >= 5
            return text if done and timed else None

        return poll("five answered requests in /metrics", answered)

    text = await trio.to_thread.run_sync(calls)
    assert "# TYPE llmgw_router_requests_total counter" in text
    assert sample(text, "llmgw_router_requests_total", model=MODEL, status="200") == 5
    assert sample(text, "llmgw_router_requests_total", status="404") == 1
    assert sample(text, "llmgw_router_time_to_first_byte_seconds_count", model=MODEL) == 5
    assert sample(text, "llmgw_router_time_to_first_byte_seconds_bucket", model=MODEL, le="+Inf") == 5
    assert 0 < sample(text, "llmgw_router_time_to_first_byte_seconds_sum", model=MODEL) < elapsed
    assert "llmgw_router_in_flight{" in text
    assert sample(text, "llmgw_router_idle_connections") >= 1  # keep-alive pooling


def test_router_only_process_with_static_routes(engines: tuple[Engine, Engine], tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    argv = [sys.executable, "-m", "router", "--static", f"{MODEL}={engines[0].url}"]
    argv += ["--static", f"{MODEL}={engines[1].url}", "--port", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        m = poll("the router to listen", lambda: re.search(r"listening on [^ ]+:(\d+)", log.read_text()))
        base = f"http://127.0.0.1:{m.group(1)}"
        c = client(base)
        assert [x.id for x in c.models.list().data] == [MODEL]
        parts = [
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True)
            if ch.choices
        ]
        assert len("".join(parts).split()) == 4
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_static_routes_names_replicas_and_refuses_bad_urls() -> None:
    routes = static_routes(
        [("m", "http://10.0.0.1:8000/"), ("m", "http://10.0.0.2:8000"), ("n", "http://h:1")]
    )()
    assert [u.replica_id for u in routes["m"].upstreams] == ["m-r0", "m-r1"]
    assert routes["m"].upstreams[0].url == "http://10.0.0.1:8000"
    with pytest.raises(ValueError, match="plain HTTP"):
        static_routes([("m", "https://10.0.0.1:8000")])
    with pytest.raises(ValueError, match="plain HTTP"):
        static_routes([("m", "10.0.0.1:8000")])


# ---------------------------------------------------------------------------------------------
# The pure parts


def choose(
    ejection: Ejection, policy: PrefixHash, upstreams: list[Upstream], prompt: str, now: float
) -> Upstream:
    """As the router picks a replica: the candidates the ejection records leave, then the policy."""
    choice = policy.choose(PolicyRequest(MODEL, prompt), ejection.candidates(upstreams, now))
    return choice.upstream


def test_ejection_is_consecutive_exponential_and_cleared_by_success() -> None:
    e = Ejection(eject_after=3, eject_base=10.0, eject_max=25.0)
    p = PrefixHash()
    up = Upstream("r0", "http://a:1")
    other = Upstream("r1", "http://b:1")
    assert e.failed(up, 0.0, "refused") is None
    assert e.failed(up, 0.0, "refused") is None
    assert e.failed(up, 0.0, "refused") == 10.0
    assert choose(e, p, [up, other], "", 5.0) == other
    assert e.failed(up, 5.0, "in flight when ejected") is None  # does not count again
    # Back after 10 s; on probation, one failure ejects it for twice as long, capped at eject_max.
    assert choose(e, p, [up], "", 10.0) == up
    assert e.failed(up, 10.0, "refused") == 20.0
    assert e.failed(up, 30.0, "refused") == 25.0
    # Every upstream ejected: they are tried anyway.
    e.failed(other, 30.0, "x")
    e.failed(other, 30.0, "x")
    e.failed(other, 30.0, "x")
    assert choose(e, p, [up, other], "", 31.0) in (up, other)
    assert [c.upstream for c in e.candidates([up, other], 31.0, exclude=[up.url])] == [other]
    assert e.candidates([up, other], 31.0, exclude=[up.url, other.url]) == []
    e.succeeded(up)
    assert e.failed(up, 60.0, "refused") is None  # the record was cleared: three failures again


def test_affinity_prefers_its_replica_until_it_is_busier_than_the_slack() -> None:
    ups = [Upstream(f"r{i}", f"http://h{i}:1") for i in range(4)]
    e = Ejection()
    p = PrefixHash(slack=2)
    prompt = "shared system prompt"
    preferred = choose(e, p, ups, prompt, 0.0)
    assert all(choose(e, p, ups, prompt, 0.0) == preferred for _ in range(5))  # idle: always the same
    for _ in range(2):
        e.begin(preferred)
    assert choose(e, p, ups, prompt, 0.0) == preferred  # 2 <= 0 + slack
    e.begin(preferred)
    assert choose(e, p, ups, prompt, 0.0) != preferred  # 3 > 0 + slack: spill to a less loaded one
    # Without a prompt: least outstanding.
    for u in ups[1:]:
        e.begin(u)
    e.end(preferred)
    e.end(preferred)
    e.end(preferred)
    assert choose(e, p, ups, "", 0.0) == preferred


def test_a_choice_names_its_policy_rule_and_inputs() -> None:
    """Every decision can be explained: which rule of which policy chose, from what."""
    a, b = Upstream("r0", "http://a:1"), Upstream("r1", "http://b:1")
    p = PrefixHash(slack=4)
    only = p.choose(PolicyRequest(MODEL, "x"), [Candidate(a, 7)])
    assert (only.upstream, only.policy, only.rule) == (a, "prefix_hash", "only")
    by_prefix = p.choose(PolicyRequest(MODEL, "x"), [Candidate(a, 1), Candidate(b, 0)])
    assert by_prefix.rule == "prefix" and dict(by_prefix.inputs)["least"] == 0
    assert dict(by_prefix.inputs)["slack"] == 4 and dict(by_prefix.inputs)["load"] in (0, 1)
    assert by_prefix.explain().startswith("prefix_hash: prefix (rank=")
    least = p.choose(PolicyRequest(MODEL, ""), [Candidate(a, 3), Candidate(b, 1)])
    assert (least.upstream, least.rule, dict(least.inputs)) == (b, "least_loaded", {"load": 1, "tied": 1})


def test_prompt_prefix_reads_messages_prompt_and_input() -> None:
    chat = {"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "q"}]}
    assert prompt_prefix(chat, 256) == "system\x00" + "S" * 249
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert prompt_prefix(parts, 256) == "user\x00hello"
    assert prompt_prefix({"prompt": "abc"}, 2) == "ab"
    assert prompt_prefix({"prompt": ["first", "second"]}, 256) == "first"
    assert prompt_prefix({"prompt": [1, 2, 3]}, 256) == "1 2 3"
    assert prompt_prefix({"input": "embed me"}, 256) == "embed me"
    assert prompt_prefix({"model": "m"}, 256) == ""


def test_chunked_scanner_finds_the_end_at_any_split() -> None:
    body = b"5\r\nhello\r\n1a;ext=1\r\n" + b"x" * 26 + b"\r\n0\r\nx-trailer: 1\r\n\r\n"
    for decode in (True, False):
        for cut in range(len(body) + 1):
            s = ChunkedScanner(decode=decode)
            used = s.feed(body[:cut]) + s.feed(body[cut:] + b"HTTP/1.1 next")
            assert s.done and used == len(body)
            assert b"".join(s.payloads) == (b"hello" + b"x" * 26 if decode else b"")
        # One byte at a time: every state boundary split.
        s = ChunkedScanner(decode=decode)
        assert sum(s.feed(body[i : i + 1]) for i in range(len(body))) == len(body) and s.done


def test_parse_response_head() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nrest"
    parsed = parse_response_head(raw)
    assert parsed is not None
    head, used = parsed
    assert raw[used:] == b"rest"
    assert (head.status, head.framing, head.keep_alive) == (200, "chunked", True)
    assert (b"content-type", b"text/event-stream") in head.headers
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nContent-") is None
    closing, _ = parse_response_head(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n"
    ) or (None, 0)
    assert closing is not None and (closing.framing, closing.length, closing.keep_alive) == (
        "length",
        2,
        False,
    )
    until_close, _ = parse_response_head(b"HTTP/1.0 200 OK\r\n\r\n") or (None, 0)
    assert until_close is not None and until_close.framing == "close" and not until_close.keep_alive


async def test_a_body_nested_past_the_limit_is_a_400_naming_it_not_a_recursion_error(
    nursery: trio.Nursery, engines: tuple[Engine, Engine]
) -> None:
    from router.http1 import MAX_JSON_DEPTH

    base = await serve(nursery, Router(routes_of({MODEL: two(engines)}), RouterConfig()))
    url = f"{base}/v1/chat/completions"
    deep = b"[" * 100_000  # Python's parser alone: 500 internal error: RecursionError
    wrapped = (
        json.dumps({"model": MODEL, "messages": CHAT, "x": "@"})
        .encode()
        .replace(b'"@"', b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    )
    # Brackets in strings are text, not nesting: within the limit, so the engine answers.
    in_strings = {"model": MODEL, "messages": [{"role": "user", "content": "[{" * 50_000}], "max_tokens": 2}

    def calls() -> None:
        for body in (deep, b"{" * 100_000, wrapped):
            r = httpx.post(url, content=body, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert f"at most {MAX_JSON_DEPTH}" in error["message"] and "Recursion" not in error["message"]
        ok = httpx.post(url, json=in_strings, timeout=30)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # still serving

    await trio.to_thread.run_sync(calls)


def test_json_depth_counts_nesting_outside_strings_and_unclosed_openers() -> None:
    from router.http1 import MAX_JSON_DEPTH, json_depth

    wrap = MAX_JSON_DEPTH + 10  # past the count shortcut, so the nesting itself is measured
    for inner, depth in [
        (rb"1", 0),
        (rb'{"a": "[[[[\"[[[", "b": [[]]}', 3),
        (rb'["\\", [[]]]', 3),
        (rb'["\\\"[[[{{{", {}]', 2),
        (rb"[[1], [[2]], []]", 3),
    ]:
        assert json_depth(b"[" * wrap + inner + b"]" * wrap) == wrap + depth, inner
    assert json_depth(b"[" * 100_000) == 100_000
    assert json_depth(b"[]" * 10_000) == 1


async def test_a_bug_after_the_client_left_is_raised_not_counted_as_a_499() -> None:
    """Only what a hang-up causes is the client's 499; a KeyError raised while the client is
    gone is a bug, and goes on (to be logged by the connection's handler) instead of vanishing
    into the disconnect count."""
    from types import SimpleNamespace
    from typing import cast

    from router.exchange import ClientLeft, Exchange
    from router.http1 import ClientConn, Request

    class Buggy(Router):
        async def _forward(self, ex: object, routes: object, request: object) -> None:
            raise KeyError("a bug")

    class Hangs(Router):
        async def _forward(self, ex: object, routes: object, request: object) -> None:
            raise BrokenPipeError("the client's socket")

    table = {MODEL: ModelRoutes((Upstream("r0", "http://127.0.0.1:9"),))}
    body = json.dumps({"model": MODEL, "messages": CHAT}).encode()

    def exchange() -> Exchange:
        client = cast(ClientConn, SimpleNamespace(eof=True, fd=-1))
        return Exchange(client, Request(b"POST", b"/v1/chat/completions", [], body, True, True), 0.0)

    buggy = Buggy(routes_of(table), RouterConfig())
    with pytest.raises(KeyError):
        await buggy._proxy(exchange())
    assert (MODEL, "499") not in buggy.metrics.requests and not buggy.metrics.disconnects
    hangs = Hangs(routes_of(table), RouterConfig())
    with pytest.raises(ClientLeft):
        await hangs._proxy(exchange())
    assert hangs.metrics.requests[(MODEL, "499")] == 1 and hangs.metrics.disconnects[MODEL] == 1
