"""Connection failures end the stream with a typed error, within a bound."""

from __future__ import annotations

import functools
import queue

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.testing
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, PingFrame, WindowUpdateFrame

import schema
from schema import envelope
from tests.rawh2 import split_frames
from tests.support import BlackHoleProxy
from tests.wirepeers import echo_handler, heartbeat
from transport import (
    CallOptions,
    GoAwayReceived,
    PeerUnresponsive,
    ServerLimits,
    StreamReset,
    StreamServer,
    TransportError,
    open_stream,
)
from transport.h2io import H2Transport


@pytest.mark.chaos
async def test_black_holed_connection_is_detected_by_ping(
    echo_server: tuple[StreamServer, int], nursery: trio.Nursery
) -> None:
    _, port = echo_server
    proxy = BlackHoleProxy(port)
    proxy_port = await nursery.start(proxy.serve)
    opts = CallOptions(keepalive_interval=0.2, keepalive_timeout=0.5)
    async with open_stream(f"http://127.0.0.1:{proxy_port}", opts) as stream:
        await stream.send(heartbeat(1))
        assert (await stream.receive()) is not None
        proxy.black_hole = True
        # Bounded: TCP alone would wait minutes; the PING fails within interval + timeout (0.7 s).
        with trio.fail_after(5), pytest.raises(PeerUnresponsive, match=r"PING within 0\.5 s"):
            await stream.receive()


async def _raw_server(misbehave: str, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """An h2 server that answers the stream's headers, then sends GOAWAY or RST_STREAM."""

    async def handle(sock: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        await sock.send_all(conn.data_to_send())
        while data := await sock.receive_some(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    sid = ev.stream_id
                    conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    if misbehave == "reset":
                        conn.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
                    else:
                        conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too_many_pings")
            await sock.send_all(conn.data_to_send())

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_stream_reset_is_a_typed_error(nursery: trio.Nursery) -> None:
    port = await nursery.start(_raw_server, "reset")
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        with trio.fail_after(5), pytest.raises(StreamReset, match="REFUSED_STREAM"):
            await stream.receive()


async def test_goaway_is_a_typed_error(nursery: trio.Nursery) -> None:
    port = await nursery.start(_raw_server, "goaway")
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        with (
            trio.fail_after(5),
            pytest.raises(GoAwayReceived, match=r"ENHANCE_YOUR_CALM.*too_many_pings") as info,
        ):
            await stream.receive()
    assert info.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM


async def test_graceful_shutdown_sends_goaway_then_ends_streams(nursery: trio.Nursery) -> None:
    server = StreamServer(echo_handler)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        await stream.send(heartbeat(1))
        assert (await stream.receive()) is not None
        with trio.fail_after(5):
            await server.shutdown(grace=0.2)
            with pytest.raises(GoAwayReceived) as info:
                await stream.receive()
    assert info.value.graceful and "server shutting down" in str(info.value)
    assert server.active_streams == 0
    # New connections are refused once the listener is closed.
    with pytest.raises(TransportError):
        async with open_stream(f"http://127.0.0.1:{port}", CallOptions(connect_timeout=2)) as stream:
            await stream.send(heartbeat(2))
            await stream.receive()


async def _goaway_then_frames_server(
    client_frames: list[Frame],
    done: trio.Event,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answers the stream's headers, then writes GOAWAY(NO_ERROR) with more frames right behind it
    in the same write (RFC 9113 6.8 allows them); records every frame the client sends after."""

    async def handle(sock: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        await sock.send_all(conn.data_to_send())
        answered = acked = False
        while not (answered and acked):
            data = await sock.receive_some(65536)
            assert data, "the client left before the GOAWAY"
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    conn.send_headers(
                        ev.stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")]
                    )
                    answered = True
                elif isinstance(ev, h2.events.SettingsAcknowledged):
                    acked = True
            await sock.send_all(conn.data_to_send())
        goaway = GoAwayFrame(0)
        goaway.last_stream_id = 1
        goaway.additional_data = b"server shutting down"
        conn_window, stream_window = WindowUpdateFrame(0), WindowUpdateFrame(1)
        conn_window.window_increment = stream_window.window_increment = 4096
        ping = PingFrame(0)
        ping.opaque_data = b"12345678"
        message = DataFrame(1)
        message.data = envelope.encode(bytes(heartbeat(9)))
        await sock.send_all(
            b"".join(bytes(f.serialize()) for f in (goaway, conn_window, stream_window, ping, message))
        )
        after = b""
        with trio.move_on_after(5):
            while chunk := await sock.receive_some(65536):
                after += chunk
        client_frames.extend(split_frames(after))
        done.set()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_goaway_with_frames_behind_it_is_a_graceful_close(nursery: trio.Nursery) -> None:
    """A control plane shutting down: today h2 rejected the frames after the GOAWAY, the GOAWAY was
    lost with them, and the agent logged "HTTP/2 protocol error ... in state CLOSED"."""
    client_frames: list[Frame] = []
    done = trio.Event()
    port = await nursery.start(_goaway_then_frames_server, client_frames, done)
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        with trio.fail_after(5), pytest.raises(GoAwayReceived) as info:
            await stream.receive()
    assert info.value.graceful
    assert str(info.value) == "peer sent GOAWAY (NO_ERROR, last stream 1): 'server shutting down'"
    with trio.fail_after(10):
        await done.wait()
    # Our answer is one GOAWAY(NO_ERROR) and nothing else: no WINDOW_UPDATE, no PING ACK, no reset.
    assert [type(f).__name__ for f in client_frames] == ["GoAwayFrame"]
    assert isinstance(client_frames[0], GoAwayFrame)
    assert client_frames[0].error_code == ErrorCodes.NO_ERROR


async def test_cancelled_server_says_goaway_and_ends_streams_with_unavailable(nursery: trio.Nursery) -> None:
    """Cancelling serve() (what SIGTERM does to a control plane) is a graceful shutdown: our client
    leaves at the GOAWAY, and grpcio, which keeps its stream after a GOAWAY, gets UNAVAILABLE."""
    server = StreamServer(echo_handler, limits=ServerLimits(shutdown_grace=0.5))
    grpc_ready, grpc_done = trio.Event(), trio.Event()
    grpc_error: list[grpc.RpcError] = []

    def grpc_peer(port: int) -> None:
        outbox: queue.Queue[schema.AgentMessage | None] = queue.Queue()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.stream_stream(
            schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse
        )
        answers = call(iter(outbox.get, None), timeout=30)
        try:
            outbox.put(heartbeat(1))
            next(answers)
            trio.from_thread.run_sync(grpc_ready.set)
            for _ in answers:
                pass
        except grpc.RpcError as exc:
            grpc_error.append(exc)
        finally:
            outbox.put(None)
            channel.close()
            trio.from_thread.run_sync(grpc_done.set)

    server_scope = trio.CancelScope()

    async def run_server(task_status: trio.TaskStatus[int]) -> None:
        with server_scope:
            await server.serve("127.0.0.1", 0, task_status=task_status)

    port = await nursery.start(run_server)
    nursery.start_soon(functools.partial(trio.to_thread.run_sync, grpc_peer, port, abandon_on_cancel=True))
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        await stream.send(heartbeat(2))
        assert (await stream.receive()) is not None
        with trio.fail_after(10):
            await grpc_ready.wait()
        server_scope.cancel()
        with trio.fail_after(5), pytest.raises(GoAwayReceived) as info:
            await stream.receive()
    assert info.value.graceful
    with trio.fail_after(10):
        await grpc_done.wait()
    assert [e.code() for e in grpc_error] == [grpc.StatusCode.UNAVAILABLE]
    assert grpc_error[0].details() == "server shutting down"
    assert server.active_streams == 0


class _GatedStream(trio.abc.Stream):
    """A connection whose writes wait for the test to let them through."""

    def __init__(self) -> None:
        self.sent = b""
        self.entered = trio.Event()
        self.release = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.entered.set()
        await self.release.wait()
        self.sent += bytes(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("not reached")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_bytes_taken_from_h2_leave_even_when_the_flushing_task_is_cancelled() -> None:
    """A handler cancelled while it flushes (its stream just reset by the peer) must not drop what
    h2 had queued for the whole connection: a lost WINDOW_UPDATE starved the connection, and the
    next call on it (grpcio reuses connections) hung until its deadline."""
    stream = _GatedStream()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.data_to_send()  # the preface: not what this is about
    transport = H2Transport(stream, conn)
    conn.ping(b"12345678")  # what another stream's task queued, waiting for the next flush
    scope = trio.CancelScope()

    async def flusher() -> None:
        with scope:
            await transport.flush()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flusher)
            await stream.entered.wait()
            scope.cancel()  # while the bytes are on their way
            stream.release.set()
    assert stream.sent == bytes(PingFrame(0, opaque_data=b"12345678").serialize())
    assert transport.error is None
