"""A deliberately naive HTTP/2 peer built from h2 alone, for sending what well-behaved clients won't."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h2.config
import h2.connection
import h2.events
import hpack
import trio
from hyperframe.frame import DataFrame, Frame, HeadersFrame, RstStreamFrame, SettingsFrame

import schema


@attrs.define
class RawResult:
    status: str = ""
    headers: dict[str, str] = attrs.field(factory=dict)
    body: bytes = b""
    trailers: dict[str, str] = attrs.field(factory=dict)
    reset: int | None = None
    goaway: h2.events.ConnectionTerminated | None = None

    @property
    def grpc_status(self) -> str:
        return self.trailers.get("grpc-status") or self.headers.get("grpc-status", "")

    @property
    def grpc_message(self) -> str:
        from schema.rpc import decode_grpc_message

        return decode_grpc_message(self.trailers.get("grpc-message") or self.headers.get("grpc-message", ""))


def _h(pairs: object) -> dict[str, str]:
    assert isinstance(pairs, list)
    return {bytes(k).decode(): bytes(v).decode() for k, v in pairs}


async def raw_call(
    port: int,
    body: bytes,
    *,
    content_type: str = "application/grpc",
    path: str = schema.CONNECT_PATH,
    end_stream: bool = True,
    deadline: float = 10,
) -> RawResult:
    """One request with a body of our choosing; returns what came back before the stream ended."""
    result = RawResult()
    with trio.fail_after(deadline):
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", path.encode()),
                (b":authority", b"127.0.0.1"),
                (b"content-type", content_type.encode()),
                (b"te", b"trailers"),
            ],
        )
        if body or end_stream:
            conn.send_data(sid, body, end_stream=end_stream)
        await sock.send_all(conn.data_to_send())
        done = False
        while not done:
            data = await sock.receive_some(65536)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    result.headers = _h(ev.headers)
                    result.status = result.headers.get(":status", "")
                elif isinstance(ev, h2.events.DataReceived):
                    result.body += ev.data or b""
                    conn.acknowledge_received_data(ev.flow_controlled_length or 0, sid)
                elif isinstance(ev, h2.events.TrailersReceived):
                    result.trailers = _h(ev.headers)
                elif isinstance(ev, h2.events.StreamEnded):
                    done = True
                elif isinstance(ev, h2.events.StreamReset):
                    result.reset = int(ev.error_code or 0)
                    done = True
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    result.goaway = ev
                    done = True
            await sock.send_all(conn.data_to_send())
        await sock.aclose()
    return result


# -- frames of our choosing ------------------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def split_frames(data: bytes) -> list[Frame]:
    """Parse a run of whole HTTP/2 frames (what a peer wrote) into hyperframe objects."""
    frames: list[Frame] = []
    pos = 0
    while pos + 9 <= len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        frame.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        frames.append(frame)
        pos += 9 + length
    return frames


class RawPeer:
    """A client connection whose frames are built by hand, so it can send what h2 would refuse to:
    a stream id lower than one already used, a stream reset in the same write that opened it."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self.sock = sock
        self.encoder = hpack.Encoder()
        self.received = b""

    @classmethod
    async def connect(cls, port: int) -> RawPeer:
        peer = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await peer.sock.send_all(PREFACE + SettingsFrame(0).serialize())
        return peer

    def headers(
        self,
        stream_id: int,
        path: str = schema.CONNECT_PATH,
        end_stream: bool = False,
        content_type: str = "application/grpc",
    ) -> bytes:
        frame = HeadersFrame(stream_id)
        frame.data = self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "127.0.0.1"),
                ("content-type", content_type),
                ("te", "trailers"),
            ]
        )
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return bytes(frame.serialize())

    @staticmethod
    def data(stream_id: int, payload: bytes, end_stream: bool = False) -> bytes:
        frame = DataFrame(stream_id)
        frame.data = payload
        if end_stream:
            frame.flags.add("END_STREAM")
        return bytes(frame.serialize())

    @staticmethod
    def rst(stream_id: int, code: int = 8) -> bytes:  # 8: CANCEL
        frame = RstStreamFrame(stream_id)
        frame.error_code = code
        return bytes(frame.serialize())

    async def send(self, data: bytes) -> None:
        await self.sock.send_all(data)

    async def read_until_closed(self, deadline: float = 10) -> list[Frame]:
        """Everything the server sends until it closes the connection, as frames."""
        with trio.fail_after(deadline):
            while True:
                try:
                    chunk = await self.sock.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                self.received += chunk
        return split_frames(self.received)

    async def read_until(
        self, what: str, done: Callable[[list[Frame]], bool], deadline: float = 10
    ) -> list[Frame]:
        """Read until ``done(frames so far)``; fail naming ``what`` after ``deadline`` seconds."""
        with trio.fail_after(deadline):
            while not done(frames := split_frames(self.received)):
                chunk = await self.sock.receive_some(65536)
                if not chunk:
                    raise AssertionError(f"connection closed while waiting for {what}; got {frames}")
                self.received += chunk
        return frames

    async def aclose(self) -> None:
        await self.sock.aclose()
