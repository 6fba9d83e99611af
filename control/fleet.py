"""The fleet: node inventory and liveness, judged on the control plane's own monotonic clock.

A sans-IO state machine in h11's shape: events in (``registered``, ``heartbeat``, ``disconnected``,
``tick``), transitions out, ``now`` always passed in. Timestamps from nodes are never trusted for
liveness: a node whose clock is wrong must not look alive or dead because of it.

States: ``ready`` -> ``unreachable`` (its stream closed, or no heartbeat within unreachable_after) ->
``lost`` (unreachable for lost_after), and back to ``ready`` when it registers again or, while its
stream is still open, at its next heartbeat (an agent paused past unreachable_after, or a network that
stalled without breaking the connection, resumes on the same authenticated stream and never registers
again). An unreachable node keeps its placements (its engines may well still be serving: the router
talks to them directly); only a lost node gives them up. Every transition is recorded with its reason
and time for ``ctl``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping

import attrs

import schema
from control.notfound import unknown_node


class NodeState(enum.StrEnum):
    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"


#: Shard states in which the agent runs an engine process for the shard.
LIVE_SHARD_STATES = frozenset(
    {
        schema.ShardState.STARTING,
        schema.ShardState.READY,
        schema.ShardState.UNHEALTHY,
        schema.ShardState.DRAINING,
    }
)


class Cordon(enum.StrEnum):
    """What an operator asked of a node; independent of its liveness, and only undone by uncordon."""

    #: Takes nothing new; keeps what runs.
    CORDONED = "cordoned"
    #: Cordoned, and its replicas move elsewhere (replacements first).
    DRAINING = "draining"


@attrs.frozen
class Transition:
    node_id: str
    old: NodeState | None
    new: NodeState
    at: float
    reason: str


@attrs.define
class Node:
    node_id: str
    register: schema.Register
    state: NodeState
    since: float
    last_heartbeat: float
    connected: bool = True
    #: GPU index -> (memory used MiB, utilization %), from the latest heartbeat.
    usage: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    #: What the agent last said about each shard on this node.
    shards: dict[str, schema.ShardStatus] = attrs.field(factory=dict)
    #: Each scraped engine's load from the latest heartbeat (received at ``last_heartbeat``),
    #: by shard id: kept in memory only, like liveness (``control.query.shard_load`` reads it).
    loads: dict[str, schema.ShardLoad] = attrs.field(factory=dict)
    history: list[Transition] = attrs.field(factory=list)
    #: Takes no new placement (set by cordon and by drain).
    cordoned: bool = False
    #: Its replicas move elsewhere (set by drain).
    draining: bool = False
    #: When an unreachable node becomes lost (the control plane's monotonic clock).
    lost_deadline: float = 0.0


@attrs.define
class Fleet:
    unreachable_after: float
    lost_after: float
    nodes: dict[str, Node] = attrs.field(factory=dict)
    #: Bumped on every change placement or persistence cares about (a Register, a state change, a
    #: drain), so that a pass with nothing new can skip rebuilding views of thousands of nodes.
    generation: int = 0
    #: Cordons and drains by node id. Kept apart from ``nodes`` so that they outlive the node
    #: record: a node that is lost (and so not saved) or not yet re-registered after a control plane
    #: restart is still cordoned when it comes back.
    cordons: dict[str, Cordon] = attrs.field(factory=dict)
    #: Told ``(node_id, before, after)`` when a node's report of a shard changes (its state, process
    #: or error), by a ShardStatus or a Register listing it: the control plane keeps these as events.
    on_shard: Callable[[str, schema.ShardStatus | None, schema.ShardStatus], None] | None = None
    #: Told every node transition as it is made (the same ones the methods return).
    on_transition: Callable[[Transition], None] | None = None

    def _seen(self, node_id: str, before: schema.ShardStatus | None, after: schema.ShardStatus) -> None:
        if self.on_shard is not None and (
            before is None
            or (before.state, before.pid, before.error) != (after.state, after.pid, after.error)
        ):
            self.on_shard(node_id, before, after)

    def cordon(self, node_id: str, mark: Cordon) -> None:
        """Cordon or drain a known node (``KeyError`` naming it when unknown). A drain is never
        weakened to a cordon by a later ``cordon``: only ``uncordon`` undoes it."""
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyError(unknown_node(node_id, self.nodes))
        if self.cordons.get(node_id) is Cordon.DRAINING:
            mark = Cordon.DRAINING
        self.cordons[node_id] = mark
        self._apply_cordon(node)

    def uncordon(self, node_id: str) -> Cordon | None:
        """Undo a cordon or a drain; returns what was undone (``None``: nothing was)."""
        if node_id not in self.nodes and node_id not in self.cordons:
            raise KeyError(unknown_node(node_id, self.nodes))
        undone = self.cordons.pop(node_id, None)
        node = self.nodes.get(node_id)
        if node is not None:
            self._apply_cordon(node)
        return undone

    def _apply_cordon(self, node: Node) -> None:
        mark = self.cordons.get(node.node_id)
        node.cordoned = mark is not None
        node.draining = mark is Cordon.DRAINING
        self.generation += 1

    def _move(self, node: Node, new: NodeState, now: float, reason: str) -> Transition:
        self.generation += 1
        t = Transition(node.node_id, node.state if node.history else None, new, now, reason)
        node.state, node.since = new, now
        if new is NodeState.UNREACHABLE:
            node.lost_deadline = now + self.lost_after
        node.history.append(t)
        del node.history[:-50]  # enough for `ctl`, bounded for a node that flaps for weeks
        if self.on_transition is not None:
            self.on_transition(t)
        return t

    def registered(self, register: schema.Register, now: float) -> list[Transition]:
        """A node (re)registered: it is ready, and its shard list replaces what we knew."""
        self.generation += 1
        node = self.nodes.get(register.node_id)
        before = node.shards if node else {}
        shards = {s.shard_id: s for s in register.shards}
        if node is None:
            node = Node(register.node_id, register, NodeState.READY, now, now, shards=shards)
            self.nodes[register.node_id] = node
            self._apply_cordon(node)
            out = [self._move(node, NodeState.READY, now, "registered")]
        else:
            node.register, node.shards = register, shards
            node.connected, node.last_heartbeat = True, now
            out = []
            if node.state is not NodeState.READY:
                reason = f"registered again after being {node.state.value}"
                out.append(self._move(node, NodeState.READY, now, reason))
        # After the node's own transition, so that a history reads: ready, then what it runs.
        for shard_id, status in shards.items():
            self._seen(register.node_id, before.get(shard_id), status)
        return out

    def heartbeat(self, node_id: str, beat: schema.Heartbeat, now: float) -> list[Transition]:
        """A heartbeat on the node's current, authenticated stream (the caller guarantees both).

        It proves the node alive now, so an unreachable or lost node is ready again at once: waiting
        for a Register that an agent on an open stream never sends would leave it to be declared lost
        (and its replicas moved off a healthy node) with a heartbeat age of zero.
        """
        node = self.nodes.get(node_id)
        if node is None:
            return []
        silent = now - node.last_heartbeat
        node.last_heartbeat = now
        node.usage = {g.index: (g.memory_used_mib, g.utilization_percent) for g in beat.gpus}
        node.loads = {load.shard_id: load for load in beat.loads}
        if node.state is NodeState.READY or not node.connected:
            return []
        reason = f"heartbeat on its open stream after {silent:.1f} s of silence (was {node.state.value})"
        return [self._move(node, NodeState.READY, now, reason)]

    def shard_status(self, node_id: str, status: schema.ShardStatus) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        before = node.shards.get(status.shard_id)
        node.shards[status.shard_id] = status
        self._seen(node_id, before, status)
        if before is None or (before.state in LIVE_SHARD_STATES) != (status.state in LIVE_SHARD_STATES):
            # An engine appeared or stopped: what the node's engines hold changed for placement.
            self.generation += 1

    def disconnected(self, node_id: str, now: float, reason: str) -> list[Transition]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        node.connected = False
        if node.state is NodeState.READY:
            return [self._move(node, NodeState.UNREACHABLE, now, f"stream closed: {reason}")]
        return []

    def restore(
        self,
        registers: Iterable[schema.Register],
        now: float,
        grace: float,
        lost: Iterable[tuple[schema.Register, float]] = (),
    ) -> list[Transition]:
        """After a control plane restart: nodes known before are unreachable until they re-register,
        and are not lost before ``grace`` has passed (``since`` is set so that lost_after ends then).

        ``lost``: nodes that were lost already, each with how many seconds before ``now`` it was
        last heard from. They come back lost, with the shards they last reported: what is known of
        engines that may still run there, until the node registers again or is forgotten."""
        out = []
        for reg, ago in lost:
            node = Node(reg.node_id, reg, NodeState.LOST, now, now, connected=False)
            node.shards = {s.shard_id: s for s in reg.shards}
            self.nodes[reg.node_id] = node
            self._apply_cordon(node)
            ago = max(ago, 0.0)
            out.append(
                self._move(
                    node,
                    NodeState.LOST,
                    now,
                    f"lost before the control plane restarted; last heard from {ago:.0f} s ago",
                )
            )
            node.since = node.last_heartbeat = now - ago
        for reg in registers:
            node = Node(reg.node_id, reg, NodeState.UNREACHABLE, now, now, connected=False)
            node.shards = {s.shard_id: s for s in reg.shards}
            self.nodes[reg.node_id] = node
            self._apply_cordon(node)
            out.append(
                self._move(node, NodeState.UNREACHABLE, now, "control plane restarted; awaiting re-register")
            )
            node.lost_deadline = now + grace
        return out

    def forget(self, node_id: str) -> bool:
        """Forget a lost node and what it last reported (``ctl node reset``, as ``kubectl delete
        node``): nothing can reach its engines to stop them, and an operator says they are gone.
        A node that is not lost is kept (False): its agent would report it again at once. Should it
        come back, it registers as a new node and its leftovers are stopped as any others are."""
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.LOST:
            return False
        del self.nodes[node_id]
        self.generation += 1
        return True

    def tick(self, now: float) -> list[Transition]:
        """Apply the timeouts; call it periodically and after anything that may have changed."""
        out = []
        for node in self.nodes.values():
            if node.state is NodeState.READY and now - node.last_heartbeat > self.unreachable_after:
                silent = now - node.last_heartbeat
                out.append(self._move(node, NodeState.UNREACHABLE, now, f"no heartbeat for {silent:.1f} s"))
            elif node.state is NodeState.UNREACHABLE and now >= node.lost_deadline:
                out.append(self._move(node, NodeState.LOST, now, f"unreachable for {now - node.since:.1f} s"))
        return out

    def next_deadline(self, now: float) -> float:
        """When ``tick`` could next change something (so a caller can sleep until then)."""
        deadlines = [now + 60.0]
        for node in self.nodes.values():
            if node.state is NodeState.READY:
                deadlines.append(node.last_heartbeat + self.unreachable_after)
            elif node.state is NodeState.UNREACHABLE:
                deadlines.append(node.lost_deadline)
        return min(deadlines)

    def registers(self) -> Mapping[str, schema.Register]:
        return {n.node_id: n.register for n in self.nodes.values()}
