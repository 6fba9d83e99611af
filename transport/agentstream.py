"""The agent's end of the stream: ``open_stream(url)`` for gRPC, Connect or WebSocket, with TLS.

Over HTTP/2 the stream is one call on a :class:`transport.client.ClientConnection`; the URL scheme
picks the carrier:

- ``http://host:port``: HTTP/2 cleartext with prior knowledge (h2c; no HTTP/1.1 upgrade dance);
- ``https://host:port``: TLS with ALPN ``h2``, optionally presenting a client certificate (mutual TLS);
- ``ws://`` and ``wss://``: the same envelopes in binary WebSocket messages, for networks whose proxies
  speak only HTTP/1.1.

Over HTTP/2 nothing but the connection preface and our SETTINGS leaves before the server's SETTINGS
arrive (see :func:`transport.client.connect`): a peer that has not spoken HTTP/2 gets neither the
node's metadata nor its Register.

Whatever carries it, the caller gets an :class:`AgentStream`: ``send`` an ``AgentMessage``, ``receive``
``ControlMessage`` values until ``None`` (the server ended the stream with OK). Every failure is a typed
exception: :class:`schema.rpc.RpcError` for a status the server sent, :class:`transport.h2io.TransportError`
subclasses for the connection (``ConnectionLost``, ``PeerUnresponsive``, ``GoAwayReceived``,
``StreamReset``). Background tasks never raise into the caller's body; they record the error, and the
next ``send`` or ``receive`` raises it, so a session sees every failure in the one place it waits.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast
from urllib.parse import urlsplit

import trio
import trio_websocket

import schema
from schema import envelope
from schema.rpc import Code, RpcError, decode_connect_end_stream
from transport.client import (
    CallOptions,
    RpcClientStream,
    closed_hint,
    connect,
    dial,
    split_url,
    with_background,
)
from transport.h2io import ConnectionLost, PeerUnresponsive, TransportError, peer_text
from transport.tls import ClientTLS


class AgentStream:
    """One agent stream, whatever protocol carries it."""

    protocol: str

    async def send(self, message: schema.AgentMessage) -> None:
        raise NotImplementedError

    async def receive(self) -> schema.ControlMessage | None:
        """The next command, or ``None`` once the server ended the stream with OK."""
        raise NotImplementedError

    async def close_send(self) -> None:
        """Half-close: tell the server we will send nothing more."""
        raise NotImplementedError

    async def __aiter__(self) -> AsyncIterator[schema.ControlMessage]:
        while (message := await self.receive()) is not None:
            yield message


def _parse_control(payload: bytes) -> schema.ControlMessage:
    try:
        return schema.ControlMessage.parse(payload)
    except Exception as exc:
        raise RpcError(
            Code.INTERNAL, f"malformed ControlMessage ({len(payload)} bytes): {type(exc).__name__}: {exc}"
        ) from exc


@asynccontextmanager
async def open_stream(url: str, options: CallOptions | None = None) -> AsyncIterator[AgentStream]:
    """Connect to ``url`` and open ``AgentService/Connect``; closing the context ends the stream."""
    options = options or CallOptions()
    scheme, host, port = split_url(url, ("http", "https", "ws", "wss"))
    if scheme in ("ws", "wss"):
        async with _open_websocket(url, scheme == "wss", options) as ws_stream:
            yield ws_stream
        return
    async with _open_h2(host, port, scheme == "https", options) as h2_stream:
        yield h2_stream


#: Where agents connect, for the hints of a connection that reached something else.
AGENT_PORT_HINT = "agents connect to the control plane's [listen] agents address"


class _H2ClientStream(RpcClientStream, AgentStream):
    def _explain(self, exc: TransportError) -> TransportError:
        """A TLS server that refuses our client certificate (TLS 1.3 checks it after our side of the
        handshake is done) just closes the connection: say what that most likely means."""
        secure = isinstance(self.transport.stream, trio.SSLStream)
        if secure and self.http_status is None and isinstance(exc, ConnectionLost):
            return ConnectionLost(f"{exc}{closed_hint(True, AGENT_PORT_HINT)}")
        return exc

    async def receive(self) -> schema.ControlMessage | None:
        while True:
            try:
                env = await self.receive_envelope()
            except TransportError as exc:
                raise self._explain(exc) from exc
            if env is None:
                self._raise_final_status()
                return None
            if env.end_stream:
                if self.protocol != "connect":
                    raise RpcError(Code.INTERNAL, "end-of-stream envelope in a gRPC response")
                self.on_connect_end(env.payload)
                continue
            if env.compressed:
                raise RpcError(Code.INTERNAL, "server sent a compressed message; none was negotiated")
            return _parse_control(env.payload)

    def _raise_final_status(self) -> None:
        error = self.final_status(f"the server does not serve {schema.CONNECT_PATH}: {AGENT_PORT_HINT}")
        if error is not None:
            raise error

    async def send(self, message: schema.AgentMessage) -> None:
        if self.remote_ended:
            self._raise_final_status()
            raise RpcError(Code.FAILED_PRECONDITION, "the server already ended the stream")
        try:
            await self.send_message(bytes(message))
        except TransportError as exc:
            if self.remote_ended:
                self._raise_final_status()  # the server's status says more than the reset after it
            raise self._explain(exc) from exc

    async def close_send(self) -> None:
        if not self.local_ended:
            await self.send_data(b"", end_stream=True)


@asynccontextmanager
async def _open_h2(host: str, port: int, secure: bool, options: CallOptions) -> AsyncIterator[AgentStream]:
    async with connect(host, port, options, secure=secure, port_hint=AGENT_PORT_HINT) as connection:
        st = connection.open_call(schema.CONNECT_PATH, options, stream=_H2ClientStream)
        await connection.transport.flush()
        yield st


# -- WebSocket ---------------------------------------------------------------------------------------


class _WsClientStream(AgentStream):
    def __init__(self, ws: trio_websocket.WebSocketConnection, options: CallOptions) -> None:
        self.ws = ws
        self.options = options
        self.protocol = "websocket"
        self.error: TransportError | None = None
        self.done = False
        self.local_ended = False

    def _closed(self, exc: trio_websocket.ConnectionClosed) -> TransportError:
        if self.error is not None:
            return self.error
        reason = exc.reason
        if reason is None:
            return ConnectionLost("websocket closed")
        return ConnectionLost(f"websocket closed ({reason.code} {reason.name}): {reason.reason or ''}")

    async def receive(self) -> schema.ControlMessage | None:
        if self.done:
            return None
        try:
            data = await self.ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from exc
        if isinstance(data, str):
            raise RpcError(Code.INTERNAL, "text WebSocket message from the server; expected binary envelopes")
        try:
            env = envelope.decode_one(bytes(data), self.options.max_message_size)
        except envelope.FramingError as exc:
            raise RpcError(Code.INTERNAL, f"malformed message from the server: {exc}") from exc
        if env.end_stream:
            self.done = True
            status = decode_connect_end_stream(env.payload)
            if status is not None:
                raise status
            return None
        return _parse_control(env.payload)

    async def send(self, message: schema.AgentMessage) -> None:
        if self.error is not None:
            raise self.error
        try:
            await self.ws.send_message(envelope.encode(bytes(message), 0, self.options.max_message_size))
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from exc

    async def close_send(self) -> None:
        if self.local_ended:
            return
        self.local_ended = True
        try:
            await self.ws.send_message(envelope.encode(b"{}", envelope.FLAG_END_STREAM))
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from exc

    async def keepalive(self) -> None:
        """WebSocket PING with a timeout: the same dead-peer bound as the HTTP/2 carrier."""
        interval, timeout = self.options.keepalive_interval, self.options.keepalive_timeout
        if interval <= 0 or math.isinf(interval):
            return
        while True:
            await trio.sleep(interval)
            with trio.move_on_after(timeout) as scope:
                try:
                    await self.ws.ping()
                except trio_websocket.ConnectionClosed:
                    return
            if scope.cancelled_caught:
                self.error = PeerUnresponsive(f"peer did not answer a WebSocket PING within {timeout:g} s")
                await trio.aclose_forcefully(self.ws._stream)
                return


@asynccontextmanager
async def _open_websocket(url: str, secure: bool, options: CallOptions) -> AsyncIterator[AgentStream]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    path = parts.path if parts.path not in ("", "/") else schema.WEBSOCKET_PATH
    stream = await dial(
        host,
        port,
        tls=(options.tls or ClientTLS()) if secure else None,
        alpn="http/1.1",
        timeout=options.connect_timeout,
        port_hint=AGENT_PORT_HINT,
    )
    extra = [(k.lower().encode(), v.encode()) for k, v in options.metadata.items()]
    extra.append((b"user-agent", options.user_agent.encode()))
    try:
        async with with_background() as nursery:
            try:
                with trio.fail_after(options.connect_timeout):
                    ws = await trio_websocket.wrap_client_stream(
                        nursery,
                        # Typed for an SSLStream straight over a socket; ours has a recorder between
                        # (see transport.client.dial), which is a trio Stream all the same.
                        cast("trio.SocketStream | trio.SSLStream[trio.SocketStream]", stream),
                        f"{host}:{port}",
                        path,
                        extra_headers=extra,
                        max_message_size=options.max_message_size + envelope.HEADER_SIZE,
                    )
            except trio_websocket.HandshakeError as exc:
                raise ConnectionLost(_ws_refused(url, exc)) from exc
            ws_stream = _WsClientStream(ws, options)
            nursery.start_soon(ws_stream.keepalive)
            try:
                yield ws_stream
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await ws.aclose()
    except BaseExceptionGroup as group:
        # trio-websocket raises a refused handshake (an HTTP answer other than 101) in its reader
        # task, in our nursery: a group, which the reconnect loop would log as a traceback.
        refused = group.subgroup(trio_websocket.HandshakeError)
        if refused is None:
            raise
        first = _leaves(refused)[0]
        assert isinstance(first, trio_websocket.HandshakeError)
        raise ConnectionLost(_ws_refused(url, first)) from group
    finally:
        await trio.aclose_forcefully(stream)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _ws_refused(url: str, exc: trio_websocket.HandshakeError) -> str:
    """The server's refusal of our WebSocket handshake, in words (its text escaped and bounded)."""
    if not isinstance(exc, trio_websocket.ConnectionRejected):
        return f"WebSocket handshake with {url} failed: {exc}"
    body = bytes(exc.body or b"").strip()
    text = f"WebSocket handshake with {url} refused: HTTP {exc.status_code}" + (
        f": {peer_text(body)}" if body else ""
    )
    if exc.status_code not in (400, 503):  # an agent port's own refusals say what is wrong
        text += f"; the server does not serve {schema.WEBSOCKET_PATH}: is this the router or admin port? "
        text += AGENT_PORT_HINT
    return text
