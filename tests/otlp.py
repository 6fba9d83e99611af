"""A real OTLP/HTTP trace receiver for tests: a loopback HTTP server that decodes each
``POST /v1/traces`` body as an ``ExportTraceServiceRequest`` with the ``opentelemetry-proto``
messages (the collector's own schema, not our encoder's) and keeps the spans it carried.

``hold()`` makes it accept requests and answer none until ``release()``: a collector that hangs,
for the exporter's bounded queue and drop count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support import poll


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@attrs.frozen
class Span:
    """One span as the receiver decoded it: ids in hex, as trace viewers and traceparent write them."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    start_ns: int
    end_ns: int
    #: The span's status code (``Status.StatusCode``: 0 unset, 1 ok, 2 error).
    status: int = 0


class Receiver:
    """The receiver; ``url`` is its base (the ``--otlp-endpoint`` form), ``traces_url`` the whole
    traces URL (the ``--otlp-traces-endpoint`` form)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._held = threading.Event()
        self._held.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver._held.wait(30)
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.traces_url = f"{self.url}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans: list[Span] = []
        for resource_spans in request.resource_spans:
            attrs_ = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs_.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            service=service,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events
                            ],
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def find(self, what: str, match: Callable[[Span], bool], count: int = 1) -> list[Span]:
        """Wait (bounded) until ``count`` spans match, and return those that do."""

        def found() -> list[Span] | None:
            with self._lock:
                got = [s for s in self.spans if match(s)]
            return got if len(got) >= count else None

        return poll(what, found, timeout=30)

    def hold(self) -> None:
        self._held.clear()

    def release(self) -> None:
        self._held.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()
