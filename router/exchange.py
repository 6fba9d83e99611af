"""One request on one client connection while it is answered (``Exchange``), and the errors
that end it: an answer of the router's own (``RouterError``), or the client gone (``ClientLeft``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from router.http1 import ClientConn, Request

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from router.relay import StreamFacts


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


class ClientLeft(Exception):
    """The client's connection closed or broke while its response was being produced."""


@attrs.define
class Exchange:
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
    #: The response's usage is read from its last bytes: a JSON body, or a stream that asked for
    #: ``stream_options.include_usage``.
    want_usage: bool = False

    @property
    def want_tail(self) -> bool:
        """Whether the relay keeps the body's last bytes: for its usage, and for a stream also to
        tell a client that left after the stream's last event from one that left before it."""
        return self.want_usage or self.stream

    #: What the relay learned about the response body (``router.relay.StreamFacts``), folded into
    #: /metrics once the request is answered.
    facts: StreamFacts | None = None
    #: While the client's body is chunked: whether what it got so far ends with a whole chunk,
    #: so that an error event and the last chunk can still be appended (see ``Router._timed_out``).
    at_chunk_end: Callable[[], bool] | None = None

    #: The request's trace span while the router traces (``router.tracing``); None when off.
    span: Span | None = None
    #: The router's ``traceparent`` header lines for the engine (b"": the client's go through).
    trace_context: bytes = b""

    @property
    def fd(self) -> int:
        return self.client.fd
