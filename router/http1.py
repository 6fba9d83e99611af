"""The router's side of its clients' HTTP/1.1 connections: requests read with httptools, responses framed here.

Requests are parsed by httptools, which is llhttp (Node's parser, in C) behind a callback
interface: the request line, headers and body (content-length or chunked) are parsed in C and
reach Python as one call per header, since this code is on every request's path to its first
byte (why not h11: docs/router.md). Framing a response is string formatting:
the status line, headers the router chose or relayed (``router.framing.parse_response_head``
already refused engine headers with bare CR or LF), and the body's framing, which depends only on
the client's HTTP version.

What an HTTP/1.1 server owes its clients, and where it is done here
-------------------------------------------------------------------
- Keep-alive and pipelining: ``RequestReader`` queues complete requests in arrival order; the
  router answers them one at a time. ``Connection: close``, HTTP/1.0 and an ``Upgrade`` (not
  taken) end the connection after their response, which then says ``connection: close``.
- ``Expect: 100-continue``: ``100 Continue`` is sent when the router waits for that body, and
  not when the declared length is over the limit (413 instead, without reading the body).
- Limits: the request head (64 KiB: 431) and the body (``max_body_bytes``: 413). What a client
  pipelines ahead of the response in progress is not read until that response ends.
- Time limits (``ClientConn.next_request``): a request's head must be complete within the header
  timeout of its first byte, a new connection's first head within it of the accept (a slowloris
  client, sending its head a byte at a time, is closed then); a connection idle between requests
  is closed after the idle timeout, and so is a body that falls silent that long.
- A request that cannot be read gets an OpenAI-shaped error and ``connection: close``; the router
  then stops sending and reads what is left for up to a second before closing, so that the
  client's unsent bytes do not turn the close into a reset that destroys the error response.
- The client hanging up while a response is produced cancels it (``ClientConn.watch``): that is
  how the engine learns the client left.
"""

from __future__ import annotations

import collections
import http
import json
import math
import os
import select
from collections.abc import Iterable
from typing import Any

import attrs
import httptools
import trio

from router.pumpconst import RECEIVE_SIZE

#: Largest request head (request line and headers) the router reads.
MAX_REQUEST_HEAD = 64 * 1024

#: Deepest nesting of arrays and objects a JSON request body may have. Python's parser recurses
#: once per level and would fail near its recursion limit (about 1,000, less the stack in use) with
#: a RecursionError, which is no answer to a malformed body; a fixed bound is one the client can be
#: told. OpenAI requests nest a few levels (tools' JSON schemas a few dozen), and 128 is also
#: serde_json's default limit, which Rust-based engines and gateways apply.
MAX_JSON_DEPTH = 128

#: Brackets become parentheses, quotes stay, and every other byte goes (``bytes.translate``).
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')

#: ``RequestReader.phase``: nothing of a next request read, a head in progress, a body in progress.
IDLE = "idle"
HEAD = "head"
BODY = "body"

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


class RequestError(Exception):
    """A request that cannot be read: answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.define(slots=True)
class Request:
    """One complete request. Header names are lower case; values are stripped of outer blanks."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    http11: bool
    #: Whether the connection stays open after the response (HTTP/1.1 without ``Connection: close``
    #: and without an Upgrade; HTTP/1.0 connections are closed after one response).
    keep_alive: bool


class RequestReader:
    """Feeds a client's bytes to llhttp and keeps the complete requests, in order.

    Errors are recorded, not raised, because llhttp calls back from C in the middle of
    ``feed_data``: ``error`` is set once, and the reader ignores everything after it."""

    def __init__(self, *, max_body: int, max_head: int = MAX_REQUEST_HEAD) -> None:
        self.max_body = max_body
        self.max_head = max_head
        self.ready: collections.deque[Request] = collections.deque()
        self.error: RequestError | None = None
        #: The request being read asked for ``100 Continue`` and its body has not arrived.
        self.continue_wanted = False
        #: The client asked to switch protocols; the bytes after that request are not HTTP.
        self.upgraded = False
        self._parser = httptools.HttpRequestParser(self)
        self._in_head = False
        self._began = False
        self._head_fed = 0
        self._head_size = 0
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._http11 = True
        self._keep_alive = True
        self._method = b""
        self._in_body = False

    @property
    def phase(self) -> str:
        """Where the request being read stands: ``HEAD`` from its first byte until its head is
        complete, ``BODY`` until its body is, else ``IDLE`` (nothing of a next request yet)."""
        if self._in_head:
            return HEAD
        return BODY if self._in_body else IDLE

    @property
    def done(self) -> bool:
        """Nothing more will be read: an error, or the protocol was switched away from HTTP."""
        return self.error is not None or self.upgraded

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        self._began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # the request before the switch is complete and answered
        except httptools.HttpParserError as exc:
            if self.error is None:
                self._fail(400, f"malformed HTTP request: {exc}")
            return
        if self._in_head and not self._began:
            # A head still incomplete after a whole receive: llhttp keeps a partial header in
            # memory, so bound it here (loosely: within one receive of the limit).
            self._head_fed += len(data)
            if self._head_fed > self.max_head:
                self._fail(431, f"request header block over {self.max_head} bytes")

    def _fail(self, status: int, message: str) -> None:
        if self.error is None:
            self.error = RequestError(status, message)
        self.continue_wanted = False

    # -- llhttp callbacks (``httptools.HTTPProtocol``) ---------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = self._began = True
        self._head_fed = self._head_size = self._size = 0
        self._url = []
        self._headers = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value.strip()))
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        if self._head_size > self.max_head:
            self._fail(431, f"request header block over {self.max_head} bytes")
            return
        parser = self._parser
        self._method = parser.get_method()
        self._http11 = parser.get_http_version() == "1.1"
        self._keep_alive = self._http11 and parser.should_keep_alive() and not parser.should_upgrade()
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                self._fail(413, f"request body over {self.max_body} bytes ({int(value)} declared)")
                return
            if name == b"expect" and value.lower() == b"100-continue" and self._http11:
                self.continue_wanted = True

    def on_body(self, body: bytes) -> None:
        if self.error is not None:
            return
        self._size += len(body)
        if self._size > self.max_body:
            self._fail(413, f"request body over {self.max_body} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.continue_wanted = False
        self._in_body = False
        if self.error is not None:
            return
        body = b"".join(self._body)
        self.ready.append(
            Request(self._method, b"".join(self._url), self._headers, body, self._http11, self._keep_alive)
        )
        self._body = []

    def take(self) -> Request:
        return self.ready.popleft()


class ClientConn:
    """One client connection: the requests read from it, and its hang-up watch.

    The connection's handler is the only reader of the socket (``next_request``), so a request's
    bytes reach the code that answers it without a task switch, and bytes a client pipelines
    while a response is produced stay in the kernel's buffer (TCP's flow control is the backlog
    limit). The client's hang-up is watched apart from its data: a per-connection epoll set holds
    the socket for ``EPOLLRDHUP`` only, and the connection's watcher task (``watch``) waits on
    that set once, for the connection's whole life.

    ``scope`` is the cancel scope around everything the connection's handler does. When the
    client closes, or its connection breaks, it is cancelled at once: the response in progress
    ends (closing its engine connection is how the engine learns the client left), and so does
    the connection. While ``next_request`` waits for a request, the same scope's deadline is the
    header timeout (a head in progress, or a new connection's first), or the idle timeout (between
    requests, or a body's silence); ``timed_out`` then says which fired. Nothing is started,
    stopped or re-registered per request, since anything that is costs every request's way to the
    next one (docs/router.md has what the alternatives cost)."""

    def __init__(
        self,
        stream: trio.SocketStream,
        reader: RequestReader,
        scope: trio.CancelScope,
        idle_timeout: float,
        header_timeout: float = math.inf,
    ) -> None:
        self.stream = stream
        self.fd = stream.socket.fileno()
        self.reader = reader
        self.scope = scope
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        #: When the head being read must be complete: the first one's counts from the accept (and
        #: is never later than an idle connection's), a later one's from its first byte.
        self._head_deadline: float | None = trio.current_time() + min(header_timeout, idle_timeout)
        #: The phase (``HEAD``, ``IDLE``, ``BODY``) whose time limit closed the connection, or "".
        self.timed_out = ""
        self.eof = False
        #: The router is stopping: the connection ends where it would wait for a next request.
        self.closing = False
        #: Waiting for a next request of which nothing has arrived: what a stopping router closes.
        self.idle = False
        self._continued = False
        self._hangup = select.epoll(1)
        self._hangup.register(self.fd, select.EPOLLRDHUP)

    def _feed(self, data: bytes) -> None:
        if data:
            self.reader.feed(data)
            return
        self._hung_up()

    def _hung_up(self) -> None:
        self.eof = True
        self.scope.cancel()

    async def next_request(self) -> Request | None:
        """The next request, once it is complete; None when the client closed or switched protocols.
        Raises ``RequestError`` when what the client sent cannot be read. A request that is not
        complete within ``idle_timeout`` of the first wait for it cancels ``scope``."""
        reader = self.reader
        scope = self.scope
        waited = False
        idle_until = math.inf
        try:
            while True:
                if reader.ready:
                    self._continued = False
                    self._head_deadline = None
                    return reader.take()
                if reader.error is not None:
                    raise reader.error
                if reader.upgraded:
                    return None
                if reader.continue_wanted and not self._continued:
                    self._continued = True
                    await self.stream.send_all(CONTINUE)
                try:
                    # Bytes already there are read at once, and otherwise the wait is trio's
                    # readiness wait and one read: trio's receive_some would pass through the
                    # scheduler first, and a client that sends its next request as soon as a
                    # response ends finds the router here.
                    data = os.read(self.fd, RECEIVE_SIZE)
                except BlockingIOError:
                    waited = True
                    now = trio.current_time()
                    phase = reader.phase
                    if phase == IDLE and self.closing:
                        return None
                    if phase == BODY:
                        scope.deadline = now + self.idle_timeout  # a body's silence
                    elif phase == HEAD or self._head_deadline is not None:  # or a new connection
                        if self._head_deadline is None:  # a later request's head: from its first byte
                            self._head_deadline = now + self.header_timeout
                        scope.deadline = self._head_deadline
                    else:
                        if idle_until == math.inf:
                            idle_until = now + self.idle_timeout
                        scope.deadline = idle_until
                    self.idle = phase == IDLE
                    try:
                        await trio.lowlevel.wait_readable(self.fd)
                    except trio.Cancelled:
                        if not self.eof and trio.current_time() >= scope.deadline:
                            self.timed_out = phase
                        raise
                    finally:
                        self.idle = False
                    continue
                except OSError:  # reset by the client
                    data = b""
                self._feed(data)
                if self.eof:
                    return None
        finally:
            if waited:
                scope.deadline = math.inf

    async def watch(self) -> None:
        """The connection's watcher task: returns once the client has hung up (a closed or
        half-closed connection, a reset), having cancelled the connection's scope."""
        try:
            while True:
                await trio.lowlevel.wait_readable(self._hangup.fileno())
                if self._hangup.poll(0):
                    break
        except trio.ClosedResourceError:
            return
        self._hung_up()

    def close(self) -> None:
        """Release the hang-up watch (after the watcher task has ended)."""
        trio.lowlevel.notify_closing(self._hangup.fileno())
        self._hangup.close()

    async def linger(self, seconds: float = 1.0) -> None:
        """After an error response: stop sending and let the reader discard what the client still
        sends, for up to ``seconds``, so that closing does not reset the connection while the
        client's unsent bytes (a body the router refused) are in flight."""
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        with trio.move_on_after(seconds):
            while True:
                try:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return


def response_head(
    status: int, headers: Iterable[tuple[bytes, bytes]], *, close: bool, reason: bytes = b""
) -> bytes:
    """A response's status line and headers, ``connection: close`` added when ``close``."""
    return status_block(status, headers, reason) + end_of_head((), close=close)


def status_block(status: int, headers: Iterable[tuple[bytes, bytes]], reason: bytes = b"") -> bytes:
    """The status line and ``headers``, without the end of the head (``end_of_head``). The relay
    pump's thread writes the same for the engine heads it relays itself (``_pump.c``,
    ``client_head``)."""
    if not reason:
        try:
            reason = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    return b"".join(lines)


def end_of_head(headers: Iterable[tuple[bytes, bytes]], *, close: bool) -> bytes:
    """The end of a response head: the last ``headers``, ``connection: close`` when ``close``,
    and the blank line."""
    lines: list[bytes] = []
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (empty data would end the body: the caller skips it)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def json_depth(body: bytes) -> int:
    """How deep a parser descends into ``body``'s arrays and objects (brackets inside strings do not
    count), or an upper bound of it: a body with no more opening brackets than ``MAX_JSON_DEPTH``
    answers their count, and a malformed one may answer more than its depth, never less.

    Every step is a C loop over bytes: the escapes that could hide a quote go (an escaped
    backslash, then an escaped quote), then every byte but brackets and quotes; splitting on the
    quotes drops what strings held; then each pass deletes the innermost pairs, one level a pass,
    and at most ``MAX_JSON_DEPTH + 1`` passes run. Openers left unclosed count too: a parser
    descends into them before it finds the body malformed ("[" * 100000)."""
    openers = body.count(b"[") + body.count(b"{")
    if openers <= MAX_JSON_DEPTH:
        return openers
    kept = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_BRACKETS, _NOT_STRUCTURE)
    nesting = b"".join(kept.split(b'"')[::2])
    depth = 0
    while depth <= MAX_JSON_DEPTH:
        inner = nesting.replace(b"()", b"")
        if len(inner) == len(nesting):
            break
        nesting = inner
        depth += 1
    return depth + nesting.count(b"(")


def json_body(body: bytes) -> Any:
    """A request body parsed as JSON; a body that is not JSON, or is nested deeper than
    ``MAX_JSON_DEPTH``, is a ``RequestError`` (400) saying so, like every other malformed body."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(
            400,
            f"the request body nests arrays and objects {depth} levels deep; the router accepts at "
            f"most {MAX_JSON_DEPTH}",
        )
    try:
        return json.loads(body)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # not below the limit, but should the stack already be deep
        raise RequestError(
            400, f"the request body nests too deep to parse; the router accepts at most {MAX_JSON_DEPTH}"
        ) from None
