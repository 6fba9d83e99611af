"""The router's span: one per proxied request, named and attributed by OpenTelemetry's ``gen_ai``
semantic conventions, with the routing decision and every failed attempt on it.

A span is made only when the process has tracing on (``telemetry.tracing``); the server holds
``tracer is None`` checks and nothing else when it is off. The span continues the client's W3C
``traceparent`` (or starts a trace), and the engine is sent the router's own ``traceparent``, so
vLLM's ``llm_request`` span (and the sim engine's) is the router span's child.

Names: ``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat m``, ``text_completion m``,
``embeddings m``), kind SERVER. Attributes: the ``gen_ai`` request and response ones the router
can know without parsing a body it relays (the model asked and served, ``stream``, the usage and
finish reasons read from the body's last bytes, which the router keeps for its metrics; time to
the first chunk for a stream), ``http.response.status_code`` and ``error.type``, and the routing
decision under ``llmgw.route.*``: the policy, the rule that decided, its inputs, the candidates
with their loads, and the chosen replica and URL. A failed attempt is an event
(``llmgw.attempt_failed``: replica, URL, why) and each further attempt a ``llmgw.retry`` event.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import error_attributes, http_attributes
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer, set_span_in_context

from router.exchange import Exchange
from router.http1 import Request
from router.metrics import is_token_count, usage_object
from router.policies import Candidate, Choice
from telemetry import tracing

#: The request path's operation (``gen_ai.operation.name``'s well-known values).
OPERATIONS = {
    b"/v1/chat/completions": gen_ai.GenAiOperationNameValues.CHAT.value,
    b"/v1/completions": gen_ai.GenAiOperationNameValues.TEXT_COMPLETION.value,
    b"/v1/embeddings": gen_ai.GenAiOperationNameValues.EMBEDDINGS.value,
}

ROUTE_POLICY = "llmgw.route.policy"
ROUTE_RULE = "llmgw.route.rule"
ROUTE_CANDIDATES = "llmgw.route.candidates"
ROUTE_LOADS = "llmgw.route.candidate_loads"
ROUTE_REPLICA = "llmgw.route.replica"
ROUTE_URL = "llmgw.route.url"
ROUTE_LOAD = "llmgw.route.load"
ROUTE_ATTEMPTS = "llmgw.route.attempts"
ATTEMPT_FAILED = "llmgw.attempt_failed"
RETRY = "llmgw.retry"

# The last "model" and every "finish_reason" in a body's tail (a JSON body's end, or a stream's
# last events): matched once per response, on at most TAIL_BYTES.
_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]{1,32})"')


def start(tracer: Tracer, request: Request, path: bytes) -> tuple[Span, bytes]:
    """The request's span, begun now as the child of the client's ``traceparent`` (if any),
    and the ``traceparent`` header line (``b"\\r\\ntraceparent: ..."``) the engine is sent."""
    headers = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in request.headers
        if name in (b"traceparent", b"tracestate")
    }
    operation = OPERATIONS.get(path, "")
    span = tracer.start_span(
        operation or "router",
        context=tracing.extract(headers),
        kind=SpanKind.SERVER,
        attributes={gen_ai.GEN_AI_OPERATION_NAME: operation} if operation else None,
    )
    carrier = tracing.traceparent(set_span_in_context(span))
    line = b"".join(f"\r\n{k}: {v}".encode("latin-1") for k, v in carrier.items())
    return span, line


def requested(span: Span, path: bytes, model: str, stream: bool) -> None:
    """The request is read: its model names the span, as the conventions want."""
    operation = OPERATIONS.get(path, "")
    span.update_name(f"{operation} {model}" if operation else model)
    span.set_attribute(gen_ai.GEN_AI_REQUEST_MODEL, model)
    span.set_attribute(gen_ai.GEN_AI_REQUEST_STREAM, stream)


def chose(span: Span, choice: Choice, candidates: Sequence[Candidate], attempt: int) -> None:
    """The policy's decision for attempt ``attempt`` (1 for the first): the last one stands."""
    chosen = choice.upstream
    span.set_attribute(ROUTE_POLICY, choice.policy)
    span.set_attribute(ROUTE_RULE, choice.rule)
    for name, value in choice.inputs:
        if isinstance(value, bool | int | float | str):
            span.set_attribute(f"llmgw.route.input.{name}", value)
    span.set_attribute(ROUTE_CANDIDATES, [c.upstream.replica_id for c in candidates])
    span.set_attribute(ROUTE_LOADS, [c.load for c in candidates])
    span.set_attribute(ROUTE_REPLICA, chosen.replica_id)
    span.set_attribute(ROUTE_URL, chosen.url)
    span.set_attribute(ROUTE_LOAD, next((c.load for c in candidates if c.upstream is chosen), 0))
    span.set_attribute(ROUTE_ATTEMPTS, attempt)
    if attempt > 1:
        span.add_event(RETRY, {"attempt": attempt, "replica": chosen.replica_id, "url": chosen.url})


def failed(span: Span, replica: str, url: str, error: str) -> None:
    """An attempt that failed before any response byte reached the client."""
    span.add_event(ATTEMPT_FAILED, {"replica": replica, "url": url, "error": error})


def finish(span: Span, ex: Exchange, ttft: float | None) -> None:
    """End the span with what the response told: status, usage, finish reasons, model served,
    and ``ttft`` (seconds from the request's arrival to its first streamed chunk) when known."""
    status = ex.status
    if status:
        span.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, status)
    # A server span's error is the server's (5xx), as the HTTP conventions say; a client that
    # left (499) is its status code alone.
    if status >= 500:
        span.set_attribute(error_attributes.ERROR_TYPE, str(status))
        span.set_status(StatusCode.ERROR)
    facts = ex.facts
    if facts is not None and facts.tail:
        tail = facts.tail
        usage = usage_object(tail)
        if usage is not None:
            for key, attribute in (
                ("prompt_tokens", gen_ai.GEN_AI_USAGE_INPUT_TOKENS),
                ("completion_tokens", gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS),
            ):
                count = usage.get(key)
                if is_token_count(count):
                    span.set_attribute(attribute, count)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if is_token_count(cached):
                span.set_attribute(gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, cached)
        reasons = [m.decode() for m in _FINISH.findall(tail)]
        if reasons:
            span.set_attribute(gen_ai.GEN_AI_RESPONSE_FINISH_REASONS, reasons)
        model = None
        for model in _MODEL.finditer(tail):  # noqa: B007 -- the last match is the one wanted
            pass
        if model is not None:
            try:
                span.set_attribute(gen_ai.GEN_AI_RESPONSE_MODEL, json.loads(b'"' + model[1] + b'"'))
            except ValueError:
                pass
    if ttft is not None:
        span.set_attribute(gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, ttft)
    span.end()
