"""The router's ``/metrics``, through ``prometheus_client``: its series, their labels and buckets.

Every series is rendered by ``prometheus_client`` (text 0.0.4, or OpenMetrics when the scraper
asks), never formatted here: a counter past a million prints every digit, label values are escaped
by the library. The values themselves are plain counters that the router's tasks update on the trio
thread (one dict update per request, no locks, no Python per relayed event: the pumps gather the
per-event facts, ``router.relay.StreamFacts``, and the router folds them in once per response).
``RouterCollector`` turns them into metric families at scrape time, on the trio thread, where
nothing can change them halfway; the encoding and the process collector's ``/proc`` reads then run
in a worker thread (``Metrics.scrape``).

The series (``docs/router.md`` lists them for operators):

- ``llmgw_router_requests_total{model,status}``: requests answered, by model and HTTP status,
  the router's own answers (400, 401, 404, 499, 502, 503, 504) included. ``model`` is bounded:
  a model the router has no route for counts as ``(unknown)`` and a request that names none as
  ``""``, so a client cannot grow the series by inventing names;
- ``llmgw_router_time_to_first_byte_seconds{model}`` (histogram): from the request's arrival to
  the first response byte sent;
- ``llmgw_router_time_to_first_token_seconds{model}`` (histogram, streamed responses): from the
  request's arrival to the router reading the response's first body event;
- ``llmgw_router_inter_token_latency_seconds{model}`` (histogram, streamed responses): the gaps
  between a stream's consecutive events as the router read them (events read together: 0 s);
  one observation per event after the first, added when the stream ends;
- ``llmgw_router_prompt_tokens_total{model}``, ``llmgw_router_completion_tokens_total{model}``:
  the ``usage`` the engine reported (a JSON body's, or a stream's last chunk when the client asked
  for ``stream_options.include_usage``);
- ``llmgw_router_upstream_errors_total{replica,url,kind}``, ``llmgw_router_retries_total{model}``,
  ``llmgw_router_client_disconnects_total{model}``, ``llmgw_router_ejections_total{replica,url}``,
  ``llmgw_router_client_connections_closed_total{reason}``;
- gauges read from the ejection records, the pool and the pump at scrape time: ``llmgw_router_in_flight``,
  ``llmgw_router_upstream_ejected``, ``llmgw_router_idle_connections``, ``llmgw_router_streams``,
  ``llmgw_router_streams_client_blocked``, ``llmgw_router_client_connections``;
- the relay pump's ``llmgw_router_relay_{wakeups,pauses,reads}_total``;
- ``llmgw_router_info{version,relay}``, and the process, platform and GC collectors.
"""

from __future__ import annotations

import json
import re
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import TypeGuard

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from router.pool import Pool
from router.relay import ITL_BUCKETS, Pump, StreamFacts
from router.retry import Ejection
from router.routes import Upstream
from telemetry.metrics import exposition, new_registry

TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Time to first token: a warm engine's prefill takes milliseconds to a second; a long prompt, a
#: queue or a cold cache tens of seconds; the response timeout (300 s by default) ends the rest.
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: The label of a model the router has no route for: one series however many names clients send.
UNKNOWN_MODEL = "(unknown)"

# The last "usage" object in a body's tail (one level of nesting: prompt_tokens_details and the
# like). Matched on the last bytes only, once per response.
_USAGE = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')


# A stream's ``data: [DONE]`` event at the end of a body's tail, past the chunk framing around it
# (the chunk's CRLF, and any part of the last chunk that came after it).
_DONE_AT_END = re.compile(rb"data: ?\[DONE\]\r?\n\r?\n(?:\r\n)?(?:0[\r\n]*)?$")


def ended_with_done(tail: bytes) -> bool:
    """Whether a streamed body's last event was ``data: [DONE]``: the OpenAI stream's end. The
    ``openai`` client closes its connection on reading it, without waiting for the chunked body's
    own end, which engines write separately; such a client was answered whole, not one that left."""
    return _DONE_AT_END.search(tail) is not None


def usage_object(tail: bytes) -> dict[str, object] | None:
    """The last ``usage`` object in ``tail`` (a body's last bytes), parsed, or None when there
    is none or it does not parse (the metrics read two counts of it, a trace span three)."""
    last = None
    for last in _USAGE.finditer(tail):  # noqa: B007 -- the last match is the one wanted
        pass
    if last is None:
        return None
    try:
        doc = json.loads(last[1])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def usage_of(tail: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from the last ``usage`` object in ``tail`` (a body's
    last bytes), or None when there is none or it does not parse."""
    doc = usage_object(tail)
    if doc is None:
        return None
    prompt, completion = doc.get("prompt_tokens"), doc.get("completion_tokens")
    if not (is_token_count(prompt) and is_token_count(completion)):
        return None
    return prompt, completion


def is_token_count(value: object) -> TypeGuard[int]:
    """A token count: a non-negative int (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Histogram:
    """Bucket counts (not cumulative, the last slot above every bound) and the sum, per label."""

    __slots__ = ("bounds", "rows")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.rows: dict[str, list[float]] = {}  # label -> counts..., then the sum

    def _row(self, label: str) -> list[float]:
        row = self.rows.get(label)
        if row is None:
            row = self.rows[label] = [0.0] * (len(self.bounds) + 2)
        return row

    def observe(self, label: str, value: float) -> None:
        row = self._row(label)
        row[bisect_left(self.bounds, value)] += 1
        row[-1] += value

    def add(self, label: str, counts: Iterable[int], total: float) -> None:
        """Many observations at once: per-bucket ``counts`` over the same bounds, and their sum."""
        row = self._row(label)
        for i, n in enumerate(counts):
            row[i] += n
        row[-1] += total

    def family(self, name: str, text: str, label: str = "model") -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, text, labels=[label])
        for value, row in sorted(self.rows.items()):
            cumulative = 0.0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip(self.bounds, row, strict=False):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            buckets.append(("+Inf", cumulative + row[-2]))
            family.add_metric([value], buckets, row[-1])
        return family


def _bound(value: float) -> str:
    # As prometheus_client's own Histogram writes ``le`` (floatToGoString: repr below 1e6).
    return repr(float(value))


def _counter(
    name: str, text: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], int]]
) -> Metric:
    family = CounterMetricFamily(name, text, labels=labels)
    for key, n in sorted(values):
        family.add_metric(list(key), n)
    return family


class Metrics:
    """The router's counters (see the module docstring), owned by one router.

    Plain dicts updated from the router's tasks, which all run on one trio thread, so no locks; the
    gauges (in flight, ejected, idle connections) are read from the ejection records and pool at scrape
    time instead of being kept up to date on every request."""

    def __init__(self, version: str = "unknown") -> None:
        self.version = version
        self.requests: dict[tuple[str, str], int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.disconnects: dict[str, int] = {}
        self.ejections: dict[tuple[str, str], int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[str, int] = {}
        self.ttfb = _Histogram(TTFB_BUCKETS)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        #: Client connections the router ended for a limit: header, idle, body, over_capacity.
        self.clients_closed: dict[str, int] = {}
        #: Client connections open (``Router.connections``), set before each exposition.
        self.client_connections = 0
        #: The process, platform and GC collectors (read in a worker thread at scrape time).
        self.process = new_registry()

    # -- updates, on the trio thread --------------------------------------------------------------

    def client_closed(self, reason: str) -> None:
        self.clients_closed[reason] = self.clients_closed.get(reason, 0) + 1

    def request(self, model: str, status: int | str) -> None:
        key = (model, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def upstream_error(self, upstream: Upstream, kind: str) -> None:
        key = (upstream.replica_id, upstream.url, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def observe_ttfb(self, model: str, seconds: float) -> None:
        self.ttfb.observe(model, seconds)

    def body_ended(self, model: str, facts: StreamFacts, since: float | None, *, count_usage: bool) -> None:
        """A response body ended (whole or not): its events' facts and, with ``count_usage``, the token
        usage in its tail, once per response. ``since``: the request's arrival as
        ``time.monotonic`` seconds, for a streamed response's time to first token and gaps (None:
        not a stream)."""
        if since is not None and facts.events:
            self.ttft.observe(model, max(0.0, facts.first_at - since))
            if facts.events > 1:
                self.itl.add(model, facts.gaps, facts.gap_sum)
        if count_usage and facts.tail:
            usage = usage_of(facts.tail)
            if usage is not None:
                self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + usage[0]
                self.completion_tokens[model] = self.completion_tokens.get(model, 0) + usage[1]

    # -- scrapes ------------------------------------------------------------------------------------

    def families(self, ejection: Ejection, pool: Pool, pump: Pump, now: float) -> list[Metric]:
        """Every router series as metric families, read now (call it on the trio thread)."""
        return list(RouterCollector(self, ejection, pool, pump, now).collect())

    async def scrape(
        self, ejection: Ejection, pool: Pool, pump: Pump, now: float, accept: str = ""
    ) -> tuple[bytes, str]:
        """The exposition (and its content type) in the format ``accept`` asks for: the router's
        series read here, on the trio thread; encoding and the process collector in a thread."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(self.families(ejection, pool, pump, now)))
        registry.register(self.process)
        return await exposition(registry, accept)


class _Fixed(Collector):
    """Families read already: what one scrape renders."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class RouterCollector(Collector):
    """A ``prometheus_client`` custom collector over one router's ``Metrics`` and the ejection,
    pool and pump gauges; not thread-safe against the router's tasks: collect on the trio thread
    (``Metrics.families``)."""

    def __init__(self, metrics: Metrics, ejection: Ejection, pool: Pool, pump: Pump, now: float) -> None:
        self.metrics, self.ejection, self.pool, self.pump, self.now = metrics, ejection, pool, pump, now

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        info = InfoMetricFamily("llmgw_router", "The router's version and relay pump.")
        info.add_metric([], {"version": m.version, "relay": self.pump.kind})
        yield info
        yield _counter(
            "llmgw_router_requests",
            "Requests answered, by model and HTTP status (the router's own answers included; a "
            f'model without a route counts as {UNKNOWN_MODEL}, a request naming none as "").',
            ["model", "status"],
            m.requests.items(),
        )
        yield m.ttfb.family(
            "llmgw_router_time_to_first_byte_seconds",
            "From the request's arrival to the first response body byte sent to the client.",
        )
        yield m.ttft.family(
            "llmgw_router_time_to_first_token_seconds",
            "Streamed responses: from the request's arrival to the router reading the first body event.",
        )
        yield m.itl.family(
            "llmgw_router_inter_token_latency_seconds",
            "Streamed responses: the gaps between consecutive body events as the router read them "
            "(events read together count as 0 s), added when the stream ends.",
        )
        yield _counter(
            "llmgw_router_prompt_tokens",
            "Prompt tokens, from the usage the engine reported (JSON bodies; streams that asked for "
            "stream_options.include_usage).",
            ["model"],
            (((k,), v) for k, v in m.prompt_tokens.items()),
        )
        yield _counter(
            "llmgw_router_completion_tokens",
            "Completion tokens, from the usage the engine reported.",
            ["model"],
            (((k,), v) for k, v in m.completion_tokens.items()),
        )
        yield _counter(
            "llmgw_router_upstream_errors",
            "Upstream failures, by replica and kind (connect, reset, closed, timeout, unavailable, "
            "protocol, mid_stream).",
            ["replica", "url", "kind"],
            m.upstream_errors.items(),
        )
        yield _counter(
            "llmgw_router_retries",
            "Requests moved to another replica after a failure.",
            ["model"],
            (((k,), v) for k, v in m.retries.items()),
        )
        yield _counter(
            "llmgw_router_client_disconnects",
            "Clients that left before their response ended (the upstream request was cancelled).",
            ["model"],
            (((k,), v) for k, v in m.disconnects.items()),
        )
        yield _counter(
            "llmgw_router_ejections",
            "Times an upstream was ejected.",
            ["replica", "url"],
            m.ejections.items(),
        )
        yield _counter(
            "llmgw_router_client_connections_closed",
            "Client connections the router ended for a limit: head too slow (head), idle too long "
            "(idle), a body silent too long (body), over router_max_connections (over_capacity).",
            ["reason"],
            (((k,), v) for k, v in m.clients_closed.items()),
        )
        health = sorted(self.ejection.health.items())
        in_flight = GaugeMetricFamily(
            "llmgw_router_in_flight", "Requests outstanding on each upstream.", labels=["replica", "url"]
        )
        ejected = GaugeMetricFamily(
            "llmgw_router_upstream_ejected", "1 while an upstream is ejected.", labels=["replica", "url"]
        )
        for url, h in health:
            in_flight.add_metric([h.replica_id, url], h.outstanding)
            ejected.add_metric([h.replica_id, url], 1 if h.ejected_until > self.now else 0)
        yield in_flight
        yield ejected
        idle = GaugeMetricFamily(
            "llmgw_router_idle_connections", "Pooled keep-alive connections per upstream.", labels=["url"]
        )
        for url, n in sorted(self.pool.idle_counts().items()):
            idle.add_metric([url], n)
        yield idle
        streams, blocked = self.pump.stats()
        yield GaugeMetricFamily(
            "llmgw_router_streams",
            "Streamed response bodies being relayed, past their first event.",
            value=streams,
        )
        yield GaugeMetricFamily(
            "llmgw_router_streams_client_blocked",
            "Streams paused because their client reads slower than the engine writes (the engine "
            "is not read until the client drains).",
            value=blocked,
        )
        yield GaugeMetricFamily(
            "llmgw_router_client_connections", "Client connections open.", value=m.client_connections
        )
        wakeups, pauses, reads = self.pump.counters()
        yield CounterMetricFamily(
            "llmgw_router_relay_wakeups",
            "Wake-ups of the relay pump; reads per wake-up is what its coalescing pause buys.",
            value=wakeups,
        )
        yield CounterMetricFamily(
            "llmgw_router_relay_pauses",
            "Coalescing pauses the relay pump took (a busy pump pauses after a wake-up; an idle one does not).",
            value=pauses,
        )
        yield CounterMetricFamily(
            "llmgw_router_relay_reads", "Engine socket reads that brought response bytes.", value=reads
        )


def monotonic_of(clock_now: float, clock_then: float) -> float:
    """``clock_then`` (a reading of the router's clock, ``clock_now`` being another taken now) as
    ``time.monotonic`` seconds, the pumps' clock."""
    return time.monotonic() - (clock_now - clock_then)
