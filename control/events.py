"""Recent events per node and per shard, for ``ctl describe``: what changed, when, and why.

A bounded, sans-IO record: the control plane appends an ``Event`` where a transition happens (a
node's liveness, a shard's reported state, a command the reconciler sent, an operator's cordon or
drain) and the admin API reads the last ones for one node or one shard. Each event carries the
control plane's monotonic time (what "seconds ago" is computed from, as liveness is) and a wall
clock stamp (what a person correlates with other logs). Nothing is written to disk: a restarted
control plane starts a new history, as kubelet's events do.

Bounds: ``per_node`` events for each node, ``per_shard`` for each shard, and ``max_shards`` shards
(the least recently touched is forgotten first), so a fleet that churns shards for weeks holds a
fixed amount: at most 200,000 shard events, some tens of MB, however it flaps.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable

import attrs

#: Events kept per node (its liveness and operators' decisions: rare) and per shard.
PER_NODE = 50
PER_SHARD = 20
#: Shards whose events are kept; beyond it the least recently touched is forgotten.
MAX_SHARDS = 10_000
#: The longest reason kept (agents' error texts are bounded too; this bounds what we add).
MAX_REASON = 500


class Kind(enum.StrEnum):
    #: A node's liveness changed (ready, unreachable, lost).
    NODE = "node"
    #: An operator's decision about a node (cordon, drain, uncordon).
    OPERATOR = "operator"
    #: A shard's state as its agent reported it changed.
    SHARD = "shard"
    #: The reconciler sent a command for a shard (start, stop, drain).
    COMMAND = "command"
    #: A model in the catalog was created, configured, scaled or deleted (``control.catalog``); its
    #: ``node_id`` is the object's name, ``model/NAME``, so ``for_node`` finds a model's events too.
    MODEL = "model"


@attrs.frozen
class Event:
    kind: Kind
    #: The control plane's monotonic clock.
    at: float
    #: Seconds since the epoch (UTC), for people.
    wall: float
    node_id: str
    #: Empty for node and operator events.
    shard_id: str = ""
    replica_id: str = ""
    #: The state before and after ("" when there is none: a first report, a command).
    old: str = ""
    new: str = ""
    reason: str = ""
    #: The order it was recorded in (set by ``EventLog.record``): events of one instant keep it.
    seq: int = 0


@attrs.define
class EventLog:
    """The last events of every node and every shard (see the module docstring)."""

    per_node: int = PER_NODE
    per_shard: int = PER_SHARD
    max_shards: int = MAX_SHARDS
    _nodes: dict[str, collections.deque[Event]] = attrs.field(factory=dict)
    _shards: collections.OrderedDict[str, collections.deque[Event]] = attrs.field(
        factory=collections.OrderedDict
    )
    _seq: int = 0
    #: shard id -> its replica id (a shard's replica never changes; a stop may not name it).
    _replicas: dict[str, str] = attrs.field(factory=dict)

    def record(self, event: Event) -> None:
        """Keep ``event`` under its shard when it has one, else under its node (so a node's own
        transitions are not pushed out by its shards' busier histories)."""
        self._seq += 1
        e = event
        reason = e.reason if len(e.reason) <= MAX_REASON else e.reason[: MAX_REASON - 3] + "..."
        # Built directly: attrs.evolve introspects the class each call, several times slower.
        event = Event(
            e.kind, e.at, e.wall, e.node_id, e.shard_id, e.replica_id, e.old, e.new, reason, self._seq
        )
        if not event.shard_id:
            self._nodes.setdefault(event.node_id, collections.deque(maxlen=self.per_node)).append(event)
        else:
            shard = self._shards.get(event.shard_id)
            if shard is None:
                shard = self._shards[event.shard_id] = collections.deque(maxlen=self.per_shard)
                while len(self._shards) > self.max_shards:
                    gone, _ = self._shards.popitem(last=False)
                    self._replicas.pop(gone, None)
            else:
                self._shards.move_to_end(event.shard_id)
            if event.replica_id:
                self._replicas[event.shard_id] = event.replica_id
            shard.append(event)

    def for_node(self, node_id: str) -> tuple[Event, ...]:
        """The node's own last events (liveness, operators' decisions), oldest first."""
        return tuple(self._nodes.get(node_id, ()))

    def for_shard(self, shard_id: str) -> tuple[Event, ...]:
        """The shard's last events, oldest first."""
        return tuple(self._shards.get(shard_id, ()))

    def for_shards(self, shard_ids: Iterable[str]) -> tuple[Event, ...]:
        """The events of several shards (a model's), merged in the order they were recorded."""
        merged = [e for sid in dict.fromkeys(shard_ids) for e in self._shards.get(sid, ())]
        return tuple(sorted(merged, key=lambda e: e.seq))

    def shards_of(self, replica_ids: Callable[[str], bool]) -> tuple[str, ...]:
        """The shards with events kept whose replica id passes ``replica_ids`` (one model's)."""
        return tuple(sid for sid, rid in self._replicas.items() if replica_ids(rid))


__all__ = ["MAX_SHARDS", "PER_NODE", "PER_SHARD", "Event", "EventLog", "Kind"]
