"""Our client against our server over every carrier, and against grpcio's server."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import trio

import schema
from tests.wirepeers import ack, heartbeat, register
from transport import CallOptions, Code, GoAwayReceived, RpcError, StreamServer, open_stream
from transport.client import RpcClientStream, connect

CARRIERS = [("http", "grpc"), ("http", "connect"), ("ws", "grpc")]


@pytest.mark.parametrize(("scheme", "protocol"), CARRIERS)
async def test_round_trips_and_statuses(
    echo_server: tuple[StreamServer, int], scheme: str, protocol: str
) -> None:
    _, port = echo_server
    opts = CallOptions(protocol=protocol)  # type: ignore[arg-type]
    async with open_stream(f"{scheme}://127.0.0.1:{port}", opts) as stream:
        for i in range(100):
            await stream.send(heartbeat(i))
            reply = await stream.receive()
            assert reply is not None and reply.ack is not None and reply.ack.message_id == i
        await stream.send(register("big", cpu_count=1 << 20))
        reply = await stream.receive()
        assert reply is not None and len(reply.ack.error) == 1 << 20
        await stream.close_send()
        assert await stream.receive() is None

    text = "refusé ✓ 100% — gpu07"
    async with open_stream(f"{scheme}://127.0.0.1:{port}", opts) as stream:
        await stream.send(register("refuse", hostname=text))
        with pytest.raises(RpcError) as info:
            await stream.receive()
    assert info.value.code is Code.PERMISSION_DENIED
    assert info.value.message == text


@pytest.mark.parametrize(("scheme", "protocol"), CARRIERS)
async def test_pipelined_and_pushed(
    echo_server: tuple[StreamServer, int], scheme: str, protocol: str
) -> None:
    _, port = echo_server
    opts = CallOptions(protocol=protocol)  # type: ignore[arg-type]
    async with open_stream(f"{scheme}://127.0.0.1:{port}", opts) as stream:
        got: list[int] = []

        async def reader() -> None:
            while len(got) < 1000 + 300:
                msg = await stream.receive()
                assert msg is not None
                got.append(msg.ack.message_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await stream.send(register("push", cpu_count=300, message_id=0))
            for i in range(1000):
                await stream.send(heartbeat(10_000 + i))
        assert got[:300] == list(range(300)) or sorted(got) == sorted([*range(300), *range(10_000, 11_000)])
        assert [g for g in got if g >= 10_000] == list(range(10_000, 11_000))


@pytest.mark.parametrize(("scheme", "protocol"), CARRIERS)
async def test_the_first_message_has_the_tighter_cap_and_the_next_the_stream_limit(
    echo_server: tuple[StreamServer, int], scheme: str, protocol: str
) -> None:
    """On every carrier the first message (the Register) is refused over 1 MiB from its envelope
    header, with the same status, while a 3 MB message right behind a small first one (sent without
    waiting: the WebSocket route widens its cap as the first message completes, before the next is
    read) is taken under the stream's 4 MiB."""
    _, port = echo_server
    opts = CallOptions(protocol=protocol)  # type: ignore[arg-type]
    big = register("echo", hostname="h" * 3_000_000, message_id=2)
    async with open_stream(f"{scheme}://127.0.0.1:{port}", opts) as stream:
        await stream.send(heartbeat(1))
        await stream.send(big)
        replies = [await stream.receive(), await stream.receive()]
        assert [r.ack.message_id for r in replies if r is not None and r.ack is not None] == [1, 2]

    with trio.fail_after(10):
        async with open_stream(f"{scheme}://127.0.0.1:{port}", opts) as stream:
            with pytest.raises(RpcError) as info:
                await stream.send(big)
                await stream.receive()
    assert info.value.code is Code.RESOURCE_EXHAUSTED
    assert "exceeds the limit of 1048576 bytes" in info.value.message


async def test_one_connection_carries_several_calls(echo_server: tuple[StreamServer, int]) -> None:
    """Dial once, open calls on the connection (as httpcore's connection carries its requests):
    three interleaved calls, each answered on its own stream, over one connection to the server."""
    server, port = echo_server
    async with connect("127.0.0.1", port) as connection:
        calls = [connection.open_call(schema.CONNECT_PATH, stream=RpcClientStream) for _ in range(3)]
        for i, call in enumerate(calls):
            await call.send_message(bytes(heartbeat(100 + i)))
        for i, call in reversed(list(enumerate(calls))):
            env = await call.receive_envelope()
            assert env is not None
            assert schema.ControlMessage.parse(env.payload).ack.message_id == 100 + i
        assert len(server._transports) == 1 and server.active_streams == 3
        assert len({call.stream_id for call in calls}) == 3


async def test_oversized_outgoing_message_is_refused_before_sending(
    echo_server: tuple[StreamServer, int],
) -> None:
    _, port = echo_server
    async with open_stream(f"http://127.0.0.1:{port}", CallOptions(max_message_size=1024)) as stream:
        from schema.envelope import MessageTooLarge

        with pytest.raises(MessageTooLarge, match="outgoing message of"):
            await stream.send(register("x", hostname="h" * 2000))
        await stream.send(heartbeat(1))
        reply = await stream.receive()
        assert reply is not None and reply.ack.message_id == 1


class _GrpcioControlPlane:
    """A grpcio server playing the control plane: echoes acks, pushes on demand, refuses on demand."""

    def connect(
        self, requests: Iterator[schema.AgentMessage], context: grpc.ServicerContext
    ) -> Iterator[schema.ControlMessage]:
        for msg in requests:
            if msg.register is not None and msg.register.node_id == "refuse":
                context.abort(grpc.StatusCode.PERMISSION_DENIED, msg.register.hostname)
            if msg.register is not None and msg.register.node_id == "push":
                for i in range(msg.register.cpu_count):
                    yield ack(i)
                continue
            if msg.register is not None and msg.register.node_id == "big":
                yield ack(msg.message_id, "x" * msg.register.cpu_count)
                continue
            yield ack(msg.message_id)


def _grpcio_server() -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.method_handlers_generic_handler(
        schema.SERVICE,
        {
            schema.METHOD: grpc.stream_stream_rpc_method_handler(
                _GrpcioControlPlane().connect,
                request_deserializer=schema.AgentMessage.parse,
                response_serializer=bytes,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture
def grpcio_server() -> Iterator[int]:
    server, port = _grpcio_server()
    yield port
    server.stop(grace=None)


async def test_against_grpcio_server(grpcio_server: int) -> None:
    url = f"http://127.0.0.1:{grpcio_server}"
    async with open_stream(url) as stream:
        for i in range(1000):  # lock-step
            await stream.send(heartbeat(i))
            reply = await stream.receive()
            assert reply is not None and reply.ack.message_id == i
        for i in range(1000):  # pipelined
            await stream.send(heartbeat(5000 + i))
        for i in range(1000):
            reply = await stream.receive()
            assert reply is not None and reply.ack.message_id == 5000 + i
        await stream.send(register("big", cpu_count=1 << 20))
        reply = await stream.receive()
        assert reply is not None and len(reply.ack.error) == 1 << 20
        # Server-initiated messages while we keep the request side open.
        await stream.send(register("push", cpu_count=50))
        pushed = [(await stream.receive()) for _ in range(50)]
        assert [p.ack.message_id for p in pushed if p is not None] == list(range(50))
        await stream.close_send()
        assert await stream.receive() is None

    text = "Register refusé: ✓ 100%"
    async with open_stream(url) as stream:
        await stream.send(register("refuse", hostname=text))
        with pytest.raises(RpcError) as info:
            await stream.receive()
    assert info.value.code is Code.PERMISSION_DENIED and info.value.message == text


async def test_grpcio_server_stopping_with_grace_is_a_graceful_goaway() -> None:
    """grpcio's ``Server.stop(grace)`` is another server's graceful shutdown: a GOAWAY with a PING
    right behind it, a second GOAWAY later. Our client surfaces the first as GoAwayReceived(NO_ERROR)
    and leaves; before, h2 rejected the frames after it as a protocol error."""
    server, port = _grpcio_server()
    try:
        async with open_stream(f"http://127.0.0.1:{port}") as stream:
            await stream.send(heartbeat(1))
            reply = await stream.receive()
            assert reply is not None and reply.ack is not None and reply.ack.message_id == 1
            stopped = server.stop(grace=10)
            with trio.fail_after(5), pytest.raises(GoAwayReceived) as info:
                await stream.receive()
        assert info.value.graceful
        # Our client left at the GOAWAY, so grpcio's stop ends long before its 10 s grace.
        assert await trio.to_thread.run_sync(stopped.wait, 5)
    finally:
        server.stop(grace=None)
