"""Desired (the placement plan) against observed (what agents report) -> commands.

A sans-IO decision maker: ``step(plan, nodes, now)`` returns the commands to send and remembers only
what it needs to be idempotent and to back off, never a socket or a clock of its own. Running it twice
on the same input sends nothing new, so it can run on every change and on a timer alike.

- A placed shard that its ready node does not report live is started (once; again only if the start
  went unanswered for ``start_timeout``).
- A shard that keeps failing is restarted with crash-loop backoff: 10 s, doubling to 5 min, reset after
  it stays ready for 10 min, so a model that cannot load does not hammer the node or its storage.
  UNHEALTHY (ready once, its liveness probe now failing, the process still running) is live, so it is
  never started a second time, and it is a failure: it is stopped at once and started again when the
  backoff allows, as kubelet restarts a container whose liveness probe fails. One engine process
  counts as one failure however many states it reports on its way out (UNHEALTHY, then FAILED).
- A live shard that no placement wants is drained when it serves (READY: the router stops sending it
  requests, in-flight ones finish, the agent stops it by ``drain_deadline``; a model's rollout and
  ``ctl delete`` retire replicas this way), and stopped otherwise (still loading, or unhealthy). A
  shard that a draining node still runs is drained only once its replacement elsewhere is ready
  (replacements first), then stopped by the deadline.
- The same holds for a READY shard left over on a node that was lost and came back after its replica
  was placed elsewhere: it keeps serving (the router's fallback) until the new copy is ready, and is
  drained then, so each replica slot ends with exactly one engine. The new placement wins rather than
  the old engine being adopted back: placements are stable (the plan never flips a replica back and
  forth), the node has just proved unreliable, and the new copy may already be serving; the old one
  bridges the gap, so no request is lost either way. A leftover that is not READY (still loading, or
  unhealthy) is no use as a fallback and is stopped at once.
- Shards reported by a registering agent count as observed: after a control plane restart they are
  adopted (the placement keeps them) rather than started again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

import schema
from control.fleet import LIVE_SHARD_STATES, Node, NodeState
from control.placement import Plan, ReplicaPlacement, ShardAssignment, model_name_of

State = schema.ShardState
#: States in which an engine process runs (the agent reports it alive); never start a second one.
LIVE = LIVE_SHARD_STATES


@attrs.frozen
class Start:
    node_id: str
    spec: schema.StartShard


@attrs.frozen
class Stop:
    node_id: str
    shard_id: str
    grace: float


@attrs.frozen
class Drain:
    node_id: str
    shard_id: str
    deadline: float


Command = Start | Stop | Drain


@attrs.define
class _ShardMemory:
    started_at: float | None = None
    failures: int = 0
    retry_at: float = 0.0
    last_failure: tuple[int, int | None, str] | None = None
    ready_since: float | None = None
    drain_sent_at: float | None = None
    stop_sent_at: float | None = None


@attrs.define
class Reconciler:
    """See the module docstring; ``specs`` builds a StartShard for a placed shard."""

    backoff_initial: float = 10.0
    backoff_max: float = 300.0
    backoff_reset_after: float = 600.0
    start_timeout: float = 30.0
    stop_grace: float = 30.0
    drain_deadline: float = 60.0
    memory: dict[tuple[str, str], _ShardMemory] = attrs.field(factory=dict)

    def backoff(self, failures: int) -> float:
        return float(min(self.backoff_max, self.backoff_initial * 2 ** max(failures - 1, 0)))

    def retry_at(self, node_id: str, shard_id: str) -> float | None:
        """When a crash-looping shard may next be started (for ``ctl replicas``), or ``None``."""
        mem = self.memory.get((node_id, shard_id))
        return mem.retry_at if mem and mem.failures else None

    def failures(self, node_id: str, shard_id: str) -> int:
        mem = self.memory.get((node_id, shard_id))
        return mem.failures if mem else 0

    def step(
        self,
        plan: Plan,
        nodes: Mapping[str, Node],
        specs: Mapping[str, schema.StartShard],
        now: float,
    ) -> list[Command]:
        commands: list[Command] = []
        wanted: set[tuple[str, str]] = set()
        replica_ready = {r.replica_id: _replica_ready(r, nodes) for r in plan.replicas}
        for replica in plan.replicas:
            for shard in replica.shards:
                key = (shard.node_id, shard.shard_id)
                wanted.add(key)
                node = nodes.get(shard.node_id)
                if node is None or node.state is not NodeState.READY:
                    continue  # cannot deliver now; unreachable nodes keep their placements
                commands.extend(self._want(node, shard, specs[shard.shard_id], now))
        for node in nodes.values():
            if node.state is not NodeState.READY:
                continue
            for status in node.shards.values():
                key = (node.node_id, status.shard_id)
                if key in wanted or status.state not in LIVE:
                    continue
                commands.extend(self._unwanted(node, status, replica_ready, now))
        return commands

    def _want(self, node: Node, shard: ShardAssignment, spec: schema.StartShard, now: float) -> list[Command]:
        mem = self.memory.setdefault((node.node_id, shard.shard_id), _ShardMemory())
        observed = node.shards.get(shard.shard_id)
        state = observed.state if observed is not None else None
        if observed is not None and state in LIVE and _differs(observed.spec, spec):
            # Same shard id, new shape: replace it. A changed template is rolled out under new
            # replica ids (control.rollout), so this is left for a placement whose revision was
            # taken as current before its engine had reported (one from before rollouts).
            if mem.stop_sent_at is None or now - mem.stop_sent_at >= self.stop_grace + self.start_timeout:
                mem.stop_sent_at = now
                return [Stop(node.node_id, shard.shard_id, self.stop_grace)]
            return []
        if state == State.READY:
            mem.started_at = None
            mem.ready_since = mem.ready_since if mem.ready_since is not None else now
            if mem.failures and now - mem.ready_since >= self.backoff_reset_after:
                mem.failures, mem.retry_at = 0, 0.0
            return []
        mem.ready_since = None
        if state in (State.STARTING, State.DRAINING):
            mem.started_at = None
            return []
        if state in (State.FAILED, State.UNHEALTHY) and observed is not None:
            self._failed(mem, observed, now)
        if state == State.UNHEALTHY:
            # Live but failing its probes: stop it now (once per stop_grace + start_timeout, in case
            # the stop is lost); the start waits for the backoff like any failure's.
            if mem.stop_sent_at is None or now - mem.stop_sent_at >= self.stop_grace + self.start_timeout:
                mem.stop_sent_at = now
                return [Stop(node.node_id, shard.shard_id, self.stop_grace)]
            return []
        if now < mem.retry_at:
            return []
        if mem.started_at is not None and now - mem.started_at < self.start_timeout:
            return []  # a start is on its way; do not send another before the agent answers
        mem.started_at = now
        return [Start(node.node_id, spec)]

    def _failed(self, mem: _ShardMemory, observed: schema.ShardStatus, now: float) -> None:
        """Count a failure once per engine process: by pid when there was one, else by its report."""
        failure = (observed.pid, observed.exit_code, observed.error)
        last = mem.last_failure
        if failure == last or (last is not None and observed.pid and observed.pid == last[0]):
            return
        mem.last_failure = failure
        mem.failures += 1
        mem.retry_at = now + self.backoff(mem.failures)
        mem.started_at = None
        mem.stop_sent_at = None

    def _unwanted(
        self, node: Node, status: schema.ShardStatus, replica_ready: Mapping[str, bool], now: float
    ) -> list[Command]:
        mem = self.memory.setdefault((node.node_id, status.shard_id), _ShardMemory())
        # Replacements first: a READY engine whose replica is placed anew but not ready there yet is
        # the router's fallback; it is drained or stopped once the replacement is ready (or when the
        # replica is not placed at all any more).
        fallback = status.state == State.READY and replica_ready.get(status.replica_id) is False
        if fallback:
            return []
        if status.state in (State.READY, State.DRAINING):
            # A serving engine is drained, never stopped under its streams: the router stops sending
            # it requests once it reports DRAINING, in-flight ones finish, and the agent stops it by
            # the deadline. A drain unanswered (or a DRAINING engine never stopped) past the deadline
            # and the stop grace is followed by a stop.
            if mem.drain_sent_at is None:
                mem.drain_sent_at = now
                if status.state == State.READY:
                    return [Drain(node.node_id, status.shard_id, self.drain_deadline)]
                return []  # drained before this control plane knew it (a restart): the agent ends it
            if now - mem.drain_sent_at < self.drain_deadline + self.stop_grace + self.start_timeout:
                return []
        if mem.stop_sent_at is not None and now - mem.stop_sent_at < self.stop_grace + self.start_timeout:
            return []
        mem.stop_sent_at = now
        return [Stop(node.node_id, status.shard_id, self.stop_grace)]

    def forget(self, live_keys: Sequence[tuple[str, str]]) -> None:
        """Drop memory of shards neither placed nor observed any more (bounded memory over months)."""
        keep = set(live_keys)
        for key in [k for k in self.memory if k not in keep]:
            del self.memory[key]


def _differs(running: schema.StartShard | None, wanted: schema.StartShard) -> bool:
    """Whether a running shard's spec is not the one wanted (ready timeout aside)."""
    if running is None:
        return False
    return (
        list(running.gpu_indices) != list(wanted.gpu_indices)
        or running.http_port != wanted.http_port
        or running.profile != wanted.profile
        or (running.nnodes, running.node_rank, running.master_addr, running.master_port)
        != (wanted.nnodes, wanted.node_rank, wanted.master_addr, wanted.master_port)
    )


def adopted_placements(
    placements: Sequence[ReplicaPlacement], nodes: Mapping[str, Node], models: Collection[str]
) -> list[ReplicaPlacement]:
    """Placements for the live shards agents report that no placement knows (a lost or older state
    file), so that they are kept rather than started a second time: one per replica of a model in
    the catalog, its shards in rank order, from the spec each engine runs with."""
    known = {(s.node_id, s.shard_id) for r in placements for s in r.shards}
    by_replica: dict[str, list[ShardAssignment]] = {}
    for node in nodes.values():
        if node.state is NodeState.LOST:
            continue  # what a lost node last said runs there may not: its replicas are placed anew
        for st in node.shards.values():
            adoptable = st.state in (State.STARTING, State.READY, State.UNHEALTHY)
            if not adoptable or (node.node_id, st.shard_id) in known:
                continue
            spec = st.spec
            if spec is None or model_name_of(st.replica_id) not in models:
                continue
            by_replica.setdefault(st.replica_id, []).append(
                ShardAssignment(
                    shard_id=st.shard_id,
                    node_id=node.node_id,
                    gpu_indices=tuple(spec.gpu_indices),
                    port=spec.http_port,
                    node_rank=spec.node_rank,
                    nnodes=max(spec.nnodes, 1),
                    master_addr=spec.master_addr,
                    master_port=spec.master_port,
                )
            )
    existing = {r.replica_id for r in placements}
    return [
        ReplicaPlacement(model_name_of(rid), rid, tuple(sorted(shards, key=lambda s: s.node_rank)))
        for rid, shards in sorted(by_replica.items())
        if rid not in existing
    ]


@attrs.frozen
class DrainVerdict:
    """What draining a node would do (``drain_verdict``)."""

    #: One line per replica on the node: where it moves, or why it cannot.
    moves: tuple[str, ...]
    #: One line per model the drain would leave with no ready replica; empty: the drain may go on.
    refusals: tuple[str, ...]


def drain_verdict(
    node_id: str, placements: Sequence[ReplicaPlacement], plan: Plan, nodes: Mapping[str, Node]
) -> DrainVerdict:
    """Judge a drain of ``node_id`` before making it: ``plan`` is the plan placement makes with the
    node draining, ``placements`` those of now.

    A model is refused when a replica on the node is ready, none elsewhere is, and none of its
    replicas on the node can move: the drain would stop its last serving engine with nothing to
    take over (kubectl drain against a PodDisruptionBudget; the operator may force it).
    """
    moves: list[str] = []
    refusals: list[str] = []
    for model in sorted({r.model for r in placements if node_id in r.node_ids}):
        replicas = [r for r in placements if r.model == model]
        leaving = [r for r in replicas if node_id in r.node_ids]
        moving = False
        for replica in leaving:
            new = plan.replica(replica.replica_id)
            if new is not None:
                moving = True
                moves.append(f"{replica.replica_id} moves to {', '.join(new.node_ids)}")
            else:
                why = plan.why(replica.replica_id)
                moves.append(f"{replica.replica_id} cannot move: {why.reason if why else 'not placed'}")
        ready_here = any(_replica_ready(r, nodes) for r in leaving)
        ready_elsewhere = any(_replica_ready(r, nodes) for r in replicas if node_id not in r.node_ids)
        if ready_here and not ready_elsewhere and not moving:
            unplaced = plan.unplaced_for(model)
            reason = unplaced[0].reason if unplaced else "not placed"
            refusals.append(
                f"{model} would have no ready replica: nowhere else can take "
                f"{', '.join(r.replica_id for r in leaving)} ({reason})"
            )
    return DrainVerdict(tuple(moves), tuple(refusals))


def _replica_ready(replica: ReplicaPlacement, nodes: Mapping[str, Node]) -> bool:
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        status = node.shards.get(shard.shard_id) if node else None
        if status is None or status.state != State.READY:
            return False
    return True
