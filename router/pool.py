"""The upstream pool: idle keep-alive engine connections per URL, and dialing new ones."""

from __future__ import annotations

import errno
import os
import socket

import trio

from router.routes import EngineAddress, parse_url
from router.upstream import UpstreamConn


class Pool:
    """Idle keep-alive connections per upstream URL, most recently used first (a warm one is
    least likely to have hit the engine's idle timeout)."""

    def __init__(self, *, max_idle: int, idle_timeout: float, connect_timeout: float) -> None:
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.idle: dict[str, list[UpstreamConn]] = {}
        self.addresses: dict[str, EngineAddress] = {}

    def address(self, url: str) -> EngineAddress:
        t = self.addresses.get(url)
        if t is None:
            t = self.addresses[url] = parse_url(url)
        return t

    def take_idle(self, url: str, now: float) -> UpstreamConn | None:
        stack = self.idle.get(url)
        while stack:
            conn = stack.pop()
            if now - conn.idle_since < self.idle_timeout and conn.looks_alive():
                return conn
            conn.close()
        return None

    async def connect(self, url: str) -> UpstreamConn:
        target = self.address(url)
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
                return UpstreamConn(sock, url)
        raise error or OSError(f"{target.host}: no address")

    def release(self, conn: UpstreamConn, now: float) -> None:
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
                    self.addresses.pop(url, None)

    def close_all(self) -> None:
        for stack in self.idle.values():
            for conn in stack:
                conn.close()
        self.idle.clear()

    def idle_counts(self) -> dict[str, int]:
        return {url: len(stack) for url, stack in self.idle.items()}
