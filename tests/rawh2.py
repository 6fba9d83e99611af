"""A deliberately naive HTTP/2 peer built from h2 alone, for sending what well-behaved clients won't."""

from __future__ import annotations

import attrs
import h2.config
import h2.connection
import h2.events
import trio

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
