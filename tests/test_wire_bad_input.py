"""Bad input: each is answered with a clear error while the server keeps serving other streams."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

import schema
from schema import envelope
from tests.rawh2 import RawPeer, raw_call
from tests.rawws import binary_frame_head, read_until_closed, ws_connect, ws_frames
from tests.wirepeers import heartbeat, nursery_handler, register
from transport import CallOptions, Code, RpcError, StreamServer, open_stream


@pytest.fixture
async def bystander(echo_server: tuple[StreamServer, int]) -> AsyncIterator[tuple[int, object]]:
    """A healthy agent stream that stays open across every bad peer, and must keep working."""
    _, port = echo_server
    async with open_stream(f"http://127.0.0.1:{port}") as stream:
        yield port, stream
        await stream.send(heartbeat(424242))
        reply = await stream.receive()
        assert reply is not None and reply.ack is not None and reply.ack.message_id == 424242


async def test_garbage_bytes_get_a_goaway_that_says_why(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    with trio.fail_after(10):
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        await sock.send_all(b"\x16\x03\x01 definitely not http/2 at all, just noise......")
        received = b""
        while chunk := await sock.receive_some(65536):
            received += chunk
    # A GOAWAY frame (type 0x7) whose debug data names what was expected.
    assert b"\x07" in received
    assert b"expected the HTTP/2 connection preface" in received


async def test_truncated_envelope(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    res = await raw_call(port, envelope.encode(bytes(heartbeat(1)))[:-3])
    assert res.grpc_status == str(int(Code.INTERNAL))
    assert "stream ended inside an envelope" in res.grpc_message


async def test_oversized_length_is_refused_from_the_header(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    res = await raw_call(port, envelope.HEADER.pack(0, 3 * 1024**3), end_stream=False)
    assert res.grpc_status == str(int(Code.RESOURCE_EXHAUSTED))
    # A stream's first message (the Register) is bounded tighter than the rest: 1 MiB, not 4.
    assert "exceeds the limit of 1048576 bytes" in res.grpc_message
    # Later messages are bounded by the stream's limit: after a small first message, 4 MiB.
    ok = envelope.encode(b"")
    res = await raw_call(port, ok + envelope.HEADER.pack(0, 5 * 1024**2), end_stream=False)
    assert "exceeds the limit of 4194304 bytes" in res.grpc_message


async def test_malformed_protobuf(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    # Field 10 (register) announces 16 bytes and carries 3.
    res = await raw_call(port, envelope.encode(b"\x52\x10abc"))
    assert res.grpc_status == str(int(Code.INTERNAL))
    assert "malformed AgentMessage (5 bytes)" in res.grpc_message


async def test_wrong_content_type(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    res = await raw_call(port, b"{}", content_type="application/json")
    assert res.status == "415"
    assert b"unsupported content-type 'application/json'" in res.body


async def test_wrong_content_type_through_our_client_is_a_typed_error(
    echo_server: tuple[StreamServer, int],
) -> None:
    # A plain HTTP/2 web server answers 404 to our path: the client maps it per the gRPC spec.
    _, port = echo_server
    res = await raw_call(port, envelope.encode(b""), path="/elsewhere")
    assert res.grpc_status == str(int(Code.UNIMPLEMENTED))
    assert "/llmgw.v1.AgentService/Connect" in res.grpc_message


async def test_http1_request_on_the_h2_port(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    async with httpx.AsyncClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}/llmgw.v1.AgentService/Connect", content=b"x")
    assert resp.status_code == 426
    assert "this port speaks HTTP/2" in resp.text


async def test_peer_that_stalls_mid_message(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    # Five bytes of a 100-byte message, then nothing: the fixture's stall_timeout is 1 s.
    res = await raw_call(port, envelope.HEADER.pack(0, 100) + b"12345", end_stream=False)
    assert res.grpc_status == str(int(Code.DEADLINE_EXCEEDED))
    assert "10 byte(s) of 105 of a message and then nothing for 1 s" in res.grpc_message


async def test_a_websocket_message_that_stalls_is_refused(bystander: tuple[int, object]) -> None:
    """As on HTTP/2: part of a message, then nothing for the stall timeout (1 s here), ends the
    stream with DEADLINE_EXCEEDED, well before the Register timeout."""
    port, _ = bystander
    sock, received = await ws_connect(port)
    began = trio.current_time()
    try:
        message = envelope.encode(bytes(heartbeat(1)))
        await sock.send_all(binary_frame_head(len(message)) + message[:-3])
        with trio.fail_after(10):
            frames = ws_frames(await read_until_closed(sock, received))
    finally:
        await sock.aclose()
    assert trio.current_time() - began < 5
    assert any('"code":"deadline_exceeded"' in f and "and then nothing for 1 s" in f for f in frames), frames


async def test_connect_protocol_errors_arrive_as_end_stream_json(bystander: tuple[int, object]) -> None:
    port, _ = bystander
    res = await raw_call(port, envelope.encode(b"\x08"), content_type="application/connect+proto")
    assert res.status == "200"
    dec = envelope.EnvelopeDecoder()
    dec.receive_data(res.body)
    env = dec.next_event()
    assert isinstance(env, envelope.Envelope) and env.end_stream
    assert b'"code":"internal"' in env.payload and b"malformed AgentMessage" in env.payload


async def test_client_refuses_server_that_is_not_rpc(nursery: trio.Nursery) -> None:
    """Our client against a port that answers HTTP/2 but not gRPC (415): a typed RpcError."""
    from transport import ServerLimits

    async def never(_: object) -> None:
        raise AssertionError("not reached")

    server = StreamServer(never, limits=ServerLimits())
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    opts = CallOptions(protocol="grpc", metadata={"x-test": "1"})
    # Send a JSON content-type by abusing metadata is not possible; use the raw peer instead.
    res = await raw_call(port, b"", content_type="text/plain")
    assert res.status == "415"
    async with open_stream(f"http://127.0.0.1:{port}", opts) as stream:
        await stream.close_send()
        with pytest.raises(RpcError) as info:
            await stream.receive()
    assert info.value.code is Code.INTERNAL and "AssertionError" in info.value.message


# -- protocol violations and lost peers: one line each, never a traceback ----------------------------


def _transport_records(
    caplog: pytest.LogCaptureFixture, level: int = logging.WARNING
) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llmgw.transport.server" and r.levelno >= level]


async def test_rapid_reset_flood_gets_goaway_and_one_warning(
    bystander: tuple[int, object], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.transport.server")
    port, _ = bystander
    peer = await RawPeer.connect(port)
    # 200 streams, each reset in the same write that opened it (CVE-2023-44487's pattern).
    await peer.send(b"".join(peer.headers(sid) + peer.rst(sid) for sid in range(1, 401, 2)))
    frames = await peer.read_until_closed()
    goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert [g.error_code for g in goaways] == [ErrorCodes.ENHANCE_YOUR_CALM]
    assert b"rapid-reset flood" in goaways[0].additional_data
    warnings = _transport_records(caplog)
    assert [r.levelname for r in warnings] == ["WARNING"], [r.getMessage() for r in warnings]
    assert "more than 64 streams reset by the peer within 10 s" in warnings[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


async def test_stream_id_too_low_gets_goaway_protocol_error_and_one_warning(
    bystander: tuple[int, object], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.transport.server")
    port, _ = bystander
    peer = await RawPeer.connect(port)
    # Stream 3 opens (and its handler starts), then stream 1: ids must increase (RFC 9113 5.1.1).
    await peer.send(peer.headers(3) + peer.headers(1))
    frames = await peer.read_until_closed()
    goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert [g.error_code for g in goaways] == [ErrorCodes.PROTOCOL_ERROR]
    assert b"stream ID" in goaways[0].additional_data or b"StreamIDTooLow" in goaways[0].additional_data
    warnings = _transport_records(caplog)
    assert [r.levelname for r in warnings] == ["WARNING"], [r.getMessage() for r in warnings]
    assert "HTTP/2 protocol error" in warnings[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


async def test_a_stream_reset_as_it_opens_is_no_violation(
    bystander: tuple[int, object], caplog: pytest.LogCaptureFixture
) -> None:
    """One cancel is ordinary (a client gave up): the same connection goes on serving."""
    caplog.set_level(logging.INFO, logger="llmgw.transport.server")
    port, _ = bystander
    peer = await RawPeer.connect(port)
    message = envelope.encode(bytes(heartbeat(77)))
    await peer.send(peer.headers(1) + peer.rst(1) + peer.headers(3) + peer.data(3, message, end_stream=True))

    def trailers(frames: list[Frame]) -> bool:
        return any(
            isinstance(f, HeadersFrame) and f.stream_id == 3 and "END_STREAM" in f.flags for f in frames
        )

    frames = await peer.read_until("stream 3's trailers", trailers)
    await peer.aclose()
    answer = b"".join(f.data for f in frames if isinstance(f, DataFrame) and f.stream_id == 3)
    ack = schema.ControlMessage.parse(answer[envelope.HEADER_SIZE :]).ack
    assert ack is not None and ack.message_id == 77
    assert not any(isinstance(f, GoAwayFrame) for f in frames)
    assert _transport_records(caplog) == []


async def test_lost_agent_is_one_info_line_naming_node_and_address(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent killed mid-stream: today's handler shape (a nursery of sender and receiver) turned
    this into an ERROR with an ExceptionGroup traceback and the peer shown as '?'."""
    caplog.set_level(logging.INFO, logger="llmgw.transport.server")
    ended: list[logging.LogRecord] = []
    logged = trio.Event()

    class StreamEnds(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "stream ended" in record.getMessage():
                ended.append(record)
                logged.set()

    watch = StreamEnds()
    logging.getLogger("llmgw.transport.server").addHandler(watch)
    try:
        server = StreamServer(nursery_handler)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        peer = await RawPeer.connect(port)
        address = f"127.0.0.1:{peer.sock.socket.getsockname()[1]}"
        # The node id is the peer's own words: a newline in it must not forge a second log line.
        message = envelope.encode(bytes(register("gpu-x\nERROR forged")))
        await peer.send(peer.headers(1) + peer.data(1, message))
        await peer.read_until("the Register's ack", lambda fs: any(isinstance(f, DataFrame) for f in fs))
        await peer.aclose()  # what the kernel does for a process killed with SIGKILL
        with trio.fail_after(5):
            await logged.wait()
    finally:
        logging.getLogger("llmgw.transport.server").removeHandler(watch)
    assert len(ended) == 1
    assert ended[0].levelname == "INFO"
    assert ended[0].getMessage() == (
        f"node 'gpu-x\\nERROR forged' ({address}): grpc stream ended: the peer closed the connection"
    )
    assert _transport_records(caplog) == []
    assert not any(r.exc_info for r in caplog.records)
    assert server.active_streams == 0
