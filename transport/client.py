"""The HTTP/2 client: dial a server once, then open gRPC or Connect calls on the connection.

httpx cannot do full-duplex HTTP/2 and drops trailers, so the client drives ``h2`` over a trio stream
itself (the plumbing shared with the server lives in :mod:`transport.h2io`). The layers follow
httpcore's: :func:`dial` makes the byte stream (TCP, then TLS with ALPN), :func:`connect` makes an
HTTP/2 :class:`ClientConnection` of it (one reader task, keepalive PINGs), and
:meth:`ClientConnection.open_call` opens one call's stream on it (:class:`RpcClientStream`). The
agent's stream (:mod:`transport.agentstream`) and the router's route watch (:func:`server_stream`)
are both calls on such a connection.

Nothing but the connection preface and our SETTINGS leaves before the server's SETTINGS arrive (and,
with TLS, before a verified handshake): the request headers carry a bearer token or a node's
metadata, which are not for a peer that has not shown it speaks HTTP/2. What answered instead names
the likely mistake in the error (the router or admin port, TLS spoken to a plaintext port or the
other way round).

Errors are typed: :class:`schema.rpc.RpcError` for a status the server sent (or an answer that is
not an RPC), :class:`transport.h2io.TransportError` subclasses for the connection. Background tasks
never raise into the caller's body; they record the error on the connection, and the next read or
write raises it.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TypeVar
from urllib.parse import urlsplit

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio
from h2.errors import ErrorCodes

from schema import envelope
from schema.rpc import (
    PROTOCOLS,
    Code,
    RpcError,
    decode_connect_end_stream,
    decode_grpc_message,
    http_status_to_code,
    request_headers,
)
from transport.h2io import (
    ConnectionLost,
    GoAwayReceived,
    H2Stream,
    H2Transport,
    PeerUnresponsive,
    TransportError,
    peer_text,
)
from transport.tls import ClientTLS

log = logging.getLogger("llmgw.transport.client")


@attrs.frozen
class CallOptions:
    """How to reach a server and call it, for every client here (the agent's stream, the router's
    route watch); every wait has a bound."""

    #: ``grpc`` (status in trailers) or ``connect`` (status in an end-of-stream envelope); a
    #: ``ws://``/``wss://`` URL speaks neither (the agent's WebSocket route).
    protocol: str = attrs.field(default="grpc", validator=attrs.validators.in_(PROTOCOLS))
    #: For ``https://`` and ``wss://``: the CA to trust and the certificate to present (mutual TLS);
    #: ``None``: the system trust store and no client certificate.
    tls: ClientTLS | None = None
    #: TCP connect plus TLS handshake must finish within this many seconds.
    connect_timeout: float = 10.0
    #: HTTP/2: the server's SETTINGS must arrive within this many seconds of our connection preface.
    #: Until they do, nothing beyond the preface and our own SETTINGS is sent (no HEADERS with the
    #: metadata): a peer that has not spoken HTTP/2 yet is not known to be the server.
    settings_timeout: float = 5.0
    #: Seconds between keepalive PINGs, and how long an answer may take: a black-holed connection is
    #: detected within ``keepalive_interval + keepalive_timeout`` rather than after TCP's minutes.
    keepalive_interval: float = 10.0
    keepalive_timeout: float = 5.0
    max_message_size: int = envelope.DEFAULT_MAX_MESSAGE_SIZE
    #: Extra request headers (lower-case names), e.g. ``{"authorization": "Bearer ..."}``.
    metadata: Mapping[str, str] = attrs.field(factory=dict)
    #: The ``user-agent`` request header (each process adds its name and version).
    user_agent: str = "llmgw"


class RpcClientStream(H2Stream):
    """One RPC's stream on the client side: the response head, the messages, and the final status.

    One definition for every client here (the agent's stream, the router's route watch): a gRPC
    status comes in trailers (or a trailers-only response), a Connect status in an end-of-stream
    envelope the reader hands to :meth:`on_connect_end`; an answer that is not an RPC at all (a web
    server's 404) keeps a little of its body for the error. :meth:`final_status` says how it ended.
    """

    def __init__(
        self, transport: H2Transport, stream_id: int, max_message_size: int, protocol: str = "grpc"
    ) -> None:
        super().__init__(transport, stream_id, max_message_size)
        self.protocol = protocol
        self.http_status: int | None = None
        self.status: RpcError | None = None
        self.status_seen = False
        self._body = bytearray()

    def on_response(self, headers: dict[str, str]) -> None:
        self.http_status = int(headers.get(":status", "0") or 0)
        if self.http_status == 200 and "grpc-status" in headers:
            self.on_trailers(headers)  # a trailers-only response (a refused call)

    def on_trailers(self, trailers: dict[str, str]) -> None:
        if self.protocol != "grpc" or "grpc-status" not in trailers:
            return
        self.status_seen = True
        try:
            code = Code(int(trailers["grpc-status"]))
        except ValueError:
            code = Code.UNKNOWN
        if code is not Code.OK:
            self.status = RpcError(code, decode_grpc_message(trailers.get("grpc-message", "")))

    def on_connect_end(self, payload: bytes) -> None:
        """A Connect end-of-stream envelope: the call's status."""
        self.status_seen = True
        self.status = decode_connect_end_stream(payload)

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        if self.http_status not in (None, 200):
            # Not an RPC answer (415 from a server that does not speak our content-type, 404 from a
            # plain web server): keep a little of the body for the error message.
            if len(self._body) < 1024:
                self._body += data[: 1024 - len(self._body)]
            self._acknowledge(flow_controlled_length)
            return
        super().on_data(data, flow_controlled_length)

    def final_status(self, not_served_hint: str = "") -> RpcError | None:
        """The error the call ended with (``None``: OK); ``not_served_hint`` is added to a 404 or
        405 (the server does not serve the method: likely the wrong port)."""
        if self.http_status not in (None, 200):
            assert self.http_status is not None
            text = peer_text(self._body.decode("utf-8", "replace").strip())
            hint = f"; {not_served_hint}" if not_served_hint and self.http_status in (404, 405) else ""
            return RpcError(http_status_to_code(self.http_status), f"HTTP {self.http_status}: {text}{hint}")
        if self.status is not None:
            return self.status
        if not self.status_seen and self.protocol == "connect" and self.remote_ended:
            self._find_connect_end()
            if self.status is not None:
                return self.status
        if not self.status_seen:
            what = "grpc-status trailer" if self.protocol == "grpc" else "Connect end-of-stream message"
            return RpcError(Code.INTERNAL, f"server ended the stream without a {what}")
        return None

    def _find_connect_end(self) -> None:
        """The Connect status among what arrived but was not read: a server that refuses a call
        while the client is still sending (a first message over its cap) ends it with the status
        and RST_STREAM(NO_ERROR), and the sender, stopped mid-message, asks how it ended before
        anyone read the status. What precedes it is dropped: the call is over."""
        while True:
            try:
                env = self.decoder.next_event()
            except envelope.FramingError:
                return
            if not isinstance(env, envelope.Envelope):
                return
            if env.end_stream:
                self.on_connect_end(env.payload)
                return


class ServerStreamCall:
    """An open server-streaming call: :meth:`receive` the messages' bytes until ``None`` (OK)."""

    def __init__(self, st: RpcClientStream) -> None:
        self._st = st

    async def receive(self) -> bytes | None:
        """The next message, or ``None`` once the server ended the call with OK; raises otherwise."""
        while True:
            env = await self._st.receive_envelope()
            if env is None:
                error = self._st.final_status()
                if error is not None:
                    raise error
                return None
            if env.compressed:
                raise RpcError(Code.INTERNAL, "server sent a compressed message; none was negotiated")
            if not env.end_stream:
                return env.payload
            if self._st.protocol != "connect":
                raise RpcError(Code.INTERNAL, "end-of-stream envelope in a gRPC response")
            self._st.on_connect_end(env.payload)


def headers_of(raw: object) -> dict[str, str]:
    """h2's header list as a dict with lower-case names (latin-1, as HTTP/2 carries them)."""
    pairs = raw if isinstance(raw, list) else []
    return {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1") for k, v in pairs}


def diagnose_answer(first: bytes, *, tls_expected: bool, port_hint: str) -> str | None:
    """What the first bytes a server sent say about a likely mistake, or ``None`` if they fit.

    ``tls_expected``: the bytes are the raw answer to our TLS ClientHello (not the HTTP/2 bytes
    inside a TLS connection, nor a plaintext connection's). The usual mistakes: a plaintext URL for a TLS port, a TLS URL
    for a plaintext port, and a client pointed at the router or the admin API (HTTP/1.1);
    ``port_hint`` says which address the caller should have used.
    """
    if first.startswith(b"HTTP/1."):
        line = first.split(b"\r\n", 1)[0]
        return (
            f"answered with HTTP/1.1 ({peer_text(line, 64)}): is this the router or admin port? {port_hint}"
        )
    if len(first) >= 2 and first[0] in (0x15, 0x16) and first[1] == 0x03:
        if tls_expected:
            return None
        return "answered with TLS: the port expects TLS; use an https:// (or wss://) server URL"
    if (
        tls_expected
        and len(first) >= 9
        and first[3] == 0x04
        and first[4] in (0, 1)
        and not first[5:9].strip(b"\0")
    ):
        # A plaintext HTTP/2 SETTINGS frame (type 4, stream 0) where a TLS record was expected.
        return (
            "answered in plaintext HTTP/2: the port does not use TLS; use an http:// server URL "
            "(or configure TLS on the control plane)"
        )
    return None


async def await_server_settings(
    transport: H2Transport, where: str, secure: bool, timeout: float, port_hint: str
) -> None:
    """Send our connection preface and SETTINGS, then wait for the server's SETTINGS.

    Nothing else leaves before the server has spoken HTTP/2 (and, with TLS, after a verified
    handshake): the request headers carry the node's metadata and the Register its inventory, and
    neither is for a peer that has not shown it is an HTTP/2 server. Waiting also tells the usual
    wrong-port mistakes apart by what answered (:func:`diagnose_answer`), so the caller's reconnect
    line names the mistake instead of a protocol error. Bounded by ``timeout`` seconds.
    """
    await transport.flush()  # the preface and our SETTINGS: h2 has queued nothing else yet
    unanswered = (
        f"{where} did not answer our HTTP/2 connection preface within {timeout:g} s (nothing else was "
        "sent): is it an llmgw control plane? "
        + ("" if secure else "A TLS port waits silently for a handshake: use an https:// URL there; ")
        + port_hint
    )
    head = b""
    with trio.move_on_after(timeout):
        while True:
            try:
                data = bytes(await transport.stream.receive_some(65536))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                cause = exc.__cause__ or exc
                raise transport.fail(
                    ConnectionLost(
                        f"connection to {where} lost before it answered: {cause}{closed_hint(secure, port_hint)}"
                    )
                ) from exc
            if not data:
                hint = diagnose_answer(head, tls_expected=False, port_hint=port_hint) if head else None
                raise transport.fail(
                    ConnectionLost(
                        f"{where} closed the connection"
                        + (
                            f"; it {hint}"
                            if hint
                            else f" before answering HTTP/2{closed_hint(secure, port_hint)}"
                        )
                    )
                )
            if len(head) < 9:
                # Judge the first frame header before h2 sees it: h2 would call an HTTP/1.1 answer
                # or a TLS alert a protocol error, and the mistake behind it would go unnamed.
                head += data
                hint = diagnose_answer(head, tls_expected=False, port_hint=port_hint)
                if hint is None and len(head) >= 9 and head[3] != 0x04:
                    hint = (
                        f"answered with something that is not HTTP/2 ({peer_text(head[:32])}): "
                        f"is it an llmgw control plane? {port_hint}"
                    )
                if hint is not None:
                    raise transport.fail(ConnectionLost(f"{where} {hint}"))
                if len(head) < 9:
                    continue  # too little to judge yet; h2 gets these bytes with the rest
                data = head
            try:
                events = transport.feed(data)
            except h2.exceptions.ProtocolError as exc:
                raise transport.fail(
                    ConnectionLost(f"{where} answered with an HTTP/2 protocol error: {exc}")
                ) from exc
            settled = False
            for event in events:
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settled = True
                transport.handle_common(event)
            if transport.error is not None:
                raise transport.error
            await transport.flush()  # our SETTINGS ACK
            if not settled:
                continue
            if transport.conn.remote_settings.max_concurrent_streams == 0:
                # hypercorn's HTTP/1.1-only configuration (the admin API) answers the preface so.
                raise transport.fail(
                    ConnectionLost(
                        f"{where} speaks HTTP/2 but takes no streams (SETTINGS_MAX_CONCURRENT_STREAMS "
                        f"0): is this the admin API port? {port_hint}"
                    )
                )
            return
    raise transport.fail(PeerUnresponsive(unanswered))


def closed_hint(secure: bool, port_hint: str) -> str:
    """What a connection closed before it answered most likely means."""
    if secure:
        # TLS 1.3 checks our certificate after our side of the handshake is done: a server that
        # refuses it closes the connection at its first read.
        return (
            "; the server closed the TLS connection before answering: it may require a client "
            "certificate (mutual TLS) that was not presented or that its CA does not trust"
        )
    return (
        ": is it a TLS port (use an https:// URL) or something other than an llmgw control plane? "
        + port_hint
    )


# -- dialling ----------------------------------------------------------------------------------------


class _Recording(trio.abc.Stream):
    """The TCP stream under a TLS one, keeping the first bytes the server sent, so that a failed
    handshake can say what answered instead of TLS (see :func:`diagnose_answer`)."""

    def __init__(self, stream: trio.SocketStream, keep: int = 64) -> None:
        self.stream = stream
        self.first = b""
        self._keep = keep

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = bytes(await self.stream.receive_some(max_bytes))
        if len(self.first) < self._keep:
            self.first += data[: self._keep - len(self.first)]
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def dial(
    host: str,
    port: int,
    *,
    tls: ClientTLS | None,
    alpn: str,
    timeout: float,
    port_hint: str,
) -> trio.SocketStream | trio.SSLStream[_Recording]:
    """TCP to ``host:port`` and, with ``tls``, a verified handshake offering ``alpn`` (``h2`` or
    ``http/1.1``), together within ``timeout`` seconds. A server that negotiates another protocol
    than ``alpn``, or answers the handshake with something other than TLS, is refused with words
    that name the likely mistake."""
    where = f"{host}:{port}"
    try:
        with trio.fail_after(timeout):
            try:
                tcp = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise ConnectionLost(f"cannot connect to {where}: {exc.strerror or exc}") from exc
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is None:
                return tcp
            recording = _Recording(tcp)
            stream = trio.SSLStream(
                recording, tls.context([alpn]), server_hostname=tls.server_hostname or host
            )
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                await trio.aclose_forcefully(tcp)
                cause = exc.__cause__ or exc
                hint = diagnose_answer(recording.first, tls_expected=True, port_hint=port_hint)
                raise ConnectionLost(
                    f"TLS handshake with {host} failed: {cause}" + (f"; the server {hint}" if hint else "")
                ) from exc
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            if alpn == "h2" and stream.selected_alpn_protocol() != "h2":
                await trio.aclose_forcefully(stream)
                raise ConnectionLost(
                    f"{where} did not negotiate HTTP/2 over TLS (ALPN gave "
                    f"{stream.selected_alpn_protocol()!r}); is it an llmgw control plane? {port_hint}"
                )
            return stream
    except trio.TooSlowError as exc:
        raise PeerUnresponsive(f"cannot connect to {where} within {timeout:g} s") from exc


@asynccontextmanager
async def with_background(*tasks: Callable[[], Awaitable[object]]) -> AsyncIterator[trio.Nursery]:
    """Run ``tasks`` in the background around the caller's body; the body's exception leaves as itself.

    Our background tasks (reader, keepalive) never raise: they record errors for the calls to raise.
    Without this, trio's strict exception groups would hand the caller an ExceptionGroup around its
    own RpcError or TransportError instead of the error itself.
    """
    caught: BaseException | None = None
    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(task)
        try:
            yield nursery
        except BaseException as exc:
            caught = exc
        finally:
            nursery.cancel_scope.cancel()
    if caught is not None:
        raise caught


# -- the connection ----------------------------------------------------------------------------------

_Call = TypeVar("_Call", bound=RpcClientStream)


class ClientConnection:
    """One HTTP/2 connection to a server, as :func:`connect` made it: open calls with :meth:`open_call`.

    Its one reader task feeds h2 and hands each stream its events; keepalive PINGs run beside it.
    """

    def __init__(self, transport: H2Transport, host: str, port: int, secure: bool) -> None:
        self.transport = transport
        self.host = host
        self.port = port
        self.secure = secure

    def open_call(
        self,
        path: str,
        options: CallOptions | None = None,
        *,
        stream: Callable[[H2Transport, int, int, str], _Call],
    ) -> _Call:
        """Open a call to ``path`` (in ``options``' protocol, with its metadata, user agent and
        message bound): its request headers are queued (sent with the next flush or message) and
        its stream returned; ``stream`` makes the stream object (:class:`RpcClientStream`, or a
        subclass that knows the call's messages)."""
        options = options or CallOptions()
        conn = self.transport.conn
        if self.transport.error is not None:
            raise self.transport.error
        stream_id = conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "https" if self.secure else "http"),
            (":path", path),
            (":authority", f"{self.host}:{self.port}"),
            *request_headers(options.protocol),
            ("user-agent", options.user_agent),
            *((k.lower(), v) for k, v in options.metadata.items()),
        ]
        st = stream(self.transport, stream_id, options.max_message_size, options.protocol)
        conn.send_headers(stream_id, [(k.encode(), v.encode()) for k, v in headers])
        return st

    async def read_loop(self) -> None:
        """The connection's only reader: socket bytes -> h2 events -> the streams.

        A GOAWAY from the server (a control plane shutting down says GOAWAY with NO_ERROR) ends the
        connection gracefully: the streams fail with :class:`GoAwayReceived`, whatever the server
        wrote after its GOAWAY is absorbed unread (``H2Transport.feed``), and once the caller lets go
        we answer with our own GOAWAY (RFC 9113 6.8) and nothing else. Never raises: failures are
        recorded on the transport for the calls to raise.
        """
        transport = self.transport
        while transport.error is None:
            try:
                events = await transport.receive_events()
            except TransportError:
                return
            except h2.exceptions.ProtocolError as exc:
                transport.fail(ConnectionLost(f"HTTP/2 protocol error from the server: {exc}"))
                await transport.refuse(exc, str(exc))
                await transport.abort()
                return
            for event in events:
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    st = transport.streams.get(int(event.stream_id or 0))
                    if isinstance(st, RpcClientStream):
                        if isinstance(event, h2.events.ResponseReceived):
                            st.on_response(headers_of(event.headers))
                        else:
                            st.on_trailers(headers_of(event.headers))
                elif not transport.handle_common(event):
                    log.debug("ignored HTTP/2 event %r", event)
            if transport.error is not None:
                return  # a GOAWAY: the answer is sent as the connection closes (see connect)
            try:
                await transport.flush()
            except TransportError:
                return


@asynccontextmanager
async def connect(
    host: str,
    port: int,
    options: CallOptions | None = None,
    *,
    secure: bool = False,
    port_hint: str = "use the server's HTTP/2 (gRPC) address",
) -> AsyncIterator[ClientConnection]:
    """Dial ``host:port`` (TLS when ``secure``, with ``options.tls``), speak HTTP/2 and wait for the
    server's SETTINGS (:func:`await_server_settings`); then the reader and keepalive run until the
    block is left. ``port_hint`` says which address the caller should have used, for the errors of
    a connection that reached something else (the router's or the admin API's port, say).

    Leaving the block resets the calls still open, says GOAWAY (after the server's own GOAWAY that
    is all we send) and closes the socket.
    """
    options = options or CallOptions()
    tls = (options.tls or ClientTLS()) if secure else None
    stream = await dial(host, port, tls=tls, alpn="h2", timeout=options.connect_timeout, port_hint=port_hint)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    transport = H2Transport(stream, conn)
    try:
        await await_server_settings(transport, f"{host}:{port}", secure, options.settings_timeout, port_hint)
        connection = ClientConnection(transport, host, port, secure)
        keepalive = functools.partial(
            transport.keepalive, options.keepalive_interval, options.keepalive_timeout
        )
        async with with_background(connection.read_loop, keepalive):
            try:
                yield connection
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    for st in list(transport.streams.values()):
                        if not (st.local_ended and st.remote_ended):
                            await st.reset(ErrorCodes.CANCEL)  # a no-op once h2 saw a GOAWAY
                    if transport.error is None or isinstance(transport.error, GoAwayReceived):
                        # RFC 9113 6.8: an endpoint done with a connection says GOAWAY before it
                        # closes it; after the server's GOAWAY that is all we send.
                        await transport.goaway(ErrorCodes.NO_ERROR)
    finally:
        await trio.aclose_forcefully(stream)


def split_url(url: str, schemes: tuple[str, ...] = ("http", "https")) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a server URL, with the scheme's default port; a clear error for
    a scheme outside ``schemes`` or a URL without a host."""
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        raise ValueError(f"server URL {url!r}: scheme must be {', '.join(schemes[:-1])} or {schemes[-1]}")
    if not parts.hostname:
        raise ValueError(f"server URL {url!r} has no host")
    secure = parts.scheme in ("https", "wss")
    return parts.scheme, parts.hostname, parts.port or (443 if secure else 80)


@asynccontextmanager
async def server_stream(
    url: str,
    path: str,
    request: bytes,
    options: CallOptions | None = None,
    *,
    port_hint: str = "use the server's HTTP/2 (gRPC) address",
) -> AsyncIterator[ServerStreamCall]:
    """Call the server-streaming method at ``path`` on ``url`` (``http://`` or ``https://``) with
    one ``request`` message; leaving the block cancels the call and closes the connection.
    ``port_hint`` says which address the caller should have used, for the errors of a connection
    that reached something else (the router's or the admin API's port, say)."""
    options = options or CallOptions()
    scheme, host, port = split_url(url)
    async with connect(host, port, options, secure=scheme == "https", port_hint=port_hint) as connection:
        st = connection.open_call(path, options, stream=RpcClientStream)
        await st.send_data(envelope.encode(request, 0, options.max_message_size), end_stream=True)
        yield ServerStreamCall(st)
