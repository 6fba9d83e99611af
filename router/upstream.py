"""One keep-alive HTTP/1.1 connection to an engine, on a plain non-blocking socket."""

from __future__ import annotations

import socket

import trio

from router.relay import RECEIVE_SIZE


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
