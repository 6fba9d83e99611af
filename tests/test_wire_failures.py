"""Connection failures end the stream with a typed error, within a bound."""

from __future__ import annotations

import functools

import h2.config
import h2.connection
import h2.events
import pytest
import trio
from h2.errors import ErrorCodes

from agent.transport import (
    Code,
    GoAwayReceived,
    PeerUnresponsive,
    RpcError,
    StreamOptions,
    StreamReset,
    TransportError,
    open_stream,
)
from control.transport import StreamServer
from tests.wirepeers import echo_handler, heartbeat


class BlackHoleProxy:
    """A TCP relay that can be told to swallow everything, like a path whose packets vanish."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.black_hole = False

    async def _pump(self, src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
        while data := await src.receive_some(65536):
            if not self.black_hole:
                await dst.send_all(data)

    async def _handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
        async with upstream, client, trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, client, upstream)
            nursery.start_soon(self._pump, upstream, client)


@pytest.mark.chaos
async def test_black_holed_connection_is_detected_by_ping(
    echo_server: tuple[StreamServer, int], nursery: trio.Nursery
) -> None:
    _, port = echo_server
    proxy = BlackHoleProxy(port)
    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"), proxy._handle, 0)
    proxy_port = listeners[0].socket.getsockname()[1]
    opts = StreamOptions(keepalive_interval=0.2, keepalive_timeout=0.5)
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
            with pytest.raises((GoAwayReceived, RpcError)) as info:
                await stream.receive()
    err = info.value
    assert isinstance(err, GoAwayReceived) or (isinstance(err, RpcError) and err.code is Code.UNAVAILABLE)
    assert server.active_streams == 0
    # New connections are refused once the listener is closed.
    with pytest.raises(TransportError):
        async with open_stream(f"http://127.0.0.1:{port}", StreamOptions(connect_timeout=2)) as stream:
            await stream.send(heartbeat(2))
            await stream.receive()
