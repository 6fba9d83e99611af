"""grpcio (an HTTP/2 stack nobody here wrote) as the client of our stream server."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
import trio

import schema
from tests.wirepeers import heartbeat, register
from transport import StreamServer


def _call(port: int) -> grpc.StreamStreamMultiCallable:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel.stream_stream(
        schema.CONNECT_PATH,
        request_serializer=bytes,
        response_deserializer=schema.ControlMessage.parse,
    )


def _run(
    port: int, requests: Iterator[schema.AgentMessage], timeout: float = 20
) -> list[schema.ControlMessage]:
    return list(_call(port)(requests, timeout=timeout))


async def test_lockstep_1000_messages(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server

    def lockstep() -> list[int]:
        outbox: queue.Queue[schema.AgentMessage | None] = queue.Queue()
        answers = _call(port)(iter(outbox.get, None), timeout=60)
        seen = []
        for i in range(1000):
            outbox.put(heartbeat(i))
            seen.append(next(answers).ack.message_id)
        outbox.put(None)
        assert list(answers) == []
        return seen

    assert await trio.to_thread.run_sync(lockstep) == list(range(1000))


async def test_pipelined_1000_messages(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server
    replies = await trio.to_thread.run_sync(_run, port, iter([heartbeat(i) for i in range(1000)]))
    assert [r.ack.message_id for r in replies] == list(range(1000))


async def test_one_mebibyte_message_both_ways(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server
    # A stream's first message is bounded at 1 MiB (it comes before the peer is believed), so the
    # mebibyte travels second; the server's answer to it is a mebibyte too.
    first = register("small", message_id=1)
    big = register("big", hostname="h" * (1 << 20), cpu_count=1 << 20, message_id=2)
    replies = await trio.to_thread.run_sync(_run, port, iter([first, big]))
    assert len(replies) == 2 and len(replies[1].ack.error) == 1 << 20


async def test_error_status_with_unicode_message(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server
    text = "gpu07: Register refusé: certificate names gpu08 ✓ 100%"
    with pytest.raises(grpc.RpcError) as info:
        await trio.to_thread.run_sync(_run, port, iter([register("refuse", hostname=text)]))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == text


async def test_server_messages_while_client_still_sending(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server

    def interleaved() -> tuple[int, int]:
        outbox: queue.Queue[schema.AgentMessage | None] = queue.Queue()
        answers = _call(port)(iter(outbox.get, None), timeout=30)
        outbox.put(register("push", cpu_count=200, message_id=1))
        # The client has not half-closed; the server pushes 200 messages on its own initiative.
        pushed = [next(answers).ack.message_id for _ in range(200)]
        outbox.put(heartbeat(5000))
        after = next(answers).ack.message_id
        outbox.put(None)
        return pushed[-1], after

    assert await trio.to_thread.run_sync(interleaved) == (199, 5000)


async def test_unknown_method_is_unimplemented(echo_server: tuple[StreamServer, int]) -> None:
    _, port = echo_server

    def call() -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        fn = channel.stream_stream("/llmgw.v1.AgentService/Nope", request_serializer=bytes)
        list(fn(iter([heartbeat(1)]), timeout=10))

    with pytest.raises(grpc.RpcError) as info:
        await trio.to_thread.run_sync(call)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert schema.CONNECT_PATH in (info.value.details() or "")


async def test_server_ends_while_client_keeps_sending(echo_server: tuple[StreamServer, int]) -> None:
    """hypercorn#329's trigger: the response ends while the request is still streaming."""
    _server, port = echo_server
    stop = threading.Event()

    def endless() -> Iterator[schema.AgentMessage]:
        yield register("end")
        i = 0
        while not stop.is_set() and i < 100_000:
            i += 1
            yield heartbeat(i)

    try:
        replies = await trio.to_thread.run_sync(_run, port, endless())
    finally:
        stop.set()
    assert replies == []
    # The server still serves new streams afterwards.
    again = await trio.to_thread.run_sync(_run, port, iter([heartbeat(7)]))
    assert [r.ack.message_id for r in again] == [7]
