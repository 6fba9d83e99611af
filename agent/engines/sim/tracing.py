"""The sim engine's trace spans, made as vLLM makes them with ``--otlp-traces-endpoint URL``.

vLLM (``vllm/tracing.py``, ``vllm/v1/engine/output_processor.py``) continues the W3C
``traceparent`` a request carries (or starts a trace), and exports one span per finished request:
named ``llm_request``, kind SERVER, begun at the request's arrival, with its own ``gen_ai.*``
attribute names (the older ``gen_ai.usage.prompt_tokens`` / ``completion_tokens``, and
``gen_ai.latency.time_to_first_token`` and ``.e2e`` in seconds). The sim does the same, so a router's span finds an engine span
as its child in tests as it would in production. The endpoint is the whole traces URL, as vLLM
hands it to the exporter. vLLM's exporter protocol comes from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (vLLM's default: grpc); the sim exports over HTTP only, so
it refuses any other value, naming the variable, instead of sending where nothing listens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Span, SpanKind

from telemetry import tracing

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: vLLM's span name and its attribute names that the semantic conventions package no longer has.
SPAN_NAME = "llm_request"
REQUEST_ID = "gen_ai.request.id"
REQUEST_N = "gen_ai.request.n"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"


class EngineTracing:
    """One sim process's tracer (``telemetry.tracing.Tracing``) and vLLM's span shape."""

    def __init__(self, endpoint: str, environ: Mapping[str, str]) -> None:
        protocol = environ.get(PROTOCOL_ENV, "http/protobuf").strip() or "http/protobuf"
        if protocol != "http/protobuf":
            raise tracing.TracingSettingsError(
                f"{PROTOCOL_ENV}={protocol!r}: the simulator exports OTLP over HTTP only; set it to "
                "http/protobuf (vLLM's own default is grpc)"
            )
        self.tracing = tracing.Tracing(
            tracing.check_endpoint(endpoint, "--otlp-traces-endpoint"), "llmgw-sim", environ
        )

    def begin(self, headers: Sequence[tuple[bytes, bytes]], arrival: float) -> Span:
        """The request's span, begun at ``arrival`` (``time.time()``), the child of its
        ``traceparent`` when it has one."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in (b"traceparent", b"tracestate")
        }
        return self.tracing.tracer.start_span(
            SPAN_NAME,
            context=tracing.extract(carrier),
            kind=SpanKind.SERVER,
            start_time=int(arrival * 1e9),
        )

    def end(
        self,
        span: Span,
        *,
        model: str,
        request_id: str,
        body: Mapping[str, object],
        prompt_tokens: int,
        completion_tokens: int,
        arrival: float,
        first_token: float,
    ) -> None:
        """vLLM's attributes for a finished request, then the span's end (now)."""
        now = time.time()
        span.set_attribute(gen_ai.GEN_AI_RESPONSE_MODEL, model)
        span.set_attribute(REQUEST_ID, request_id)
        for key, attribute in (
            ("temperature", gen_ai.GEN_AI_REQUEST_TEMPERATURE),
            ("top_p", gen_ai.GEN_AI_REQUEST_TOP_P),
            ("max_tokens", gen_ai.GEN_AI_REQUEST_MAX_TOKENS),
            ("n", REQUEST_N),
        ):
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                span.set_attribute(attribute, value)
        span.set_attribute(gen_ai.GEN_AI_USAGE_PROMPT_TOKENS, prompt_tokens)
        span.set_attribute(gen_ai.GEN_AI_USAGE_COMPLETION_TOKENS, completion_tokens)
        if first_token:
            span.set_attribute(TIME_TO_FIRST_TOKEN, max(0.0, first_token - arrival))
        span.set_attribute(E2E, max(0.0, now - arrival))
        span.end(end_time=int(now * 1e9))

    def shutdown(self) -> None:
        """Send what is queued and stop the exporter's thread (blocks: from a worker thread)."""
        self.tracing.shutdown()
