"""Traces from a real router and a real sim engine under the ``openai`` client, collected by a real
OTLP/HTTP receiver (``tests/otlp.py``, decoding with the ``opentelemetry-proto`` messages).

One trace per request: the router's ``gen_ai`` span (named and attributed with the semantic
conventions package's constants) and the sim's ``llm_request`` span as its child, the client's
``traceparent`` continued, the routing decision and each failed attempt on the router's span, JSON
log lines carrying the span's ids; with tracing off the router passes the client's context
through untouched. And the exporter's bounded queue: a collector that hangs costs dropped spans,
counted on ``/metrics``, never a blocked caller.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import http_attributes
from opentelemetry.trace import use_span

from agent.engines.sim import tracing as sim_tracing
from router import tracing as router_tracing
from telemetry import tracing
from telemetry.logs import JsonFormatter
from tests.otlp import Receiver, Span, receiver
from tests.test_router import MODEL, Engine, closed_port_url, start_engine, stop_engines
from tests.test_router_metrics import CHAT, REPO, RouterProc, value

#: Export within ~50 ms of a span's end, so the receiver sees it at once.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}

#: Every gen_ai attribute the router's span may carry, by the semconv package's constants.
GEN_AI_NAMES = {
    gen_ai.GEN_AI_OPERATION_NAME,
    gen_ai.GEN_AI_REQUEST_MODEL,
    gen_ai.GEN_AI_REQUEST_STREAM,
    gen_ai.GEN_AI_RESPONSE_MODEL,
    gen_ai.GEN_AI_USAGE_INPUT_TOKENS,
    gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS,
    gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    gen_ai.GEN_AI_RESPONSE_FINISH_REASONS,
    gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK,
}


@pytest.fixture(scope="module")
def collector() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, collector: Receiver) -> Iterator[Engine]:
    started = start_engine(
        tmp_path_factory.mktemp("engine"),
        "traced",
        {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        extra=["--otlp-traces-endpoint", collector.traces_url],
    )
    yield started
    stop_engines([started])


def traceparent() -> tuple[str, str, str]:
    """A client's ``traceparent`` header, its trace id and its span id."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def client(base: str, header: str | None = None) -> openai.OpenAI:
    headers = {"traceparent": header} if header else None
    return openai.OpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30, default_headers=headers
    )


def in_trace(trace_id: str, name: str) -> Callable[[Span], bool]:
    return lambda s: s.trace_id == trace_id and s.name == name


def test_one_trace_per_request_router_span_parent_of_the_engines(
    engine: Engine, collector: Receiver, tmp_path: Path
) -> None:
    router = RouterProc(
        tmp_path,
        ["--static", f"{MODEL}={engine.url}", "--otlp-endpoint", collector.url, "--log-level", "debug"],
        {**FAST_EXPORT, "LLMGW_LOG_FORMAT": "json"},
    )
    try:
        # A stream with usage, the client's traceparent continued.
        header, trace_id, client_span = traceparent()
        chunks = list(
            client(router.base, header).chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        (span,) = collector.find("the router's span", in_trace(trace_id, f"chat {MODEL}"))
        (engine_span,) = collector.find("the engine's span", in_trace(trace_id, "llm_request"))
        assert span.parent_span_id == client_span  # the client's trace, continued
        assert span.kind == ProtoSpan.SPAN_KIND_SERVER
        assert span.service == "llmgw-router" and engine_span.service == "llmgw-sim"
        assert engine_span.parent_span_id == span.span_id  # the engine got the router's context
        a = span.attributes
        assert a[gen_ai.GEN_AI_OPERATION_NAME] == "chat"
        assert a[gen_ai.GEN_AI_REQUEST_MODEL] == MODEL
        assert a[gen_ai.GEN_AI_RESPONSE_MODEL] == MODEL
        assert a[gen_ai.GEN_AI_REQUEST_STREAM] is True
        assert a[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] == usage.prompt_tokens
        assert a[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] == usage.completion_tokens == 5
        assert a[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] == finish
        assert 0 < a[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] < (span.end_ns - span.start_ns) / 1e9
        assert a[http_attributes.HTTP_RESPONSE_STATUS_CODE] == 200
        assert a[router_tracing.ROUTE_REPLICA] == f"{MODEL}-r0"
        assert a[router_tracing.ROUTE_URL] == engine.url
        assert a[router_tracing.ROUTE_CANDIDATES] == [f"{MODEL}-r0"]
        assert a[router_tracing.ROUTE_POLICY] == "prefix_hash" and a[router_tracing.ROUTE_ATTEMPTS] == 1
        assert {k for k in a if k.startswith("gen_ai.")} <= GEN_AI_NAMES
        # The engine's span as vLLM's: its own names, its usage, inside the router's span.
        e = engine_span.attributes
        assert e[gen_ai.GEN_AI_USAGE_COMPLETION_TOKENS] == 5
        assert e[gen_ai.GEN_AI_USAGE_PROMPT_TOKENS] == usage.prompt_tokens
        assert e[sim_tracing.TIME_TO_FIRST_TOKEN] > 0 and e[sim_tracing.E2E] > 0
        assert span.start_ns <= engine_span.start_ns <= engine_span.end_ns <= span.end_ns

        # A whole (non-streamed) completion without a traceparent: a trace of its own.
        answer = client(router.base).completions.create(model=MODEL, prompt="count", max_tokens=3)
        assert answer.usage is not None
        (whole,) = collector.find(
            "the completion's span",
            lambda s: s.name == f"text_completion {MODEL}" and s.service == "llmgw-router",
        )
        assert whole.parent_span_id == "" and whole.trace_id != trace_id
        assert whole.attributes[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] == answer.usage.completion_tokens == 3
        assert whole.attributes[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] == [answer.choices[0].finish_reason]
        assert gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK not in whole.attributes
        (child,) = collector.find("its engine span", in_trace(whole.trace_id, "llm_request"))
        assert child.parent_span_id == whole.span_id

        # JSON log lines inside the span carry its ids (the routing decision is logged at debug).
        lines = [json.loads(line) for line in router.err.read_text().splitlines() if line.startswith("{")]
        decided = [d for d in lines if d["message"].startswith(f"router: model {MODEL} to")]
        assert {(d.get("trace_id"), d.get("span_id")) for d in decided} == {
            (trace_id, span.span_id),
            (whole.trace_id, whole.span_id),
        }
        assert all("trace_id" not in d for d in lines if d not in decided)

        # The exporter's counts on /metrics: nothing dropped.
        metrics = router.metrics()
        assert value(metrics, "llmgw_tracing_spans_ended_total") >= 2
        assert ("llmgw_tracing_spans_dropped_total", frozenset()) in metrics
        assert value(metrics, "llmgw_tracing_spans_dropped_total") == 0
    finally:
        router.stop()


def test_a_failed_attempt_and_the_retry_are_events(
    engine: Engine, collector: Receiver, tmp_path: Path
) -> None:
    dead = closed_port_url()
    router = RouterProc(
        tmp_path,
        [
            "--static",
            f"{MODEL}={dead}",
            "--static",
            f"{MODEL}={engine.url}",
            "--otlp-endpoint",
            collector.url,
        ],
        FAST_EXPORT,
    )
    try:
        # Prefix affinity sends a prompt to one replica; prompts differ until one went to the
        # dead one first (about every other prompt does; three failures eject it).
        for n in range(12):
            header, trace_id, _ = traceparent()
            client(router.base, header).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"prompt {n}"}], max_tokens=2
            )
            (span,) = collector.find("the router's span", in_trace(trace_id, f"chat {MODEL}"))
            if span.events:
                break
        else:
            pytest.fail("no prompt of 12 went to the dead replica first")
        names = [name for name, _ in span.events]
        assert names == [router_tracing.ATTEMPT_FAILED, router_tracing.RETRY]
        failed, retry = span.events[0][1], span.events[1][1]
        assert failed["url"] == dead and "refused" in failed["error"]
        assert retry == {"attempt": 2, "replica": f"{MODEL}-r1", "url": engine.url}
        assert span.attributes[router_tracing.ROUTE_ATTEMPTS] == 2
        assert span.attributes[router_tracing.ROUTE_REPLICA] == f"{MODEL}-r1"
        assert span.attributes[router_tracing.ROUTE_CANDIDATES] == [f"{MODEL}-r1"]
    finally:
        router.stop()


def test_a_client_that_leaves_mid_stream_is_a_499_not_an_error(
    engine: Engine, collector: Receiver, tmp_path: Path
) -> None:
    router = RouterProc(
        tmp_path, ["--static", f"{MODEL}={engine.url}", "--otlp-endpoint", collector.url], FAST_EXPORT
    )
    try:
        header, trace_id, _ = traceparent()
        stream = client(router.base, header).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=400, stream=True
        )
        for n, _chunk in enumerate(stream):
            if n == 2:
                break
        stream.close()  # the client hangs up with most of the stream still to come
        (span,) = collector.find("the router's span", in_trace(trace_id, f"chat {MODEL}"))
        assert span.attributes[http_attributes.HTTP_RESPONSE_STATUS_CODE] == 499
        assert span.status != ProtoStatus.STATUS_CODE_ERROR and "error.type" not in span.attributes
        (engine_span,) = collector.find("the engine's span", in_trace(trace_id, "llm_request"))
        assert 2 <= engine_span.attributes[gen_ai.GEN_AI_USAGE_COMPLETION_TOKENS] < 400
    finally:
        router.stop()


def test_tracing_off_passes_the_clients_context_to_the_engine(
    engine: Engine, collector: Receiver, tmp_path: Path
) -> None:
    assert not [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]
    router = RouterProc(tmp_path, ["--static", f"{MODEL}={engine.url}"])
    try:
        header, trace_id, client_span = traceparent()
        client(router.base, header).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        (engine_span,) = collector.find("the engine's span", in_trace(trace_id, "llm_request"))
        assert engine_span.parent_span_id == client_span
        assert not [s for s in collector.spans if s.trace_id == trace_id and s.service == "llmgw-router"]
        assert ("llmgw_tracing_spans_ended_total", frozenset()) not in router.metrics()
    finally:
        router.stop()


def test_the_endpoint_rules() -> None:
    assert tracing.traces_endpoint("", {}) == ""  # off by default
    assert tracing.traces_endpoint("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert tracing.traces_endpoint("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    env = {tracing.ENDPOINT_ENV: "https://c:4318/"}
    assert tracing.traces_endpoint("", env) == "https://c:4318/v1/traces"
    assert tracing.traces_endpoint("http://flag:1", env) == "http://flag:1/v1/traces"
    assert tracing.traces_endpoint("", {**env, tracing.TRACES_ENDPOINT_ENV: "http://t:1/x"}) == "http://t:1/x"
    assert tracing.traces_endpoint("http://flag:1", {tracing.DISABLED_ENV: "true"}) == ""
    with pytest.raises(tracing.TracingSettingsError, match=f"^{tracing.ENDPOINT_ENV} 'c:4318' is not"):
        tracing.traces_endpoint("", {tracing.ENDPOINT_ENV: "c:4318"})
    assert tracing.start("", "x", {}) is None


def test_a_bad_endpoint_is_refused_with_its_flag() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "router",
            "--static",
            f"{MODEL}=http://127.0.0.1:1",
            "--otlp-endpoint",
            "c:4318",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2
    assert "otlp_endpoint" in done.stderr and "'c:4318' is not an OTLP/HTTP endpoint" in done.stderr


def test_a_hanging_collector_drops_spans_and_counts_them(
    monkeypatch: pytest.MonkeyPatch, collector: Receiver
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")
    collector.hold()
    traced = tracing.Tracing(collector.traces_url, "llmgw-test", {})
    try:
        began = time.monotonic()
        for n in range(200):
            traced.tracer.start_span(f"span {n}").end()
        took = time.monotonic() - began
        # The worker holds one batch (4) in a POST that hangs, the queue 8 more: the rest drop.
        assert traced.dropped >= 200 - 8 - 4 - 4
        assert took < 1.0, f"ending 200 spans took {took:.2f} s: the caller waited on the exporter"
        families = {m.name: m.samples[0].value for m in traced.collector().collect()}
        assert families["llmgw_tracing_spans_dropped"] == traced.dropped
        assert families["llmgw_tracing_spans_ended"] == 200
    finally:
        collector.release()
        traced.shutdown(timeout=5)


def test_json_log_lines_carry_the_span_ids_only_inside_a_span() -> None:
    traced = tracing.Tracing("http://127.0.0.1:1/v1/traces", "llmgw-test", {})
    try:
        record = logging.LogRecord("t", logging.INFO, "", 0, "outside", None, None)
        assert "trace_id" not in json.loads(JsonFormatter().format(record))
        span = traced.tracer.start_span("s")
        with use_span(span, end_on_exit=False):
            inside = json.loads(JsonFormatter().format(record))
        context = span.get_span_context()
        assert inside["trace_id"] == format(context.trace_id, "032x")
        assert inside["span_id"] == format(context.span_id, "016x")
    finally:
        traced.processor.shutdown()  # nothing ended: nothing to send to the closed port


def test_the_sim_refuses_a_protocol_it_cannot_speak() -> None:
    with pytest.raises(tracing.TracingSettingsError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='grpc'"):
        sim_tracing.EngineTracing("http://127.0.0.1:1/v1/traces", {sim_tracing.PROTOCOL_ENV: "grpc"})
