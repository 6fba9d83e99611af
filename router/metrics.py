"""The router's ``/metrics`` (Prometheus text format 0.0.4): counters owned by one router."""

from __future__ import annotations

from bisect import bisect_left

from router.balancer import Balancer
from router.pool import Pool
from router.relay import Pump
from router.routes import Upstream

TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters for ``/metrics`` (Prometheus text format 0.0.4), owned by one router.

    Plain dicts updated from the router's tasks, which all run on one trio thread, so no locks; the
    gauges (in flight, ejected, idle connections) are read from the balancer and pool at scrape
    time instead of being kept up to date on every request."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.disconnects: dict[str, int] = {}
        self.ejections: dict[tuple[str, str], int] = {}
        self.ttfb: dict[str, list[float]] = {}  # model -> bucket counts..., then sum, then count
        #: Client connections the router ended for a limit: header, idle, body, over_capacity.
        self.clients_closed: dict[str, int] = {}
        #: Client connections open (``Router.connections``), set before each exposition.
        self.client_connections = 0

    def client_closed(self, reason: str) -> None:
        self.clients_closed[reason] = self.clients_closed.get(reason, 0) + 1

    def request(self, model: str, status: int | str) -> None:
        key = (model, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def upstream_error(self, upstream: Upstream, kind: str) -> None:
        key = (upstream.replica_id, upstream.url, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def observe_ttfb(self, model: str, seconds: float) -> None:
        row = self.ttfb.get(model)
        if row is None:
            row = self.ttfb[model] = [0.0] * (len(TTFB_BUCKETS) + 2)
        row[bisect_left(TTFB_BUCKETS, seconds)] += 1  # index len(TTFB_BUCKETS) is the +Inf-only slot
        row[-2] += seconds
        row[-1] += 1

    def exposition(self, balancer: Balancer, pool: Pool, pump: Pump, now: float) -> bytes:
        out: list[str] = []

        def family(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        family("llmgw_router_requests_total", "counter", "Requests answered, by model and HTTP status.")
        for (model, status), n in sorted(self.requests.items()):
            out.append(f'llmgw_router_requests_total{{model="{_label(model)}",status="{status}"}} {n}')
        family(
            "llmgw_router_upstream_errors_total",
            "counter",
            "Upstream failures, by replica and kind (connect, reset, closed, timeout, unavailable, "
            "protocol, mid_stream).",
        )
        for (rid, url, kind), n in sorted(self.upstream_errors.items()):
            out.append(
                f'llmgw_router_upstream_errors_total{{replica="{_label(rid)}",url="{_label(url)}",'
                f'kind="{kind}"}} {n}'
            )
        family("llmgw_router_retries_total", "counter", "Requests moved to another replica after a failure.")
        for model, n in sorted(self.retries.items()):
            out.append(f'llmgw_router_retries_total{{model="{_label(model)}"}} {n}')
        family(
            "llmgw_router_client_disconnects_total",
            "counter",
            "Clients that left before their response ended (the upstream request was cancelled).",
        )
        for model, n in sorted(self.disconnects.items()):
            out.append(f'llmgw_router_client_disconnects_total{{model="{_label(model)}"}} {n}')
        family("llmgw_router_ejections_total", "counter", "Times an upstream was ejected.")
        for (rid, url), n in sorted(self.ejections.items()):
            out.append(f'llmgw_router_ejections_total{{replica="{_label(rid)}",url="{_label(url)}"}} {n}')
        family(
            "llmgw_router_time_to_first_byte_seconds",
            "histogram",
            "From the request's arrival to the first response body byte sent to the client.",
        )
        for model, row in sorted(self.ttfb.items()):
            m = _label(model)
            cumulative = 0.0
            for bound, count in zip(TTFB_BUCKETS, row, strict=False):
                cumulative += count
                out.append(
                    f'llmgw_router_time_to_first_byte_seconds_bucket{{model="{m}",le="{bound}"}} {cumulative:g}'
                )
            out.append(f'llmgw_router_time_to_first_byte_seconds_bucket{{model="{m}",le="+Inf"}} {row[-1]:g}')
            out.append(f'llmgw_router_time_to_first_byte_seconds_sum{{model="{m}"}} {row[-2]}')
            out.append(f'llmgw_router_time_to_first_byte_seconds_count{{model="{m}"}} {row[-1]:g}')
        family("llmgw_router_in_flight", "gauge", "Requests outstanding on each upstream.")
        for url, h in sorted(balancer.health.items()):
            out.append(
                f'llmgw_router_in_flight{{replica="{_label(h.replica_id)}",url="{_label(url)}"}} {h.outstanding}'
            )
        family("llmgw_router_upstream_ejected", "gauge", "1 while an upstream is ejected.")
        for url, h in sorted(balancer.health.items()):
            flag = 1 if h.ejected_until > now else 0
            out.append(
                f'llmgw_router_upstream_ejected{{replica="{_label(h.replica_id)}",url="{_label(url)}"}} {flag}'
            )
        family("llmgw_router_idle_connections", "gauge", "Pooled keep-alive connections per upstream.")
        for url, n in sorted(pool.idle_counts().items()):
            out.append(f'llmgw_router_idle_connections{{url="{_label(url)}"}} {n}')
        streams, blocked = pump.stats()
        family(
            "llmgw_router_streams", "gauge", "Streamed response bodies being relayed, past their first event."
        )
        out.append(f"llmgw_router_streams {streams}")
        family(
            "llmgw_router_streams_client_blocked",
            "gauge",
            "Streams paused because their client reads slower than the engine writes (the engine "
            "is not read until the client drains).",
        )
        out.append(f"llmgw_router_streams_client_blocked {blocked}")
        family("llmgw_router_client_connections", "gauge", "Client connections open.")
        out.append(f"llmgw_router_client_connections {self.client_connections}")
        family(
            "llmgw_router_client_connections_closed_total",
            "counter",
            "Client connections the router ended for a limit: head too slow (head), idle too long "
            "(idle), a body silent too long (body), over router_max_connections (over_capacity).",
        )
        for reason, n in sorted(self.clients_closed.items()):
            out.append(f'llmgw_router_client_connections_closed_total{{reason="{reason}"}} {n}')
        wakeups, pauses, reads = pump.counters()
        family(
            "llmgw_router_relay_wakeups_total",
            "counter",
            "Wake-ups of the relay pump; reads per wake-up is what its coalescing pause buys.",
        )
        out.append(f"llmgw_router_relay_wakeups_total {wakeups}")
        family(
            "llmgw_router_relay_pauses_total",
            "counter",
            "Coalescing pauses the relay pump took (a busy pump pauses after a wake-up; an idle one does not).",
        )
        out.append(f"llmgw_router_relay_pauses_total {pauses}")
        family(
            "llmgw_router_relay_reads_total", "counter", "Engine socket reads that brought response bytes."
        )
        out.append(f"llmgw_router_relay_reads_total {reads}")
        return ("\n".join(out) + "\n").encode()
