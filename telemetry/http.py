"""A tiny HTTP/1.1 server for ``/healthz`` and ``/metrics`` on a local port: h11 over trio streams.

An admin port needs two GETs, not a framework: h11 does the parsing (sans-IO), trio the sockets, and
every bound is explicit (head size, time to send a request, one request per connection), so a
scraper that stalls or a client that sends garbage costs one connection and nothing else.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping

import attrs
import h11
import trio

log = logging.getLogger("llmgw.telemetry.http")

#: A request's head must arrive within this long and fit in this many bytes.
REQUEST_TIMEOUT = 10.0
MAX_HEAD_BYTES = 16 * 1024


@attrs.frozen
class Response:
    status: int
    content_type: str
    body: bytes


#: A route: given the request's Accept header, what to answer.
Handler = Callable[[str], Awaitable[Response]]


@attrs.frozen
class Listen:
    """Where an admin port listens; ``host`` is loopback unless one was given."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(text: str) -> Listen:
    """``9100``, ``:9100``, ``0.0.0.0:9100`` or ``[::1]:9100``; no host means 127.0.0.1 (an admin
    port is local unless an operator names an interface). Port 0 picks a free port.

    Raises ValueError saying what to write instead."""
    example = "write PORT, HOST:PORT or [IPV6]:PORT, e.g. 9100 or 127.0.0.1:9100"
    value = text.strip()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: {example}")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            host, port_text = "", value
        if ":" in host:
            raise ValueError(f"{text!r}: put an IPv6 address in brackets; {example}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port {port_text!r} is not 0-65535; {example}")
    return Listen(host or "127.0.0.1", int(port_text))


async def serve(
    listen: Listen,
    routes: Mapping[str, Handler],
    *,
    task_status: trio.TaskStatus[Listen] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve GETs of ``routes`` (path -> handler) until cancelled; reports the bound address (the
    real port when ``listen.port`` is 0) through ``task_status``. Binding errors (OSError) raise
    before ``started``, so a parent's ``nursery.start`` sees them."""
    listeners = await trio.open_tcp_listeners(listen.port, host=listen.host)
    sockname = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, lambda s: _connection(s, routes), listeners)
        task_status.started(Listen(listen.host, int(sockname[1])))


async def _connection(stream: trio.SocketStream, routes: Mapping[str, Handler]) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    try:
        with trio.move_on_after(REQUEST_TIMEOUT):
            request = await _read_request(stream, conn)
            if request is None:
                return
            response = await _answer(request, routes)
            headers = [
                ("content-type", response.content_type),
                ("content-length", str(len(response.body))),
                ("connection", "close"),
                ("cache-control", "no-store"),
            ]
            await stream.send_all(conn.send(h11.Response(status_code=response.status, headers=headers)))
            if request.method != b"HEAD":
                await stream.send_all(conn.send(h11.Data(data=response.body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
    except h11.RemoteProtocolError as exc:
        # Not HTTP/1.1, or a head over MAX_HEAD_BYTES: say so (400 or 431) and close.
        log.debug("admin port: bad request: %s", exc)
        with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError, h11.ProtocolError):
            body = f"bad request: {exc}\n".encode()
            headers = [("content-type", "text/plain; charset=utf-8"), ("connection", "close")]
            headers.append(("content-length", str(len(body))))
            await stream.send_all(conn.send(h11.Response(status_code=exc.error_status_hint, headers=headers)))
            await stream.send_all(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        log.debug("admin port: connection ended: %s", exc)
    finally:
        await stream.aclose()


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            conn.receive_data(data)
            if not data:
                return None
            continue
        if isinstance(event, h11.Request):
            return event
        return None


async def _answer(request: h11.Request, routes: Mapping[str, Handler]) -> Response:
    path = request.target.decode("ascii", "replace").split("?", 1)[0]
    if request.method not in (b"GET", b"HEAD"):
        return Response(405, "text/plain; charset=utf-8", b"only GET and HEAD\n")
    handler = routes.get(path)
    if handler is None:
        known = ", ".join(sorted(routes))
        return Response(
            404, "text/plain; charset=utf-8", f"no such path; this port serves {known}\n".encode()
        )
    accept = next((v.decode("latin-1") for k, v in request.headers if k == b"accept"), "")
    try:
        return await handler(accept)
    except Exception:
        log.exception("admin port: %s failed", path)
        return Response(500, "text/plain; charset=utf-8", b"internal error; see the process's log\n")
