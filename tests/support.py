"""Helpers every test file shares: a free port, polling with a deadline, reading ``/proc``, and
one request to an in-process ASGI app.

Defined once here so that each rule lives in one place: a wait always has a bound and names what it
waited for (never a fixed sleep); a process counts as running only while it is not a zombie; a scan of
``/proc`` tolerates processes that exit while it reads them.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")

#: ``poll``'s first pause between two checks, and its longest. Checks start fast (most events under
#: test take milliseconds) and back off, so a check that costs an HTTP request or a scan of ``/proc``
#: does not eat the two shared cores while a fleet takes seconds to converge.
FIRST_INTERVAL = 0.005
MAX_INTERVAL = 0.2

#: ``apoll``'s pause between two checks, fixed: its checks read the test's own in-process state (cheap),
#: and what they wait for is often a step of a thread or task whose timing the test cares about.
ASYNC_INTERVAL = 0.005

#: Long enough for a loaded CI host to start a control plane, agents and engines; a passing test
#: never waits it out, so only a failing one pays for it.
DEFAULT_TIMEOUT = 60.0


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (bound, then released).

    Another process may take it before the caller binds it; tests accept that small race rather than
    passing sockets across processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(what: str, check: Callable[[], T | None], timeout: float = DEFAULT_TIMEOUT) -> T:
    """Call ``check`` until it returns something truthy and return that; after ``timeout`` seconds
    fail with an ``AssertionError`` naming ``what``. For waits on other processes, from plain
    (synchronous) test code."""
    deadline = time.monotonic() + timeout
    interval = FIRST_INTERVAL
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(interval)  # poll interval; the deadline above bounds the wait
        interval = min(interval * 2, MAX_INTERVAL)


async def apoll(what: str, check: Callable[[], T | None], timeout: float = DEFAULT_TIMEOUT) -> T:
    """``poll`` for trio code: the same contract, sleeping with ``trio.sleep`` so the tasks under test
    (in the same process) run between checks, every ``ASYNC_INTERVAL``."""
    deadline = trio.current_time() + timeout
    while True:
        result = check()
        if result:
            return result
        if trio.current_time() > deadline:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")
        await trio.sleep(ASYNC_INTERVAL)  # poll interval; the deadline above bounds the wait


async def apoll_await(
    what: str, check: Callable[[], Awaitable[T | None]], timeout: float = DEFAULT_TIMEOUT
) -> T:
    """``apoll`` for a check that must itself await (a request to a server under test), every
    ``ASYNC_INTERVAL`` after the previous check ended."""
    deadline = trio.current_time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if trio.current_time() > deadline:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")
        await trio.sleep(ASYNC_INTERVAL)  # poll interval; the deadline above bounds the wait


class BlackHoleProxy:
    """A TCP relay on loopback to ``upstream_port`` that can be told to swallow everything, like a
    path whose packets vanish (``black_hole``), or to cut every connection it relays (``cut``), like
    a peer's host that went away. ``serve`` runs it and reports its port to ``nursery.start``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.black_hole = False
        #: How many connections it has relayed, and how many of them ``cut`` ended.
        self.connections = 0
        self.cuts = 0
        self._scopes: set[trio.CancelScope] = set()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    def cut(self) -> None:
        """End every connection relayed now (both sides see the socket closed); new ones are relayed."""
        for scope in self._scopes:
            scope.cancel()
        self.cuts += len(self._scopes)

    async def _pump(self, src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
        while data := await src.receive_some(65536):
            if not self.black_hole:
                await dst.send_all(data)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
                async with upstream, client, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, upstream)
                    nursery.start_soon(self._pump, upstream, client)
            except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the upstream refused or a side reset: the relay ends as the path would
            finally:
                self._scopes.discard(scope)
        await client.aclose()


# -- /proc ----------------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process: a zombie (exited, not yet reaped by its parent) is not,
    since it holds no port, no GPU and no file any more."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name in parentheses may itself hold spaces and ')': the state follows the last ')'.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> list[bytes] | None:
    """The argv of ``pid`` as the kernel holds it, or None when the process is gone (or a zombie,
    whose command line is empty)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").split(b"\0") if raw else None


def environ(pid: int) -> dict[bytes, bytes] | None:
    """The environment ``pid`` was started with (``/proc/PID/environ``), or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def rss_kib(pid: int) -> int:
    """The resident set size of ``pid`` in KiB (``VmRSS`` of ``/proc/PID/status``)."""
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    assert m, f"no VmRSS line in /proc/{pid}/status:\n{text}"
    return int(m.group(1))


def processes(match: Callable[[list[bytes]], bool]) -> list[int]:
    """Running processes (zombies left out) whose argv satisfies ``match``, by pid, sorted: how a
    test finds the engines it caused to start, and checks that they are gone again."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = cmdline(int(entry.name))
        if argv is not None and match(argv) and pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return sorted(pids)


def asgi_call(
    app: Callable[..., Any],
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: Sequence[tuple[bytes, bytes]] = ((b"content-type", b"application/json"),),
    query: bytes = b"",
    host: bytes = b"127.0.0.1:7080",
    client: str = "127.0.0.1",
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request to an ASGI app in this process (the admin API over a hand-built query): its
    status, headers and body. The body arrives in two messages, as a client may send it."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "client": (client, 40000),
        "headers": [(b"host", host), *headers],
    }
    chunks = [body[:7], body[7:]]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    trio.run(app, scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]
