"""The agent port's HTTP/2 event handling, sans-IO: h2 events in, decisions out.

hypercorn keeps its protocol handling (``protocol/h2.py``) apart from its socket IO; this is the same
split for :class:`transport.server.StreamServer`. The server reads the socket, feeds h2
(:meth:`transport.h2io.H2Transport.feed`) and hands each event to :meth:`ServerProtocol.receive`,
which decides: start a call's handler (:class:`StartCall`), answer a request that cannot be served
(the answer is queued on the h2 connection, :class:`Refused` says what to log), end the connection
for a flood (:class:`CloseConnection`), or leave the event to what both ends do alike
(``H2Transport.handle_common``). No sockets, no clocks (``now`` is passed in), no tasks: every
decision can be tested with a bare ``h2`` connection and made-up times.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs
import h2.connection
import h2.events
import h2.exceptions
from h2.errors import ErrorCodes

from schema import envelope
from schema.rpc import (
    CONNECT_CONTENT_TYPE,
    GRPC_CONTENT_TYPE,
    GRPC_CONTENT_TYPES,
    Code,
    encode_connect_end_stream,
    grpc_status_headers,
    protocol_of,
)
from transport.h2io import peer_text
from transport.limits import ServerLimits


class FrameBudget:
    """How many of something a peer may send per time window: a token bucket of ``limit`` tokens
    that refills at ``limit / window`` a second.

    Tripping it means more than ``limit`` arrived within some ``window``-second span; steady traffic
    below ``limit`` per window never trips it however long it goes on (a budget per time window, not
    per lifetime), and it costs two numbers per connection whatever the rate.
    """

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._tokens = float(limit)
        self._last: float | None = None

    def spend(self, now: float) -> bool:
        """Count one at ``now``; ``False`` once the peer went over its budget."""
        if self._last is not None and self.window > 0:
            refill = (now - self._last) * self.limit / self.window
            self._tokens = min(float(self.limit), self._tokens + max(refill, 0.0))
        self._last = now
        self._tokens -= 1
        return self._tokens >= 0


@attrs.frozen
class StartCall:
    """A call to serve: its response headers are queued; the server runs the method's handler."""

    stream_id: int
    protocol: str
    path: str
    #: Request headers, lower-case names (the handler's ``metadata``).
    metadata: dict[str, str]
    #: The request's HEADERS ended the stream (a call with no messages).
    ended: bool


@attrs.frozen
class Refused:
    """A request answered with an error (queued on the connection); ``reason`` is for the log."""

    stream_id: int
    reason: str


@attrs.frozen
class CloseConnection:
    """End the connection with GOAWAY(``error_code``, ``detail``) and log ``detail`` once."""

    error_code: ErrorCodes
    detail: str


@attrs.frozen
class Ignored:
    """Nothing to do (a request on a connection that is ending, a stream reset as it opened)."""

    reason: str = ""


Decision = StartCall | Refused | CloseConnection | Ignored | None

#: Frames that carry no request: each costs parsing (SETTINGS and PING also an answer), so a peer
#: that sends them without end is flooding (CVE-2019-9512 PING, -9513 PRIORITY, -9515 SETTINGS,
#: -9518 empty frames). Events, as h2 reports the frames.
_CONTROL_EVENTS: dict[type[h2.events.Event], str] = {
    h2.events.RemoteSettingsChanged: "SETTINGS",
    h2.events.SettingsAcknowledged: "SETTINGS ACK",
    h2.events.PingReceived: "PING",
    h2.events.PingAckReceived: "PING ACK",
    h2.events.WindowUpdated: "WINDOW_UPDATE",
    h2.events.PriorityUpdated: "PRIORITY",
    h2.events.UnknownFrameReceived: "unknown-type",
}


class ServerProtocol:
    """One server connection's decisions about what its peer sends; see the module docstring."""

    def __init__(
        self, conn: h2.connection.H2Connection, limits: ServerLimits, methods: Collection[str]
    ) -> None:
        self.conn = conn
        self.limits = limits
        self.methods = methods
        self.resets = FrameBudget(limits.max_peer_resets, limits.peer_reset_window)
        self.control = FrameBudget(limits.max_control_frames, limits.control_frame_window)
        #: Control frames by kind since the connection opened, to name the kind of a flood.
        self.control_counts: dict[str, int] = {}

    def receive(
        self,
        event: h2.events.Event,
        now: float,
        *,
        closing: bool = False,
        accepting: bool = True,
        open_streams: int = 0,
    ) -> Decision:
        """Decide about one event; ``None``: leave it to ``H2Transport.handle_common``.

        ``closing``: the connection is ending (the peer said GOAWAY, or it failed); ``accepting``:
        the server takes new calls (not shutting down); ``open_streams``: calls open server-wide.
        """
        if isinstance(event, h2.events.RequestReceived):
            if closing:
                return Ignored("the peer said GOAWAY in the same breath: there is no one to answer")
            h2_stream = self.conn.streams.get(int(event.stream_id or 0))
            if h2_stream is None or h2_stream.closed:
                # Reset by the peer in the same read that opened it (h2 has already forgotten it,
                # and answering would make h2 open it anew): counted as a reset, not answered.
                return Ignored(f"stream {event.stream_id} reset before it was answered")
            return self._request(event, accepting=accepting, open_streams=open_streams)
        if isinstance(event, h2.events.StreamReset) and event.remote_reset:
            if not self.resets.spend(now):
                return CloseConnection(
                    ErrorCodes.ENHANCE_YOUR_CALM,
                    f"more than {self.resets.limit} streams reset by the peer within "
                    f"{self.resets.window:g} s: a rapid-reset flood",
                )
            return None
        kind = _CONTROL_EVENTS.get(type(event))
        if kind is None and isinstance(event, h2.events.DataReceived):
            if not event.data and event.stream_ended is None:
                kind = "empty DATA"
        if kind is not None:
            self.control_counts[kind] = self.control_counts.get(kind, 0) + 1
            if not self.control.spend(now):
                counts = ", ".join(
                    f"{name} {n:,}" for name, n in sorted(self.control_counts.items(), key=lambda kv: -kv[1])
                )
                return CloseConnection(
                    ErrorCodes.ENHANCE_YOUR_CALM,
                    f"more than {self.control.limit:,} control frames within {self.control.window:g} s "
                    f"({counts} on this connection): a control-frame flood",
                )
        return None

    # -- requests ----------------------------------------------------------------------------------

    def _request(self, event: h2.events.RequestReceived, *, accepting: bool, open_streams: int) -> Decision:
        stream_id = int(event.stream_id or 0)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in (event.headers or [])}
        raw_type = headers.get("content-type", "")
        protocol = protocol_of(raw_type)
        if protocol is None:
            self._respond(
                stream_id,
                415,
                f"unsupported content-type {peer_text(raw_type)}: this server takes "
                f"{', '.join(GRPC_CONTENT_TYPES)} or {CONNECT_CONTENT_TYPE}",
            )
            return Refused(stream_id, f"unsupported content-type {peer_text(raw_type)}")
        if headers.get(":method") != "POST":
            text = f"method {peer_text(headers.get(':method', ''))} not allowed: gRPC and Connect use POST"
            self._respond(stream_id, 405, text)
            return Refused(stream_id, text)
        path = headers.get(":path", "")
        if path not in self.methods:
            return self._trailers_only(
                stream_id,
                protocol,
                Code.UNIMPLEMENTED,
                f"unknown method {peer_text(path)}; served: {', '.join(self.methods)}",
            )
        encoding = headers.get(
            "grpc-encoding" if protocol == "grpc" else "connect-content-encoding", "identity"
        )
        if encoding != "identity":
            return self._trailers_only(
                stream_id,
                protocol,
                Code.UNIMPLEMENTED,
                f"message encoding {peer_text(encoding)} not supported; use identity",
            )
        if not accepting:
            return self._trailers_only(stream_id, protocol, Code.UNAVAILABLE, "server shutting down")
        if open_streams >= self.limits.max_streams:
            return self._trailers_only(
                stream_id,
                protocol,
                Code.RESOURCE_EXHAUSTED,
                f"server at its limit of {self.limits.max_streams} streams",
            )
        # The answer names the content type the caller used (grpcio wants its own +proto back).
        content_type = raw_type.split(";", 1)[0].strip().lower()
        self.conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", content_type.encode())])
        return StartCall(stream_id, protocol, path, headers, event.stream_ended is not None)

    def _respond(self, stream_id: int, status: int, text: str) -> None:
        """A plain HTTP answer, for a request that is not a gRPC or Connect call at all."""
        self.conn.send_headers(
            stream_id, [(b":status", str(status).encode()), (b"content-type", b"text/plain; charset=utf-8")]
        )
        self.conn.send_data(stream_id, (text + "\n").encode(), end_stream=True)

    def _trailers_only(self, stream_id: int, protocol: str, code: Code, message: str) -> Refused:
        """A call refused before it began: a trailers-only gRPC response, or Connect's end-of-stream."""
        if protocol == "connect":
            self.conn.send_headers(
                stream_id, [(b":status", b"200"), (b"content-type", CONNECT_CONTENT_TYPE.encode())]
            )
            payload = encode_connect_end_stream(code, message)
            self.conn.send_data(
                stream_id, envelope.encode(payload, envelope.FLAG_END_STREAM), end_stream=True
            )
        else:
            self.conn.send_headers(
                stream_id,
                [
                    (b":status", b"200"),
                    (b"content-type", GRPC_CONTENT_TYPE.encode()),
                    *grpc_status_headers(code, message),
                ],
                end_stream=True,
            )
        return Refused(stream_id, f"stream refused: {code.name}: {message}")


def protocol_error_text(exc: h2.exceptions.ProtocolError, data: bytes) -> str:
    """A protocol violation in words; a connection that did not start with the HTTP/2 preface says
    what it sent instead (escaped)."""
    text = str(exc) or type(exc).__name__
    if "preamble" in text.lower() or "preface" in text.lower():
        return f"expected the HTTP/2 connection preface (gRPC/Connect over h2c); got {data[:24]!r}"
    return text
