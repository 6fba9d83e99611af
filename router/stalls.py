"""Silent engines: the response and stream idle timeouts, judged from the kernel's counters of each
engine socket (``tcp_progress``) by the router's stall watch, so the relay path pays nothing."""

from __future__ import annotations

import fcntl
import select
import socket
import struct
import termios

import trio

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


def unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (0 when that cannot be read)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def writable(fd: int) -> bool:
    """Whether the client's socket would take bytes now (or has failed, which the next write
    will find): when it would not, its reader is what holds the stream up."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))


class Watch:
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
