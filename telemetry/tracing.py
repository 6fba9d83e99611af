"""OpenTelemetry traces for every llmgw process: the OTLP/HTTP (protobuf) exporter behind a batching
processor, configured by the standard ``OTEL_*`` variables and a process's ``--otlp-endpoint``.

Off by default. Tracing is on when an endpoint is given: the process's ``--otlp-endpoint`` (the
collector's base URL; ``/v1/traces`` is added as the OTLP/HTTP specification says), else
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full traces URL, used as it is), else
``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL). ``OTEL_SDK_DISABLED=true`` turns it off whatever is
given. When off, :func:`start` returns None and nothing of the SDK runs: a process's request path
holds a ``None`` check, never a no-op tracer's calls.

Everything else is the SDK's own reading of the standard variables: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the service name defaults to the process's, ``llmgw-router`` ...),
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on),
``OTEL_EXPORTER_OTLP_HEADERS`` / ``_TIMEOUT`` / ``_CERTIFICATE`` / ``_COMPRESSION`` (and their
``_TRACES_`` forms), and ``OTEL_BSP_MAX_QUEUE_SIZE`` / ``_SCHEDULE_DELAY`` /
``_MAX_EXPORT_BATCH_SIZE`` / ``_EXPORT_TIMEOUT`` for the batching processor.

Why it never blocks the trio thread: ending a span only puts it on the batching processor's
bounded queue (a deque, and at most the setting of a ``threading.Event``); the encoding and the
HTTP POST run in the SDK's own worker thread. A collector that is down or slow fills the queue,
and then spans are dropped, never waited for: :class:`Tracing` counts them, and its
:meth:`Tracing.collector` shows them on the process's ``/metrics`` as
``llmgw_tracing_spans_dropped_total`` beside ``llmgw_tracing_queue_spans``. Shutting down flushes
what is queued, with a bound: call :meth:`Tracing.shutdown` after the event loop ended (or from a
worker thread).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from telemetry.version import version

#: The signal-specific variable: the whole traces URL, used as it is.
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
#: The base URL of every signal; ``/v1/traces`` is appended for traces.
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
DISABLED_ENV = "OTEL_SDK_DISABLED"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
TRACES_PATH = "/v1/traces"
#: How long :meth:`Tracing.shutdown` waits for the queue to be sent, in seconds.
SHUTDOWN_TIMEOUT = 5.0

#: W3C Trace Context (``traceparent``, ``tracestate``): what vLLM reads and writes.
PROPAGATOR = TraceContextTextMapPropagator()


class TracingSettingsError(ValueError):
    """An OTLP endpoint that is not an http(s) URL; the message names the flag or variable."""


def endpoint_problem(value: str) -> str:
    """What is wrong with ``value`` as an OTLP/HTTP endpoint ("" when it is empty or an
    ``http://`` / ``https://`` URL with a host), for a config loader to name its key."""
    if not value:
        return ""
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:
        host = None
    if parts.scheme not in ("http", "https") or not host:
        return (
            f"{value[:80]!r} is not an OTLP/HTTP endpoint; write http://HOST:4318 "
            "(a collector's OTLP/HTTP port) or https://..."
        )
    return ""


def check_endpoint(value: str, source: str) -> str:
    """``value`` when :func:`endpoint_problem` finds nothing; else :class:`TracingSettingsError`
    naming ``source`` (the flag or variable it came from)."""
    problem = endpoint_problem(value)
    if problem:
        raise TracingSettingsError(f"{source} {problem}")
    return value


def traces_endpoint(flag: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The URL spans are POSTed to, or "" when tracing is off (the module docstring's rules)."""
    environ = os.environ if environ is None else environ
    if environ.get(DISABLED_ENV, "").strip().lower() == "true":
        return ""
    if flag:
        return _with_path(check_endpoint(flag, "--otlp-endpoint"))
    full = environ.get(TRACES_ENDPOINT_ENV, "").strip()
    if full:
        return check_endpoint(full, TRACES_ENDPOINT_ENV)
    base = environ.get(ENDPOINT_ENV, "").strip()
    return _with_path(check_endpoint(base, ENDPOINT_ENV)) if base else ""


def _with_path(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


class _CountingProcessor(BatchSpanProcessor):
    """The SDK's batching processor, counting the spans it drops because its queue is full.

    The SDK drops one span for each one ended while the queue holds ``max_queue_size`` (it
    logs a warning, rate-limited); the count is read from the same queue, on the thread that
    ends spans, before the span is handed over."""

    def __init__(self, exporter: OTLPSpanExporter) -> None:
        super().__init__(exporter)
        self.dropped = 0
        self.ended = 0
        self._lock = threading.Lock()

    def queued(self) -> int:
        batch = getattr(self, "_batch_processor", None)
        queue = getattr(batch, "_queue", None)
        return len(queue) if queue is not None else 0

    def _full(self) -> bool:
        batch = getattr(self, "_batch_processor", None)
        limit = getattr(batch, "_max_queue_size", None)
        return limit is not None and self.queued() >= limit

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            full = self._full()
            with self._lock:  # spans may end on several threads (the router's pump is one)
                self.ended += 1
                if full:
                    self.dropped += 1
        super().on_end(span)


class Tracing:
    """One process's tracer provider, its exporter and the counts of what it sent and dropped.

    Made by :func:`start`; the process hands :attr:`tracer` to what makes spans and calls
    :meth:`shutdown` once, off the trio thread, when it stops."""

    def __init__(self, endpoint: str, service_name: str, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.endpoint = endpoint
        # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) are read by Resource.create; the
        # process's own name is only the default, so it is given only when the variable is not.
        attributes = {} if environ.get(SERVICE_NAME_ENV) else {SERVICE_NAME: service_name}
        attributes["service.version"] = version()
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.processor = _CountingProcessor(OTLPSpanExporter(endpoint=endpoint))
        self.provider.add_span_processor(self.processor)
        self.tracer: Tracer = self.provider.get_tracer("llmgw", version())

    @property
    def dropped(self) -> int:
        return self.processor.dropped

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Send what is queued (up to ``timeout`` seconds) and stop the worker thread. Blocks:
        call it after the event loop, or in a worker thread."""
        self.processor.force_flush(int(timeout * 1000))
        self.provider.shutdown()

    def collector(self) -> Collector:
        """The counts as Prometheus series, for the process's registry."""
        return _TracingCollector(self.processor)


class _TracingCollector(Collector):
    def __init__(self, processor: _CountingProcessor) -> None:
        self.processor = processor

    def collect(self) -> Iterator[Metric]:
        ended = CounterMetricFamily(
            "llmgw_tracing_spans_ended", "Sampled spans ended and handed to the OTLP exporter's queue."
        )
        ended.add_metric([], self.processor.ended)
        yield ended
        dropped = CounterMetricFamily(
            "llmgw_tracing_spans_dropped",
            "Spans dropped because the export queue was full (the collector down or slow; "
            "OTEL_BSP_MAX_QUEUE_SIZE bounds the queue).",
        )
        dropped.add_metric([], self.processor.dropped)
        yield dropped
        queue = GaugeMetricFamily("llmgw_tracing_queue_spans", "Spans waiting in the export queue.")
        queue.add_metric([], self.processor.queued())
        yield queue


def start(flag: str, service_name: str, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Tracing for a process named ``service_name``, or None when no endpoint is given (off).
    ``flag`` is the process's ``--otlp-endpoint`` ("" when not given). Raises
    :class:`TracingSettingsError` for an endpoint that is not an http(s) URL."""
    endpoint = traces_endpoint(flag, environ)
    return Tracing(endpoint, service_name, environ) if endpoint else None


def extract(headers: Mapping[str, str]) -> Context:
    """The context a request's ``traceparent`` (and ``tracestate``) carry; an empty one (a new
    trace) when it has none or a malformed one."""
    return PROPAGATOR.extract(headers)


def traceparent(context: Context) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``) headers that continue ``context``."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    return carrier
