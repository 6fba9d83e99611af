"""The relay pumps on socket pairs: the ends of a body, back-pressure, and withdrawal.

An engine side and a client side are each a ``socket.socketpair``; the test plays both peers.
Every test runs against both pumps, the native thread and the Python loop (``router.relay``).
"""

from __future__ import annotations

import functools
import os
import random
import re
import socket
from collections.abc import Callable, Iterator

import pytest
import trio
import trio.testing

from router import relay as relay_module
from router.framing import ChunkedScanner
from router.relay import ClientGone, EngineClosed, Pump, make_pump
from tests.support import apoll as until  # the native pump works in its own thread: poll it


@pytest.fixture
def make(relay_kind: str) -> Callable[[], Pump]:
    return lambda: make_pump(relay_kind)


def chunked(events: int, size: int) -> bytes:
    payload = b"data: " + b"x" * size + b"\n\n"
    return (b"%x\r\n%s\r\n" % (len(payload), payload)) * events + b"0\r\n\r\n"


async def read_until(sock: socket.socket, end: bytes, size: int = 1 << 20) -> bytes:
    got = b""
    while not got.endswith(end):
        await trio.lowlevel.wait_readable(sock)
        data = sock.recv(size)
        assert data, "closed before the end"
        got += data
    return got


@pytest.fixture
def pairs() -> Iterator[tuple[socket.socket, socket.socket, socket.socket, socket.socket]]:
    engine, up = socket.socketpair()  # the test writes as the engine; the pump reads ``up``
    client_fd_side, client = socket.socketpair()  # the pump writes ``client_fd_side``
    for s in (engine, up, client_fd_side, client):
        s.setblocking(False)
    yield engine, up, client_fd_side, client
    for s in (engine, up, client_fd_side, client):
        s.close()  # also ends a sender thread a failed test left blocked


async def test_a_body_larger_than_the_buffers_arrives_whole_and_the_job_ends(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    engine, up, down, client = pairs
    pump = make()
    await nursery.start(pump.run)
    body = chunked(2000, 500)  # about 1 MB: the client socket fills, the rest waits for it
    result: list[bool] = []

    async def relay() -> None:
        result.append(await pump.relay(up, down.fileno(), ChunkedScanner()))

    nursery.start_soon(relay)
    engine.setblocking(True)
    nursery.start_soon(
        functools.partial(trio.to_thread.run_sync, engine.sendall, body, abandon_on_cancel=True)
    )
    with trio.fail_after(10):
        while True:
            if pump.stats() == (1, 1):  # waiting for the client, not reading the engine
                break
            await trio.sleep(0.01)  # poll interval; the deadline above bounds the wait
        # Small reads: the pump's writes, the last one included, keep finding the socket nearly
        # full, so the body ends while draining what the client's socket did not take.
        assert await read_until(client, b"0\r\n\r\n", 4096) == body
    await until("the relay to return", lambda: bool(result))
    assert result == [True] and pump.stats() == (0, 0)


async def test_bytes_past_the_body_make_the_connection_unreusable(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    engine, up, down, client = pairs
    pump = make()
    await nursery.start(pump.run)
    body = chunked(3, 10)
    engine.send(body + b"HTTP/1.1 200 OK\r\n")
    with trio.fail_after(10):
        assert await pump.relay(up, down.fileno(), ChunkedScanner()) is False
    assert await read_until(client, b"0\r\n\r\n") == body


async def test_engine_close_and_client_close_fail_the_relay(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    engine, up, down, client = pairs
    pump = make()
    await nursery.start(pump.run)
    engine.send(chunked(1, 10)[:-5])  # one event, then the engine goes away
    engine.close()
    with pytest.raises(EngineClosed, match="closed the connection mid-response"), trio.fail_after(10):
        await pump.relay(up, down.fileno(), ChunkedScanner())

    engine2, up2 = socket.socketpair()
    up2.setblocking(False)
    client.close()
    engine2.send(chunked(1, 10)[:-5])
    with pytest.raises(ClientGone), trio.fail_after(10):
        await pump.relay(up2, down.fileno(), ChunkedScanner())
    assert pump.stats() == (0, 0)
    engine2.close()
    up2.close()


async def test_cancelling_a_relay_withdraws_it(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    engine, up, down, _client = pairs
    pump = make()
    await nursery.start(pump.run)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(pump.relay, up, down.fileno(), ChunkedScanner())
            await trio.testing.wait_all_tasks_blocked()
            assert pump.stats() == (1, 0)
            scope.cancel()
    assert pump.stats() == (0, 0)
    up.close()  # safe at once: the pump no longer watches it
    engine.close()
    await trio.testing.wait_all_tasks_blocked()
    assert pump.stats() == (0, 0)


async def test_a_stopping_pump_fails_parked_relays(make: Callable[[], Pump]) -> None:
    from router.relay import RelayClosed

    engine, up = socket.socketpair()
    down, client = socket.socketpair()
    up.setblocking(False)
    pump = make()
    errors: list[BaseException] = []

    async def relay() -> None:
        try:
            await pump.relay(up, down.fileno(), ChunkedScanner())
        except RelayClosed as exc:
            errors.append(exc)

    async with trio.open_nursery() as outer:
        outer.start_soon(relay)  # before the pump runs: refused at once
        await trio.testing.wait_all_tasks_blocked()
        assert len(errors) == 1
        with trio.CancelScope() as pump_scope:
            async with trio.open_nursery() as inner:
                await inner.start(pump.run)
                outer.start_soon(relay)
                await trio.testing.wait_all_tasks_blocked()
                assert pump.stats() == (1, 0)
                pump_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
    assert len(errors) == 2
    for s in (engine, up, down, client):
        s.close()


def random_body(rng: random.Random) -> bytes:
    """A chunked body with what engines may send: upper- and lower-case sizes, extensions,
    spaces before the CRLF, empty-looking payloads, and sometimes trailers."""
    out = b""
    for _ in range(rng.randint(1, 12)):
        payload = bytes(rng.choice(b"data: {}\r\n0;x") for _ in range(rng.randint(1, 300)))
        size = b"%x" % len(payload)
        size = size.upper() if rng.random() < 0.3 else size
        if rng.random() < 0.2:
            size += b";ext=1"
        if rng.random() < 0.1:
            size += b" "
        out += size + b"\r\n" + payload + b"\r\n"
    out += b"0\r\n"
    if rng.random() < 0.3:
        out += b"x-trailer: 1\r\n"
    return out + b"\r\n"


async def test_random_bodies_split_anywhere_arrive_whole(
    nursery: trio.Nursery, make: Callable[[], Pump]
) -> None:
    """Each body is handed over part-way (the router's task scanned the first part) and the rest
    arrives in pieces that end anywhere, in a size line, a payload, its CRLF or the trailers; the
    client must get exactly the rest, and the job must end exactly at the body's end."""
    pump = make()
    await nursery.start(pump.run)
    rng = random.Random(5)
    for case in range(60):
        body = random_body(rng)
        engine, up = socket.socketpair()
        down, client = socket.socketpair()
        for s in (up, down, client):
            s.setblocking(False)
        start = rng.randint(0, len(body) - 1)
        scanner = ChunkedScanner()
        assert scanner.feed(body[:start]) == start and not scanner.done
        extra = b"HTTP/1.1 200 OK\r\n" if case % 4 == 0 else b""
        rest = body[start:] + extra
        result: list[bool] = []

        async def relay(
            up: socket.socket = up,
            fd: int = down.fileno(),
            sc: ChunkedScanner = scanner,
            out: list[bool] = result,
        ) -> None:
            out.append(await pump.relay(up, fd, sc))

        nursery.start_soon(relay)
        got = b""
        # Bytes past the body must come in the same read as its end to be seen: no cut there.
        tail = len(body) - start
        cuts = sorted(rng.sample(range(1, tail), min(4, tail - 1))) if tail > 1 else []
        for a, b in zip([0, *cuts], [*cuts, len(rest)], strict=True):
            engine.sendall(rest[a:b])
            want = min(b, len(body) - start)
            with trio.fail_after(10):
                while len(got) < want:
                    await trio.lowlevel.wait_readable(client)
                    got += client.recv(65536)

        def returned(out: list[bool] = result) -> bool:
            return bool(out)

        await until(f"case {case}: the relay to return", returned)
        assert got == body[start:], f"case {case}: split at {start}"
        assert result == [not extra], f"case {case}"
        for s in (engine, up, down, client):
            s.close()
    assert pump.stats() == (0, 0)


async def test_a_bad_chunk_size_fails_the_relay(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    engine, up, down, _client = pairs
    pump = make()
    await nursery.start(pump.run)
    engine.send(b"zz\r\ndata\r\n")
    with pytest.raises(Exception, match=r"bad chunk size .*zz"), trio.fail_after(10):
        await pump.relay(up, down.fileno(), ChunkedScanner())
    assert pump.stats() == (0, 0)


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        (b"5\r\nhelloXY", r"chunk data not followed by CRLF"),  # bytes other than CRLF after data
        (b"0x5\r\nhello\r\n", r"bad chunk size"),  # a hex prefix, which int(x, 16) took
        (b"-5\r\nhello\r\n", r"bad chunk size"),  # a negative size, which moved the scan back
        (b"5\nhello\r\n", r"bad chunk size"),  # a bare LF
    ],
)
async def test_malformed_chunks_fail_the_relay_and_reach_no_client(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump], sent: bytes, error: str
) -> None:
    """Both pumps refuse what RFC 9112 does not allow, before a byte of the read that carried it
    goes to the client; the router then ends the client's stream with an error."""
    engine, up, down, client = pairs
    pump = make()
    await nursery.start(pump.run)
    engine.send(sent + b"0\r\n\r\nHTTP/1.1 200 OK\r\n")  # and what looks like another response
    with pytest.raises(Exception, match=error), trio.fail_after(10):
        await pump.relay(up, down.fileno(), ChunkedScanner())
    assert pump.stats() == (0, 0)
    with pytest.raises(BlockingIOError):
        client.recv(100)


async def test_a_withdrawn_relay_hands_its_chunk_state_back(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], make: Callable[[], Pump]
) -> None:
    """A relay cancelled inside a chunk (the engine stalled mid-event) leaves the scanner saying
    so, with either pump: the native one hands its thread's state back on withdrawal, so the
    router does not write an error event into the middle of a chunk."""
    engine, up, down, client = pairs
    pump = make()
    await nursery.start(pump.run)
    scanner = ChunkedScanner()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(pump.relay, up, down.fileno(), scanner)
            engine.send(b"3\r\nabc\r\nc;x=1\r\nhel")
            assert await read_until(client, b"hel") == b"3\r\nabc\r\nc;x=1\r\nhel"
            scope.cancel()
    assert scanner.snapshot() == (1, 9, b"") and not scanner.at_chunk_end
    assert pump.stats() == (0, 0)

    # The relay resumes from the state handed back, as the router's next relay would.
    for sent, state in ((b"lo, world\r\n4\r", (0, 0, b"4\r")), (b"\nabcd\r\n", (0, 0, b""))):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                inner.start_soon(pump.relay, up, down.fileno(), scanner)
                engine.send(sent)
                assert await read_until(client, sent) == sent
                scope.cancel()
        assert scanner.snapshot() == state
    assert scanner.at_chunk_end


def test_asking_for_a_pump_by_name() -> None:
    assert make_pump("python").kind == "python"
    with pytest.raises(ValueError, match="LLMGW_RELAY='fast'"):
        make_pump("fast")
    with pytest.raises(ValueError, match="relay coalescing must be 0 to 100000 us, got -1"):
        make_pump("python", coalesce_us=-1)
    if relay_module.NATIVE_AVAILABLE:
        assert make_pump("native").kind == "native"
        assert make_pump().kind == "native" or os.environ.get("LLMGW_RELAY") == "python"


async def test_many_streams_some_withdrawn_midway(nursery: trio.Nursery, make: Callable[[], Pump]) -> None:
    """Concurrency: 100 streams at once, every third cancelled while its engine is still writing
    (withdrawal racing the pump serving it); the rest arrive whole, and nothing stays registered."""
    pump = make()
    await nursery.start(pump.run)
    socks: list[socket.socket] = []
    outcomes: dict[int, object] = {}
    engines: list[socket.socket] = []
    clients: list[socket.socket] = []
    scopes: list[trio.CancelScope] = []
    body = chunked(40, 200)

    async def one(i: int, up: socket.socket, fd: int, scope: trio.CancelScope) -> None:
        with scope:
            outcomes[i] = await pump.relay(up, fd, ChunkedScanner())
            return
        outcomes[i] = "cancelled"

    for i in range(100):
        engine, up = socket.socketpair()
        down, client = socket.socketpair()
        for s in (up, down, client):
            s.setblocking(False)
        socks += (engine, up, down, client)
        engines.append(engine)
        clients.append(client)
        scopes.append(trio.CancelScope())
        nursery.start_soon(one, i, up, down.fileno(), scopes[i])
    await until("every relay to be registered", lambda: pump.stats()[0] == 100)
    half = len(body) // 2
    for engine in engines:
        engine.sendall(body[:half])
    for i in range(0, 100, 3):
        scopes[i].cancel()
    for engine in engines:
        engine.sendall(body[half:])
    await until("every relay to end", lambda: len(outcomes) == 100)
    for i, client in enumerate(clients):
        if i % 3 == 0:
            assert outcomes[i] == "cancelled"
            continue
        assert outcomes[i] is True
        got = b""
        with trio.fail_after(10):
            while not got.endswith(b"0\r\n\r\n"):
                await trio.lowlevel.wait_readable(client)
                got += client.recv(1 << 16)
        assert got == body, f"stream {i}"
    assert pump.stats() == (0, 0)
    for s in socks:
        s.close()


def test_the_router_refuses_an_unknown_pump_by_name() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "router", "--static", "m=http://127.0.0.1:9", "--port", "0"],
        env={**os.environ, "LLMGW_RELAY": "fast"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "LLMGW_RELAY='fast': expected native, python or auto" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Whole responses (NativeRelayPump.respond): the native thread relays the usual engine head itself


def native_pump() -> relay_module.NativeRelayPump:
    """The native pump, which alone relays heads; failing in CI where it must be built."""
    if not relay_module.NATIVE_AVAILABLE:
        if os.environ.get("LLMGW_REQUIRE_NATIVE_PUMP"):
            pytest.fail("the native relay pump (router/_pump.c) was not built")
        pytest.skip("the native relay pump was not built here (no C compiler)")
    pump = make_pump("native")
    assert isinstance(pump, relay_module.NativeRelayPump)
    return pump


SUFFIX = b"x-llmgw-replica: r0\r\ntransfer-encoding: chunked\r\n\r\n"

# The heads engines send for a streamed completion: uvicorn (vLLM, SGLang, TensorRT-LLM's
# trtllm-serve), cpp-httplib (llama.cpp's server) and h11 (the sim engine).
ENGINE_HEADS = [
    b"HTTP/1.1 200 OK\r\ndate: Thu, 03 Dec 2026 14:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked",
    b"HTTP/1.1 200 OK\r\nAccess-Control-Allow-Origin: \r\nContent-Type: text/event-stream\r\n"
    b"Keep-Alive: timeout=5, max=100\r\nServer: llama.cpp\r\nTransfer-Encoding: chunked",
    b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"x-request-id: abc\r\ntransfer-encoding: chunked",
]


def python_head(block: bytes) -> tuple[bytes, bool] | None:
    """What the router's Python writes for an engine head block, where the pump may take it over:
    a 200 with a chunked body; None where the pump must hand it back."""
    from router.framing import CHUNKED, UpstreamError, parse_response_head
    from router.http1 import status_block
    from router.relay import HOP_BY_HOP

    try:
        parsed = parse_response_head(block + b"\r\n\r\n")
    except UpstreamError:
        return None
    assert parsed is not None
    head, _ = parsed
    if head.status != 200 or head.framing != CHUNKED:
        return None
    engine = [(k, v) for k, v in head.headers if k not in HOP_BY_HOP]
    return status_block(head.status, engine, head.reason) + SUFFIX, head.keep_alive


@pytest.mark.parametrize("block", ENGINE_HEADS)
def test_the_pump_relays_the_engines_usual_heads_as_the_router_would(block: bytes) -> None:
    native_pump()  # skips or fails where it is not built
    from router import _pump

    expected = python_head(block)
    assert expected is not None
    assert _pump.client_head(block, SUFFIX) == expected


def head_variants(rng: random.Random) -> Iterator[bytes]:
    """Engine heads near the usual ones: what the pump must either relay as the router would or
    hand back."""
    pieces = [
        b"connection: close",
        b"Connection: keep-alive",
        b"connection: Keep-Alive, Upgrade",
        b"content-length: 12",
        b"Transfer-Encoding: gzip, chunked",
        b"transfer-encoding: gzip",
        b"  x-indented: 1",
        b"x-empty:",
        b"X-Spaced :  v  ",
        b"x-tab:\tv\t",
        b"no colon here",
        b"x-nul: a\0b",
        b"x-cr: a\rb",
        b"x-lf: a\nb",
        b"Upgrade: h2c",
        b"TE: trailers",
        b"Keep-Alive: timeout=5",
        b"x-colon: a:b",
        b"x-long: " + b"v" * 300,
    ]
    status = [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200",
        b"HTTP/1.1 200 ",
        b"HTTP/1.0 200 OK",
        b"HTTP/1.1 503 Busy",
        b"HTTP/1.1 0200 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 204 No Content",
        b"HTTP/1.1 100 Continue",
        b"HTTP/1.1 200 All Good",
        b"HTTP/2 200",
    ]
    for _ in range(400):
        lines = [rng.choice(status)]
        lines += rng.sample(pieces, rng.randrange(0, 4))
        lines.insert(rng.randrange(1, len(lines) + 1), b"transfer-encoding: chunked")
        yield b"\r\n".join(lines)


def test_the_pump_relays_a_head_only_as_the_router_would_and_hands_back_the_rest() -> None:
    native_pump()
    from router import _pump

    relayed = 0
    for block in head_variants(random.Random(7)):
        got = _pump.client_head(block, SUFFIX)
        if got is not None:
            relayed += 1
            assert got == python_head(block), block
    assert relayed > 50  # the sample keeps plenty of heads the pump takes over


async def test_respond_relays_the_head_and_body_and_says_when_the_head_went_out(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...]
) -> None:
    import time

    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    block = ENGINE_HEADS[0]
    body = chunked(5, 20)
    before = time.monotonic()
    heads: list[float] = []
    for i in range(0, len(block) + 4, 7):  # the head arrives in pieces
        engine.send((block + b"\r\n\r\n")[i : i + 7])
    engine.send(body)
    with trio.fail_after(10):
        answer = await pump.respond(up, down.fileno(), SUFFIX, heads.append)
    expected = python_head(block)
    assert expected is not None
    assert await read_until(client, b"0\r\n\r\n") == expected[0] + body
    assert answer.handed_back is None and answer.reusable is True
    assert len(heads) == 1 and before <= heads[0] <= time.monotonic()
    assert pump.stats() == (0, 0)


@pytest.mark.parametrize(
    ("sent", "reusable"),
    [(b"HTTP/1.1 200 OK\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n", False)],
)
async def test_an_engine_that_closes_after_the_response_is_not_reused(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], sent: bytes, reusable: bool
) -> None:
    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    engine.send(sent + chunked(1, 5))
    with trio.fail_after(10):
        answer = await pump.respond(up, down.fileno(), SUFFIX, lambda _: None)
    assert answer.reusable is reusable
    assert (await read_until(client, b"0\r\n\r\n")).endswith(chunked(1, 5))


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nx-bad: a\rb\r\ntransfer-encoding: chunked\r\n\r\n5\r\n",
    ],
)
async def test_other_heads_are_handed_back_with_what_came_and_nothing_sent(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], head: bytes
) -> None:
    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    engine.send(head)
    heads: list[float] = []
    with trio.fail_after(10):
        answer = await pump.respond(up, down.fileno(), SUFFIX, heads.append)
    assert answer.handed_back == head and heads == []
    with pytest.raises(BlockingIOError):
        client.recv(1)
    assert pump.stats() == (0, 0)


@pytest.mark.parametrize(("sent", "got_bytes"), [(b"", False), (b"HTTP/1.1 200 OK\r\nserver: x", True)])
async def test_an_engine_that_closes_before_its_head_fails_early(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], sent: bytes, got_bytes: bool
) -> None:
    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    engine.send(sent)
    engine.shutdown(socket.SHUT_WR)
    heads: list[float] = []
    with pytest.raises(relay_module.EngineFailedEarly) as failed, trio.fail_after(10):
        await pump.respond(up, down.fileno(), SUFFIX, heads.append)
    assert heads == []
    assert failed.value.errno == 0 and failed.value.got_bytes is got_bytes
    assert "before responding" in str(failed.value) or "mid response head" in str(failed.value)
    with pytest.raises(BlockingIOError):
        client.recv(1)


@pytest.mark.parametrize("head_sent", [False, True], ids=["before-the-head", "mid-body"])
async def test_cancelling_a_response_withdraws_it_and_says_whether_its_head_went_out(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], head_sent: bool
) -> None:
    """The client leaving cancels the response's task: the job is withdrawn, and the router still
    learns when the head went out (for its time-to-first-byte histogram) if it did."""
    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    heads: list[float] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(pump.respond, up, down.fileno(), SUFFIX, heads.append)
            await until("the job to start", lambda: pump.stats() == (1, 0))
            if head_sent:
                engine.send(ENGINE_HEADS[0] + b"\r\n\r\n" + chunked(1, 5)[:-5])  # a head, one event
                await read_until(client, b"data: xxxxx\n\n\r\n")
            else:
                engine.send(b"HTTP/1.1 200 OK\r\n")  # half a head: the job holds it
            scope.cancel()
    assert pump.stats() == (0, 0)
    assert len(heads) == (1 if head_sent else 0)


def read_blocking(sock: socket.socket, end: bytes) -> bytes:
    """Read up to ``end`` without yielding to trio: its loop (and so the pump's collector task)
    stays where it is meanwhile. A blocking read with a timeout bounds the wait."""
    sock.settimeout(10)
    got = b""
    try:
        while not got.endswith(end):
            data = sock.recv(1 << 16)
            assert data, "closed before the end"
            got += data
    finally:
        sock.setblocking(False)
    return got


@pytest.mark.parametrize("whole", [True, False], ids=["respond", "relay"])
async def test_a_job_that_ended_stands_when_its_task_is_cancelled_before_collecting_it(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...], whole: bool
) -> None:
    """A client that reads a response's last byte and hangs up at once: its hang-up cancels the
    response's task after the pump's thread sent the end, before trio collected the job's
    result. The response went out whole and must end as such (the router counts it answered,
    not a client that left); the cancellation is raised at the task's next checkpoint."""
    engine, up, down, client = pairs
    pump = native_pump()
    await nursery.start(pump.run)
    heads: list[float] = []
    answers: list[object] = []
    after = False

    async def respond() -> None:
        nonlocal after
        if whole:
            answers.append(await pump.respond(up, down.fileno(), SUFFIX, heads.append))
        else:
            answers.append(await pump.relay(up, down.fileno(), ChunkedScanner()))
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            after = True
            raise

    body = chunked(3, 5)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(respond)
            await until("the job to start", lambda: pump.stats() == (1, 0))
            engine.send((ENGINE_HEADS[0] + b"\r\n\r\n" if whole else b"") + body)
            assert read_blocking(client, b"0\r\n\r\n").endswith(body)
            assert pump.stats() == (0, 0)  # the job ended in the thread; trio has not run since
            scope.cancel()
    if whole:
        assert answers == [relay_module.Response(None, True)] and len(heads) == 1
    else:
        assert answers == [True]
    assert after, "the cancellation was lost"


class Streams:
    """``n`` relays on one native pump, each a socket pair per side; ``send(i, data)`` writes as
    stream i's engine and waits until its client has read exactly that, and says how long that
    took."""

    def __init__(self, nursery: trio.Nursery, pump: relay_module.NativeRelayPump) -> None:
        self.nursery, self.pump = nursery, pump
        self.socks: list[tuple[socket.socket, socket.socket, socket.socket, socket.socket]] = []

    def start(self, n: int) -> None:
        for _ in range(n):
            engine, up = socket.socketpair()
            down, client = socket.socketpair()
            for s in (engine, up, down, client):
                s.setblocking(False)
            self.socks.append((engine, up, down, client))
            self.nursery.start_soon(self.pump.relay, up, down.fileno(), ChunkedScanner())

    async def send(self, i: int, data: bytes) -> float:
        engine, _, _, client = self.socks[i]
        started = trio.current_time()
        engine.send(data)
        assert await read_until(client, data) == data
        return trio.current_time() - started

    async def close(self) -> None:
        """End every body, wait for the jobs to end, close the sockets."""
        for engine, *_ in self.socks:
            engine.send(b"0\r\n\r\n")
        await until("the jobs to end", lambda: self.pump.stats() == (0, 0))
        for socks in self.socks:
            for s in socks:
                s.close()


EVENT = chunked(1, 10)[:-5]  # one event, not the body's end


async def test_a_busy_pump_pauses_and_an_idle_one_does_not(nursery: trio.Nursery) -> None:
    """The coalescing pause: after a wake-up that served one event following a long wait (more
    than four pauses), the pump is idle and does not pause; an event that comes sooner finds it
    busy, and a pause follows. Nine streams: the pause is the whole 20 ms."""
    native_pump()  # skips or fails where it is not built
    pump = relay_module.NativeRelayPump(coalesce_us=20_000)
    await nursery.start(pump.run)
    streams = Streams(nursery, pump)
    streams.start(9)
    await until("the jobs to start", lambda: pump.stats() == (9, 0))
    for n in range(1, 4):
        await trio.sleep(0.2)  # pacing, not a wait for an event: the engine is quiet for ten pauses
        await streams.send(0, EVENT)
        await until(f"wake-up {n} to be counted", lambda n=n: pump.counters()[0] >= n)
    wakeups, pauses, reads = pump.counters()
    assert (pauses, reads) == (0, 3), (wakeups, pauses, reads)

    # Two events in quick succession: each comes well within four pauses (80 ms) of the last.
    await streams.send(0, EVENT)
    await streams.send(0, EVENT)
    await until("a pause", lambda: pump.counters()[1] >= 1)
    assert pump.counters()[2] == 5
    await streams.close()


async def test_a_lone_stream_is_never_paused(nursery: trio.Nursery) -> None:
    """With one stream there is no other stream's event to wait for: the pause is zero, however
    quickly its events come (the pause grows with the streams, to the whole setting at nine)."""
    native_pump()
    pump = relay_module.NativeRelayPump(coalesce_us=20_000)
    await nursery.start(pump.run)
    streams = Streams(nursery, pump)
    streams.start(1)
    await until("the job to start", lambda: pump.stats() == (1, 0))
    for _ in range(20):
        await streams.send(0, EVENT)
    assert pump.counters()[1:] == (0, 20)
    await streams.close()


async def test_a_responses_first_event_cuts_a_pause_short(nursery: trio.Nursery) -> None:
    """A stream's first event is relayed at once even while the pump pauses for the others (the
    pause is the whole 100 ms here); a later event of a stream that has begun waits the pause
    out. The client's time to first byte does not pay for coalescing."""
    native_pump()
    pump = relay_module.NativeRelayPump(coalesce_us=100_000)
    await nursery.start(pump.run)
    streams = Streams(nursery, pump)
    streams.start(9)
    await until("the jobs to start", lambda: pump.stats() == (9, 0))
    for i in range(9):  # each stream's first event: none of them waits for a pause
        assert await streams.send(i, EVENT) < 0.05
    await trio.sleep(0.5)  # pacing: the pump goes idle (five pauses), not a wait for an event
    streams.start(1)  # stream 9: fresh
    await until("the new job to start", lambda: pump.stats() == (10, 0))
    pauses = pump.counters()[1]
    await streams.send(0, EVENT)
    await streams.send(0, EVENT)  # soon after the last: a pause of 100 ms follows this one
    await until("a pause", lambda: pump.counters()[1] > pauses)
    first = await streams.send(9, EVENT)
    assert first < 0.05, f"stream 9's first event took {first * 1000:.0f} ms"
    # A begun stream's event during a pause waits for its end: coalescing still happens.
    await streams.send(0, EVENT)
    await streams.send(0, EVENT)
    await until("a pause", lambda: pump.counters()[1] > pauses + 1)
    later = await streams.send(1, EVENT)
    assert later > 0.02, f"stream 1's event came in {later * 1000:.0f} ms, during a pause"
    await streams.close()


async def test_the_relay_counters_reach_metrics(nursery: trio.Nursery, relay_kind: str) -> None:
    from router.config import RouterConfig
    from router.server import Router

    router = Router(dict, RouterConfig())
    await nursery.start(router.pump.run)
    data, _ = await router.metrics.scrape(router.ejection, router.pool, router.pump, 0.0)
    text = data.decode()
    for name in ("wakeups", "pauses", "reads"):
        assert f"# TYPE llmgw_router_relay_{name}_total counter" in text
        assert f"llmgw_router_relay_{name}_total 0.0" in text


@pytest.mark.parametrize(
    "bad",
    [b"5\r\nhelloXY", b"-5\r\nhello\r\n", b"0x5\r\nhello\r\n", b"5\nhello\r\n"],
    ids=["no-crlf", "negative", "hex-prefix", "bare-lf"],
)
@pytest.mark.parametrize("with_head", [False, True], ids=["later", "with-head"])
async def test_a_malformed_engine_body_ends_the_clients_stream_with_an_error(
    nursery: trio.Nursery, relay_kind: str, bad: bytes, with_head: bool
) -> None:
    """Through a real router, either pump: an engine whose body breaks chunked framing ends the
    client's stream broken (closed with no last chunk) after its first event, or gets the client
    a 502 when it came with the head; never the rest of the bytes, however much like a next
    response they look, and never a hang."""
    from router.config import RouterConfig
    from router.routes import ModelRoutes, Upstream
    from router.server import Router

    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    first = b"10\r\ndata: one\n\n12345\r\n"
    after = b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfalse"

    async def engine(stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += await stream.receive_some(65536)
        if with_head:
            await stream.send_all(head + bad + after)
        else:
            await stream.send_all(head + first)
            await trio.sleep(0.05)  # pacing: the first event goes out on its own, then the bad one
            await stream.send_all(bad + after)
        await trio.sleep_forever()  # the router must not wait for the engine to close

    listeners = await nursery.start(functools.partial(trio.serve_tcp, engine, 0, host="127.0.0.1"))
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    router = Router(lambda: {"m": ModelRoutes((Upstream("r0", url),))}, RouterConfig())
    port = await nursery.start(router.serve, "127.0.0.1", 0)
    body = b'{"model": "m", "prompt": "x", "stream": true}'
    request = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    request += b"content-length: %d\r\n\r\n%s" % (len(body), body)
    client = trio.socket.socket()
    with client:
        await client.connect(("127.0.0.1", port))
        await client.send(request)
        got = b""
        with trio.fail_after(10):  # to the end of the connection, or of a response it keeps
            while data := await client.recv(65536):
                got += data
                head_end = got.find(b"\r\n\r\n") + 4
                parsed = re.search(rb"content-length: (\d+)", got[:head_end])
                if head_end > 3 and parsed and len(got) >= head_end + int(parsed[1]):
                    break
    assert got.count(b"HTTP/1.1") == 1 and b"false" not in got, got
    if with_head:  # nothing had gone out: the router answers for the engine
        assert got.startswith(b"HTTP/1.1 502 ") and b"malformed" in got, got
    else:  # the stream had begun: it breaks off, with no last chunk
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(first), got
