"""What the admin API may read of the control plane, and what it may ask of it: nothing more.

``ControlQuery`` is the narrow interface ``control.api`` depends on (the control plane implements
it in ``control.plane.PlaneQuery``): a ``ControlView`` of what the plane knows at one instant, the
commands an operator gives (cordon, uncordon, drain, forget a node's credential; apply, scale and
delete models in the catalog), and the agents' log tails. The API never sees the plane's
attributes, so the plane can change its insides without breaking ``ctl``, and the documents the
API serves are pure functions of a view (tests build one by hand).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import attrs

import schema
from control.catalog import CatalogConflict, Change, Entry
from control.config import ModelConfig
from control.events import EventLog
from control.fleet import Cordon, Node, NodeState
from control.placement import EngineView, Plan, ReplicaPlacement
from control.rollout import RolloutStatus

#: Engines and the longest version or error text a node may report (its agent bounds them too).
_MAX_ENGINES = 16
_MAX_ENGINE_TEXT = 240


class DrainRefused(Exception):
    """A drain that would leave a model with no replica; the message says which and why."""


def engine_views(reg: schema.Register) -> dict[str, EngineView]:
    """The engines a node's Register reports, bounded: a node's strings reach tables and logs."""
    return {
        e.engine[:32]: EngineView(e.version[:_MAX_ENGINE_TEXT], e.error[:_MAX_ENGINE_TEXT])
        for e in reg.engines[:_MAX_ENGINES]
    }


def _no_backoff(node_id: str, shard_id: str) -> tuple[int, float | None]:
    return 0, None


@attrs.frozen
class ControlView:
    """What the control plane knows at one instant, for documents built synchronously from it.

    The node records are the fleet's own (not copies: a fleet of thousands is not copied per
    request), so a view is read at once, never held across an ``await``.
    """

    #: The control plane's monotonic clock, the only clock liveness is judged on.
    now: float
    nodes: Mapping[str, Node]
    #: The placed replicas (the plan's, or restored ones before the first pass).
    placements: tuple[ReplicaPlacement, ...]
    #: The latest placement plan: unplaced replicas with reasons, where replacements go.
    plan: Plan
    #: The catalog, by model name (as placement sees it: a deleting model has replicas 0).
    models: Mapping[str, ModelConfig]
    #: node id -> an operator's cordon or drain (kept apart from the node records: it outlives them).
    cordons: Mapping[str, Cordon] = attrs.field(factory=dict)
    #: node id -> how its stream proved it speaks for the node (mtls, token, credential, ...).
    admitted_by: Mapping[str, str] = attrs.field(factory=dict)
    #: The control plane accepts agents with no authentication (``insecure = true``).
    insecure: bool = False
    #: ``(node_id, shard_id) -> (failures, retry_at)``: a placed shard's crash-loop backoff.
    backoff: Callable[[str, str], tuple[int, float | None]] = _no_backoff
    #: The last transitions of every node and shard (``control.events``), for ``describe``.
    events: EventLog = attrs.field(factory=EventLog)
    #: Each model's catalog entry (source, generation, deleting), by name (``control.catalog``).
    catalog: Mapping[str, Entry] = attrs.field(factory=dict)
    #: Each model's rollout after the last reconcile pass (``control.rollout``), by name.
    rollouts: Mapping[str, RolloutStatus] = attrs.field(factory=dict)
    #: Unix time at ``now``, to tell people when something happened (never to judge liveness).
    wall: float = 0.0
    #: An engine load no heartbeat has refreshed for this long is stale (the fleet's
    #: ``unreachable_after``: by then the node is unreachable too).
    load_stale_after: float = 15.0


@attrs.frozen
class EngineLoad:
    """One engine's load (or a replica's, summed over its shards) as the control plane knows it at
    one instant: the one value type ``ctl``, the fleet page, the fleet ``/metrics`` and a load-aware
    router or autoscaler read. ``None``: the engine does not publish that figure."""

    running: int | None = None
    waiting: int | None = None
    #: Fraction of the KV cache in use, 0..1 (a replica's: its fullest shard's).
    kv_usage: float | None = None
    #: Prefix-cache hits per query over the agent's last interval, 0..1.
    hit_rate: float | None = None
    tokens_per_second: float | None = None
    #: Seconds since the figures were read from the engine: the agent's sample age when it sent
    #: them plus the time since the control plane received them (its own clock).
    age: float = 0.0
    #: Not to be believed as current: the agent said so (its scrapes fail or hang), or no heartbeat
    #: has carried a newer sample for ``unreachable_after``, or the node is not ready.
    stale: bool = True
    #: Why the agent's last scrape failed, or what it refused in it; empty when clean.
    error: str = ""

    def doc(self) -> dict[str, object]:
        """The JSON form the admin API serves (``load`` of a shard or a replica)."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 4),
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "tokens_per_second": None if self.tokens_per_second is None else round(self.tokens_per_second, 1),
            "age_s": round(self.age, 1),
            "stale": self.stale,
            "error": self.error,
        }


def shard_load(view: ControlView, node_id: str, shard_id: str) -> EngineLoad | None:
    """The latest load of one shard's engine; ``None`` when its agent sent none (not scraped:
    starting, stopped, or an agent that predates engine loads)."""
    node = view.nodes.get(node_id)
    load = node.loads.get(shard_id) if node is not None else None
    if node is None or load is None:
        return None
    since = max(view.now - node.last_heartbeat, 0.0)
    return EngineLoad(
        running=load.requests_running,
        waiting=load.requests_waiting,
        kv_usage=load.kv_cache_usage,
        hit_rate=load.prefix_cache_hit_rate,
        tokens_per_second=load.generation_tokens_per_second,
        age=load.sample_age_seconds + since,
        stale=load.stale or since > view.load_stale_after or node.state is not NodeState.READY,
        error=load.error,
    )


def _total(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def replica_load(loads: list[EngineLoad | None]) -> EngineLoad | None:
    """A replica's load from its shards': counts and rates summed, the fullest KV cache, the mean
    hit rate, the oldest age; stale when any shard's is. Shards that sent none are left out."""
    known = [load for load in loads if load is not None]
    if not known:
        return None
    kv = [load.kv_usage for load in known if load.kv_usage is not None]
    hits = [load.hit_rate for load in known if load.hit_rate is not None]
    rates = [load.tokens_per_second for load in known if load.tokens_per_second is not None]
    return EngineLoad(
        running=_total([load.running for load in known]),
        waiting=_total([load.waiting for load in known]),
        kv_usage=max(kv) if kv else None,
        hit_rate=sum(hits) / len(hits) if hits else None,
        tokens_per_second=sum(rates) if rates else None,
        age=max(load.age for load in known),
        stale=any(load.stale for load in known),
        error="; ".join(dict.fromkeys(load.error for load in known if load.error)),
    )


class JoinSecrets(Protocol):
    """The join token and node credentials (``control.joins.JoinBook``), as the API uses them."""

    @property
    def token_path(self) -> Path: ...

    def join_token(self) -> str: ...

    async def reset(self, node_id: str) -> bool: ...


class ControlQuery(Protocol):
    """The admin API's whole dependency on the control plane."""

    def view(self) -> ControlView:
        """What the plane knows now."""
        ...

    async def request_logs(
        self, node_id: str, shard_id: str, lines: int, *, previous: bool = False, after: int | None = None
    ) -> schema.LogsReply:
        """The tail of a shard's engine log, from its agent (``previous``: the run before its last
        restart; ``after``: the lines past a follower's offset); ``LookupError`` when it cannot answer."""
        ...

    async def cordon(self, node_id: str) -> Cordon:
        """Cordon a node; on disk before it returns. ``KeyError`` naming an unknown node."""
        ...

    async def uncordon(self, node_id: str) -> Cordon | None:
        """Undo a cordon or drain; returns what was undone. ``KeyError`` naming an unknown node."""
        ...

    async def drain(self, node_id: str, *, force: bool = False) -> list[str]:
        """Drain a node; one line per replica on what it does. ``DrainRefused`` with the reason."""
        ...

    def joins(self) -> JoinSecrets | None:
        """The join book, or None before it is loaded."""
        ...

    async def forget_lost(self, node_id: str) -> bool:
        """Forget a lost node and the shards it last reported (``ctl node reset``); on disk before
        it returns. False when the node is not lost (nothing is changed then)."""
        ...

    async def apply_models(self, models: list[ModelConfig]) -> list[Change]:
        """Create or update models (``ctl apply``); on disk before it returns. ``CatalogConflict``
        for a model being deleted (nothing is changed then)."""
        ...

    async def scale_model(self, name: str, replicas: int) -> Change:
        """Set a model's replicas (``ctl scale``). ``KeyError`` naming the known models,
        ``CatalogConflict`` for a model being deleted, ``ValueError`` for a bad count."""
        ...

    async def delete_model(self, name: str) -> Change:
        """Delete a model (``ctl delete``): drained, stopped, then gone. ``KeyError`` naming the
        known models, ``CatalogConflict`` for a model llmgw.toml defines."""
        ...


__all__ = [
    "CatalogConflict",
    "Change",
    "ControlQuery",
    "ControlView",
    "DrainRefused",
    "EngineLoad",
    "JoinSecrets",
    "engine_views",
    "replica_load",
    "shard_load",
]
