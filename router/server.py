"""The router: an OpenAI-compatible HTTP API that sends traffic straight to the engines.

It is served by the control plane's process (``Router(plane_routes)``) or alone with a static endpoint
list (``python -m router --static MODEL=URL``). Either way it talks only to engine URLs, so
engines keep serving while the agent or the control plane restarts.

Why it is built this way
------------------------
Byte transparency. A request body is forwarded as it came; JSON is parsed once, only to read ``model``
and the prompt prefix. A response is relayed as it arrives: its status, its end-to-end headers and its
body. A streamed (SSE) body that the engine sends with chunked framing goes to an HTTP/1.1 client in
that same framing, byte for byte: the router only scans the chunk-size lines to find where the body
ends (``ChunkedScanner``), so no event is decoded, re-encoded or re-framed on the way.

Cost per token. Everything on the path of a streamed chunk is one readiness wait on the engine's
socket, one ``recv``, one scan and one ``write`` to the client. Both sides therefore drive sockets
themselves: the client side is ``router.http1`` (httptools, that is llhttp in C, reads requests;
responses are framed there), and the engine side is a small HTTP/1.1 client on plain non-blocking
sockets with a keep-alive pool (``_Pool``). An ASGI stack and httpx add several task switches and
copies per chunk; on two cores that is the difference between tens and hundreds of microseconds of
CPU per relayed chunk. The chunks themselves, and with the native pump the usual response head
before them (HTTP/1.1 200, chunked), are moved by the relay pump (``router.relay``), so a streamed
request wakes its task once, when its body has ended (``_respond_whole``).

Choosing a replica (``Balancer``). Least outstanding requests, with prefix affinity: the first
``affinity_chars`` characters of the prompt (chat messages concatenated, or ``prompt``, or ``input``)
are hashed, the model's upstreams are ranked by rendezvous hashing of that digest with each URL,
and the request goes to the highest-ranked upstream whose outstanding count is at most the lowest
count among them plus ``affinity_slack``. Requests sharing a prefix therefore land on the engine that
already holds that prefix's KV cache while it is not overloaded, and spill to the least loaded one
when it is; rendezvous ranking moves only the prefixes of a replica that comes or goes. Requests with
no prompt go to the least loaded upstream (ties at random).

Failures. A failure before any response byte reached the client (connect refused or timed out,
reset, closed before a status line, or an HTTP 503 while another replica is left to try) moves the
request to another replica, at most ``max_attempts`` replicas; when all fail the client gets a 502
naming each failure. A pooled connection that the engine had already closed is redone once on a
fresh one and not counted. ``eject_after`` consecutive failures eject an upstream for
``eject_base`` seconds, doubling per consecutive ejection up to ``eject_max``; after an ejection one
more failure ejects it again, and one success clears the record. When every upstream of a model is
ejected they are tried anyway: refusing outright would turn a blip into an outage.

Silent engines. An engine that accepted a request and went quiet (hung, SIGSTOPped, a black hole)
is cut off: ``response_timeout`` bounds the wait for its first response byte, and
``stream_idle_timeout`` the silence after that. One task, the stall watch, checks every request in
flight a few times per timeout against its engine socket's counters, which the kernel keeps
anyway (``tcp_progress``), so neither pump does any per-chunk bookkeeping for it. A timeout
before anything reached the client is a 504 naming the replica and the wait; one mid-stream ends
the stream with an SSE error event and the chunked body's end. Either way the replica is ejected
at once and the request is not retried (its client has waited the whole timeout; see
``_timed_out``).

Cancellation. The client connection's watcher task waits for the client to hang up
(``router.http1.ClientConn``); a hang-up during a response means the client left, and the
upstream connection is closed at once instead of going back to the pool, which is how an engine
(vLLM, SGLang, the simulator) learns to stop generating.

Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "code"}}``: 400 bad JSON or no model,
401 bad or missing bearer key (when keys are configured), 404 unknown model (naming the known ones),
503 no ready replica (with placement's reason), 502 every attempted upstream failed, 504 the
engine went silent (``_timed_out``).
``GET /health`` needs no key; ``GET /metrics`` (Prometheus text) wants ``metrics_key`` as a bearer
token when one is set, and answers loopback clients only when none is (``_authorize_metrics``).
Idle and slow clients are bounded by ``ClientLimits``: a header timeout, an idle timeout, a cap.

No global state: every counter, pool and table belongs to one ``Router``.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import random
import resource
import select
import socket
import struct
import sys
import termios
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, cast

import attrs
import trio

from router.framing import (
    CHUNKED,
    LENGTH,
    NO_BODY,
    UNTIL_CLOSE,
    ChunkedScanner,
    ResponseHead,
    UpstreamError,
    parse_response_head,
)
from router.framing import (
    UpstreamBroken as _UpstreamBroken,
)
from router.http1 import (
    LAST_CHUNK,
    ClientConn,
    Request,
    RequestError,
    RequestReader,
    chunk,
    end_of_head,
    response_head,
    status_block,
)
from router.relay import (
    DEFAULT_COALESCE_US,
    MAX_COALESCE_US,
    RECEIVE_SIZE,
    ClientGone,
    EngineClosed,
    EngineFailedEarly,
    NativeRelayPump,
    Pump,
    RelayClosed,
    Response,
    make_pump,
)
from router.routes import ModelRoutes, RoutesFn, Target, Upstream, parse_url, static_routes

log = logging.getLogger("llmgw.router")


CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"
EMBEDDINGS = b"/v1/embeddings"
MODELS = b"/v1/models"
PROXIED = frozenset({CHAT, COMPLETIONS, EMBEDDINGS})

#: Connection-level headers that describe one hop, never relayed (RFC 9110 7.6.1); the body's
#: framing headers are set by the router for the client's hop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
    }
)

#: Request headers passed to the engine; the rest (the client's SDK telemetry, cookies) is noise there.
FORWARDED_REQUEST_HEADERS = frozenset({b"content-type", b"accept", b"x-request-id", b"user-agent"})


# ---------------------------------------------------------------------------------------------
# Values


class RouterError(Exception):
    """A request the router answers itself, with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code

    def body(self) -> bytes:
        doc = {"error": {"message": self.message, "type": self.type, "code": self.code}}
        return json.dumps(doc).encode()


class _ClientGone(Exception):
    """The client's connection closed or broke while its response was being produced."""


# ---------------------------------------------------------------------------------------------
# Prompt prefix (affinity key)


def affinity_key(doc: Mapping[str, Any], limit: int) -> str:
    """The first ``limit`` characters of what the engine will see first: the chat messages (role
    and text parts), or ``prompt``, or ``input``. Shared system prompts and few-shot preambles make
    this the part an engine's prefix cache can reuse."""
    parts: list[str] = []
    size = 0

    def add(text: str) -> bool:
        nonlocal size
        parts.append(text)
        size += len(text)
        return size >= limit

    messages = doc.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            if add(f"{message.get('role', '')}\x00"):
                break
            content = message.get("content")
            if isinstance(content, str):
                if add(content + "\x00"):
                    break
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str) and add(part["text"]):
                        break
                if size >= limit:
                    break
    else:
        prompt = doc.get("prompt", doc.get("input"))
        if isinstance(prompt, str):
            add(prompt)
        elif isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str):
                add(first)
            elif isinstance(first, int):  # token ids
                add(" ".join(str(t) for t in prompt[:limit] if isinstance(t, int)))
            elif isinstance(first, list):  # a batch of token id lists
                add(" ".join(str(t) for t in first[:limit] if isinstance(t, int)))
    return "".join(parts)[:limit]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _score(digest: bytes, url: str) -> int:
    """Rendezvous weight of ``url`` for a prefix: a stable hash (not Python's salted ``hash``), so
    that several router processes send the same prefix to the same engine."""
    return int.from_bytes(hashlib.blake2b(digest + url.encode(), digest_size=8).digest(), "big")


# ---------------------------------------------------------------------------------------------
# Balancing and ejection: pure, clock passed in


@attrs.define
class Health:
    """What the router knows about one engine URL."""

    replica_id: str
    outstanding: int = 0
    failures: int = 0  # consecutive failures since the last success or ejection
    ejections: int = 0  # consecutive ejections without a success in between
    ejected_until: float = 0.0
    last_error: str = ""


class Balancer:
    """Least outstanding with prefix affinity, and outlier ejection (rules in the module docstring).

    State is keyed by URL, not replica id: load and health belong to the engine process listening
    there, and one engine serving two model names must count its load once."""

    def __init__(
        self,
        *,
        affinity_slack: int = 4,
        eject_after: int = 3,
        eject_base: float = 10.0,
        eject_max: float = 300.0,
        rng: random.Random | None = None,
    ) -> None:
        self.affinity_slack = affinity_slack
        self.eject_after = eject_after
        self.eject_base = eject_base
        self.eject_max = eject_max
        self.health: dict[str, Health] = {}
        self._rng = rng or random.Random()

    def _get(self, upstream: Upstream) -> Health:
        h = self.health.get(upstream.url)
        if h is None:
            h = self.health[upstream.url] = Health(upstream.replica_id)
        else:
            h.replica_id = upstream.replica_id
        return h

    def outstanding(self, url: str) -> int:
        h = self.health.get(url)
        return h.outstanding if h else 0

    def is_ejected(self, url: str, now: float) -> bool:
        h = self.health.get(url)
        return h is not None and h.ejected_until > now

    def choose(
        self,
        upstreams: Sequence[Upstream],
        digest: bytes | None,
        now: float,
        exclude: Iterable[str] = (),
    ) -> Upstream | None:
        """The upstream for the next attempt, or None when every one is excluded (already tried)."""
        skip = set(exclude)
        candidates = [u for u in upstreams if u.url not in skip]
        if not candidates:
            return None
        healthy = [u for u in candidates if not self.is_ejected(u.url, now)]
        pool = healthy or candidates
        if len(pool) == 1:
            return pool[0]
        loads = [self.outstanding(u.url) for u in pool]
        low = min(loads)
        if digest is not None:
            ranked = sorted(
                zip(pool, loads, strict=True), key=lambda p: _score(digest, p[0].url), reverse=True
            )
            for upstream, load in ranked:
                if load <= low + self.affinity_slack:
                    return upstream
        least = [u for u, load in zip(pool, loads, strict=True) if load == low]
        return least[0] if len(least) == 1 else self._rng.choice(least)

    def begin(self, upstream: Upstream) -> None:
        self._get(upstream).outstanding += 1

    def end(self, upstream: Upstream) -> None:
        self._get(upstream).outstanding -= 1

    def succeeded(self, upstream: Upstream) -> None:
        h = self._get(upstream)
        h.failures = 0
        h.ejections = 0

    def failed(self, upstream: Upstream, now: float, error: str, *, at_once: bool = False) -> float | None:
        """Record a failure; returns the ejection's length in seconds when this one ejects it.
        ``at_once``: a failure that ejects without waiting for ``eject_after`` of them (a timeout:
        the next request sent there would wait as long).

        Failures of requests that were already in flight when the upstream was ejected do not
        count again: a burst against a dead engine is one ejection, not an escalating series."""
        h = self._get(upstream)
        h.last_error = error
        if h.ejected_until > now:
            return None
        h.failures += 1
        threshold = 1 if h.ejections or at_once else self.eject_after
        if h.failures < threshold:
            return None
        h.ejections += 1
        h.failures = 0
        seconds = min(self.eject_base * 2.0 ** (h.ejections - 1), self.eject_max)
        h.ejected_until = now + seconds
        return seconds

    def prune(self, live: set[str], now: float) -> None:
        """Forget URLs no model routes to any more, once nothing is in flight on them and no
        ejection is pending (a replica that comes back on the same URL inherits its ejection)."""
        for url in [u for u, h in self.health.items() if u not in live]:
            h = self.health[url]
            if h.outstanding == 0 and h.ejected_until <= now:
                del self.health[url]


# ---------------------------------------------------------------------------------------------
# Upstream connections


class _UpstreamConn:
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


class _Pool:
    """Idle keep-alive connections per upstream URL, most recently used first (a warm one is
    least likely to have hit the engine's idle timeout)."""

    def __init__(self, *, max_idle: int, idle_timeout: float, connect_timeout: float) -> None:
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.idle: dict[str, list[_UpstreamConn]] = {}
        self.targets: dict[str, Target] = {}

    def target(self, url: str) -> Target:
        t = self.targets.get(url)
        if t is None:
            t = self.targets[url] = parse_url(url)
        return t

    def take_idle(self, url: str, now: float) -> _UpstreamConn | None:
        stack = self.idle.get(url)
        while stack:
            conn = stack.pop()
            if now - conn.idle_since < self.idle_timeout and conn.looks_alive():
                return conn
            conn.close()
        return None

    async def connect(self, url: str) -> _UpstreamConn:
        target = self.target(url)
        with trio.fail_after(self.connect_timeout):
            infos = await trio.socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
            error: OSError | None = None
            for family, type_, proto, _, addr in infos:
                sock = socket.socket(family, type_, proto)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    code = sock.connect_ex(addr)
                    if code == errno.EINPROGRESS:
                        await trio.lowlevel.wait_writable(sock)
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if code:
                        raise OSError(code, os.strerror(code))
                except OSError as exc:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
                    error = exc
                    continue
                except BaseException:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
                    raise
                return _UpstreamConn(sock, url)
        raise error or OSError(f"{target.host}: no address")

    def release(self, conn: _UpstreamConn, now: float) -> None:
        stack = self.idle.setdefault(conn.url, [])
        if len(stack) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = now
        stack.append(conn)

    def sweep(self, now: float, live: set[str]) -> None:
        """Close idle connections past the idle timeout or to URLs nothing routes to."""
        for url in list(self.idle):
            keep = []
            for conn in self.idle[url]:
                if url in live and now - conn.idle_since < self.idle_timeout:
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self.idle[url] = keep
            else:
                del self.idle[url]
                if url not in live:
                    self.targets.pop(url, None)

    def close_all(self) -> None:
        for stack in self.idle.values():
            for conn in stack:
                conn.close()
        self.idle.clear()

    def idle_counts(self) -> dict[str, int]:
        return {url: len(stack) for url, stack in self.idle.items()}


# ---------------------------------------------------------------------------------------------
# Idle and slow clients: the header timeout, the idle timeout and the connection cap

#: A request's head (request line and headers) must arrive within this many seconds of its first
#: byte; a new connection's first head within this of the accept. Real clients send a head in one
#: write, so ten seconds is generous for any network, and a slowloris client (a head sent a byte at
#: a time) holds its connection ten seconds, not for ever.
DEFAULT_HEADER_TIMEOUT = 10.0
#: An idle keep-alive connection (between requests) is closed after this many seconds. Longer than
#: the 60 s idle timeout of the load balancers that sit in front of routers (the balancer, not the
#: router, should close first, or it may send a request on a connection the router is closing),
#: the same as nginx's keepalive_timeout; clients' own pools (httpx: 5 s) close theirs sooner.
DEFAULT_CLIENT_IDLE_TIMEOUT = 75.0
#: Client connections served at once. Each costs two descriptors (the socket and its hang-up
#: watch) and one more while its request is relayed; 10,000 is far above what one router's
#: engines answer at once, and a router whose descriptor limit is lower lowers it (``serve``).
DEFAULT_MAX_CONNECTIONS = 10_000


@attrs.frozen
class ClientLimits:
    """What idle and slow clients may cost the router.

    Over ``max_connections`` a connection is answered ``503`` with ``retry-after: 1`` and closed,
    not queued: routers run several behind a load balancer, and a fast refusal lets the balancer
    or the client (the OpenAI SDKs retry 503 with backoff) go elsewhere, where a queue (a paused
    accept) would leave them waiting in the kernel's backlog with no answer and no way to tell an
    overloaded router from a dead one."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    idle_timeout: float = DEFAULT_CLIENT_IDLE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __attrs_post_init__(self) -> None:
        for name in ("header_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"the router's client {name} must be more than 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"the router's max_connections must be at least 1, got {self.max_connections}")


#: Descriptors per client connection: its socket, its hang-up watch, and an engine connection.
_FDS_PER_CONNECTION = 3
#: Descriptors kept for everything else: listeners, pooled engine connections, logs, the pump.
_FDS_RESERVED = 256


def connection_cap(wanted: int) -> int:
    """The connection cap this process's descriptor limit allows, ``wanted`` or less. The soft
    limit is raised towards the hard one first (as Go's runtime does at start: the soft default of
    1,024 is a relic of select()); if even the hard limit is short, one warning says so and the
    cap is lowered, so that over-cap clients get a 503 rather than an accept loop out of
    descriptors."""
    need = wanted * _FDS_PER_CONNECTION + _FDS_RESERVED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    cap = max(1, (soft - _FDS_RESERVED) // _FDS_PER_CONNECTION)
    log.warning(
        "router: a cap of %d client connections (router_max_connections, --max-connections) needs %d "
        "descriptors, this process may open %d (hard limit %s); serving at most %d client "
        "connections: raise the limit (LimitNOFILE= in the unit, ulimit -n) to serve more",
        wanted,
        need,
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        cap,
    )
    return cap


# ---------------------------------------------------------------------------------------------
# Silent engines: the response and stream idle timeouts

#: Until an engine's first response byte, from sending it the request. A non-streamed answer's
#: head comes only once the whole answer is generated, after any wait in the engine's queue: on a
#: busy engine a long answer takes minutes (4096 tokens at 20 a second is 205 s). Five minutes
#: lets that through and still frees a request that an engine accepted and never answered.
DEFAULT_RESPONSE_TIMEOUT = 300.0
#: The longest silence of an engine once its response has begun. Tokens come every few tens of
#: milliseconds, so a minute without a byte is a hung engine rather than a slow one; a minute is
#: also nginx's proxy_read_timeout, the figure operators know. vLLM, SGLang and llama.cpp send a
#: stream's head before its first token, so for a stream this also bounds the wait in the
#: engine's queue: where queues hold requests longer than a minute, raise it.
DEFAULT_STREAM_IDLE_TIMEOUT = 60.0

#: struct tcp_info (linux/tcp.h) up to tcpi_bytes_received (Linux 4.1), and the offsets read.
_TCP_INFO_SIZE = 136
_LAST_DATA_RECV = 52  # __u32, milliseconds since data last arrived
_BYTES_RECEIVED = 128  # __u64


def tcp_progress(sock: socket.socket) -> tuple[int, float] | None:
    """(bytes the kernel has received on ``sock``, seconds since data last arrived), from
    ``TCP_INFO``; None when that cannot be read (the socket closed, or not TCP).

    Why the kernel's counters: the streamed body is relayed by the pump, natively by a C thread
    that never reports progress per chunk, and counting or re-arming a timer per token in Python
    is what the pump exists to avoid. The kernel keeps both figures per socket anyway, so the
    stall watch reads them once per tick per request in flight, and the relay path pays nothing."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except OSError:
        return None
    if len(info) < _TCP_INFO_SIZE:
        return None
    (quiet_ms,) = struct.unpack_from("=I", info, _LAST_DATA_RECV)
    (received,) = struct.unpack_from("=Q", info, _BYTES_RECEIVED)
    return received, quiet_ms / 1000


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (0 when that cannot be read)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def _writable(fd: int) -> bool:
    """Whether the client's socket would take bytes now (or has failed, which the next write
    will find): when it would not, its reader is what holds the stream up."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))


class _Watch:
    """One attempt's engine connection, as the stall watch (``Router._watch_stalls``) sees it.
    ``fired`` says which timeout cut it off ("head" or "idle"), ``waited`` after how long."""

    __slots__ = ("baseline", "client_fd", "fired", "got_bytes", "scope", "since", "sock", "waited")

    def __init__(self, client_fd: int) -> None:
        self.client_fd = client_fd
        self.scope = trio.CancelScope()
        self.sock: socket.socket | None = None
        self.since = 0.0
        self.baseline = 0
        self.got_bytes = False
        self.fired = ""
        self.waited = 0.0

    def arm(self, sock: socket.socket, now: float) -> None:
        """Watch ``sock`` from ``now`` on; called before the request goes out on it, so that any
        byte received after this is the engine's answer to it."""
        progress = tcp_progress(sock)
        self.sock = sock if progress is not None else None
        self.baseline = progress[0] if progress is not None else 0
        self.since = now
        self.got_bytes = False


def stall(
    *,
    waited: float,
    got_bytes: bool,
    quiet: float,
    response_timeout: float,
    idle_timeout: float,
) -> str:
    """Which timeout an engine connection has run past: "head" (no byte of the response
    ``waited`` seconds after the request), "idle" (the response began and nothing came for
    ``quiet`` seconds), or "" (neither). The caller confirms "idle" against the sockets first:
    bytes unread on the router's side, or a client not reading, mean the silence is not the
    engine's."""
    if not got_bytes:
        return "head" if waited >= response_timeout else ""
    return "idle" if quiet >= idle_timeout else ""


# ---------------------------------------------------------------------------------------------
# Metrics

TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters for ``/metrics`` (Prometheus text format 0.0.4), owned by one router.

    Plain dicts updated from the router's tasks, which all run on one trio thread, so no locks; the
    gauges (in flight, ejected, idle connections) are read from the balancer and pool at scrape
    time instead of being kept up to date on every request."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.disconnects: dict[str, int] = {}
        self.ejections: dict[tuple[str, str], int] = {}
        self.ttfb: dict[str, list[float]] = {}  # model -> bucket counts..., then sum, then count
        #: Client connections the router ended for a limit: header, idle, body, over_capacity.
        self.clients_closed: dict[str, int] = {}
        #: Client connections open (``Router.connections``), set before each exposition.
        self.client_connections = 0

    def client_closed(self, reason: str) -> None:
        self.clients_closed[reason] = self.clients_closed.get(reason, 0) + 1

    def request(self, model: str, status: int | str) -> None:
        key = (model, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def upstream_error(self, upstream: Upstream, kind: str) -> None:
        key = (upstream.replica_id, upstream.url, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def observe_ttfb(self, model: str, seconds: float) -> None:
        row = self.ttfb.get(model)
        if row is None:
            row = self.ttfb[model] = [0.0] * (len(TTFB_BUCKETS) + 2)
        row[bisect_left(TTFB_BUCKETS, seconds)] += 1  # index len(TTFB_BUCKETS) is the +Inf-only slot
        row[-2] += seconds
        row[-1] += 1

    def exposition(self, balancer: Balancer, pool: _Pool, pump: Pump, now: float) -> bytes:
        out: list[str] = []

        def family(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        family("llmgw_router_requests_total", "counter", "Requests answered, by model and HTTP status.")
        for (model, status), n in sorted(self.requests.items()):
            out.append(f'llmgw_router_requests_total{{model="{_label(model)}",status="{status}"}} {n}')
        family(
            "llmgw_router_upstream_errors_total",
            "counter",
            "Upstream failures, by replica and kind (connect, reset, closed, timeout, unavailable, "
            "protocol, mid_stream).",
        )
        for (rid, url, kind), n in sorted(self.upstream_errors.items()):
            out.append(
                f'llmgw_router_upstream_errors_total{{replica="{_label(rid)}",url="{_label(url)}",'
                f'kind="{kind}"}} {n}'
            )
        family("llmgw_router_retries_total", "counter", "Requests moved to another replica after a failure.")
        for model, n in sorted(self.retries.items()):
            out.append(f'llmgw_router_retries_total{{model="{_label(model)}"}} {n}')
        family(
            "llmgw_router_client_disconnects_total",
            "counter",
            "Clients that left before their response ended (the upstream request was cancelled).",
        )
        for model, n in sorted(self.disconnects.items()):
            out.append(f'llmgw_router_client_disconnects_total{{model="{_label(model)}"}} {n}')
        family("llmgw_router_ejections_total", "counter", "Times an upstream was ejected.")
        for (rid, url), n in sorted(self.ejections.items()):
            out.append(f'llmgw_router_ejections_total{{replica="{_label(rid)}",url="{_label(url)}"}} {n}')
        family(
            "llmgw_router_time_to_first_byte_seconds",
            "histogram",
            "From the request's arrival to the first response body byte sent to the client.",
        )
        for model, row in sorted(self.ttfb.items()):
            m = _label(model)
            cumulative = 0.0
            for bound, count in zip(TTFB_BUCKETS, row, strict=False):
                cumulative += count
                out.append(
                    f'llmgw_router_time_to_first_byte_seconds_bucket{{model="{m}",le="{bound}"}} {cumulative:g}'
                )
            out.append(f'llmgw_router_time_to_first_byte_seconds_bucket{{model="{m}",le="+Inf"}} {row[-1]:g}')
            out.append(f'llmgw_router_time_to_first_byte_seconds_sum{{model="{m}"}} {row[-2]}')
            out.append(f'llmgw_router_time_to_first_byte_seconds_count{{model="{m}"}} {row[-1]:g}')
        family("llmgw_router_in_flight", "gauge", "Requests outstanding on each upstream.")
        for url, h in sorted(balancer.health.items()):
            out.append(
                f'llmgw_router_in_flight{{replica="{_label(h.replica_id)}",url="{_label(url)}"}} {h.outstanding}'
            )
        family("llmgw_router_upstream_ejected", "gauge", "1 while an upstream is ejected.")
        for url, h in sorted(balancer.health.items()):
            flag = 1 if h.ejected_until > now else 0
            out.append(
                f'llmgw_router_upstream_ejected{{replica="{_label(h.replica_id)}",url="{_label(url)}"}} {flag}'
            )
        family("llmgw_router_idle_connections", "gauge", "Pooled keep-alive connections per upstream.")
        for url, n in sorted(pool.idle_counts().items()):
            out.append(f'llmgw_router_idle_connections{{url="{_label(url)}"}} {n}')
        streams, blocked = pump.stats()
        family(
            "llmgw_router_streams", "gauge", "Streamed response bodies being relayed, past their first event."
        )
        out.append(f"llmgw_router_streams {streams}")
        family(
            "llmgw_router_streams_client_blocked",
            "gauge",
            "Streams paused because their client reads slower than the engine writes (the engine "
            "is not read until the client drains).",
        )
        out.append(f"llmgw_router_streams_client_blocked {blocked}")
        family("llmgw_router_client_connections", "gauge", "Client connections open.")
        out.append(f"llmgw_router_client_connections {self.client_connections}")
        family(
            "llmgw_router_client_connections_closed_total",
            "counter",
            "Client connections the router ended for a limit: head too slow (head), idle too long "
            "(idle), a body silent too long (body), over router_max_connections (over_capacity).",
        )
        for reason, n in sorted(self.clients_closed.items()):
            out.append(f'llmgw_router_client_connections_closed_total{{reason="{reason}"}} {n}')
        wakeups, pauses, reads = pump.counters()
        family(
            "llmgw_router_relay_wakeups_total",
            "counter",
            "Wake-ups of the relay pump; reads per wake-up is what its coalescing pause buys.",
        )
        out.append(f"llmgw_router_relay_wakeups_total {wakeups}")
        family(
            "llmgw_router_relay_pauses_total",
            "counter",
            "Coalescing pauses the relay pump took (a busy pump pauses after a wake-up; an idle one does not).",
        )
        out.append(f"llmgw_router_relay_pauses_total {pauses}")
        family(
            "llmgw_router_relay_reads_total", "counter", "Engine socket reads that brought response bytes."
        )
        out.append(f"llmgw_router_relay_reads_total {reads}")
        return ("\n".join(out) + "\n").encode()


# ---------------------------------------------------------------------------------------------
# The server


@attrs.define
class _Exchange:
    """One request on one client connection, while it is answered."""

    client: ClientConn
    request: Request
    started: float
    model: str = ""
    status: int = 0
    ttfb_done: bool = False
    #: The response head went out: an error now can only end the connection.
    head_sent: bool = False
    #: The response went out whole, framed so that the connection can carry another.
    complete: bool = False
    #: The request asked for a streamed (SSE) answer.
    stream: bool = False
    #: While the client's body is chunked: whether what it got so far ends with a whole chunk,
    #: so that an error event and the last chunk can still be appended (see ``_timed_out``).
    at_chunk_end: Callable[[], bool] | None = None

    @property
    def fd(self) -> int:
        return self.client.fd


class Router:
    """The OpenAI-compatible proxy. ``routes()`` is called once per request, so it must be cheap: the
    control plane hands a function that returns a mapping it rebuilds when replicas change.

    Tunables: ``affinity_chars`` (prompt prefix length for affinity), ``affinity_slack`` (how many
    more outstanding requests than the least loaded upstream the preferred one may have),
    ``max_attempts`` (replicas tried per request), ``eject_after``/``eject_base``/``eject_max``
    (ejection), ``connect_timeout``, ``response_timeout`` (from sending the request until the
    engine's first response byte) and ``stream_idle_timeout`` (the longest silence once the
    response began; see ``DEFAULT_RESPONSE_TIMEOUT`` and ``_timed_out``), ``pool_max_idle`` and
    ``pool_idle_timeout`` (below the engines' keep-alive timeout: uvicorn's is 5 s),
    ``client_limits`` (the header timeout, the idle timeout and the connection cap: ``ClientLimits``;
    ``client_idle_timeout`` overrides its idle timeout), ``metrics_key`` (``GET /metrics`` wants
    ``Authorization: Bearer`` it; without one, /metrics answers loopback clients only), ``max_body_bytes``,
    ``relay_coalesce_us`` (the native relay pump's pause after each wake-up, so that the tokens
    one decode step writes to many streams share a wake-up: a token may wait that long, a
    stream's first one included when it comes during a pause; 0 turns it off; see
    ``router/_pump.c``)."""

    def __init__(
        self,
        routes: RoutesFn,
        *,
        api_keys: frozenset[str] = frozenset(),
        affinity_chars: int = 256,
        affinity_slack: int = 4,
        max_attempts: int = 3,
        eject_after: int = 3,
        eject_base: float = 10.0,
        eject_max: float = 300.0,
        connect_timeout: float = 5.0,
        response_timeout: float = DEFAULT_RESPONSE_TIMEOUT,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        pool_max_idle: int = 1024,
        pool_idle_timeout: float = 4.0,
        client_limits: ClientLimits | None = None,
        client_idle_timeout: float | None = None,
        metrics_key: str = "",
        max_body_bytes: int = 32 * 1024 * 1024,
        relay_coalesce_us: int = DEFAULT_COALESCE_US,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.routes = routes
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.affinity_chars = affinity_chars
        self.max_attempts = max(1, max_attempts)
        for name, value in (
            ("response_timeout", response_timeout),
            ("stream_idle_timeout", stream_idle_timeout),
        ):
            if not value > 0:  # also refuses NaN
                raise ValueError(f"the router's {name} must be more than 0 seconds, got {value}")
        self.response_timeout = response_timeout
        self.stream_idle_timeout = stream_idle_timeout
        # The stall watch's period: a tenth of the shorter timeout, so a timeout fires within
        # 10% of its length, and at most a second (a tick costs a getsockopt per request in flight).
        self.stall_tick = min(1.0, max(0.01, min(response_timeout, stream_idle_timeout) / 10))
        self._watches: set[_Watch] = set()
        limits = client_limits or ClientLimits()
        if client_idle_timeout is not None:
            limits = attrs.evolve(limits, idle_timeout=client_idle_timeout)
        self.client_limits = limits
        #: Client connections open now (``_handle_connection``), against ``client_limits.max_connections``.
        self.connections = 0
        self.max_connections = limits.max_connections
        self.metrics_key = metrics_key.encode()
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.balancer = Balancer(
            affinity_slack=affinity_slack, eject_after=eject_after, eject_base=eject_base, eject_max=eject_max
        )
        self.pool = _Pool(
            max_idle=pool_max_idle, idle_timeout=pool_idle_timeout, connect_timeout=connect_timeout
        )
        self.metrics = Metrics()
        self.pump = make_pump(coalesce_us=relay_coalesce_us)
        self.created = int(time.time())

    # -- the service -----------------------------------------------------------------------------

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port`` (0: the kernel picks), report the bound port, serve until cancelled."""
        self.max_connections = connection_cap(self.client_limits.max_connections)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = int(listeners[0].socket.getsockname()[1])
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._housekeeping)
                nursery.start_soon(self._watch_stalls)
                await nursery.start(self.pump.run)
                await nursery.start(trio.serve_listeners, self._handle_connection, listeners)
                task_status.started(bound)
        finally:
            self.pool.close_all()

    async def _housekeeping(self) -> None:
        """Close pooled connections before the engines' idle timeouts do (a request sent on one
        the engine is closing would need a redo), and forget upstreams no longer routed to."""
        while True:
            await trio.sleep(1.0)
            try:
                live = {u.url for r in self.routes().values() for u in r.upstreams}
            except Exception:
                log.exception("router: routes() failed during housekeeping")
                continue
            now = self.clock()
            self.pool.sweep(now, live)
            self.balancer.prune(live, now)

    async def _watch_stalls(self) -> None:
        """Cut off engines that went silent: every ``stall_tick`` seconds, each request in flight
        to an engine is checked against the response and stream idle timeouts (``stall``), from
        its socket's counters (``tcp_progress``), and one past either has its attempt's scope
        cancelled (``_attempt`` then answers the client). A stalled engine needs no cooperation:
        a SIGSTOPped process or one that accepted and never answered looks the same."""
        while True:
            await trio.sleep(self.stall_tick)
            now = self.clock()
            for watch in list(self._watches):
                if watch.sock is None or watch.fired:
                    continue
                verdict = self._stalled(watch, now)
                if verdict:
                    watch.fired = verdict
                    watch.scope.cancel()

    def _stalled(self, watch: _Watch, now: float) -> str:
        sock = watch.sock
        assert sock is not None
        progress = tcp_progress(sock)
        if progress is None:
            return ""
        received, quiet = progress
        if received != watch.baseline:
            watch.got_bytes = True
        waited = now - watch.since
        verdict = stall(
            waited=waited,
            got_bytes=watch.got_bytes,
            quiet=quiet,
            response_timeout=self.response_timeout,
            idle_timeout=self.stream_idle_timeout,
        )
        if verdict == "idle" and (_unread(sock) or not _writable(watch.client_fd)):
            return ""  # bytes wait for the router, or the client does not read: not the engine
        watch.waited = waited if verdict == "head" else quiet
        return verdict

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        if self.connections >= self.max_connections:
            await self._over_capacity(stream)
            return
        self.connections += 1
        reader = RequestReader(max_body=self.max_body_bytes)
        client: ClientConn | None = None
        limits = self.client_limits
        try:
            async with trio.open_nursery() as nursery:
                # The nursery's scope is the connection's: the watcher task cancels it when the
                # client hangs up, and next_request sets its deadline to the header or idle timeout.
                try:
                    client = ClientConn(
                        stream, reader, nursery.cancel_scope, limits.idle_timeout, limits.header_timeout
                    )
                except OSError as exc:  # no descriptor left for its hang-up watch
                    log.warning("router: refusing a client connection: %s", exc)
                    return
                nursery.start_soon(client.watch)
                await self._serve_client(client)
                nursery.cancel_scope.cancel()
        finally:
            self.connections -= 1
            if client is not None:
                client.close()
                if client.timed_out:
                    self.metrics.client_closed(client.timed_out)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _over_capacity(self, stream: trio.SocketStream) -> None:
        """A connection over ``max_connections``: a 503 that says so, then closed (``ClientLimits``
        says why not queued). Counted in /metrics, not logged: a flood would be a flood of lines.
        The client's request is read and dropped for up to a second after the answer, so that
        closing does not reset the connection before the client has read the 503."""
        self.metrics.client_closed("over_capacity")
        body = RouterError(
            503,
            f"the router has {self.connections} client connections, its limit "
            "(router_max_connections); retry, or raise the limit",
            "server_error",
            "too_many_connections",
        ).body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ]
        try:
            with trio.move_on_after(1.0):
                await stream.send_all(response_head(503, headers, close=True) + body)
                await stream.send_eof()
                while await stream.receive_some(RECEIVE_SIZE):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _serve_client(self, client: ClientConn) -> None:
        """Answer the client's requests in order until the connection ends. Nothing escapes: the
        connection's watcher task shares the nursery and one connection's failure is its own."""
        try:
            while True:
                try:
                    request = await client.next_request()
                except RequestError as error:
                    await self._refuse(client, error)
                    return
                if request is None:  # closed or switched protocols (idle: the scope is cancelled)
                    return
                ex = _Exchange(client, request, self.clock())
                await self._respond(ex)
                if not (ex.complete and request.keep_alive) or client.eof:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, _ClientGone, _UpstreamBroken):
            return
        except Exception:
            # One connection's bug must not take the server down with it.
            log.exception("router: connection handler failed")

    async def _refuse(self, client: ClientConn, error: RequestError) -> None:
        """Answer a request that cannot be read to its end, and close."""
        body = RouterError(error.status, error.message, "invalid_request_error").body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await client.stream.send_all(response_head(error.status, headers, close=True) + body)
        await client.linger()

    # -- one request ------------------------------------------------------------------------------

    async def _respond(self, ex: _Exchange) -> None:
        head = ex.request
        path = head.target.split(b"?", 1)[0]
        try:
            if path == b"/metrics" or path == b"/health":
                self._method(head, b"GET")
                if path == b"/health":
                    await self._send(ex, 200, b'{"status":"ok"}\n')
                else:
                    self._authorize_metrics(ex)
                    self.metrics.client_connections = self.connections
                    data = self.metrics.exposition(self.balancer, self.pool, self.pump, self.clock())
                    await self._send(ex, 200, data, b"text/plain; version=0.0.4; charset=utf-8")
                return
            if path != MODELS and path not in PROXIED:
                raise RouterError(
                    404,
                    f"no route {head.method.decode()} {path.decode(errors='replace')}",
                    "invalid_request_error",
                    "not_found",
                )
            self._method(head, b"GET" if path == MODELS else b"POST")
            self._authorize(head)
            if path == MODELS:
                await self._send(ex, 200, self._models_body())
                ex.status = 200
                return
            await self._proxy(ex)
        except RouterError as error:
            ex.status = error.status
            self.metrics.request(ex.model or "", error.status)
            await self._send(ex, error.status, error.body())
        except (_ClientGone, _UpstreamBroken):
            raise
        except Exception as exc:
            log.exception("router: %s %r failed", head.method.decode(), head.target)
            if ex.head_sent:
                raise  # the response had begun: closing the connection is all that is left
            internal = RouterError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
            self.metrics.request(ex.model or "", 500)
            await self._send(ex, 500, internal.body())

    def _method(self, head: Request, allowed: bytes) -> None:
        if head.method != allowed and not (allowed == b"GET" and head.method == b"HEAD"):
            raise RouterError(
                405,
                f"{head.method.decode()} not allowed here; use {allowed.decode()}",
                "invalid_request_error",
                "method_not_allowed",
            )

    def _authorize(self, head: Request) -> None:
        if not self.api_keys:
            return
        given = b""
        for name, value in head.headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        # compare_digest against every key: the time taken says nothing about which key is close.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(key, given)
        if not given:
            raise RouterError(
                401,
                "missing API key: send Authorization: Bearer KEY",
                "invalid_request_error",
                "invalid_api_key",
            )
        if not ok:
            raise RouterError(401, "incorrect API key", "invalid_request_error", "invalid_api_key")

    def _authorize_metrics(self, ex: _Exchange) -> None:
        """``/metrics`` names every replica's URL and the traffic per model: with ``metrics_key``
        it wants that key as a bearer token, and without one it answers loopback clients only (a
        scraper elsewhere needs the key configured; Prometheus sends it with ``authorization``)."""
        if self.metrics_key:
            given = b""
            for name, value in ex.request.headers:
                if name == b"authorization":
                    scheme, _, token = value.partition(b" ")
                    if scheme.lower() == b"bearer":
                        given = token.strip()
            if not hmac.compare_digest(self.metrics_key, given):
                raise RouterError(
                    401,
                    "/metrics wants the metrics key: send Authorization: Bearer KEY (metrics_key in llmgw.toml)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
            return
        try:
            peer = ex.client.stream.socket.getpeername()[0]
            address = ipaddress.ip_address(peer)
        except (OSError, ValueError):
            address = None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address is None or not address.is_loopback:
            raise RouterError(
                403,
                "/metrics answers only this machine while no metrics_key is set; set metrics_key in "
                "llmgw.toml (--metrics-key for a router-only run) and scrape with Authorization: Bearer KEY",
                "permission_error",
                "forbidden",
            )

    def _models_body(self) -> bytes:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "llmgw"}
            for name, routes in sorted(self.routes().items())
            if routes.upstreams
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _send(
        self, ex: _Exchange, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        data = response_head(status, headers, close=not ex.request.keep_alive)
        ex.head_sent = True
        await ex.client.stream.send_all(data if ex.request.method == b"HEAD" else data + body)
        ex.complete = True

    async def _proxy(self, ex: _Exchange) -> None:
        try:
            doc = json.loads(ex.request.body)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise RouterError(
                400, f"the request body is not valid JSON: {exc}", "invalid_request_error"
            ) from None
        if not isinstance(doc, dict):
            raise RouterError(400, "the request body must be a JSON object", "invalid_request_error")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise RouterError(
                400, 'the request names no model ("model": "NAME")', "invalid_request_error", "model_required"
            )
        table = self.routes()
        routes = table.get(model)
        if routes is None:
            known = ", ".join(sorted(table)) or "none"
            raise RouterError(
                404,
                f"The model `{model}` does not exist on this router; models: {known}",
                "invalid_request_error",
                "model_not_found",
            )
        ex.model = model
        ex.stream = doc.get("stream") is True
        if not routes.upstreams:
            why = routes.reason or "no replica is ready"
            raise RouterError(
                503, f"model `{model}` has no ready replica: {why}", "service_unavailable", "no_ready_replica"
            )
        key = affinity_key(doc, self.affinity_chars)
        digest = _digest(key) if key else None

        # The client hanging up cancels the connection's scope (ClientConn.watch), and with it
        # this request: leaving _forward closes the engine connection, which cancels its work.
        try:
            await self._forward(ex, routes, digest)
        except BaseException as exc:
            if ex.client.eof or isinstance(exc, _ClientGone):
                self.metrics.disconnects[model] = self.metrics.disconnects.get(model, 0) + 1
                self.metrics.request(model, 499)
                if not isinstance(exc, trio.Cancelled):
                    raise _ClientGone() from None
            elif isinstance(exc, _UpstreamBroken):
                self.metrics.request(model, ex.status)
            raise
        self.metrics.request(model, ex.status)

    def _upstream_request(self, ex: _Exchange, target: Target, api_key: str = "") -> bytes:
        """The request head and body for the engine. An engine with a key of its own gets that key
        and never the client's (the client's is for this router's ``api_keys``); one without gets
        the client's ``Authorization`` only when this router checks none itself (a static
        endpoint that wants the client's own credentials)."""
        head = ex.request
        body = head.body
        lines = [head.method, b" ", target.base_path, head.target, b" HTTP/1.1\r\nhost: ", target.host_header]
        lines.append(b"\r\ncontent-length: ")
        lines.append(str(len(body)).encode())
        if api_key:
            lines += (b"\r\nauthorization: Bearer ", api_key.encode())
        for name, value in head.headers:
            if name in FORWARDED_REQUEST_HEADERS or (
                name == b"authorization" and not self.api_keys and not api_key
            ):
                lines += (b"\r\n", name, b": ", value)
        lines.append(b"\r\n\r\n")
        lines.append(body)
        return b"".join(lines)

    async def _forward(self, ex: _Exchange, routes: ModelRoutes, digest: bytes | None) -> None:
        tried: list[str] = []
        failures: list[str] = []
        attempts = min(self.max_attempts, len(routes.upstreams))
        for attempt in range(attempts):
            upstream = self.balancer.choose(routes.upstreams, digest, self.clock(), tried)
            if upstream is None:
                break
            tried.append(upstream.url)
            if attempt:
                self.metrics.retries[ex.model] = self.metrics.retries.get(ex.model, 0) + 1
            error = await self._attempt(ex, upstream, last=attempt == attempts - 1)
            if error is None:
                return
            failures.append(f"{upstream.replica_id} ({upstream.url}): {error}")
        raise RouterError(
            502,
            f"every upstream of model `{ex.model}` failed before responding: " + "; ".join(failures),
            "upstream_error",
            "upstream_failed",
        )

    async def _attempt(self, ex: _Exchange, upstream: Upstream, *, last: bool) -> str | None:
        """Send the request to one upstream. Returns None once a response went to the client (its
        status may be anything the engine said), or the failure when nothing did and another
        replica may be tried. An engine that stays silent past the response or stream idle
        timeout is cut off by the stall watch (``_watch_stalls``), which cancels this scope;
        ``_timed_out`` then answers for it."""
        watch = _Watch(ex.fd)
        with watch.scope:
            self._watches.add(watch)
            try:
                return await self._try_upstream(ex, upstream, watch, last=last)
            finally:
                self._watches.discard(watch)
        # Only the stall watch cancels this scope (the client leaving cancels an outer one, and
        # that cancellation goes on through this scope), so the engine was too slow.
        await self._timed_out(ex, upstream, watch)

    async def _try_upstream(
        self, ex: _Exchange, upstream: Upstream, watch: _Watch, *, last: bool
    ) -> str | None:
        balancer = self.balancer
        balancer.begin(upstream)
        conn: _UpstreamConn | None = None
        try:
            try:
                target = self.pool.target(upstream.url)
            except ValueError as exc:
                return self._failed(upstream, UpstreamError("connect", str(exc)))
            request = self._upstream_request(ex, target, upstream.api_key)
            # The native pump relays the usual streamed response from its head on (see
            # _respond_whole); the timeouts apply to it from outside (the stall watch).
            whole = isinstance(self.pump, NativeRelayPump) and ex.request.http11
            head: ResponseHead | None = None
            buf = b""
            for fresh in (False, True):
                conn = None if fresh else self.pool.take_idle(upstream.url, self.clock())
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await self.pool.connect(upstream.url)
                    watch.arm(conn.sock, self.clock())
                    await conn.send_all(request)
                    if whole:
                        answer = await self._respond_whole(ex, conn, upstream)
                        if answer.handed_back is None:
                            if answer.reusable:
                                self.pool.release(conn, self.clock())
                                conn = None
                            return None
                        buf = answer.handed_back
                    head, buf = await self._read_head(conn, buf)
                    break
                except (OSError, trio.TooSlowError, UpstreamError, EngineFailedEarly) as exc:
                    watch.sock = None
                    if conn is not None:
                        conn.close()
                        conn = None
                    error = _classify(exc)
                    if reused and not fresh and not error.got_bytes:
                        continue  # a pooled connection the engine had closed: redo on a new one
                    return self._failed(upstream, error)
            assert conn is not None and head is not None
            if head.status == 503 and not last:
                conn.close()
                conn = None
                return self._failed(
                    upstream, UpstreamError("unavailable", "answered 503 (loading or draining)")
                )
            balancer.succeeded(upstream)
            if await self._relay(ex, conn, head, buf, upstream):
                self.pool.release(conn, self.clock())
                conn = None
            return None
        finally:
            watch.sock = None
            if conn is not None:
                conn.close()  # never pooled mid-response: closing is what cancels the engine's work
            balancer.end(upstream)

    async def _timed_out(self, ex: _Exchange, upstream: Upstream, watch: _Watch) -> NoReturn:
        """Answer for an engine the stall watch cut off. The replica is ejected at once, not after
        ``eject_after`` failures: each request sent to a silent engine costs its client the whole
        timeout, where a refused connection costs a millisecond and a retry. The request is not
        tried elsewhere: its client has waited the whole timeout already, and the engine may
        still be generating it. Before the response began the client gets a 504. A stream that
        had begun ends with an SSE error event and a proper end of its chunked body, where its
        framing allows, and then the client's connection is closed (where it does not allow, the
        close alone tells the client its body broke off)."""
        where = f"replica {upstream.replica_id} ({upstream.url})"
        if watch.fired == "head":
            what = (
                f"{where} sent no response in {watch.waited:.1f} s "
                f"(router_response_timeout {self.response_timeout:g} s)"
            )
            code = "upstream_response_timeout"
        else:
            when = "mid-stream" if ex.head_sent else "mid response head"
            what = (
                f"{where} sent nothing for {watch.waited:.1f} s {when} "
                f"(router_stream_idle_timeout {self.stream_idle_timeout:g} s)"
            )
            code = "upstream_idle_timeout"
        self._failed(upstream, UpstreamError("timeout", what), at_once=True)
        what += "; the replica is ejected"
        if not ex.head_sent:
            raise RouterError(504, f"model `{ex.model}`: {what}", "timeout", code)
        if ex.stream and ex.at_chunk_end is not None and ex.at_chunk_end():
            doc = {"error": {"message": f"model `{ex.model}`: {what}", "type": "timeout", "code": code}}
            event = b"data: " + json.dumps(doc).encode() + b"\n\n"
            # The client's socket took bytes a moment ago (the watch checks); one that stops
            # reading now must not hold this task.
            with trio.move_on_after(self.stream_idle_timeout):
                await self._write(ex, chunk(event) + LAST_CHUNK)
        raise _UpstreamBroken(what)

    def _failed(self, upstream: Upstream, error: UpstreamError, *, at_once: bool = False) -> str:
        text = str(error)
        self.metrics.upstream_error(upstream, error.kind)
        ejected = self.balancer.failed(upstream, self.clock(), text, at_once=at_once)
        if ejected is not None:
            key = (upstream.replica_id, upstream.url)
            self.metrics.ejections[key] = self.metrics.ejections.get(key, 0) + 1
            log.warning(
                "router: ejected %s (%s) for %gs: %s", upstream.replica_id, upstream.url, ejected, text
            )
        return text

    async def _respond_whole(self, ex: _Exchange, conn: _UpstreamConn, upstream: Upstream) -> Response:
        """The usual streamed response, all of it relayed by the native pump's thread from the
        engine's head on (``NativeRelayPump.respond``): this task is woken once per request,
        when the body has ended, instead of once more for the head. The answer says whether the
        engine's connection is reusable, or holds the head the pump handed back for ``_read_head``
        and ``_relay`` to take from there; raises ``EngineFailedEarly`` when the engine failed
        before its head (another replica may be tried)."""
        suffix = end_of_head(
            ((b"x-llmgw-replica", upstream.replica_id.encode()), (b"transfer-encoding", b"chunked")),
            close=not ex.request.keep_alive,
        )
        pump = cast(NativeRelayPump, self.pump)
        ex.at_chunk_end = _whole_engine_chunks

        def head_out(sent_at: float) -> None:
            ex.head_sent = ex.ttfb_done = True
            ex.status = 200  # the only head the pump relays itself
            self.metrics.observe_ttfb(ex.model, self.clock() - ex.started - (time.monotonic() - sent_at))

        try:
            answer = await pump.respond(conn.sock, ex.fd, suffix, head_out)
        except EngineClosed as exc:  # after the head, or a malformed first chunk with it
            self.balancer.succeeded(upstream)
            self.metrics.upstream_error(upstream, "mid_stream")
            ex.status = 200
            raise _UpstreamBroken(str(exc)) from None
        except (ClientGone, RelayClosed) as exc:
            raise _ClientGone(str(exc)) from None
        if answer.handed_back is None:
            self.balancer.succeeded(upstream)
            ex.status = 200
            ex.complete = ex.request.keep_alive
        return answer

    async def _read_head(self, conn: _UpstreamConn, buf: bytes = b"") -> tuple[ResponseHead, bytes]:
        """The engine's response head (after any 1xx heads), and the body bytes that came with
        it; ``buf`` is what was read already."""
        data = buf or conn.recv_nowait()
        buf = b""
        while True:
            if data is None:
                data = await conn.recv()
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

    async def _write(self, ex: _Exchange, data: bytes) -> None:
        """Write to the client: straight to the socket when the kernel takes it all (the usual case
        for an SSE event), avoiding ``send_all``'s scheduler round trips; the readiness wait on the
        upstream is the loop's checkpoint."""
        try:
            sent = os.write(ex.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise _ClientGone(str(exc)) from exc
        if sent < len(data):
            try:
                await ex.client.stream.send_all(data[sent:])
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _ClientGone(str(exc)) from exc
        if not ex.ttfb_done:
            ex.ttfb_done = True
            self.metrics.observe_ttfb(ex.model, self.clock() - ex.started)

    async def _relay(
        self, ex: _Exchange, conn: _UpstreamConn, head: ResponseHead, buf: bytes, upstream: Upstream
    ) -> bool:
        """Relay the response to the client; returns whether the upstream connection is reusable.

        The body keeps the engine's framing where the client can take it: chunked to an HTTP/1.1
        client (byte for byte), a content-length body as it is. An HTTP/1.0 client gets a chunked
        body decoded, ended by closing; a body the engine ends by closing goes to an HTTP/1.1
        client chunked, so that its connection stays usable."""
        ex.status = head.status
        http11 = ex.request.http11
        ours = [(b"x-llmgw-replica", upstream.replica_id.encode())]
        close = not ex.request.keep_alive
        encode = False
        if head.framing == NO_BODY:
            ours.append((b"content-length", b"0"))
        elif head.framing == LENGTH:
            ours.append((b"content-length", str(head.length).encode()))
        elif http11:  # CHUNKED relayed as it is, or UNTIL_CLOSE chunk-encoded here
            ours.append((b"transfer-encoding", b"chunked"))
            encode = head.framing == UNTIL_CLOSE
        else:
            close = True  # an HTTP/1.0 client: the end of the body is the end of the connection
        # The engine's headers less the hop-by-hop ones, then ours: as the pump's thread writes
        # the heads it relays itself (_respond_whole).
        engine = [(k, v) for k, v in head.headers if k not in HOP_BY_HOP]
        out = status_block(head.status, engine, head.reason) + end_of_head(ours, close=close)
        ex.head_sent = True
        try:
            if head.framing == NO_BODY:
                await self._write(ex, out)
                ex.complete = not close
                return head.keep_alive and not buf
            if head.framing == CHUNKED and http11:
                reusable = await self._relay_chunked(ex, conn, buf, out, head.keep_alive)
            else:
                reusable = await self._relay_decoded(ex, conn, head, buf, out, encode)
            ex.complete = not close
            return reusable
        except OSError as exc:  # the engine's socket broke after the response had begun
            self.metrics.upstream_error(upstream, "mid_stream")
            raise _UpstreamBroken(str(exc)) from exc
        except _UpstreamBroken:
            self.metrics.upstream_error(upstream, "mid_stream")
            raise

    async def _relay_chunked(
        self, ex: _Exchange, conn: _UpstreamConn, buf: bytes, out: bytes, keep_alive: bool
    ) -> bool:
        """The hot path: chunked bytes pass through unchanged. The head goes out at once, with
        whatever part of the body came with it; the rest of the body goes to the relay pump
        (``router.relay``). An engine sends a stream's head before its first token, so the
        first token is usually relayed by the pump too: from the pump's thread, which is woken
        by the engine's socket directly, that is sooner than a wake-up through trio's loop, and
        it spares this task one wake-up per request."""
        scanner = ChunkedScanner()
        used = scanner.feed(buf) if buf else 0
        extra = used < len(buf)
        # The Python pump feeds this scanner as it relays; the native one takes its state over.
        native = isinstance(self.pump, NativeRelayPump)
        ex.at_chunk_end = _whole_engine_chunks if native else lambda: scanner.at_chunk_end
        await self._write(ex, out + buf[:used])
        if not scanner.done:
            try:
                extra = not await self.pump.relay(conn.sock, ex.fd, scanner)
            except EngineClosed as exc:
                raise _UpstreamBroken(str(exc)) from None
            except (ClientGone, RelayClosed) as exc:
                raise _ClientGone(str(exc)) from None
        return keep_alive and not extra

    async def _relay_decoded(
        self, ex: _Exchange, conn: _UpstreamConn, head: ResponseHead, buf: bytes, out: bytes, encode: bool
    ) -> bool:
        """Bodies that are not passed through chunk for chunk: content-length (relayed as it
        arrives), chunked to an HTTP/1.0 client (decoded), or an engine body that ends when its
        connection closes (chunk-encoded when ``encode``)."""
        scanner = ChunkedScanner(decode=True) if head.framing == CHUNKED else None
        remaining = head.length
        extra = False
        data = buf
        if encode:  # chunks written here, whole, by this task
            ex.at_chunk_end = _whole_engine_chunks
        while True:
            done = False
            if data:
                if scanner is not None:
                    used = scanner.feed(data)
                    extra = extra or used < len(data)
                    pieces, scanner.payloads = scanner.payloads, []
                    done = scanner.done
                elif head.framing == LENGTH:
                    if len(data) > remaining:
                        extra, data = True, data[:remaining]
                    remaining -= len(data)
                    pieces, done = [data], remaining == 0
                else:
                    pieces = [data]
                out += b"".join(chunk(p) for p in pieces if p) if encode else b"".join(pieces)
            if out:
                await self._write(ex, out)
                out = b""
            if done:
                return head.keep_alive and not extra
            data = await conn.recv()
            if not data:
                if head.framing == UNTIL_CLOSE:
                    if encode:
                        await self._write(ex, LAST_CHUNK)
                    return False
                raise _UpstreamBroken("the engine closed the connection mid-response")


def _whole_engine_chunks() -> bool:
    """Whether a client's chunked body, relayed as it came, ends with a whole chunk now that its
    engine fell silent, where no scanner state is at hand: the native pump's thread keeps its
    own (``router/_pump.c``) and does not hand it back. Taken as true: engines write each SSE
    event as one chunk in one write, the silence has lasted the whole idle timeout with the
    engine's socket drained and the client's writable, so everything the engine wrote has gone
    through. Should an engine have stopped inside a chunk, the error event lands inside it and
    the connection is closed after, which the client sees as a broken body: an error either
    way, never a hang."""
    return True


def _classify(exc: OSError | trio.TooSlowError | UpstreamError | EngineFailedEarly) -> UpstreamError:
    """What went wrong with an upstream before its response head, as the balancer and the
    metrics name it."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, EngineFailedEarly):  # the relay pump's thread saw it (see _respond_whole)
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


# ---------------------------------------------------------------------------------------------
# Router-only runs: python -m router --static MODEL=URL


def _parse_static(values: Sequence[str]) -> list[tuple[str, str]]:
    endpoints = []
    for value in values:
        model, sep, url = value.partition("=")
        if not sep or not model or not url:
            raise ValueError(f"--static {value!r}: expected MODEL=URL, e.g. llama=http://10.0.0.7:8000")
        endpoints.append((model, url))
    return endpoints


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router",
        description="llmgw's OpenAI-compatible router on a static endpoint list (no control plane).",
    )
    parser.add_argument(
        "--static", action="append", default=[], metavar="MODEL=URL", help="a replica; repeat"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer key; repeat (or LLMGW_ROUTER_API_KEYS=k1,k2, which keeps keys out of ps)",
    )
    parser.add_argument(
        "--relay-coalesce-us",
        type=int,
        default=DEFAULT_COALESCE_US,
        metavar="US",
        help=f"the relay pump's pause after each wake-up, 0 to {MAX_COALESCE_US} "
        f"(default {DEFAULT_COALESCE_US}; 0: none): streamed tokens that arrive together share a wake-up",
    )
    parser.add_argument(
        "--response-timeout",
        type=float,
        default=DEFAULT_RESPONSE_TIMEOUT,
        metavar="SECONDS",
        help=f"the longest wait for an engine's first response byte (default {DEFAULT_RESPONSE_TIMEOUT:g}); "
        "past it the client gets a 504 and the replica is ejected",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"the longest silence of an engine once its response began (default "
        f"{DEFAULT_STREAM_IDLE_TIMEOUT:g}); past it the stream ends with an error event and the "
        "replica is ejected",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help=f"a request's head must arrive within this of its first byte, a new connection's first "
        f"within this of the accept (default {DEFAULT_HEADER_TIMEOUT:g}; slowloris clients are closed)",
    )
    parser.add_argument(
        "--client-idle-timeout",
        type=float,
        default=DEFAULT_CLIENT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"an idle keep-alive client connection is closed after this (default {DEFAULT_CLIENT_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"client connections over N get a 503 and are closed (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--metrics-key",
        default=os.environ.get("LLMGW_ROUTER_METRICS_KEY", ""),
        metavar="KEY",
        help="GET /metrics wants Authorization: Bearer KEY (or LLMGW_ROUTER_METRICS_KEY, which keeps it "
        "out of ps); without one /metrics answers loopback clients only",
    )
    args = parser.parse_args(argv)
    if args.max_connections < 1:
        parser.error(f"--max-connections must be at least 1, got {args.max_connections}")
    for flag, value in (
        ("--response-timeout", args.response_timeout),
        ("--stream-idle-timeout", args.stream_idle_timeout),
        ("--header-timeout", args.header_timeout),
        ("--client-idle-timeout", args.client_idle_timeout),
    ):
        if not value > 0:
            parser.error(f"{flag} must be more than 0 seconds, got {value:g}")
    try:
        routes = static_routes(_parse_static(args.static))
    except ValueError as exc:
        parser.error(str(exc))
    if not args.static:
        parser.error("no --static MODEL=URL given")
    keys = set(args.api_key)
    keys.update(k for k in os.environ.get("LLMGW_ROUTER_API_KEYS", "").split(",") if k)
    try:
        router = Router(
            routes,
            api_keys=frozenset(keys),
            relay_coalesce_us=args.relay_coalesce_us,
            response_timeout=args.response_timeout,
            stream_idle_timeout=args.stream_idle_timeout,
            client_limits=ClientLimits(
                header_timeout=args.header_timeout,
                idle_timeout=args.client_idle_timeout,
                max_connections=args.max_connections,
            ),
            metrics_key=args.metrics_key,
        )
    except (RuntimeError, ValueError) as exc:  # the relay pump asked for (LLMGW_RELAY, coalescing), timeouts
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(router.serve, args.host, args.port)
            print(
                f"llmgw router listening on {args.host}:{port} (pid {os.getpid()}, {router.pump.kind} relay pump)",
                flush=True,
            )

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
