"""The router's HTTP/1.1 client to engines: one keep-alive connection on a plain non-blocking
socket (``UpstreamConn``; ``router.pool`` keeps them), the request sent on it
(``request_bytes``), the response head read from it (``UpstreamConn.read_head``), and what went
wrong before a response began, as the retries and the metrics name it (``classify``)."""

from __future__ import annotations

import os
import socket

import trio

from router.framing import ResponseHead, UpstreamError, parse_response_head
from router.http1 import Request
from router.pumpconst import RECEIVE_SIZE
from router.relay import EngineFailedEarly
from router.routes import EngineAddress

#: Request headers passed to the engine; the rest (the client's SDK telemetry, cookies) is noise there.
#: The W3C trace context goes through as it came while the router traces nothing itself, so an
#: engine that traces (vLLM's --otlp-traces-endpoint) still joins the client's trace.
FORWARDED_REQUEST_HEADERS = frozenset(
    {b"content-type", b"accept", b"x-request-id", b"user-agent", b"traceparent", b"tracestate"}
)
_TRACE_CONTEXT = (b"traceparent", b"tracestate")


def request_bytes(
    request: Request,
    target: EngineAddress,
    api_key: str = "",
    *,
    pass_authorization: bool,
    trace_context: bytes = b"",
) -> bytes:
    """The request head and body for the engine. An engine with a key of its own (``api_key``)
    gets that key and never the client's (the client's is for the router's ``api_keys``); one
    without gets the client's ``Authorization`` only with ``pass_authorization`` (a router that
    checks no key itself, in front of a static endpoint that wants the client's own credentials).
    ``trace_context``: the router's own ``traceparent`` (and ``tracestate``) header lines, each
    beginning with CRLF (``router.tracing.start``), sent instead of the client's."""
    body = request.body
    lines = [
        request.method,
        b" ",
        target.base_path,
        request.target,
        b" HTTP/1.1\r\nhost: ",
        target.host_header,
    ]
    lines.append(b"\r\ncontent-length: ")
    lines.append(str(len(body)).encode())
    if api_key:
        lines += (b"\r\nauthorization: Bearer ", api_key.encode())
    for name, value in request.headers:
        if name in FORWARDED_REQUEST_HEADERS or (
            name == b"authorization" and pass_authorization and not api_key
        ):
            if trace_context and name in _TRACE_CONTEXT:
                continue
            lines += (b"\r\n", name, b": ", value)
    if trace_context:
        lines.append(trace_context)
    lines.append(b"\r\n\r\n")
    lines.append(body)
    return b"".join(lines)


def classify(exc: OSError | trio.TooSlowError | UpstreamError | EngineFailedEarly) -> UpstreamError:
    """What went wrong with an upstream before its response head, as the retries and the metrics
    name it."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, EngineFailedEarly):  # the relay pump's thread saw it (Relay.respond_whole)
        if not exc.errno:
            return UpstreamError("closed", str(exc), got_bytes=exc.got_bytes)
        exc = OSError(exc.errno, os.strerror(exc.errno))  # the subclass that names the errno
    if isinstance(exc, trio.TooSlowError):
        return UpstreamError("timeout", "timed out")
    if isinstance(exc, ConnectionRefusedError):
        return UpstreamError("connect", f"connection refused ({exc.strerror or exc})")
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return UpstreamError("reset", f"connection reset ({exc.strerror or exc})")
    return UpstreamError("connect", exc.strerror or str(exc) or type(exc).__name__)


class UpstreamConn:
    """One keep-alive connection to an engine, on a plain non-blocking socket.

    Each call that may block waits on readiness with trio (a checkpoint, so cancellation works)
    and then does one system call; this is the leanest loop trio allows."""

    __slots__ = ("idle_since", "sock", "url")

    def __init__(self, sock: socket.socket, url: str) -> None:
        self.sock = sock
        self.url = url
        self.idle_since = 0.0

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            view = view[sent:]

    def recv_nowait(self) -> bytes | None:
        """What has arrived, without waiting (None: nothing yet). On a busy machine the engine has
        often answered by the time this process gets a CPU back after sending; reading at once
        then saves a trip through the scheduler on the path to the first byte."""
        try:
            return self.sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return None

    async def recv(self) -> bytes:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                return self.sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                continue

    async def read_head(self, buf: bytes = b"") -> tuple[ResponseHead, bytes]:
        """The engine's response head (after any 1xx heads), and the body bytes that came with
        it; ``buf`` is what was read already."""
        data = buf or self.recv_nowait()
        buf = b""
        while True:
            if data is None:
                data = await self.recv()
            if not data:
                what = "closed the connection before responding" if not buf else "closed mid response head"
                raise UpstreamError("closed", what, got_bytes=bool(buf))
            buf += data
            data = None
            parsed = parse_response_head(buf)
            if parsed is None:
                continue
            head, used = parsed
            buf = buf[used:]
            while head.status < 200:  # 100 Continue and friends: skip to the real response
                parsed = parse_response_head(buf)
                if parsed is None:
                    break
                head, used = parsed
                buf = buf[used:]
            if head.status >= 200:
                return head, buf

    def looks_alive(self) -> bool:
        """An idle keep-alive connection has nothing to read; end of file (the engine's idle
        timeout) or stray bytes both mean it cannot carry another request."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
