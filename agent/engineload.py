"""Engine load for the heartbeat: which series mean what per engine, one parser, and the scraper.

The control plane (and, through it, ``ctl``, the fleet page, the fleet ``/metrics`` and later the
autoscaler and the router) wants each engine's load: requests running and waiting, KV cache use,
prefix-cache hit rate, generation tokens per second. The agent supervises the engines, so it reads
their own Prometheus ``/metrics`` on the heartbeat interval and the heartbeat carries the latest
sample per shard.

- Which series means what is each engine's descriptor's (``enginedefs``: ``publishes.load``);
  ``LOAD_SERIES`` is that table by engine name.
- ``parse`` is the one reading of an engine's Prometheus text (``prometheus_client``'s parser),
  with every number bounded: NaN, infinities and negatives are refused, absurd counts clamped,
  and either is named in the sample's ``problems``.
- ``figures`` turns two readings into a sample's figures (counter rates over the interval between
  them) as a pure function; ``LoadScraper`` does the I/O and the timing.

Bounded: each scrape runs in the background with a timeout, at most one per shard at a time, and
the heartbeat takes whatever sample is latest, so a slow or broken ``/metrics`` never delays it;
figures older than ``STALE_INTERVALS`` intervals are marked stale, with the last scrape's error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

import enginedefs
import schema
from agent.supervise import Shard, Supervisor
from enginedefs import LoadSeries

#: A sample older than this many heartbeat intervals is stale.
STALE_INTERVALS = 2
#: The most requests a count may say, and tokens per second (the wire's bounds): above is clamped.
MAX_REQUESTS = schema.MAX_LOAD_REQUESTS
MAX_TOKENS_PER_SECOND = schema.MAX_LOAD_TOKENS_PER_SECOND
#: The most bytes of a ``/metrics`` answer read (vLLM's is about 60 KiB with its histograms).
MAX_METRICS_BYTES = 4 * 1024 * 1024
#: The shortest bound on one scrape.
MIN_TIMEOUT = 1.0
#: The longest error text sent.
MAX_ERROR = 200
#: Shard states whose engine is asked for its load (a draining engine still runs requests).
SCRAPED_STATES = (schema.ShardState.READY, schema.ShardState.UNHEALTHY, schema.ShardState.DRAINING)


#: engine name -> the series of its load (``enginedefs``: ``publishes.load``). An engine without
#: (trtllm) sends no figures; its shards' loads say so.
LOAD_SERIES: Mapping[str, LoadSeries] = {
    d.name: d.publishes.load for d in enginedefs.DESCRIPTORS if d.publishes.load is not None
}


@attrs.frozen
class Reading:
    """What one scrape found: gauges as read, counters as totals; ``None`` where not published."""

    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    hit_rate: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    generation_tokens: float | None = None
    #: Numbers refused or clamped, named ("vllm:num_requests_waiting is nan: refused").
    problems: tuple[str, ...] = ()


def _first(values: Mapping[str, float], names: Iterable[str]) -> tuple[str, float] | None:
    for name in names:
        if name in values:
            return name, values[name]
    return None


def parse(text: str, series: LoadSeries, at: float) -> Reading:
    """Read ``series`` from an engine's Prometheus text; ``ValueError`` naming what is not
    Prometheus text. Samples of one name are summed over their labels (several engines or data
    parallel ranks behind one port), except the KV and hit-rate gauges, whose worst (largest) is
    kept. Every value is checked: not finite or negative is refused, fractions above 1 and counts
    above ``MAX_REQUESTS`` are clamped; each is named in ``problems``."""
    wanted = set(
        series.running
        + series.waiting
        + series.kv_usage
        + series.hit_rate
        + series.prefix_hits
        + series.prefix_queries
        + series.generation_tokens
    )
    fractions = set(series.kv_usage + series.hit_rate)
    values: dict[str, float] = {}
    problems: list[str] = []
    refused: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name not in wanted or name in refused:
                continue
            if not math.isfinite(value) or value < 0:
                problems.append(f"{name} is {value}: refused")
                refused.add(name)
                values.pop(name, None)
                continue
            if name in fractions:
                values[name] = max(values.get(name, 0.0), value)
            else:
                values[name] = values.get(name, 0.0) + value
    figures: dict[str, float | None] = {}
    for figure in ("running", "waiting", "kv_usage", "hit_rate"):
        found = _first(values, getattr(series, figure))
        if found is None:
            figures[figure] = None
            continue
        name, value = found
        limit = 1.0 if figure in ("kv_usage", "hit_rate") else float(MAX_REQUESTS)
        if value > limit:
            problems.append(f"{name} is {value:g}: clamped to {limit:.10g}")
            value = limit
        figures[figure] = value
    for figure in ("prefix_hits", "prefix_queries", "generation_tokens"):
        found = _first(values, getattr(series, figure))
        figures[figure] = found[1] if found else None
    return Reading(at=at, problems=tuple(problems), **figures)


@attrs.frozen
class Figures:
    """One sample's figures, as the heartbeat carries them; ``None``: unknown."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    hit_rate: float | None = None
    tokens_per_second: float | None = None


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """A counter's rate; ``None`` without two readings or across a reset (an engine restarted)."""
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def figures(previous: Reading | None, current: Reading) -> Figures:
    """The figures of ``current``, with counter rates over the time since ``previous``."""
    hit_rate = current.hit_rate
    if previous is not None and current.prefix_queries is not None:
        queries = _rate(previous.prefix_queries, current.prefix_queries, 1.0)
        hits = _rate(previous.prefix_hits, current.prefix_hits, 1.0)
        # No queries in the interval: the rate is unknown, not 0.
        if queries and hits is not None:
            hit_rate = min(hits / queries, 1.0)
    tokens = None
    if previous is not None:
        tokens = _rate(previous.generation_tokens, current.generation_tokens, current.at - previous.at)
        if tokens is not None:
            tokens = min(tokens, MAX_TOKENS_PER_SECOND)
    return Figures(
        running=None if current.running is None else round(current.running),
        waiting=None if current.waiting is None else round(current.waiting),
        kv_usage=current.kv_usage,
        hit_rate=hit_rate,
        tokens_per_second=tokens,
    )


def scraped(shard: Shard) -> bool:
    """Whether the agent asks this shard's engine for its load: a running engine that serves HTTP
    (ranks above 0 of a multi-node replica serve none: rank 0's figures are the replica's)."""
    spec = shard.spec
    return (
        shard.state in SCRAPED_STATES and spec.http_port > 0 and not (spec.nnodes > 1 and spec.node_rank > 0)
    )


@attrs.define
class _Track:
    """One shard's scrapes: the last good reading, the one before it, the last error."""

    shard: Shard
    current: Reading | None = None
    previous: Reading | None = None
    error: str = ""
    busy: bool = False


class LoadScraper:
    """Scrapes every scraped shard's engine each ``interval`` in the background; ``loads`` gives the
    heartbeat the latest sample per shard without waiting for anything."""

    def __init__(self, supervisor: Supervisor, interval: float, *, timeout: float | None = None) -> None:
        self.supervisor = supervisor
        self.interval = interval
        #: One scrape's bound: an interval (a second at least, so a busy engine's answer is not
        #: cut short at a test's sub-second interval); a hung engine has one scrape outstanding.
        self.timeout = timeout if timeout is not None else max(interval, MIN_TIMEOUT)
        self._tracks: dict[str, _Track] = {}

    async def run(self) -> None:
        """Scrape until cancelled (in the agent's root nursery: samples survive a reconnect)."""
        async with trio.open_nursery() as scrapes:
            while True:
                for shard in list(self.supervisor.shards.values()):
                    if not scraped(shard) or shard.engine not in LOAD_SERIES:
                        continue
                    track = self._tracks.get(shard.shard_id)
                    if track is None or track.shard is not shard:
                        # A restarted shard is a new object: its counters start again.
                        track = self._tracks[shard.shard_id] = _Track(shard)
                    if not track.busy:
                        track.busy = True
                        scrapes.start_soon(self._scrape, track)
                live = set(self.supervisor.shards)
                for shard_id in [s for s in self._tracks if s not in live]:
                    del self._tracks[shard_id]
                await trio.sleep(self.interval)

    async def _scrape(self, track: _Track) -> None:
        series = LOAD_SERIES[track.shard.engine]
        descriptor = enginedefs.lookup(track.shard.engine)
        path = descriptor.publishes.metrics_path if descriptor is not None else "/metrics"
        try:
            with trio.move_on_after(self.timeout) as bound:
                text = await self._fetch(track.shard, path)
            if bound.cancelled_caught:
                track.error = f"GET {path} timed out after {self.timeout:g} s"
                return
            # Parsing megabytes of text is CPU work: off the trio thread.
            reading = await trio.to_thread.run_sync(parse, text, series, trio.current_time())
        except Exception as exc:  # an engine's bad answer must never end the agent's root nursery
            detail = str(exc).splitlines()[0] if str(exc) else ""
            track.error = f"GET {path}: {type(exc).__name__}" + (f": {detail}" if detail else "")
            return
        finally:
            track.busy = False
        track.previous, track.current = track.current, reading
        track.error = "; ".join(reading.problems)

    async def _fetch(self, shard: Shard, path: str) -> str:
        async with self.supervisor.engine_client(shard, timeout=self.timeout) as client:
            async with client.stream("GET", path) as resp:
                if resp.status_code != 200:
                    raise httpx.HTTPStatusError(
                        f"status {resp.status_code}", request=resp.request, response=resp
                    )
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        raise ValueError(f"answer larger than {MAX_METRICS_BYTES} bytes")
        return body.decode("utf-8")

    def loads(self) -> list[schema.ShardLoad]:
        """The latest sample of every scraped shard, for one heartbeat (never waits)."""
        now = trio.current_time()
        out = []
        for shard in self.supervisor.shards.values():
            if not scraped(shard):
                continue
            track = self._tracks.get(shard.shard_id)
            out.append(self._load(shard, track if track and track.shard is shard else None, now))
        return out

    def _load(self, shard: Shard, track: _Track | None, now: float) -> schema.ShardLoad:
        load = schema.ShardLoad(shard_id=shard.shard_id, replica_id=shard.spec.replica_id)
        if shard.engine not in LOAD_SERIES:
            load.stale, load.error = True, f"{shard.engine} publishes no load the agent reads"
            return load
        if track is None or track.current is None:
            load.stale = True
            load.error = (track.error if track else "") or "no sample yet"
            load.error = load.error[:MAX_ERROR]
            return load
        f = figures(track.previous, track.current)
        load.requests_running, load.requests_waiting = f.running, f.waiting
        load.kv_cache_usage, load.prefix_cache_hit_rate = f.kv_usage, f.hit_rate
        load.generation_tokens_per_second = f.tokens_per_second
        load.sample_age_seconds = max(now - track.current.at, 0.0)
        load.stale = load.sample_age_seconds > STALE_INTERVALS * self.interval
        load.error = track.error[:MAX_ERROR]
        return load


def no_loads() -> Sequence[schema.ShardLoad]:
    """The loads of an agent that scrapes nothing (tests that build a Session by hand)."""
    return ()


__all__ = [
    "LOAD_SERIES",
    "MAX_REQUESTS",
    "STALE_INTERVALS",
    "Figures",
    "LoadScraper",
    "Reading",
    "figures",
    "no_loads",
    "parse",
    "scraped",
]
