"""The relay pump on socket pairs: the ends of a body, back-pressure, and withdrawal.

An engine side and a client side are each a ``socket.socketpair``; the test plays both peers.
"""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from control.relay import ClientGone, EngineClosed, RelayPump
from control.router import ChunkedScanner


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
def pairs() -> tuple[socket.socket, socket.socket, socket.socket, socket.socket]:
    engine, up = socket.socketpair()  # the test writes as the engine; the pump reads ``up``
    client_fd_side, client = socket.socketpair()  # the pump writes ``client_fd_side``
    for s in (engine, up, client_fd_side, client):
        s.setblocking(False)
    return engine, up, client_fd_side, client


async def test_a_body_larger_than_the_buffers_arrives_whole_and_the_job_ends(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...]
) -> None:
    engine, up, down, client = pairs
    pump = RelayPump()
    await nursery.start(pump.run)
    body = chunked(2000, 500)  # about 1 MB: the client socket fills, the rest waits for it
    result: list[bool] = []

    async def relay() -> None:
        result.append(await pump.relay(up, down.fileno(), ChunkedScanner()))

    nursery.start_soon(relay)
    engine.setblocking(True)
    nursery.start_soon(trio.to_thread.run_sync, engine.sendall, body)
    with trio.fail_after(10):
        while True:
            if pump.stats() == (1, 1):  # waiting for the client, not reading the engine
                break
            await trio.sleep(0.01)  # poll interval; the deadline above bounds the wait
        # Small reads: the pump's writes, the last one included, keep finding the socket nearly
        # full, so the body ends while draining what the client's socket did not take.
        assert await read_until(client, b"0\r\n\r\n", 4096) == body
    await trio.testing.wait_all_tasks_blocked()
    assert result == [True] and pump.stats() == (0, 0)


async def test_bytes_past_the_body_make_the_connection_unreusable(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...]
) -> None:
    engine, up, down, client = pairs
    pump = RelayPump()
    await nursery.start(pump.run)
    body = chunked(3, 10)
    engine.send(body + b"HTTP/1.1 200 OK\r\n")
    assert await pump.relay(up, down.fileno(), ChunkedScanner()) is False
    assert await read_until(client, b"0\r\n\r\n") == body


async def test_engine_close_and_client_close_fail_the_relay(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...]
) -> None:
    engine, up, down, client = pairs
    pump = RelayPump()
    await nursery.start(pump.run)
    engine.send(chunked(1, 10)[:-5])  # one event, then the engine goes away
    engine.close()
    with pytest.raises(EngineClosed, match="closed the connection mid-response"):
        await pump.relay(up, down.fileno(), ChunkedScanner())

    engine2, up2 = socket.socketpair()
    up2.setblocking(False)
    client.close()
    engine2.send(chunked(1, 10)[:-5])
    with pytest.raises(ClientGone):
        await pump.relay(up2, down.fileno(), ChunkedScanner())
    assert pump.stats() == (0, 0)
    engine2.close()
    up2.close()


async def test_cancelling_a_relay_withdraws_it(
    nursery: trio.Nursery, pairs: tuple[socket.socket, ...]
) -> None:
    engine, up, down, _client = pairs
    pump = RelayPump()
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


async def test_a_stopping_pump_fails_parked_relays() -> None:
    from control.relay import RelayClosed

    engine, up = socket.socketpair()
    down, client = socket.socketpair()
    up.setblocking(False)
    pump = RelayPump()
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
