"""The agent stream server: gRPC, Connect and WebSocket on one port, cleartext or TLS.

We drive ``h2`` ourselves rather than serve through hypercorn: hypercorn 0.18's HTTP/2 code raises
KeyError when a server ends a response while the client is still sending, and on the trio worker that
takes the whole server down (pgjones/hypercorn#329). Here every connection runs in its own nursery and
every stream's handler in its own cancel scope, so a peer that misbehaves costs only its own connection.

One port serves three protocols, told apart by their first bytes (or by TLS ALPN):

- the HTTP/2 connection preface: gRPC (``application/grpc``) or Connect (``application/connect+proto``)
  streams on ``/llmgw.v1.AgentService/Connect``;
- an HTTP/1.1 ``Upgrade: websocket`` request on ``/ws/llmgw.v1.AgentService/Connect``: the same envelopes
  in binary WebSocket messages, for networks whose proxies speak only HTTP/1.1;
- anything else is answered with a clear error (an HTTP/1.1 response or a GOAWAY with debug text) and
  the connection closed; other connections do not notice.

Other RPCs can share the port over HTTP/2 (``StreamServer(methods=...)``): the route watch that
routers subscribe to (``/llmgw.v1.RouteService/WatchRoutes``, :mod:`control.routewatch`).

What a peer's HTTP/2 frames mean (which calls to start, which requests to refuse, which floods to
end) is decided in :mod:`transport.h2proto`, without IO; this module reads and writes the sockets
and runs the handlers.

The handler sees a :class:`ServerStream` per stream: the authenticated peer (certificate subject and
SANs), an async iterator of ``AgentMessage`` and a ``send`` for ``ControlMessage``. Returning ends the
stream with OK; raising :class:`schema.rpc.RpcError` ends it with that status.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio
import trio_websocket
import wsproto
import wsproto.events
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, SettingsFrame

import schema
from schema import envelope
from schema.fastpath import decode_agent_message
from schema.rpc import Code, RpcError, encode_connect_end_stream, grpc_status_headers
from transport.bursts import BurstLog
from transport.h2io import PREFACE, H2Stream, H2Transport, StalledMessage, TransportError, peer_text
from transport.h2proto import (
    CloseConnection,
    Ignored,
    Refused,
    ServerProtocol,
    StartCall,
    protocol_error_text,
)
from transport.limits import ServerLimits
from transport.tls import ServerTLS

log = logging.getLogger("llmgw.transport.server")

_HTTP1_REQUEST_LINE = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r?\n")
_MAX_HTTP1_HEAD = 16 * 1024
#: How long a stream's final status (and a WebSocket's close handshake) may take to leave.
_FINISH_TIMEOUT = 5.0
#: How long a WebSocket close waits for the peer's answering close.
_CLOSE_HANDSHAKE_TIMEOUT = 1.0
#: The first byte of a TLS ClientHello (a handshake record); anything else at a TLS port is plaintext.
_TLS_HANDSHAKE_RECORD = 0x16

__all__ = ["Handler", "PeerIdentity", "ServerLimits", "ServerStream", "ServerTLS", "StreamServer"]


@attrs.frozen
class PeerIdentity:
    """Who is on the other end: the socket address and, with TLS, the verified client certificate."""

    address: str
    common_name: str = ""
    dns_names: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    #: True when a client certificate was presented and verified against the configured CA.
    verified: bool = False

    def names(self) -> tuple[str, ...]:
        """Every name the certificate vouches for: the subject CN, then the DNS and URI SANs."""
        return tuple(n for n in (self.common_name, *self.dns_names, *self.uris) if n)


def _identity(address: str, cert: dict[str, Any] | None) -> PeerIdentity:
    if not cert:
        return PeerIdentity(address)
    cn = ""
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = value
    sans = cert.get("subjectAltName", ())
    return PeerIdentity(
        address,
        common_name=cn,
        dns_names=tuple(v for k, v in sans if k == "DNS"),
        uris=tuple(v for k, v in sans if k == "URI"),
        verified=True,
    )


def _format_address(stream: trio.abc.Stream) -> str:
    sock_stream = stream
    while isinstance(sock_stream, trio.SSLStream):
        sock_stream = sock_stream.transport_stream
    if isinstance(sock_stream, trio.SocketStream):
        try:
            host, port, *_ = sock_stream.socket.getpeername()
            return f"{host}:{port}"
        except OSError:
            pass
    return "?"


class ServerStream:
    """One agent stream as the handler sees it, whatever protocol carries it."""

    protocol: str
    peer: PeerIdentity
    #: Request headers (lower-case names), e.g. ``authorization`` or ``x-llmgw-node``.
    metadata: dict[str, str]
    #: The node the stream's first Register named (what the agent says it is; the handler decides
    #: whether to believe it). Log lines about the stream name it, escaped.
    node_id: str = ""
    #: Why the connection under the stream failed (the peer closed it, reset the stream, stopped
    #: answering PINGs), once it has; ``None`` while it works or after an orderly end.
    error: TransportError | None = None
    #: Messages received so far (the first is bounded by ``ServerLimits.max_first_message_size``).
    received: int = 0
    #: Who calls, for log lines before a node names itself (a route watcher is not an agent).
    caller: str = "an agent"

    def describe(self) -> str:
        """``node 'gpu01' (10.0.0.7:51234)`` for log lines; the peer's words escaped and bounded."""
        if self.node_id:
            return f"node {peer_text(self.node_id, 128)} ({self.peer.address})"
        return f"{self.caller} at {self.peer.address}"

    def _note(self, message: schema.AgentMessage) -> schema.AgentMessage:
        self.received += 1
        if not self.node_id and message.register is not None:
            self.node_id = message.register.node_id
        return message

    def failure(self) -> TransportError | None:
        """The connection's failure, if the stream ended because of one."""
        return self.error

    async def receive(self) -> schema.AgentMessage | None:
        """The next message, or ``None`` once the agent half-closed its side cleanly."""
        raise NotImplementedError

    async def send(self, message: schema.ControlMessage) -> None:
        raise NotImplementedError

    async def receive_payload(self) -> bytes | None:
        """The next message's bytes, unparsed (another method's request); ``None`` at a clean end."""
        raise NotImplementedError

    async def send_payload(self, payload: bytes) -> None:
        """Send one message's bytes (another method's response)."""
        raise NotImplementedError

    async def finish(self, code: Code, message: str = "") -> None:
        """End the stream with a status (idempotent)."""
        raise NotImplementedError

    async def _refuse(self, code: Code, message: str) -> NoReturn:
        """Bad input from the peer: end the stream with a status that says why, and tell the handler.

        The handler's error carries the status to :meth:`StreamServer._run_handler`, which logs the
        stream's one closing line (a WARNING, since the peer sent what it should not have). The
        status is sent best effort within a bound: a peer that sends what it should not may also
        never read, nor answer a WebSocket close."""
        with trio.move_on_after(_FINISH_TIMEOUT):
            await self.finish(code, message)
        raise PeerRefused(code, message)

    async def __aiter__(self) -> AsyncIterator[schema.AgentMessage]:
        while (message := await self.receive()) is not None:
            yield message


Handler = Callable[[ServerStream], Awaitable[None]]


class PeerRefused(RpcError):
    """The transport refused what the peer sent (a malformed, oversized or stalled message)."""


def _parse(payload: bytes) -> schema.AgentMessage:
    try:
        return decode_agent_message(payload)
    except Exception as exc:
        raise RpcError(
            Code.INTERNAL, f"malformed AgentMessage ({len(payload)} bytes): {type(exc).__name__}: {exc}"
        ) from exc


class _H2ServerStream(H2Stream, ServerStream):
    def __init__(
        self,
        server: StreamServer,
        transport: H2Transport,
        stream_id: int,
        protocol: str,
        peer: PeerIdentity,
        metadata: dict[str, str],
    ) -> None:
        super().__init__(transport, stream_id, server.limits.max_message_size)
        self.server = server
        self.protocol = protocol
        self.peer = peer
        self.metadata = metadata
        self.scope = trio.CancelScope()
        self.finished = False

    def on_reset(self, error: TransportError) -> None:
        super().on_reset(error)
        # The peer is gone: whatever the handler waits on, nothing it does can reach the peer now.
        self.scope.cancel()

    def failure(self) -> TransportError | None:
        return self.error or self.transport.error

    async def receive(self) -> schema.AgentMessage | None:
        payload = await self.receive_payload()
        if payload is None:
            return None
        try:
            return self._note(_parse(payload))
        except RpcError as exc:
            await self._refuse(exc.code, exc.message)

    async def receive_payload(self) -> bytes | None:
        if self.finished:
            return None
        limits = self.server.limits
        self.decoder.max_size = limits.message_limit(self.received)
        try:
            env = await self.receive_envelope(limits.stall_timeout)
        except envelope.MessageTooLarge as exc:
            await self._refuse(Code.RESOURCE_EXHAUSTED, str(exc))
        except envelope.FramingError as exc:
            await self._refuse(Code.INTERNAL, f"malformed envelope: {exc}")
        except StalledMessage as exc:
            await self._refuse(Code.DEADLINE_EXCEEDED, str(exc))
        if env is None:
            return None
        if env.compressed:
            await self._refuse(
                Code.UNIMPLEMENTED, "compressed message received; this server takes identity only"
            )
        if env.end_stream:
            await self._refuse(Code.INTERNAL, "unexpected end-of-stream envelope from a client")
        return env.payload

    async def send(self, message: schema.ControlMessage) -> None:
        await self.send_payload(bytes(message))

    async def send_payload(self, payload: bytes) -> None:
        if self.finished:
            raise RpcError(Code.FAILED_PRECONDITION, "stream already ended")
        await self.send_message(payload)

    async def finish(self, code: Code, message: str = "") -> None:
        """End our side with a status: gRPC trailers, or Connect's end-of-stream envelope."""
        if self.finished or self.error is not None or self.transport.error is not None:
            self.finished = True
            return
        self.finished = True
        try:
            if self.protocol == "connect":
                payload = encode_connect_end_stream(code, message)
                await self.send_data(envelope.encode(payload, envelope.FLAG_END_STREAM), end_stream=True)
            else:
                self.transport.conn.send_headers(
                    self.stream_id, grpc_status_headers(code, message), end_stream=True
                )
                self.local_ended = True
                await self.transport.flush()
            if not self.remote_ended:
                # RFC 9113 8.1: a server that answered before the request ended tells the client to
                # stop sending with RST_STREAM(NO_ERROR) rather than leaving it to fill our window.
                await self.reset(ErrorCodes.NO_ERROR)
        except (TransportError, h2.exceptions.ProtocolError):
            pass


class _WsServerStream(ServerStream):
    """The same envelopes in binary WebSocket messages; status in a final Connect-style envelope."""

    def __init__(
        self,
        server: StreamServer,
        ws: _CappedWebSocket,
        peer: PeerIdentity,
        metadata: dict[str, str],
    ) -> None:
        self.server = server
        self.ws = ws
        self.protocol = "websocket"
        self.peer = peer
        self.metadata = metadata
        self.finished = False

    async def receive(self) -> schema.AgentMessage | None:
        if self.finished:
            return None
        try:
            data = await self._next_message()
        except trio_websocket.ConnectionClosed as exc:
            reason = exc.reason
            if reason is not None and reason.code == 1009:
                # Closed as "message too big" while the message arrived: longer than its envelope
                # header said, over this message's limit (see _CappedWebSocket). No status can
                # follow a close; the stream's log line says why.
                self.finished = True
                limit = self.server.limits.message_limit(self.received)
                raise PeerRefused(
                    Code.RESOURCE_EXHAUSTED,
                    f"WebSocket message {self.received + 1} exceeds the limit of {limit} bytes "
                    f"({limit // 1024} KiB) for it; closed (1009) as it arrived",
                ) from exc
            raise self._closed(exc) from exc
        if isinstance(data, envelope.MessageTooLarge):  # refused from its header (_CappedWebSocket)
            await self._refuse(Code.RESOURCE_EXHAUSTED, str(data))
        if isinstance(data, str):
            await self._refuse(Code.INTERNAL, "text WebSocket message; envelopes travel in binary messages")
        try:
            env = envelope.decode_one(bytes(data), self.server.limits.message_limit(self.received))
        except envelope.MessageTooLarge as exc:
            await self._refuse(Code.RESOURCE_EXHAUSTED, str(exc))
        except envelope.FramingError as exc:
            await self._refuse(Code.INTERNAL, f"malformed envelope: {exc}")
        if env.end_stream:
            return None
        try:
            return self._note(_parse(env.payload))
        except RpcError as exc:
            await self._refuse(exc.code, exc.message)

    async def _next_message(self) -> bytes | str | envelope.MessageTooLarge:
        """The next message, as HTTP/2's ``receive_envelope`` waits for one: a message begun must go
        on arriving (``ServerLimits.stall_timeout`` since its last fragment, checked at least once
        per timeout), while waiting between messages has no bound here."""
        stall = self.server.limits.stall_timeout
        while True:
            with trio.move_on_after(stall):
                return await self.ws.get_message()
            ws = self.ws
            if ws.partial and trio.current_time() - ws.last_fragment >= stall:
                await self._refuse(
                    Code.DEADLINE_EXCEEDED,
                    f"peer sent {ws.partial} byte(s) of a message and then nothing for {stall:g} s",
                )

    def _closed(self, exc: trio_websocket.ConnectionClosed) -> TransportError:
        reason = exc.reason
        if reason is None:
            text = "the WebSocket connection was lost"
        else:
            words = f": {peer_text(reason.reason)}" if reason.reason else ""
            text = f"the peer closed the WebSocket ({reason.code} {reason.name}){words}"
        if self.error is None:
            self.error = TransportErrorClosed(text)
        return self.error

    async def send(self, message: schema.ControlMessage) -> None:
        if self.finished:
            raise RpcError(Code.FAILED_PRECONDITION, "stream already ended")
        try:
            await self.ws.send_message(
                envelope.encode(bytes(message), 0, self.server.limits.max_message_size)
            )
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from exc

    async def finish(self, code: Code, message: str = "") -> None:
        if self.finished:
            return
        self.finished = True
        try:
            end = envelope.encode(encode_connect_end_stream(code, message), envelope.FLAG_END_STREAM)
            await self.ws.send_message(end)
            # The close handshake waits for the peer's answer (an agent's comes in milliseconds);
            # one that never answers is closed with the connection after the stream all the same.
            with trio.move_on_after(_CLOSE_HANDSHAKE_TIMEOUT):
                await self.ws.aclose(1000)
        except trio_websocket.ConnectionClosed:
            pass


class _CappedWebSocket(trio_websocket.WebSocketConnection):
    """A server WebSocket whose message limits apply while a message arrives, as on HTTP/2.

    trio-websocket checks one ``max_message_size`` for the whole connection, on each fragment as it
    is read; but a stream's first message (the Register, before anything the peer says is believed)
    has a tighter limit than the rest (``ServerLimits.message_limit``), and HTTP/2 refuses a message
    from its 5-byte envelope header before buffering any of it. So here, as fragments arrive:

    - the envelope header, once its 5 bytes are in, is judged against the limit of this message:
      over it, the message is refused at once (the handler's ``get_message`` returns the
      :class:`envelope.MessageTooLarge`, and the stream ends with RESOURCE_EXHAUSTED as on HTTP/2);
      the rest of it is dropped unread;
    - trio-websocket's own check stays as the backstop (a message longer than its envelope says),
      set to this message's limit; once a message completes, the limit becomes the next one's
      before the reader reads on, so no fragment is judged by another message's bound.

    It overrides a private method of trio-websocket (0.12, bounded in pyproject.toml) and builds the
    connection as ``wrap_server_stream`` does; tests/test_register_limits.py and
    tests/test_wire_client.py hold it to the behaviour on every route.
    """

    def __init__(self, stream: trio.abc.Stream, limits: ServerLimits) -> None:
        super().__init__(
            stream,
            wsproto.WSConnection(wsproto.ConnectionType.SERVER),
            max_message_size=limits.message_limit(0) + envelope.HEADER_SIZE,
        )
        self._limits = limits
        self._messages = 0
        self._head = b""
        self._refused = False
        #: Bytes of the message in progress, and when its last fragment came (the stall watch).
        self.partial = 0
        self.last_fragment = 0.0

    async def _handle_message_event(
        self, event: wsproto.events.BytesMessage | wsproto.events.TextMessage
    ) -> None:
        if self._refused:
            return  # the rest of a refused message (and anything after it) is dropped unread
        self.partial += len(event.data)
        self.last_fragment = trio.current_time()
        if isinstance(event.data, bytes) and len(self._head) < envelope.HEADER_SIZE:
            self._head += event.data[: envelope.HEADER_SIZE - len(self._head)]
            if len(self._head) == envelope.HEADER_SIZE:
                _, length = envelope.HEADER.unpack(self._head)
                limit = self._limits.message_limit(self._messages)
                if length > limit:
                    self._refused = True
                    self._message_size, self._message_parts = 0, []
                    refusal = envelope.MessageTooLarge(length, limit, "incoming")
                    try:
                        await self._send_channel.send(refusal)  # type: ignore[arg-type]
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        pass  # the stream is already over (as trio-websocket's own sends)
                    return
        await super()._handle_message_event(event)
        if event.message_finished:
            self._messages += 1
            self._head = b""
            self.partial = 0
            self._max_message_size = self._limits.message_limit(self._messages) + envelope.HEADER_SIZE


async def _accept_websocket(
    nursery: trio.Nursery, stream: trio.abc.Stream, limits: ServerLimits
) -> trio_websocket.WebSocketRequest:
    """``trio_websocket.wrap_server_stream`` with a :class:`_CappedWebSocket`: the handshake request."""
    connection = _CappedWebSocket(stream, limits)
    nursery.start_soon(connection._reader_task)
    return await connection._get_request()


class _PrefixedStream(trio.abc.Stream):
    """A stream that first replays bytes we already read while telling protocols apart."""

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self.stream = stream
        self.prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.prefix:
            n = len(self.prefix) if max_bytes is None else max_bytes
            out, self.prefix = self.prefix[:n], self.prefix[n:]
            return out
        return bytes(await self.stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        if isinstance(self.stream, trio.abc.HalfCloseableStream):
            await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class StreamServer:
    """Serves ``AgentService/Connect`` to a handler; see the module docstring.

    ``methods`` adds other RPCs by HTTP/2 path (``/llmgw.v1.RouteService/WatchRoutes``), gRPC and
    Connect over HTTP/2 only: their handlers read and write raw messages with
    :meth:`ServerStream.receive_payload` and :meth:`ServerStream.send_payload`, with the same limits,
    status handling and shutdown as the agent streams.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        tls: ServerTLS | None = None,
        limits: ServerLimits | None = None,
        methods: Mapping[str, Handler] | None = None,
    ) -> None:
        self.handler = handler
        self.methods: dict[str, Handler] = {schema.CONNECT_PATH: handler, **(methods or {})}
        self.tls = tls
        self.limits = limits or ServerLimits()
        self._ssl_context = tls.context() if tls else None
        self._transports: set[H2Transport] = set()
        self._protocols: dict[H2Transport, ServerProtocol] = {}
        self._streams: set[ServerStream] = set()
        self._scopes: set[trio.CancelScope] = set()
        self._listen_scope = trio.CancelScope()
        self._shutting_down = False
        self._idle = trio.Event()
        self._idle.set()
        keep, interval = self.limits.log_burst_keep, self.limits.log_burst_interval
        self._silent_log = BurstLog(
            log,
            "closed {count} more connections that sent no TLS handshake or request within "
            f"{self.limits.handshake_timeout:g} s, in the last {{interval}} s (the last: {{last}})",
            keep=keep,
            interval=interval,
        )
        self._tls_failure_log = BurstLog(
            log,
            "{count} more TLS handshakes failed in the last {interval} s (the last: {last})",
            keep=keep,
            interval=interval,
        )
        # A health check or a scanner aimed at this port repeats these once per connection too.
        self._http1_log = BurstLog(
            log,
            "{count} more HTTP/1.1 requests on the HTTP/2 port in the last {interval} s (the last: {last})",
            keep=keep,
            interval=interval,
        )
        self._protocol_log = BurstLog(
            log,
            "{count} more connections ended for HTTP/2 protocol errors in the last {interval} s "
            "(the last: {last})",
            keep=keep,
            interval=interval,
        )

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen and serve until cancelled; reports the bound port through ``task_status``.

        Cancelling ``serve`` shuts down gracefully, within a bound (:meth:`shutdown`): a control
        plane that is stopped (SIGTERM cancels its nursery) says GOAWAY to every agent instead of
        vanishing, so agents read an orderly goodbye and reconnect with their backoff. The
        connections run in a shielded scope for that reason: the outer cancellation reaches them
        only through :meth:`shutdown`, which ends them in order and then cancels that scope.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        log.info("agent streams on %s://%s:%d (gRPC, Connect, WebSocket)", self.scheme, host, bound)
        connections_scope = trio.CancelScope(shield=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._silent_log.run)
            nursery.start_soon(self._tls_failure_log.run)
            nursery.start_soon(self._http1_log.run)
            nursery.start_soon(self._protocol_log.run)
            await nursery.start(self._serve_connections, listeners, connections_scope)
            task_status.started(bound)
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self.shutdown()
                    connections_scope.cancel()

    async def _serve_connections(
        self,
        listeners: list[trio.SocketListener],
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with scope:
            async with trio.open_nursery() as connections:
                # Listeners live in their own scope so shutdown() can close them while the
                # connections, which run in the outer nursery, drain.
                with self._listen_scope:
                    async with trio.open_nursery() as listening:
                        serve = functools.partial(trio.serve_listeners, handler_nursery=connections)
                        await listening.start(serve, self._handle_tcp, listeners)
                        task_status.started()

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop taking connections, GOAWAY every connection, let streams end, then end the rest.

        Every step has a bound, so the whole takes at most ``grace`` (``limits.shutdown_grace``)
        plus about 7 s however the peers behave: GOAWAY(NO_ERROR) goes to every connection at
        once (1 s each at most: a peer that stopped reading must not hold up the rest); streams get
        ``grace`` seconds to end (our agents leave at the GOAWAY); the rest are ended with
        UNAVAILABLE "server shutting down" (5 s); then each connection gets a final GOAWAY and is
        closed. Calling it again (serve's cancellation after an explicit call) repeats only what
        is left to do. Ends with one INFO line that sums it up.
        """
        began = trio.current_time()
        self._shutting_down = True
        self._listen_scope.cancel()
        connections = list(self._transports)
        streams = len(self._streams)
        async with trio.open_nursery() as nursery:
            for transport in connections:
                nursery.start_soon(transport.announce_goaway, "server shutting down")
        with trio.move_on_after(self.limits.shutdown_grace if grace is None else grace):
            await self._idle.wait()
        lingering = len(self._streams)
        for scope in list(self._scopes):
            scope.cancel()
        # Cancelled handlers still send their UNAVAILABLE status; wait (bounded) until they have.
        with trio.move_on_after(5):
            await self._idle.wait()
        async with trio.open_nursery() as nursery:
            for transport in list(self._transports):
                nursery.start_soon(_close_connection, transport)
        if connections or streams:
            log.info(
                "agent streams shut down in %.1f s: GOAWAY to %d connection(s); of %d stream(s), "
                "%d ended by their peers, %d ended with UNAVAILABLE after the %g s grace",
                trio.current_time() - began,
                len(connections),
                streams,
                streams - lingering,
                lingering,
                self.limits.shutdown_grace if grace is None else grace,
            )

    # -- connections -----------------------------------------------------------------------------

    async def _handle_tcp(self, tcp: trio.SocketStream) -> None:
        """One connection, fenced: nothing that happens on it may take the server down.

        The peer's address is read first: once the peer is gone ``getpeername`` fails, and a line
        about its departure would have nobody to name.
        """
        address = _format_address(tcp)
        try:
            await self._handle_connection(tcp, address)
        except Exception:
            log.exception("connection from %s failed", address)
            await trio.aclose_forcefully(tcp)

    async def _handle_connection(self, tcp: trio.SocketStream, address: str) -> None:
        try:
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        stream: trio.abc.Stream = tcp
        peer = PeerIdentity(address)
        alpn: str | None = None
        prefix = b""
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                if self._ssl_context is not None:
                    first = await tcp.socket.recv(1, socket.MSG_PEEK)
                    if first and first[0] != _TLS_HANDSHAKE_RECORD:
                        await self._answer_plaintext(tcp, address)
                        return
                    ssl_stream = trio.SSLStream(tcp, self._ssl_context, server_side=True)
                    await ssl_stream.do_handshake()
                    alpn = ssl_stream.selected_alpn_protocol()
                    peer = _identity(address, ssl_stream.getpeercert())
                    stream = ssl_stream
                if alpn != "h2":
                    prefix = await self._sniff(stream)
        except trio.TooSlowError:
            self._silent_log.note(
                "%s: no TLS handshake or request within %g s; closing", address, self.limits.handshake_timeout
            )
            await trio.aclose_forcefully(stream)
            return
        except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
            cause = exc.__cause__ or exc
            self._tls_failure_log.note("%s: TLS handshake failed: %s", address, cause)
            await trio.aclose_forcefully(stream)
            return
        try:
            if alpn == "h2" or not _HTTP1_REQUEST_LINE.match(prefix):
                await self._serve_h2(stream, peer, prefix)
            else:
                await self._serve_http1(stream, peer, prefix)
        finally:
            await trio.aclose_forcefully(stream)

    async def _answer_plaintext(self, tcp: trio.SocketStream, address: str) -> None:
        """A plaintext client at the TLS port: say in its own protocol that this port needs TLS.

        An agent with an ``http://`` URL for a TLS port would otherwise see the connection closed
        and could only guess why; its HTTP/2 preface is answered with SETTINGS and a GOAWAY whose
        text names the fix, an HTTP/1.1 request with a 400 that does. Nothing is served.
        """
        hint = "this port speaks TLS: use an https:// (or wss://) server URL"
        data = b""
        with trio.move_on_after(self.limits.handshake_timeout):
            # Read what the client sent first: closing with unread bytes would reset the connection
            # and could discard our answer before the client reads it.
            while len(data) < _MAX_HTTP1_HEAD and not (
                data.startswith(PREFACE) or b"\r\n\r\n" in data or (data and not data[:1].isalpha())
            ):
                chunk = await tcp.receive_some(4096)
                if not chunk:
                    break
                data += bytes(chunk)
        if data.startswith(PREFACE[: len(data)]) and data:
            goaway = GoAwayFrame(0)
            goaway.error_code = ErrorCodes.PROTOCOL_ERROR
            goaway.additional_data = hint.encode()
            answer = SettingsFrame(0).serialize() + goaway.serialize()
        elif _HTTP1_REQUEST_LINE.match(data):
            body = (hint + "\n").encode()
            answer = (
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
        else:
            answer = b""
        self._tls_failure_log.note(
            "%s: plaintext on the TLS port (%s); %s",
            address,
            peer_text(data[:24]),
            "answered that it needs TLS" if answer else "closing",
        )
        with trio.move_on_after(1):
            try:
                if answer:
                    await tcp.send_all(answer)
                    await tcp.send_eof()
                    while await tcp.receive_some(4096):  # until the client has read it and gone
                        pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(tcp)

    async def _sniff(self, stream: trio.abc.Stream) -> bytes:
        """Read enough to tell the HTTP/2 preface from an HTTP/1.1 request head."""
        buf = b""
        while True:
            if len(buf) >= len(PREFACE) and not _HTTP1_REQUEST_LINE.match(buf):
                return buf
            if _HTTP1_REQUEST_LINE.match(buf) and (b"\r\n\r\n" in buf or len(buf) > _MAX_HTTP1_HEAD):
                return buf
            if (
                buf
                and not PREFACE.startswith(buf[: len(PREFACE)])
                and not re.match(rb"^[A-Z]{0,10}( |$)", buf)
            ):
                return buf  # garbage: let h2 reject it with a GOAWAY that says why
            chunk = await stream.receive_some(4096)
            if not chunk:
                return buf
            buf += bytes(chunk)

    async def _serve_http1(self, stream: trio.abc.Stream, peer: PeerIdentity, head: bytes) -> None:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        headers = head.split(b"\r\n\r\n", 1)[0].lower()
        path = request_line.split(" ")[1] if " " in request_line else ""
        if b"upgrade: websocket" in headers and path.split("?")[0] == schema.WEBSOCKET_PATH:
            await self._serve_websocket(_PrefixedStream(stream, head), peer)
            return
        body = (
            f"this port speaks HTTP/2 (gRPC or Connect at {schema.CONNECT_PATH}) and WebSocket at "
            f"{schema.WEBSOCKET_PATH}; got an HTTP/1.1 request: {request_line}\n"
        ).encode()
        status = b"426 Upgrade Required" if path.split("?")[0] == schema.CONNECT_PATH else b"400 Bad Request"
        response = (
            b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Upgrade: h2c\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self._http1_log.note(
            "%s: HTTP/1.1 request on the HTTP/2 port: %s", peer.address, peer_text(request_line)
        )
        with trio.move_on_after(self.limits.handshake_timeout):
            try:
                await stream.send_all(response)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _serve_websocket(self, stream: trio.abc.Stream, peer: PeerIdentity) -> None:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(self.limits.handshake_timeout) as hs:
                request = await _accept_websocket(nursery, stream, self.limits)
                metadata = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
                if self._shutting_down or len(self._streams) >= self.limits.max_streams:
                    await request.reject(503, body=b"server shutting down or at its stream limit\n")
                    nursery.cancel_scope.cancel()
                    return
                ws = await request.accept()
            if hs.cancelled_caught:
                nursery.cancel_scope.cancel()
                return
            assert isinstance(ws, _CappedWebSocket)  # request.accept() hands back our connection
            st = _WsServerStream(self, ws, peer, metadata)
            await self._run_handler(st, st.finish)
            nursery.cancel_scope.cancel()

    async def _serve_h2(self, stream: trio.abc.Stream, peer: PeerIdentity, prefix: bytes) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config=config)
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_streams_per_connection,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 16 * 1024,
            },
        )
        conn.initiate_connection()
        transport = H2Transport(stream, conn)
        self._transports.add(transport)
        self._protocols[transport] = ServerProtocol(conn, self.limits, self.methods)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    transport.keepalive, self.limits.keepalive_interval, self.limits.keepalive_timeout
                )
                nursery.start_soon(self._first_request_due, transport, peer)
                await transport.flush()
                if prefix:
                    if not await self._feed(transport, nursery, peer, prefix):
                        nursery.cancel_scope.cancel()
                        return
                if self._shutting_down:
                    await transport.announce_goaway("server shutting down")
                while True:
                    try:
                        data = bytes(await stream.receive_some(65536))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        cause = exc.__cause__ or exc
                        transport.fail(TransportErrorClosed(f"connection lost: {cause}"))
                        break
                    if not data:
                        transport.fail(TransportErrorClosed("the peer closed the connection"))
                        break
                    if not await self._feed(transport, nursery, peer, data):
                        break
                    if transport.error is not None and not transport.streams:
                        break
                nursery.cancel_scope.cancel()
        except TransportError:
            pass
        finally:
            self._transports.discard(transport)
            self._protocols.pop(transport, None)

    async def _first_request_due(self, transport: H2Transport, peer: PeerIdentity) -> None:
        """Close an HTTP/2 connection that opens no stream within ``handshake_timeout``.

        An agent opens its stream right after the server's SETTINGS; a connection that only said
        the preface (a scanner, a stuck or hostile client) would otherwise be held for as long as it
        answers PINGs. It ends with GOAWAY(NO_ERROR) saying why, logged as a burst line.
        """
        await trio.sleep(self.limits.handshake_timeout)
        if transport.conn.highest_inbound_stream_id or transport.error is not None:
            return
        timeout = self.limits.handshake_timeout
        self._silent_log.note(
            "%s: no request within %g s of the HTTP/2 preface; closing", peer.address, timeout
        )
        transport.fail(TransportErrorClosed(f"no request within {timeout:g} s"))
        await transport.goaway(ErrorCodes.NO_ERROR, f"no request within {timeout:g} s")
        await transport.abort()

    async def _feed(
        self, transport: H2Transport, nursery: trio.Nursery, peer: PeerIdentity, data: bytes
    ) -> bool:
        """Feed bytes to h2 and carry out what :class:`transport.h2proto.ServerProtocol` decides
        about each event; ``False`` when the connection must close.

        A protocol violation (a stream id reused or lower than one already seen, a frame h2 rejects)
        and a flood (rapid reset, CVE-2023-44487; SETTINGS, PING, WINDOW_UPDATE and other control
        frames faster than anyone needs, CVE-2019-9512/-9515) each end this connection with a GOAWAY
        that says why and one WARNING line; other connections and their streams do not notice.
        """
        try:
            events = transport.feed(data)
        except h2.exceptions.ProtocolError as exc:
            detail = protocol_error_text(exc, data)
            self._protocol_log.note(
                "%s: HTTP/2 protocol error: %s; answered with GOAWAY", peer.address, detail
            )
            transport.fail(TransportErrorClosed(f"HTTP/2 protocol error: {detail}"))
            await transport.refuse(exc, detail)
            return False
        protocol = self._protocols[transport]
        for event in events:
            decision = protocol.receive(
                event,
                trio.current_time(),
                closing=transport.peer_went_away or transport.error is not None,
                accepting=not self._shutting_down,
                open_streams=len(self._streams),
            )
            if decision is None:
                if not transport.handle_common(event):
                    log.debug("%s: ignored HTTP/2 event %r", peer.address, event)
            elif isinstance(decision, StartCall):
                self._start_call(transport, nursery, peer, decision)
            elif isinstance(decision, Refused):
                log.warning("%s: %s", peer.address, decision.reason)
            elif isinstance(decision, CloseConnection):
                log.warning(
                    "%s: %s; answered with GOAWAY (%s)",
                    peer.address,
                    decision.detail,
                    decision.error_code.name,
                )
                transport.fail(TransportErrorClosed(decision.detail))
                transport.conn.data_to_send()  # the answers to the flood (SETTINGS and PING ACKs) go unsent
                await transport.goaway(decision.error_code, decision.detail)
                return False
            elif isinstance(decision, Ignored):
                log.debug("%s: %s", peer.address, decision.reason)
        try:
            await transport.flush()
        except TransportError:
            return False
        return True

    def _start_call(
        self, transport: H2Transport, nursery: trio.Nursery, peer: PeerIdentity, call: StartCall
    ) -> None:
        """Run the method's handler on a call the protocol accepted (its response headers are queued)."""
        handler = self.methods[call.path]
        st = _H2ServerStream(self, transport, call.stream_id, call.protocol, peer, call.metadata)
        if handler is not self.handler:
            st.caller = f"a {call.path.rsplit('/', 1)[-1]} caller"
        if call.ended:
            st.on_remote_end()
        nursery.start_soon(self._run_h2_stream, st, handler)

    async def _run_h2_stream(self, st: _H2ServerStream, handler: Handler) -> None:
        try:
            await self._run_handler(st, st.finish, st.scope, handler)
        finally:
            st.forget()

    async def _run_handler(
        self,
        st: ServerStream,
        finish: Callable[[Code, str], Awaitable[None]],
        scope: trio.CancelScope | None = None,
        handler: Handler | None = None,
    ) -> None:
        """Run the handler on one stream, end the stream with a status, and log one closing line.

        Whatever the handler raises (an ExceptionGroup from its own nursery, with the Cancelled of
        its sibling tasks in it, included) ends this stream with a status and never reaches the
        connection or the server. Cancellation is level-triggered in trio, so setting aside the
        Cancelled leaves of such a group loses nothing: a scope that is still cancelled cancels
        again at the next checkpoint.
        """
        scope = scope or trio.CancelScope()
        self._streams.add(st)
        self._scopes.add(scope)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        code, message = Code.OK, ""
        failed: BaseException | None = None
        try:
            with scope:
                try:
                    await (handler or self.handler)(st)
                except BaseException as exc:
                    if not _is_failure(exc):
                        raise
                    failed = exc
                    code, message = _status_of(exc)
            if scope.cancel_called and self._shutting_down and code is Code.OK:
                code, message = Code.UNAVAILABLE, "server shutting down"
            with trio.CancelScope(shield=True), trio.move_on_after(_FINISH_TIMEOUT):
                await finish(code, message)
            self._log_end(st, code, message, failed)
        finally:
            self._streams.discard(st)
            self._scopes.discard(scope)
            if not self._streams:
                self._idle.set()

    def _log_end(self, st: ServerStream, code: Code, message: str, failed: BaseException | None) -> None:
        """One line per stream, naming the node and the peer's address.

        An ordinary end (the agent closed or lost its connection, reset its stream, stopped
        answering PINGs, or the server shut down) is INFO and says why, with no traceback; bad
        input refused by the transport is a WARNING; a bug in the handler is an ERROR with its
        traceback. During a shutdown each line is DEBUG and :meth:`shutdown` sums them up.
        """
        who = st.describe()
        if failed is not None and not all(
            isinstance(leaf, TransportError | RpcError | trio.Cancelled) for leaf in _leaves(failed)
        ):
            log.error("%s: %s stream: handler failed (%s)", who, st.protocol, message, exc_info=failed)
            return
        broken = st.failure()
        if broken is not None:
            reason = str(broken)
        elif code is Code.OK:
            reason = "OK"
        else:
            reason = f"{code.name}: {message}"
        refused = failed is not None and any(isinstance(leaf, PeerRefused) for leaf in _leaves(failed))
        level = logging.WARNING if refused else logging.DEBUG if self._shutting_down else logging.INFO
        log.log(level, "%s: %s stream ended: %s", who, st.protocol, reason)


async def _close_connection(transport: H2Transport) -> None:
    """The last word on a connection at shutdown: a final GOAWAY naming the last stream, then close."""
    transport.fail(TransportErrorClosed("the server shut down"))
    await transport.goaway(ErrorCodes.NO_ERROR, "server shutting down")
    await transport.abort()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _is_failure(exc: BaseException) -> bool:
    """Whether a handler's exception is for the stream's status (``False``: let it propagate).

    Propagated: a lone Cancelled or a group of them (the scope above decides), and anything that is
    not an ``Exception`` (KeyboardInterrupt, SystemExit) wherever it sits in a group.
    """
    leaves = _leaves(exc)
    if any(not isinstance(leaf, Exception | trio.Cancelled) for leaf in leaves):
        return False
    return any(isinstance(leaf, Exception) for leaf in leaves)


def _status_of(exc: BaseException) -> tuple[Code, str]:
    """The status a handler's exception ends its stream with: its own RpcError if it raised one,
    UNAVAILABLE when the stream or connection failed under it, INTERNAL for a bug."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    for leaf in leaves:
        if isinstance(leaf, RpcError):
            return leaf.code, leaf.message
    if all(isinstance(leaf, TransportError) for leaf in leaves):
        return Code.UNAVAILABLE, "; ".join(str(leaf) for leaf in leaves)
    first = next(leaf for leaf in leaves if not isinstance(leaf, TransportError))
    return Code.INTERNAL, f"internal error: {type(first).__name__}: {first}"


class TransportErrorClosed(TransportError):
    """The connection is over: closed by the peer, or by us after a protocol error."""
