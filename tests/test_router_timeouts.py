"""The router's response and stream idle timeouts, against engine stand-ins that go silent.

The stand-ins are plain trio TCP servers in the test: one accepts a request and never answers, one
sends the head and one SSE event of a stream and then stalls. The healthy replica beside them is
a real ``sim`` engine, and the client is the real ``openai`` client (in a worker thread). Every
test runs once per relay pump (``relay_kind``): the pump relays the streamed body, so the timeouts
must hold for both. Every wait polls with a deadline or is bounded by ``trio.fail_after``.

The response timeout is judged on trio's clock (``Router.clock``), so where the engine, router and
client all run in this process, its default of minutes is tested under trio's ``MockClock`` in a
fraction of a second. The stream idle timeout is judged from the kernel's own silence counter of
each engine socket (``router.stalls.tcp_progress``), in real time, and so are the tests of it.
"""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

import control.config
from router.config import FieldProblem, RouterConfig
from router.policies import prompt_prefix
from router.policies.prefix_hash import prefix_digest, rendezvous_score
from router.retry import Ejection
from router.routes import ModelRoutes, Upstream
from router.server import Router
from router.stalls import DEFAULT_RESPONSE_TIMEOUT, stall, tcp_progress
from tests.test_router import (
    MODEL,
    REPO,
    Engine,
    apoll,
    metrics_of,
    metrics_once,
    sample,
    serve,
    start_engine,
    stop_engines,
)

#: Short timeouts for the tests: long enough that a loaded 2-core machine does not trip them on
#: a healthy engine, short enough to keep each test to a few seconds.
RESPONSE_TIMEOUT = 1.0
IDLE_TIMEOUT = 1.0
#: How late a timeout may fire and its answer reach the client: the stall watch's tick (a tenth
#: of the timeout) plus a busy machine's scheduling.
SLACK = 2.0

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"sim-model",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"once"},"finish_reason":null}]}\n\n'
)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    engine = start_engine(tmp_path_factory.mktemp("engines"), "healthy")
    yield engine
    stop_engines([engine])


@attrs.define
class StandIn:
    """An engine stand-in: its URL, the requests it read, and how many of its connections the
    router closed (the router closing is how an engine learns to stop working on a request)."""

    url: str = ""
    requests: list[bytes] = attrs.field(factory=list)
    closed_by_router: int = 0


async def stand_in(nursery: trio.Nursery, reply: bytes | None) -> StandIn:
    """A TCP server that reads each request whole, sends ``reply`` (None: nothing), and then
    neither answers nor closes: a hung engine. It notices the router closing the connection."""
    state = StandIn()

    async def handler(stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        while len(body) < length:
            body += await stream.receive_some(65536)
        state.requests.append(body)
        if reply is not None:
            await stream.send_all(reply)
        while await stream.receive_some(65536):
            pass  # never answers; an end of file is the router giving up on the request
        state.closed_by_router += 1

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    state.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    return state


def prompt_preferring(url: str, other: str) -> str:
    """A prompt whose prefix affinity ranks ``url`` above ``other`` (rendezvous hashing), so that
    the first request goes to ``url`` for certain and the next with the same prompt would too,
    but for its ejection."""
    for i in range(1000):
        text = f"question {i}"
        key = prompt_prefix({"messages": [{"role": "user", "content": text}]}, 256)
        if rendezvous_score(prefix_digest(key), url) > rendezvous_score(prefix_digest(key), other):
            return text
    raise AssertionError("no prompt ranks the stand-in first")


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


# ---------------------------------------------------------------------------------------------
# An engine that accepts and never answers


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_silent_engine_is_a_504_within_the_timeout_and_the_next_request_goes_elsewhere(
    nursery: trio.Nursery, healthy: Engine, relay_kind: str, stream: bool
) -> None:
    silent = await stand_in(nursery, None)
    routes = ModelRoutes((Upstream("sim-model-r0", silent.url), Upstream("sim-model-r1", healthy.url)))
    router = Router(
        lambda: {MODEL: routes},
        RouterConfig(response_timeout=RESPONSE_TIMEOUT, stream_idle_timeout=IDLE_TIMEOUT),
    )
    assert router.pump.kind == relay_kind
    base = await serve(nursery, router)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": prompt_preferring(silent.url, healthy.url)}
    ]

    def first() -> tuple[float, openai.APIStatusError]:
        started = time.monotonic()
        chat = openai_client(base).chat.completions
        with pytest.raises(openai.APIStatusError) as caught:
            if stream:
                list(chat.create(model=MODEL, messages=messages, max_tokens=3, stream=True))
            else:
                chat.create(model=MODEL, messages=messages, max_tokens=3)
        return time.monotonic() - started, caught.value

    with trio.fail_after(RESPONSE_TIMEOUT + 15):
        elapsed, error = await trio.to_thread.run_sync(first)
    assert error.status_code == 504
    assert RESPONSE_TIMEOUT <= elapsed < RESPONSE_TIMEOUT + SLACK
    body = error.body
    assert isinstance(body, dict) and body["code"] == "upstream_response_timeout"
    assert "sim-model-r0" in error.message and silent.url in error.message
    assert "router_response_timeout 1 s" in error.message and "ejected" in error.message
    assert len(silent.requests) == 1 and json.loads(silent.requests[0])["messages"] == messages
    # The router gave the request up at the engine too: it closed the connection.
    await apoll("the router to close the silent engine's connection", lambda: silent.closed_by_router == 1)

    def second() -> tuple[str, str]:
        raw = openai_client(base).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=3
        )
        return raw.headers["x-llmgw-replica"], raw.parse().choices[0].message.content or ""

    replica, text = await trio.to_thread.run_sync(second)
    assert replica == "sim-model-r1" and len(text.split()) == 3
    assert len(silent.requests) == 1  # the prompt's preferred replica is ejected: not asked again
    text_metrics = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_requests_total", 1, model=MODEL, status="200")
    )
    assert sample(text_metrics, "llmgw_router_requests_total", model=MODEL, status="504") == 1
    assert (
        sample(text_metrics, "llmgw_router_upstream_errors_total", replica="sim-model-r0", kind="timeout")
        == 1
    )
    assert sample(text_metrics, "llmgw_router_upstream_ejected", replica="sim-model-r0") == 1
    assert sample(text_metrics, "llmgw_router_ejections_total", replica="sim-model-r0") == 1
    assert sample(text_metrics, "llmgw_router_in_flight", replica="sim-model-r0") == 0


async def test_the_default_response_timeout_on_trios_clock(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The default response timeout (minutes) cuts off a silent engine at that figure on the
    router's clock, tested in virtual time: the stand-in, the router and the client are all in this
    process on trio's clock, which jumps to the next deadline whenever every task waits (bytes sent
    on loopback are already in the peer's queue by then, so no wait for one is skipped)."""
    silent = await stand_in(nursery, None)
    router = Router(lambda: {MODEL: ModelRoutes((Upstream("sim-model-r0", silent.url),))}, RouterConfig())
    assert router.response_timeout == DEFAULT_RESPONSE_TIMEOUT
    base = await serve(nursery, router)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello?"}]}).encode()
    started = trio.current_time()
    stream = await trio.open_tcp_stream("127.0.0.1", int(base.rsplit(":", 1)[1]))
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    with trio.fail_after(DEFAULT_RESPONSE_TIMEOUT + 60):  # virtual seconds
        while b"upstream_response_timeout" not in received:
            data = await stream.receive_some(65536)
            assert data, f"the router closed the connection: {received!r}"
            received += data
    waited = trio.current_time() - started
    await stream.aclose()
    assert received.startswith(b"HTTP/1.1 504 "), received
    # Within a tick of the stall watch (a second at most) after the timeout, and not before it.
    assert DEFAULT_RESPONSE_TIMEOUT <= waited <= DEFAULT_RESPONSE_TIMEOUT + router.stall_tick + 0.5, waited
    assert b"router_response_timeout %g s" % DEFAULT_RESPONSE_TIMEOUT in received
    assert len(silent.requests) == 1 and json.loads(silent.requests[0])["messages"][0]["content"] == "hello?"
    await apoll("the router to close the silent engine's connection", lambda: silent.closed_by_router == 1)


# ---------------------------------------------------------------------------------------------
# An engine that stalls mid-stream


async def test_an_engine_stalling_mid_stream_ends_the_stream_with_an_error_event(
    nursery: trio.Nursery, relay_kind: str
) -> None:
    stalling = await stand_in(nursery, HEAD + b"%x\r\n%s\r\n" % (len(FIRST_EVENT), FIRST_EVENT))
    router = Router(
        lambda: {MODEL: ModelRoutes((Upstream("sim-model-r0", stalling.url),))},
        RouterConfig(response_timeout=5 * RESPONSE_TIMEOUT, stream_idle_timeout=IDLE_TIMEOUT),
    )
    assert router.pump.kind == relay_kind
    base = await serve(nursery, router)

    def with_openai() -> tuple[list[str], float, openai.APIError]:
        stream = openai_client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stall"}], max_tokens=50, stream=True
        )
        words: list[str] = []
        first_at = 0.0
        with pytest.raises(openai.APIError) as caught:
            for chunk in stream:
                first_at = first_at or time.monotonic()
                words += [c.delta.content or "" for c in chunk.choices]
        return words, time.monotonic() - first_at, caught.value

    with trio.fail_after(IDLE_TIMEOUT + 15):
        words, after_first, error = await trio.to_thread.run_sync(with_openai)
    assert words == ["once"]
    assert not isinstance(error, openai.APIConnectionError)  # an error event, not a broken body
    assert IDLE_TIMEOUT - 0.1 <= after_first < IDLE_TIMEOUT + SLACK
    assert error.body == {
        "message": error.message,
        "type": "timeout",
        "code": "upstream_idle_timeout",
    }
    assert "sim-model-r0" in error.message and "mid-stream" in error.message
    assert "router_stream_idle_timeout 1 s" in error.message

    # The same on the wire: the event is a chunk of its own, then the chunked body's end, so an
    # HTTP client sees a complete body (httpx would raise on a broken one) ending in the error.
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "again"}], "stream": True}
        with trio.fail_after(IDLE_TIMEOUT + 15):
            async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "sim-model-r0"
                received = b"".join([part async for part in r.aiter_bytes()])
    first, error_event, rest = received.split(b"\n\n")
    assert first + b"\n\n" == FIRST_EVENT and rest == b""
    assert json.loads(error_event.removeprefix(b"data: "))["error"]["code"] == "upstream_idle_timeout"

    await apoll("the router to close both engine connections", lambda: stalling.closed_by_router == 2)
    text = await trio.to_thread.run_sync(
        functools.partial(metrics_once, base, "llmgw_router_upstream_errors_total", 2, kind="timeout")
    )
    # Ejected by the first timeout; the second came while ejected (the only replica is tried
    # anyway) and does not eject again.
    assert sample(text, "llmgw_router_ejections_total", replica="sim-model-r0") == 1
    assert sample(text, "llmgw_router_requests_total", model=MODEL, status="200") == 2
    assert sample(text, "llmgw_router_in_flight", replica="sim-model-r0") == 0
    assert router.pump.stats() == (0, 0)


async def test_a_client_that_does_not_read_is_not_an_engine_stall(
    nursery: trio.Nursery, tmp_path: Path, relay_kind: str
) -> None:
    """An engine held up by its client's full socket is not silent on its own account: its stream
    waits (the engine is not read until the client drains), longer than the idle timeout, and
    then arrives whole; the engine is not ejected."""
    fast = await trio.to_thread.run_sync(start_engine, tmp_path, "fast", {"LLMGW_SIM_ITL_MS": "0"})
    try:
        router = Router(
            lambda: {MODEL: ModelRoutes((Upstream("r0", fast.url),))},
            RouterConfig(response_timeout=RESPONSE_TIMEOUT, stream_idle_timeout=0.3),
        )
        base = await serve(nursery, router)
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "slow"}],
                "max_tokens": 6000,
                "stream": True,
            }
        ).encode()
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        await sock.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await apoll("the stream to wait for its slow client", lambda: router.pump.stats() == (1, 1))
        # The engine's socket, as the stall watch sees it: silent (the router does not read it
        # while the client does not) for five idle timeouts by the kernel's count, which is what
        # the watch judges by, looking every 30 ms; it must have left the stream alone throughout.
        (watch,) = router._watches

        def quiet() -> float:
            assert watch.sock is not None
            progress = tcp_progress(watch.sock)
            return progress[1] if progress is not None else 0.0

        await apoll("the engine's socket to be silent for five idle timeouts", lambda: quiet() >= 1.5)
        assert not watch.fired and router.pump.stats() == (1, 1)
        received = b""
        with trio.fail_after(30):
            while not received.endswith(b"\r\n0\r\n\r\n"):
                data = await sock.recv(65536)
                assert data, "the router closed the connection mid-stream"
                received += data
        sock.close()
        assert b"error" not in received and received.count(b"data: ") > 6000
        text = await trio.to_thread.run_sync(metrics_of, base)
        assert sample(text, "llmgw_router_upstream_errors_total") == 0
        assert sample(text, "llmgw_router_upstream_ejected", replica="r0") == 0
    finally:
        stop_engines([fast])


# ---------------------------------------------------------------------------------------------
# Settings and the pure parts


def test_stall_verdicts() -> None:
    args = {"response_timeout": 10.0, "idle_timeout": 2.0}
    assert stall(waited=9.9, got_bytes=False, quiet=9.9, **args) == ""
    assert stall(waited=10.0, got_bytes=False, quiet=10.0, **args) == "head"
    assert stall(waited=50.0, got_bytes=True, quiet=1.9, **args) == ""
    assert stall(waited=3.0, got_bytes=True, quiet=2.0, **args) == "idle"


def test_a_timeout_ejects_at_once() -> None:
    b = Ejection(eject_after=3, eject_base=10.0)
    up = Upstream("r0", "http://10.0.0.1:8000")
    assert b.failed(up, 0.0, "connection refused") is None  # one of three
    assert b.failed(up, 0.0, "sent nothing", at_once=True) == 10.0
    assert b.is_ejected(up.url, 5.0)


def test_router_refuses_timeouts_that_are_not_positive() -> None:
    with pytest.raises(FieldProblem, match="must be a number of seconds more than 0, got 0") as refused:
        RouterConfig(stream_idle_timeout=0)
    assert refused.value.key == "stream_idle_timeout"
    with pytest.raises(FieldProblem, match="must be a number of seconds more than 0, got -1") as refused:
        RouterConfig(response_timeout=-1)
    assert refused.value.key == "response_timeout"


def test_config_keys_and_their_checks() -> None:
    cfg = control.config.parse("router_response_timeout = 120\nrouter_stream_idle_timeout = 7.5\n")
    assert (cfg.router_config.response_timeout, cfg.router_config.stream_idle_timeout) == (120.0, 7.5)
    defaults = control.config.ControlConfig().router_config
    assert (defaults.response_timeout, defaults.stream_idle_timeout) == (300.0, 60.0)
    with pytest.raises(
        control.config.ConfigError, match=r"router_stream_idle_timeout must be .*more than 0.*line 2"
    ):
        control.config.parse("api_keys = []\nrouter_stream_idle_timeout = 0\n", "llmgw.toml")
    with pytest.raises(control.config.ConfigError, match=r"router_response_timeout"):
        control.config.parse('router_response_timeout = "soon"\n', "llmgw.toml")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--response-timeout", "0"],
            "response_timeout (from --response-timeout): must be a number of seconds more than 0, got 0",
        ),
        (
            ["--stream-idle-timeout=-2"],
            "stream_idle_timeout (from --stream-idle-timeout): must be a number of seconds more than 0, got -2",
        ),
    ],
)
def test_router_cli_refuses_timeouts_that_are_not_positive(flags: list[str], says: str) -> None:
    argv = [sys.executable, "-m", "router", "--static", f"{MODEL}=http://127.0.0.1:9", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr
