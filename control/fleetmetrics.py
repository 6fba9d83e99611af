"""The fleet's metrics on the admin API's ``/metrics``: what a Prometheus scrape of the control plane
sees.

Two kinds of series, both through ``prometheus_client`` (never hand-written exposition):

- **What the fleet is now** (gauges): nodes by state and cordoned, GPUs and GPUs in use by node
  state, replicas wanted, placed, ready and unplaced per model, open agent streams. These are read
  from a ``ControlView`` at scrape time by a custom collector, so nothing has to be kept in step
  with the fleet as it changes. The view holds the fleet's live records and must be read on the trio
  thread, while the exposition runs in a worker thread (it reads ``/proc`` for the process
  metrics): so a scrape first takes a frozen ``FleetSample`` of the view on the trio thread, and the
  collector yields families built from that sample.
- **What happened** (counters and a histogram, incremented by the control plane where it happens):
  shards that failed and shards started again after a failure, per model, and how long each
  reconcile pass took.
- **What the engines say** (gauges per replica, ``llmgw_replica_*{model,replica}``): requests
  running and waiting, KV cache use, prefix-cache hit rate, generation tokens per second, and the
  sample's age and staleness, from the agents' heartbeats (``control.query.EngineLoad``).

Plus the process metrics of ``telemetry.metrics.new_registry`` (memory, CPU, open fds, GC).

Label values are bounded: node states are an enum, and a model label is a catalog name (a replica
id an agent reports for a model the catalog does not hold counts under ``model="(not in catalog)"``),
so a node cannot grow the series count by what it sends.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

import attrs
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import schema
from control.fleet import NodeState
from control.placement import ReplicaPlacement
from control.query import ControlView, EngineLoad, replica_load, shard_load
from telemetry.metrics import exposition, new_registry

#: The model label of a shard whose replica id names no model in the catalog.
NOT_IN_CATALOG = "(not in catalog)"

#: Reconcile passes take milliseconds on a small fleet and seconds at thousands of nodes.
RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@attrs.frozen
class ModelSample:
    model: str
    wanted: int
    placed: int
    ready: int
    unplaced: int


@attrs.frozen
class FleetSample:
    """The fleet's gauges at one instant, taken from a view on the trio thread."""

    #: node state -> nodes in it (every state, zeros included).
    nodes: tuple[tuple[str, int], ...] = ()
    cordoned: int = 0
    draining: int = 0
    #: node state -> (GPUs, GPUs a placed shard uses) on the nodes in that state.
    gpus: tuple[tuple[str, int, int], ...] = ()
    models: tuple[ModelSample, ...] = ()
    #: Nodes whose agent holds a stream open to this control plane now.
    agent_streams: int = 0
    #: (model, replica id, its load) of every placed replica whose agents sent one.
    loads: tuple[tuple[str, str, EngineLoad], ...] = ()


def fleet_sample(view: ControlView) -> FleetSample:
    """The gauges of a view: a pure function, so tests give it a hand-built view.

    A replica is ready when every one of its shards reports ready, as ``/api/models`` and ``ctl get
    models`` count it."""
    states = [s.value for s in NodeState]
    nodes = dict.fromkeys(states, 0)
    gpus = dict.fromkeys(states, 0)
    in_use = dict.fromkeys(states, 0)
    used: dict[str, set[int]] = {}
    for replica in view.placements:
        for shard in replica.shards:
            used.setdefault(shard.node_id, set()).update(shard.gpu_indices)
    cordoned = draining = streams = 0
    for node in view.nodes.values():
        state = node.state.value
        nodes[state] = nodes.get(state, 0) + 1
        total = len(node.register.gpus)
        gpus[state] = gpus.get(state, 0) + total
        in_use[state] = in_use.get(state, 0) + min(len(used.get(node.node_id, ())), total)
        cordoned += node.cordoned
        draining += node.draining
        streams += node.connected
    models = []
    for name in sorted(view.models):
        mine = [r for r in view.placements if r.model == name]
        models.append(
            ModelSample(
                model=name,
                wanted=view.models[name].replicas,
                placed=len(mine),
                ready=sum(1 for r in mine if _ready(view, r)),
                unplaced=sum(1 for u in view.plan.unplaced if u.model == name),
            )
        )
    loads = []
    for replica in view.placements:
        load = replica_load([shard_load(view, sh.node_id, sh.shard_id) for sh in replica.shards])
        if load is not None:
            model = replica.model if replica.model in view.models else NOT_IN_CATALOG
            loads.append((model, replica.replica_id, load))
    return FleetSample(
        loads=tuple(loads),
        nodes=tuple(nodes.items()),
        cordoned=cordoned,
        draining=draining,
        gpus=tuple((s, gpus[s], in_use[s]) for s in nodes),
        models=tuple(models),
        agent_streams=streams,
    )


def _ready(view: ControlView, replica: ReplicaPlacement) -> bool:
    for shard in replica.shards:
        node = view.nodes.get(shard.node_id)
        status = node.shards.get(shard.shard_id) if node else None
        if status is None or status.state != schema.ShardState.READY:
            return False
    return True


class _FleetCollector(Collector):
    """Yields the gauge families of the latest sample (see the module docstring for why a sample)."""

    def __init__(self) -> None:
        self.sample = FleetSample()

    def describe(self) -> Iterator[Any]:
        # Describing by collecting an empty sample registers the names, so a clash with another
        # series of the registry fails at construction, not at the first scrape.
        return self._families(FleetSample())

    def collect(self) -> Iterator[Any]:
        return self._families(self.sample)

    def _families(self, s: FleetSample) -> Iterator[Any]:
        nodes = GaugeMetricFamily(
            "llmgw_fleet_nodes", "Nodes known to the control plane, by state.", labels=["state"]
        )
        for state, count in s.nodes:
            nodes.add_metric([state], count)
        yield nodes
        yield GaugeMetricFamily(
            "llmgw_fleet_nodes_cordoned",
            "Nodes cordoned or draining (they take no new replicas).",
            value=s.cordoned,
        )
        yield GaugeMetricFamily(
            "llmgw_fleet_nodes_draining",
            "Nodes being drained (their replicas move elsewhere).",
            value=s.draining,
        )
        gpus = GaugeMetricFamily(
            "llmgw_fleet_gpus", "GPUs the nodes registered, by node state.", labels=["node_state"]
        )
        used = GaugeMetricFamily(
            "llmgw_fleet_gpus_in_use", "GPUs a placed shard uses, by node state.", labels=["node_state"]
        )
        for state, total, in_use in s.gpus:
            gpus.add_metric([state], total)
            used.add_metric([state], in_use)
        yield gpus
        yield used
        families = {
            "wanted": ("llmgw_fleet_replicas_wanted", "Replicas the catalog asks for, per model."),
            "placed": ("llmgw_fleet_replicas_placed", "Replicas placed onto nodes, per model."),
            "ready": ("llmgw_fleet_replicas_ready", "Replicas whose every shard reports ready, per model."),
            "unplaced": (
                "llmgw_fleet_replicas_unplaced",
                "Replicas that cannot be placed now, per model (ctl describe model says why).",
            ),
        }
        for field, (name, help_text) in families.items():
            family = GaugeMetricFamily(name, help_text, labels=["model"])
            for m in s.models:
                family.add_metric([m.model], getattr(m, field))
            yield family
        yield GaugeMetricFamily(
            "llmgw_fleet_agent_streams",
            "Agents holding a stream open to this control plane.",
            value=s.agent_streams,
        )
        yield from _load_families(s.loads)


#: Per replica: (series, help, the EngineLoad attribute). A figure the engine does not publish, or
#: one of a stale sample, has no sample (absent, not 0: old numbers are never shown as current).
_LOAD_GAUGES = (
    ("llmgw_replica_requests_running", "Requests the replica's engines are generating now.", "running"),
    ("llmgw_replica_requests_waiting", "Requests waiting in the replica's engine queues.", "waiting"),
    ("llmgw_replica_kv_cache_usage", "Fraction of KV cache in use (its fullest engine), 0..1.", "kv_usage"),
    (
        "llmgw_replica_prefix_cache_hit_rate",
        "Prefix-cache hits per query over the agents' last interval, 0..1.",
        "hit_rate",
    ),
    (
        "llmgw_replica_generation_tokens_per_second",
        "Generation tokens per second over the agents' last interval.",
        "tokens_per_second",
    ),
)


def _load_families(loads: tuple[tuple[str, str, EngineLoad], ...]) -> Iterator[Any]:
    """The per-replica load gauges; labels are the catalog's models and the placed replica ids
    (bounded by what the operator asked for, not by what agents send)."""
    for name, help_text, attribute in _LOAD_GAUGES:
        family = GaugeMetricFamily(name, help_text, labels=["model", "replica"])
        for model, replica, load in loads:
            value = getattr(load, attribute)
            if value is not None and not load.stale:
                family.add_metric([model, replica], value)
        yield family
    age = GaugeMetricFamily(
        "llmgw_replica_load_age_seconds",
        "Seconds since the replica's load figures were read from its engines.",
        labels=["model", "replica"],
    )
    stale = GaugeMetricFamily(
        "llmgw_replica_load_stale",
        "1 when the replica's load figures are stale (scrapes failing or hanging, or no heartbeat).",
        labels=["model", "replica"],
    )
    for model, replica, load in loads:
        age.add_metric([model, replica], load.age)
        stale.add_metric([model, replica], 1.0 if load.stale else 0.0)
    yield age
    yield stale


class FleetMetrics:
    """The control plane's registry: the fleet collector, the counters, the process metrics."""

    def __init__(self, *, process: bool = True) -> None:
        self.registry = new_registry(process=process)
        self._fleet = _FleetCollector()
        self.registry.register(self._fleet)
        self._failures = Counter(
            "llmgw_fleet_shard_failures",
            "Shards whose agent reported them failed (the engine exited or never became ready), per model.",
            ["model"],
            registry=self.registry,
        )
        self._restarts = Counter(
            "llmgw_fleet_shard_restarts",
            "StartShard sent again for a shard that had failed (after its crash-loop backoff), per model.",
            ["model"],
            registry=self.registry,
        )
        self._reconcile = Histogram(
            "llmgw_control_reconcile_pass_seconds",
            "How long one reconcile pass took (placement, commands, route table, state file).",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )

    def shard_reported(
        self,
        before: schema.ShardStatus | None,
        after: schema.ShardStatus,
        model: str,
        catalog: Container[str],
    ) -> None:
        """An agent reported a shard's state: a shard that became FAILED counts once."""
        failed = schema.ShardState.FAILED
        if after.state == failed and (before is None or before.state != failed):
            self._failures.labels(model if model in catalog else NOT_IN_CATALOG).inc()

    def shard_restarted(self, model: str, catalog: Container[str]) -> None:
        """A StartShard went out again for a shard that had failed."""
        self._restarts.labels(model if model in catalog else NOT_IN_CATALOG).inc()

    def reconcile_pass(self, seconds: float) -> None:
        self._reconcile.observe(seconds)

    async def scrape(self, view: ControlView, accept: str = "") -> tuple[bytes, str]:
        """The exposition (text, or OpenMetrics when ``accept`` asks for it) and its content type.

        Call on the trio thread with a fresh view: the sample is taken here, the rendering runs in a
        worker thread. Every catalog model gets its counters' series at zero, so ``rate()`` and
        ``increase()`` see the first failure rather than a series appearing at 1."""
        for model in view.models:
            self._failures.labels(model)
            self._restarts.labels(model)
        self._fleet.sample = fleet_sample(view)
        return await exposition(self.registry, accept)


__all__ = ["NOT_IN_CATALOG", "FleetMetrics", "FleetSample", "ModelSample", "fleet_sample"]
