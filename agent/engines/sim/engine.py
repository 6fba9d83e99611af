"""The trio side of the capacity model: one task steps the scheduler, request handlers wait.

:class:`EngineLoop` owns the pure core (:mod:`kvcache`, :mod:`scheduler`) and is its only
caller: it runs a step, publishes the step's KV events, sleeps the step's modelled duration (times
``--sim-time-scale``), then hands each request that got a token its token by unparking that
request's own lot, so a handler wakes only for its own tokens and an idle engine does not wake at
all. Per step the work is O(requests in the step).

A request's life as a handler sees it: :meth:`EngineLoop.submit` (after the frontend's share of
the TTFT), then :meth:`Ticket.wait` for each token, then :meth:`EngineLoop.release`, which aborts
it in the scheduler if it had not finished (a client that went away frees its blocks at once).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from agent.engines.sim import kvcache
from agent.engines.sim.config import SimConfig, kv_events_settings
from agent.engines.sim.scheduler import Request, Scheduler, StepCost

if TYPE_CHECKING:
    from agent.engines.sim.kvevents import Publisher

#: vLLM's buckets (``vllm/v1/metrics/loggers.py``) for the two latency histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class Histogram:
    """A Prometheus histogram's state: per-bucket counts (cumulated on exposition), sum, count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_count{{{labels}}} {self.count}")
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        return out


class Ticket:
    """A handler's view of its request: how many tokens the engine produced for it so far."""

    def __init__(self, request: Request, arrived: float) -> None:
        self.request = request
        self.arrived = arrived
        self.produced = 0
        self.last = arrived
        self.done = False
        self._lot = trio.lowlevel.ParkingLot()

    async def wait(self, count: int) -> None:
        """Until at least ``count`` tokens were produced (a checkpoint either way)."""
        if self.produced >= count:
            await trio.lowlevel.checkpoint()
            return
        while self.produced < count:
            await self._lot.park()

    def _deliver(self) -> None:
        self.produced += 1
        self._lot.unpark_all()


class EngineLoop:
    """The scheduler, its KV cache and publisher, and the vLLM metrics they feed."""

    def __init__(
        self,
        config: SimConfig,
        log: Callable[[str], None],
        environ: Mapping[str, str],
    ) -> None:
        self.config = config
        algo = config.prefix_caching_hash_algo
        hash_fn = kvcache.hash_function(algo)
        none = kvcache.none_hash(hash_fn, algo, environ, config.vllm_version)
        self.cache = kvcache.KVCache(
            config.num_gpu_blocks, config.block_size, caching=config.enable_prefix_caching
        )
        scale = config.time_scale / 1000  # the knobs are milliseconds
        cost = StepCost(
            base=config.itl_ms * scale,
            prefill_per_token=config.prefill_ms_per_token * scale,
            decode_per_seq=config.decode_ms_per_seq * scale,
            context_per_token=config.context_ms_per_token * scale,
        )
        self.scheduler = Scheduler(
            self.cache,
            lambda parent, ids: kvcache.hash_block_tokens(hash_fn, none, parent, ids),
            cost,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.publisher: Publisher | None = None
        if config.kv_events_config:
            settings = kv_events_settings(config.kv_events_config)
            if settings["enable_kv_cache_events"] and settings["publisher"] == "zmq":
                # Imported here: pyzmq and msgpack are needed only by a sim that publishes.
                from agent.engines.sim.kvevents import Publisher

                self.publisher = Publisher(settings, config.vllm_version, log)
                log(
                    f"KV events on {self.publisher.endpoint}"
                    + (f", replay on {self.publisher.replay_endpoint}" if self.publisher.replay else "")
                    + f" (vLLM {config.vllm_version}'s encoding)"
                )
        self._tickets: dict[str, Ticket] = {}
        self._wake = trio.Event()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    @property
    def capacity_tokens(self) -> int:
        return self.cache.num_blocks * self.cache.block_size

    def submit(self, request: Request, arrived: float) -> Ticket:
        """Queue a request; ``arrived`` (trio time) is when its HTTP request was read, for TTFT."""
        ticket = Ticket(request, arrived)
        self._tickets[request.request_id] = ticket
        self.scheduler.add(request)
        self._wake.set()
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The handler is done with the request: abort it if the engine still has it."""
        if self._tickets.pop(ticket.request.request_id, None) is not None and not ticket.done:
            self.scheduler.abort(ticket.request)
            self._flush_events()
            # Freed blocks may let a waiting request in: wake a loop that found nothing to do.
            self._wake.set()

    async def run(self) -> None:
        """Step while there is work; sleep on an event while there is none. The replay socket,
        if any, is served beside."""
        try:
            async with trio.open_nursery() as nursery:
                if self.publisher is not None:
                    nursery.start_soon(self.publisher.serve_replay)
                await self._steps()
        finally:
            if self.publisher is not None:
                self.publisher.close()

    async def _steps(self) -> None:
        s = self.scheduler
        while True:
            if s.idle:
                self._wake = trio.Event()
                await self._wake.wait()
            result = s.step()
            self._flush_events()
            if result.seconds > 0:
                await trio.sleep(result.seconds)
            elif not result.sampled and not result.prefill_tokens:
                # Nothing could be scheduled (every block held by requests that cannot
                # proceed): wait for a release or a new request instead of spinning.
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            else:
                await trio.lowlevel.checkpoint()
            now = trio.current_time()
            for req in result.sampled:
                ticket = self._tickets.get(req.request_id)
                if ticket is None:
                    continue  # aborted while its step ran
                if ticket.produced == 0:
                    self.ttft.observe(now - ticket.arrived)
                else:
                    self.itl.observe(now - ticket.last)
                ticket.last = now
                if req.finished:
                    ticket.done = True
                ticket._deliver()

    def _flush_events(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def metrics(self, model: str) -> list[str]:
        """vLLM v1's scheduler and cache metrics, labelled as vLLM labels them."""
        labels = f'model_name={_quote(model)},engine="0"'
        s = self.scheduler
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {len(s.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {len(s.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.cache.usage}",
            "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {s.prefix_queries}",
            "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {s.prefix_hits}",
            "# HELP vllm:num_preemptions Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions counter",
            f"vllm:num_preemptions_total{{{labels}}} {s.preemptions}",
        ]
        lines += self.ttft.lines("vllm:time_to_first_token_seconds", labels)
        lines += self.itl.lines("vllm:inter_token_latency_seconds", labels)
        return lines


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
