"""The control plane process: wires the fleet, placement, the reconciler and the agent service.

This is the one place with clocks and loops; the rooms it wires are pure (``placement.place``,
``fleet.Fleet``, ``reconcile.Reconciler``) or own their I/O (``agentsvc``, ``transport``, ``api``).

What survives a control plane restart is written to ``state_dir/control-state.json``: the nodes it
knew (their last Register), the placements, and the model catalog (``control.catalog``: what ``ctl
apply``, ``scale`` and ``delete`` made of the models, merged with llmgw.toml's ``[[models]]`` at
each start and SIGHUP by the file rule). A restarted control plane therefore treats every known
node as unreachable-until-it-re-registers with ``startup_grace`` before it may be declared lost, keeps
every placement (an unreachable node keeps its placements), and so starts nothing twice. Even without
that file, shards that registering agents report are adopted into placements rather than started anew.

**Only the router reaches the engines.** Each shard gets its own API key (``StartShard.api_key``),
which the agent passes to the engine's own key option and the embedded router sends upstream. The
key is HMAC-SHA256 of the shard id under a cluster secret kept in ``state_dir/shard-key-secret``
(mode 0600, made on first start): a restarted control plane derives the same keys for the engines
that kept running, and no key is ever written down, in ``control-state.json`` or anywhere else.
trtllm-serve has no key option, so its shards get none.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import attrs
import trio

import enginedefs
import schema
import statefile
from control.agentsvc import AgentService
from control.api import serve_api
from control.catalog import Action, Catalog, Change
from control.config import ControlConfig, Listen, ModelConfig
from control.etcd import EtcdClient, EtcdError, EtcdLeaseLost, LeaseKeeper, connect
from control.events import Event, EventLog, Kind
from control.fleet import LIVE_SHARD_STATES, Cordon, Fleet, Node, NodeState, Transition
from control.fleetmetrics import FleetMetrics
from control.joins import JoinBook
from control.leader import SteppedDown, campaign
from control.notfound import unknown_node
from control.placement import (
    GpuView,
    ModelSpec,
    NodeView,
    Plan,
    ReplicaPlacement,
    ShardAssignment,
    model_name_of,
    place,
)
from control.query import ControlView, DrainRefused, JoinSecrets, engine_views
from control.reconcile import Drain, Reconciler, Start, Stop, adopted_placements, drain_verdict
from control.rollout import (
    Decision,
    RolloutGoal,
    Rollouts,
    RolloutStatus,
    observed_view,
    recovered,
    revision,
    status_of,
)
from control.routetable import route_table
from control.routewatch import RouteWatch
from control.state import STATE_FILE, SavedState, StateFileError, StateSaver, read_state, set_aside
from control.statestore import SHARD_KEY_SECRET_KEY, EtcdStore, NotLeader, etcd_config
from router.routes import ModelRoutes
from transport import ServerLimits, StreamServer

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger("llmgw.control")
State = schema.ShardState

#: The cluster secret the shards' keys are derived from, in ``state_dir``.
SHARD_KEY_SECRET = "shard-key-secret"


def load_shard_key_secret(state_dir: Path) -> bytes:
    """The cluster secret in ``state_dir/shard-key-secret``, made (32 random bytes, hex, mode 0600)
    when there is none. Blocks on the filesystem: call it from a worker thread.

    Losing the file changes every key: engines still running keep their old one and answer the
    router 401 until they are restarted, so it belongs in the state directory's backups.
    """
    path = state_dir / SHARD_KEY_SECRET
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            # Made whole or not at all (a crash cannot leave half a secret), never over one that a
            # racing start made first.
            statefile.write_atomic(path, secrets.token_hex(32) + "\n", mode=0o600, replace=False)
        text = path.read_text().strip()
    except OSError as exc:
        raise OSError(
            f"{path}: cannot read or create the shard key secret: {exc.strerror or exc}; "
            "make state_dir writable by the control plane"
        ) from exc
    if len(text) < 32:
        raise ValueError(
            f"{path}: the shard key secret is {len(text)} characters, expected 64 hex digits; "
            "remove the file to make a new one (running engines then need a restart)"
        )
    if os.stat(path).st_mode & 0o077:
        log.warning("%s is readable by other users; chmod 600 it", path)
    return text.encode()


def shard_key(secret: bytes, shard_id: str) -> str:
    """A shard's API key: HMAC-SHA256 of its id under the cluster secret, in hex."""
    return hmac.new(secret, shard_id.encode(), hashlib.sha256).hexdigest()


def _cc(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    try:
        return int(major or 0), int(minor or 0)
    except ValueError:
        return (0, 0)


def _same_key(a: object, b: tuple[object, ...]) -> bool:
    assert isinstance(a, tuple)
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def _held(node: Node) -> tuple[frozenset[int], frozenset[int]]:
    """The GPUs and ports of every engine the node reports running (placement keeps new replicas
    off those that no placement accounts for: a leftover copy, a replica being replaced)."""
    gpus: set[int] = set()
    ports: set[int] = set()
    for st in node.shards.values():
        spec = st.spec
        if st.state not in LIVE_SHARD_STATES or spec is None:
            continue
        gpus.update(spec.gpu_indices)
        ports.add(spec.http_port)
        if spec.nnodes > 1 and spec.node_rank == 0 and spec.master_port:
            ports.add(spec.master_port)
    return frozenset(gpus), frozenset(ports)


class ControlPlane:
    def __init__(
        self,
        config: ControlConfig,
        clock: Callable[[], float] = trio.current_time,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        #: The desired models (``control.catalog``): the file's ``[[models]]`` at first, the saved
        #: catalog merged with the file once ``run`` has read the state file, ``ctl`` since.
        self.catalog = Catalog()
        self.catalog.apply_file(config.models)
        self._models: tuple[int, Mapping[str, ModelConfig]] = (-1, MappingProxyType({}))
        live = config.liveness
        #: The last transitions of every node and shard, for ``ctl describe`` (``control.events``).
        self.events = EventLog()
        self.fleet = Fleet(
            live.unreachable_after, live.lost_after, on_shard=self._shard_seen, on_transition=self._node_moved
        )
        self.agents = AgentService(
            self.fleet,
            tokens=config.tokens,
            insecure=config.insecure,
            clock=clock,
            on_change=self.poke,
            on_transitions=self._transitions,
        )
        self.reconciler = Reconciler(
            backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max,
            backoff_reset_after=config.backoff_reset_after,
            stop_grace=config.stop_grace,
            drain_deadline=config.drain_deadline,
        )
        self.placements: tuple[ReplicaPlacement, ...] = ()
        self.plan = Plan((), ())
        #: Each model's rolling change (``control.rollout``): what it remembers, this pass's
        #: decisions (which replicas placement places) and the status ``ctl rollout status`` shows.
        self.rollouts = Rollouts()
        self._decisions: dict[str, Decision] = {}
        self.rollout_status: dict[str, RolloutStatus] = {}
        self._revisions: dict[str, tuple[ModelConfig, str]] = {}
        self.state_file = config.state_dir / STATE_FILE
        self.agent_port = 0
        self.api_port = 0
        self.router_port = 0
        self._routes: Mapping[str, ModelRoutes] = MappingProxyType({})
        #: Serves the route table to routers run apart (``WatchRoutes`` on the agent port).
        self.route_watch = RouteWatch((*config.api.read_tokens, *config.api.admin_tokens))
        self._wake = trio.Event()
        self._views: dict[str, tuple[object, NodeView]] = {}
        self._plan_key: object = None
        self._views_generation = -1
        self._views_list: list[NodeView] = []
        self._saver = StateSaver(self.state_file)
        #: Where the state is, for the log: the file, or etcd's endpoints and prefix.
        self.state_where = str(self.state_file)
        #: Whether this control plane may send commands now: always with the file backend; with
        #: etcd, while the leader's lease is surely ours for a command's time (``control.leader``).
        self.may_act: Callable[[], bool] = lambda: True
        #: Whether this control plane acts (always with the file; with etcd, once it leads).
        self.acting = config.state.backend == "file"
        #: Set when a fenced write was refused: another control plane leads (``run`` stops).
        self.deposed = trio.Event()
        #: What the admin API reads and asks (``control.query.ControlQuery``).
        self.query = PlaneQuery(self)
        #: The admin API's ``/metrics``: the fleet read at scrape time, and the counters below.
        self.metrics = FleetMetrics()
        #: Loaded by ``run`` (or set by a test); while empty, shards get no key.
        self.shard_key_secret = b""

    @property
    def models(self) -> Mapping[str, ModelConfig]:
        """The catalog's models by name, as placement sees them (a deleting one has replicas 0)."""
        if self._models[0] != self.catalog.revision:
            self._models = (
                self.catalog.revision,
                MappingProxyType({m.name: m for m in self.catalog.models()}),
            )
        return self._models[1]

    def key_for(self, shard_id: str, engine: str) -> str:
        """The key of one shard, for its StartShard and the router; empty for an engine with no key
        option (trtllm) or before the secret is loaded."""
        if not self.shard_key_secret or not enginedefs.takes_key(engine):
            return ""
        return shard_key(self.shard_key_secret, shard_id)

    # -- events -------------------------------------------------------------------------------------

    def poke(self) -> None:
        """Something changed: run the reconciler soon."""
        self._wake.set()

    def _transitions(self, transitions: list[Transition]) -> None:
        for t in transitions:
            log.info(
                "node %s: %s -> %s (%s)", t.node_id, t.old.value if t.old else "-", t.new.value, t.reason
            )
        if transitions:
            self.poke()

    def _node_moved(self, t: Transition) -> None:
        """A node's liveness changed: recorded as the fleet makes the change, so that its shards'
        events, reported in the same Register, follow it."""
        old = t.old.value if t.old else ""
        self._event(Kind.NODE, t.node_id, old=old, new=t.new.value, reason=t.reason, at=t.at)

    def _event(
        self,
        kind: Kind,
        node_id: str,
        *,
        at: float | None = None,
        shard_id: str = "",
        replica_id: str = "",
        old: str = "",
        new: str = "",
        reason: str = "",
    ) -> None:
        """Record a transition (``control.events``) at ``at`` (default now) and the wall clock's now."""
        at = self.clock() if at is None else at
        wall = self.wall_clock()
        self.events.record(Event(kind, at, wall, node_id, shard_id, replica_id, old, new, reason))

    def _command(
        self, node_id: str, shard_id: str, replica_id: str, new: str, reason: str, at: float
    ) -> None:
        """Record a command the reconciler sent; a stop or drain names the replica the node reported."""
        if not replica_id:
            node = self.fleet.nodes.get(node_id)
            status = node.shards.get(shard_id) if node else None
            replica_id = status.replica_id if status else ""
        self._event(
            Kind.COMMAND, node_id, at=at, shard_id=shard_id, replica_id=replica_id, new=new, reason=reason
        )

    def _shard_seen(self, node_id: str, before: schema.ShardStatus | None, after: schema.ShardStatus) -> None:
        """A node reported a shard in a new state (or a new process, or a new error)."""
        old = State(before.state).name.lower() if before is not None else ""
        new = State(after.state).name.lower()
        reason = after.error
        self.metrics.shard_reported(before, after, model_name_of(after.replica_id), self.models)
        if before is not None and old == new and before.pid != after.pid:
            reason = reason or f"engine process {before.pid} -> {after.pid}"
        self._event(
            Kind.SHARD,
            node_id,
            shard_id=after.shard_id,
            replica_id=after.replica_id,
            old=old,
            new=new,
            reason=reason,
        )

    async def cordon_node(self, node_id: str) -> None:
        """Cordon a node (it takes nothing new, keeps what runs); on disk before this returns."""
        self.fleet.cordon(node_id, Cordon.CORDONED)
        mark = self.fleet.cordons[node_id].value
        log.info("node %s: %s (takes no new replicas)", node_id, mark)
        self._event(Kind.OPERATOR, node_id, new=mark, reason="cordoned by an admin: takes no new replicas")
        await self.save()
        self.poke()

    async def uncordon_node(self, node_id: str) -> Cordon | None:
        """Undo a cordon or a drain; on disk before this returns. Replicas that already moved stay
        where they are now (placements are stable); the node takes new ones again."""
        undone = self.fleet.uncordon(node_id)
        was = undone.value if undone else "not cordoned"
        log.info("node %s: uncordoned (was %s)", node_id, was)
        self._event(
            Kind.OPERATOR,
            node_id,
            old=undone.value if undone else "",
            new="uncordoned",
            reason=f"uncordoned by an admin (was {was})",
        )
        await self.save()
        self.poke()
        return undone

    async def drain_node(self, node_id: str, *, force: bool = False) -> list[str]:
        """Drain a node: cordon it and move its replicas elsewhere, replacements first (each old
        engine serves until its replacement is ready, then is drained and stops).

        Refused (``DrainRefused``, with the reason) when a model would be left with no replica at all
        because nowhere else can take the ones on this node, unless ``force``: like kubectl drain
        against a PodDisruptionBudget, the operator decides, not a timeout. Returns what the drain
        will do, one line per replica; the drain is on disk before this returns.
        """
        if node_id not in self.fleet.nodes:
            raise KeyError(unknown_node(node_id, self.fleet.nodes))
        plan = await self._plan_without(node_id)
        verdict = drain_verdict(node_id, self.placements, plan, self.fleet.nodes)
        lines, refusals = list(verdict.moves), verdict.refusals
        if refusals and not force:
            refused = DrainRefused(
                f"drain of {node_id} refused: {'; '.join(refusals)}; "
                "add capacity elsewhere, or drain with --force to stop them anyway"
            )
            self._event(Kind.OPERATOR, node_id, new="drain refused", reason=str(refused))
            raise refused
        self.fleet.cordon(node_id, Cordon.DRAINING)
        what = "; ".join(lines) or "nothing runs there"
        forced = " with --force" if refusals else ""
        log.info("node %s: draining%s (cordoned; replicas move elsewhere): %s", node_id, forced, what)
        self._event(Kind.OPERATOR, node_id, new="draining", reason=f"drained by an admin{forced}: {what}")
        await self.save()
        self.poke()
        return lines

    async def forget_lost(self, node_id: str) -> bool:
        """Forget a lost node and the shards it last reported (``control.fleet.Fleet.forget``); on
        disk before it returns. False (nothing changed) for a node that is not lost."""
        node = self.fleet.nodes.get(node_id)
        shards = sorted(node.shards) if node is not None else []
        if not self.fleet.forget(node_id):
            return False
        what = f"its last reported shards ({', '.join(shards)})" if shards else "nothing ran there"
        log.info("node %s: lost, forgotten by an admin: %s", node_id, what)
        self._event(Kind.OPERATOR, node_id, old="lost", new="forgotten", reason=f"reset by an admin: {what}")
        await self.save()
        self.poke()
        return True

    # -- the catalog: ctl apply, scale, delete, and the file on SIGHUP --------------------------------

    def _log_changes(self, changes: list[Change], why: str) -> None:
        """Log and record each change that changed something (``model/chat configured (file)``)."""
        for change in changes:
            if change.action is Action.UNCHANGED:
                continue
            log.info("%s (%s)", change, why)
            self._event(
                Kind.MODEL,
                f"model/{change.name}",
                new=change.action.value,
                reason=f"{change} by {why} (generation {change.generation})",
            )

    async def _catalog_changed(self, changes: list[Change], why: str) -> None:
        """Log, record, save (on disk before the caller answers) and wake the reconciler. The routes
        follow the catalog before the answer, not at the next reconcile pass: a deleted model has
        left the embedded router's table and the watchers' when ``ctl delete`` returns, as the
        README's "at once" promises (a request sent just after was still served otherwise)."""
        self._log_changes(changes, why)
        if any(c.action is not Action.UNCHANGED for c in changes):
            self.build_routes()
            await self.save()
            self.poke()

    async def apply_models(self, models: list[ModelConfig]) -> list[Change]:
        """``ctl apply``: create or update each model (``control.catalog.Catalog.apply``)."""
        changes = self.catalog.apply(models)
        await self._catalog_changed(changes, "ctl apply")
        return changes

    async def scale_model(self, name: str, replicas: int) -> Change:
        """``ctl scale``: ``KeyError`` for an unknown model, ``CatalogConflict`` for a deleting one."""
        change = self.catalog.scale(name, replicas)
        await self._catalog_changed([change], f"ctl scale to {replicas}")
        return change

    async def delete_model(self, name: str) -> Change:
        """``ctl delete``: the model's replicas go to 0 (drained and stopped), then it leaves the
        catalog (``_finish_deletes``). ``CatalogConflict`` for a model llmgw.toml defines."""
        change = self.catalog.delete(name)
        await self._catalog_changed([change], "ctl delete")
        return change

    async def reload_config(self, config: ControlConfig) -> list[Change]:
        """SIGHUP: apply the file's ``[[models]]`` by the file rule; every other setting that
        changed is named in a warning, since it takes effect at the next start only."""
        changed = [
            a.name
            for a in attrs.fields(ControlConfig)
            if a.name != "models" and getattr(config, a.name) != getattr(self.config, a.name)
        ]
        if changed:
            log.warning(
                "llmgw.toml: %s changed; that takes effect at the next start of the control plane "
                "(only [[models]] are applied on SIGHUP)",
                ", ".join(changed),
            )
        self.config = attrs.evolve(self.config, models=config.models)
        changes = self.catalog.apply_file(config.models)
        await self._catalog_changed(changes, "file")
        if not any(c.action is not Action.UNCHANGED for c in changes):
            log.info("llmgw.toml re-read: no model changed")
        return changes

    def _finish_deletes(self) -> None:
        """Remove deleted models that nothing runs any more: no placement and no live shard on any
        node that is not lost (a lost node's engines are presumed gone with it)."""
        deleting = [e.name for e in self.catalog.entries() if e.deleting]
        if not deleting:
            return
        running = {r.model for r in self.placements}
        running |= {
            model_name_of(st.replica_id)
            for n in self.fleet.nodes.values()
            if n.state is not NodeState.LOST
            for st in n.shards.values()
            if st.state in LIVE_SHARD_STATES
        }
        self._log_changes(self.catalog.finish_deletes(running), "the reconciler: no shard of it is left")

    async def _plan_without(self, node_id: str) -> Plan:
        """The plan placement would make with ``node_id`` draining as well (nothing is changed)."""
        draining = {n.node_id for n in self.fleet.nodes.values() if n.draining} | {node_id}
        current = tuple(
            r
            for r in (*self.placements, *self._adopted())
            if not any(s.node_id in draining for s in r.shards)
        )
        views = [attrs.evolve(v, draining=True) if v.node_id == node_id else v for v in self.node_views()]
        return await trio.to_thread.run_sync(place, self.model_specs(), views, current)

    # -- desired state ------------------------------------------------------------------------------

    def model_specs(self) -> list[ModelSpec]:
        return [
            ModelSpec(
                name=m.name,
                replicas=m.replicas,
                gpus_per_shard=m.gpus.count,
                min_gpu_memory_mib=int(m.gpus.min_memory_gib * 1024),
                min_compute_capability=m.gpus.compute_capability,
                selector=dict(m.selector),
                nodes_per_replica=m.nodes_per_replica,
                engine=m.profile.engine,
                engine_version=m.profile.engine_version,
                revision=self.revision_of(m),
                replica_ids=decision.wanted if (decision := self._decisions.get(m.name)) else None,
                retained=frozenset(decision.old) if decision else frozenset(),
            )
            for m in self.catalog.models()
        ]

    # -- rollouts -----------------------------------------------------------------------------------

    def revision_of(self, model: ModelConfig) -> str:
        """The model's template revision (``control.rollout.revision``), hashed once per definition."""
        cached = self._revisions.get(model.name)
        if cached is None or cached[0] is not model:
            cached = self._revisions[model.name] = (model, revision(model))
        return cached[1]

    def _rollout_goal(self, model: ModelConfig) -> RolloutGoal:
        return RolloutGoal(
            model.name,
            model.replicas,
            self.revision_of(model),
            model.rollout.max_surge,
            model.rollout.max_unavailable,
        )

    def _with_revisions(self, placements: tuple[ReplicaPlacement, ...]) -> tuple[ReplicaPlacement, ...]:
        """Placements with the revision their engines show, for those that carry none."""
        if all(r.revision for r in placements):
            return placements
        out = []
        for r in placements:
            model = self.models.get(r.model)
            if not r.revision and model is not None:
                r = recovered(r, self.fleet.nodes, model, self._profile(model), self.revision_of(model))
            out.append(r)
        return tuple(out)

    def _decide_rollouts(self, placements: tuple[ReplicaPlacement, ...], now: float) -> None:
        """Which replicas each model wants this pass (``control.rollout.decide``)."""
        by_model: dict[str, list[ReplicaPlacement]] = {}
        for r in placements:
            by_model.setdefault(r.model, []).append(r)
        reported: dict[str, set[str]] = {}
        for node in self.fleet.nodes.values():
            for st in node.shards.values():
                reported.setdefault(model_name_of(st.replica_id), set()).add(st.replica_id)
        failures = self.reconciler.failures
        decisions = {}
        for name, model in self.models.items():
            goal = self._rollout_goal(model)
            nodes = self.fleet.nodes
            views = [observed_view(r, nodes, failures, goal.revision) for r in by_model.get(name, ())]
            decisions[name] = self.rollouts.decide(
                goal, views, ready_timeout=model.ready_timeout, now=now, taken=reported.get(name, ())
            )
        self.rollouts.forget(self.models)
        for gone in [n for n in self._revisions if n not in self.models]:
            del self._revisions[gone]
        self._decisions = decisions

    def _rollout_statuses(self, plan: Plan) -> None:
        """Each model's rollout status after this pass's plan."""
        generations = {e.name: e.generation for e in self.catalog.entries()}
        failures = self.reconciler.failures
        placed: dict[str, list[ReplicaPlacement]] = {}
        for r in plan.replicas:
            placed.setdefault(r.model, []).append(r)
        unplaced: dict[str, dict[str, str]] = {}
        for u in plan.unplaced:
            unplaced.setdefault(u.model, {})[u.replica_id] = u.reason
        out = {}
        for name, model in self.models.items():
            goal = self._rollout_goal(model)
            nodes = self.fleet.nodes
            views = [observed_view(r, nodes, failures, goal.revision) for r in placed.get(name, ())]
            failure = self.rollouts.failure(name)
            generation = generations.get(name, 0)
            mine = unplaced.get(name, {})
            out[name] = status_of(goal, views, mine, failure=failure, generation=generation)
            before = self.rollout_status.get(name)
            now = out[name]
            if before is not None and (before.phase, before.revision) != (now.phase, now.revision):
                what = f"rollout of revision {now.revision} {now.phase.value}"
                log.info("model %s: %s%s", name, what, f": {now.reason}" if now.reason else "")
                self._event(Kind.MODEL, f"model/{name}", old=before.revision, new=what, reason=now.reason)
        self.rollout_status = out

    def node_views(self) -> list[NodeView]:
        """Placement's view of every node, rebuilt only for nodes whose Register or state changed
        (a fleet of thousands heartbeats constantly; rebuilding every view each pass would not scale)."""
        if self._views_generation == self.fleet.generation:
            return self._views_list
        views = []
        for node in self.fleet.nodes.values():
            # The Register object itself, compared by identity: ids of freed objects are reused.
            held = _held(node)
            key = (node.register, node.state, node.draining, node.cordoned, held)
            cached = self._views.get(node.node_id)
            if cached is None or not _same_key(cached[0], key):
                cached = (key, self._view(node, held))
                self._views[node.node_id] = cached
            views.append(cached[1])
        for gone in set(self._views) - set(self.fleet.nodes):
            del self._views[gone]
        self._views_generation, self._views_list = self.fleet.generation, views
        return views

    def _view(self, node: Node, held: tuple[frozenset[int], frozenset[int]]) -> NodeView:
        first, last = self.config.engines.port_range
        reg = node.register
        # The control plane's engine ports, within what the node offers; first > last: none.
        lo = max(first, reg.engine_ports.first if reg.engine_ports else first)
        hi = min(last, reg.engine_ports.last if reg.engine_ports and reg.engine_ports.last else last)
        if lo > hi and reg.engine_ports:
            log.warning(
                "node %s offers engine ports %d-%d, outside this control plane's %d-%d: nothing can be placed there",
                node.node_id, reg.engine_ports.first, reg.engine_ports.last, first, last,
            )  # fmt: skip
        return NodeView(
            node_id=node.node_id,
            state=node.state.value,
            gpus=tuple(
                GpuView(g.index, g.memory_total_mib, _cc(g.compute_capability), frozenset(g.nvlink_peers))
                for g in reg.gpus
            ),
            labels=dict(reg.labels),
            fabrics=frozenset(f.fabric for f in reg.fabrics),
            mgmt_addr=reg.mgmt_addr,
            port_range=(lo, hi),
            draining=node.draining,
            cordoned=node.cordoned,
            held_gpus=held[0],
            held_ports=held[1],
            engines=engine_views(reg),
        )

    def _adopted(self) -> list[ReplicaPlacement]:
        return adopted_placements(self.placements, self.fleet.nodes, self.models)

    async def replan(self) -> Plan:
        """Place again, when any input changed. Placement is pure and its inputs are frozen values,
        so it runs in a worker thread: at thousands of nodes a pass takes long enough that running it
        on the event loop would delay reading heartbeats past the liveness budget."""
        draining = {n.node_id for n in self.fleet.nodes.values() if n.draining}
        # Every placement counts for the rollouts (one on a draining node is still the model's);
        # placement keeps those off draining nodes, so their replicas are placed elsewhere.
        every = self._with_revisions((*self.placements, *self._adopted()))
        self._decide_rollouts(every, self.clock())
        current = tuple(r for r in every if not any(s.node_id in draining for s in r.shards))
        views = self.node_views()
        key = (tuple(views), current, self.catalog.revision, tuple(self._decisions.items()))
        if key != self._plan_key:
            self.plan = await trio.to_thread.run_sync(place, self.model_specs(), views, current)
            self._plan_key = key
        self.placements = self.plan.replicas
        return self.plan

    def start_spec(self, replica: ReplicaPlacement, shard: ShardAssignment) -> schema.StartShard:
        """The StartShard for one placed shard.

        ``served_model_name`` is always the name the router advertises for the model
        (``ModelConfig.served_name``: the profile's own, else the catalog name), so an engine can only
        answer to the name clients are sent to it with; the agent never derives one itself.
        """
        model = self.models[replica.model]
        if replica.revision and replica.revision != self.revision_of(model):
            # An old revision's replica that a rollout keeps: it runs (and restarts) as it was started.
            node = self.fleet.nodes.get(shard.node_id)
            status = node.shards.get(shard.shard_id) if node is not None else None
            if status is not None and status.spec is not None:
                engine = status.spec.profile.engine if status.spec.profile else model.profile.engine
                return dataclasses.replace(status.spec, api_key=self.key_for(shard.shard_id, engine))
        profile = self._profile(model)
        return schema.StartShard(
            shard_id=shard.shard_id,
            replica_id=replica.replica_id,
            profile=profile,
            gpu_indices=list(shard.gpu_indices),
            http_port=shard.port,
            ready_timeout_seconds=model.ready_timeout,
            nnodes=shard.nnodes,
            node_rank=shard.node_rank,
            master_addr=shard.master_addr,
            master_port=shard.master_port,
            api_key=self.key_for(shard.shard_id, profile.engine),
        )

    @staticmethod
    def _profile(model: ModelConfig) -> schema.EngineProfile:
        """The profile a shard of ``model`` is sent, with the name the router advertises."""
        profile = model.profile.to_proto()
        profile.served_model_name = model.served_name
        return profile

    async def reconcile_once(self) -> None:
        self._transitions(self.fleet.tick(self.clock()))
        plan = await self.replan()
        if not self.may_act():
            # Checked after the last await before the commands go out: the lease must outlive
            # them, so a leader that cannot renew stops sending before another can have taken over.
            log.warning("not reconciling: the leader's lease cannot be renewed in time (etcd unreachable?)")
            return
        self._rollout_statuses(plan)
        now = self.clock()
        specs = {s.shard_id: self.start_spec(r, s) for r in plan.replicas for s in r.shards}
        for command in self.reconciler.step(plan, self.fleet.nodes, specs, now):
            if isinstance(command, Start):
                shard_id = command.spec.shard_id
                log.info("start %s on %s", shard_id, command.node_id)
                self.agents.send(command.node_id, start=command.spec)
                failures = self.reconciler.failures(command.node_id, shard_id)
                if failures:
                    self.metrics.shard_restarted(model_name_of(command.spec.replica_id), self.models)
                reason = f"StartShard sent (after {failures} failure(s))" if failures else "StartShard sent"
                self._command(command.node_id, shard_id, command.spec.replica_id, "start", reason, now)
            elif isinstance(command, Stop):
                log.info("stop %s on %s", command.shard_id, command.node_id)
                self.agents.send(
                    command.node_id,
                    stop=schema.StopShard(shard_id=command.shard_id, grace_seconds=command.grace),
                )
                reason = f"StopShard sent (grace {command.grace:g} s)"
                self._command(command.node_id, command.shard_id, "", "stop", reason, now)
            elif isinstance(command, Drain):
                log.info("drain %s on %s", command.shard_id, command.node_id)
                self.agents.send(
                    command.node_id,
                    drain=schema.DrainShard(shard_id=command.shard_id, deadline_seconds=command.deadline),
                )
                reason = f"DrainShard sent (deadline {command.deadline:g} s)"
                self._command(command.node_id, command.shard_id, "", "drain", reason, now)
        live = [(s.node_id, s.shard_id) for r in plan.replicas for s in r.shards]
        live += [(n.node_id, sid) for n in self.fleet.nodes.values() for sid in n.shards]
        self.reconciler.forget(live)
        self._finish_deletes()
        self.build_routes()
        await self.save()

    # -- persistence --------------------------------------------------------------------------------

    async def save(self) -> None:
        """Write what a restart needs (``control.state``), when it changed; fsynced before it returns."""
        try:
            await self._saver.save(
                self.fleet.generation,
                self.fleet.nodes.values(),
                self.placements,
                self.fleet.cordons,
                self.catalog,
                wall_of=self.wall_of,
            )
        except NotLeader:
            self.deposed.set()
            raise

    def wall_of(self, t: float) -> float:
        """Unix time of ``t`` on the plane's monotonic clock (for people and the state file only:
        liveness is never judged on it)."""
        return self.wall_clock() - (self.clock() - t)

    async def save_now(self) -> None:
        """Write what a restart needs, now, and return once it is on disk (fsynced).

        For a shutdown path (SIGTERM): call it after the reconciler has stopped, inside a shielded,
        bounded scope (``with trio.CancelScope(shield=True), trio.move_on_after(10)``), since the
        process is being cancelled. A state that has not changed since the last write is already on
        disk (every write is fsynced), so that costs nothing.
        """
        await self.save()

    def restore(self) -> None:
        """Start from the state file, if there is one (see the module docstring). Blocks on the
        filesystem: ``run`` reads the file in a worker thread and applies it here on the trio one."""
        self._restore(self._read_saved())

    def _read_saved(self) -> SavedState | None:
        """The saved state, or None. A damaged file is named in the log with the field that is wrong
        and renamed ``control-state.json.damaged`` (the next save would overwrite it), and the
        control plane starts with no memory of the fleet: the agents' Registers then bring their
        shards back as adopted placements. Blocks on the filesystem."""
        try:
            return read_state(self.state_file)
        except StateFileError as exc:
            try:
                kept = f"; it is kept as {set_aside(self.state_file)}"
            except OSError as err:
                kept = f"; it could not be set aside ({err.strerror or err})"
            log.warning("%s; starting with no memory of the fleet (cordons and drains too)%s", exc, kept)
            return None

    def _restore(self, saved: SavedState | None) -> None:
        if saved is None:
            return
        for line in saved.skipped:
            log.warning("%s", line)
        self.fleet.cordons.update(saved.cordons)
        if saved.catalog is not None:
            # The saved catalog, then the file's [[models]] by the file rule (control.catalog).
            self.catalog = Catalog(saved.catalog)
            self._log_changes(self.catalog.apply_file(self.config.models), "file")
        now = self.clock()
        lost = [(reg, self.wall_clock() - seen) for reg, seen in saved.lost]
        self._transitions(self.fleet.restore(saved.registers, now, self.config.liveness.grace, lost))
        self.placements = saved.placements
        log.info(
            "restored %d node(s) (%d of them lost), %d placement(s) and %d cordon(s) from %s",
            len(saved.registers) + len(saved.lost),
            len(saved.lost),
            len(self.placements),
            len(self.fleet.cordons),
            self.state_where,
        )

    # -- the service --------------------------------------------------------------------------------

    def build_routes(self) -> None:
        """Rebuild the router's table (``control.routetable.route_table``) from the placements and the
        fleet; the one place it is rebuilt, after every reconcile pass. A model being deleted is
        left out: new requests for it are answered 404 while its engines finish what they have."""
        self._routes = route_table(
            self.catalog.served(),
            self.placements,
            self.fleet.nodes,
            self.plan.unplaced,
            self.config.endpoints,
            self.key_for,
        )
        self.route_watch.publish(self._routes, self.fleet.nodes.values())

    def routes(self) -> Mapping[str, ModelRoutes]:
        return self._routes

    async def run(self, *, task_status: trio.TaskStatus[ControlPlane] = trio.TASK_STATUS_IGNORED) -> None:
        from router.server import Router

        self.build_routes()
        router = Router(self.routes, self.config.router_config)
        if not self.config.runs_control_plane:
            # A catalog of static endpoints only: a router-only run, no agents, no reconciler.
            host, port = Listen.split(self.config.listen.router)
            async with trio.open_nursery() as nursery:
                self.router_port = await nursery.start(router.serve, host, port)
                task_status.started(self)
            return
        if self.config.state.backend == "etcd":
            await self._run_etcd(task_status)
            return
        self.shard_key_secret = await trio.to_thread.run_sync(load_shard_key_secret, self.config.state_dir)
        self._restore(await trio.to_thread.run_sync(self._read_saved))
        await self._load_joins()
        await self._serve(router, task_status)

    async def _run_etcd(self, task_status: trio.TaskStatus[ControlPlane]) -> None:
        """With ``[state] backend = "etcd"``: wait to lead (``control.leader``), then start from etcd's
        state and serve as the file backend does, every write fenced; stop (``SteppedDown``) when
        the lease is lost or a write is refused."""
        state = self.config.state
        etcd = etcd_config(state, os.environ)
        if etcd.password and state.insecure_password:
            log.warning("[state] insecure_password = true: the etcd password crosses the network in clear")
        async with connect(etcd) as client, trio.open_nursery() as nursery:
            keeper = await client.keeper(state.lease_ttl)
            nursery.start_soon(self._keep_lease, keeper)
            try:
                await self._lead(client, keeper, nursery, task_status)
            finally:
                # Stopping (SIGTERM, or stepping down): what changed since the last pass, while the
                # client is open; then the lease is handed back, so a standby need not wait it out.
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await self._last_etcd_save(keeper)

    async def _lead(
        self,
        client: EtcdClient,
        keeper: LeaseKeeper,
        nursery: trio.Nursery,
        task_status: trio.TaskStatus[ControlPlane],
    ) -> None:
        """Campaign (a standby until then), then start from etcd's state and serve."""
        from router.server import Router

        state = self.config.state
        member = f"{socket.gethostname()} {self.config.listen.agents}"
        led = await campaign(client, state.prefix, member, keeper)
        self.acting = True
        store = EtcdStore(client, state.prefix, led.fence)
        self.state_where = store.where
        self._saver = StateSaver(store)
        # A command is acted on within about a second; the lease must outlive that.
        self.may_act = lambda: keeper.valid(margin=1.0)
        secret, _ = await store.get_or_create(SHARD_KEY_SECRET_KEY, secrets.token_hex(32).encode())
        self.shard_key_secret = secret.strip()
        self._restore(await store.load())
        self._joins_loaded(await JoinBook.load_etcd(store, self.config.state_dir))
        nursery.start_soon(self._step_down_when_deposed)
        await self._serve(Router(self.routes, self.config.router_config), task_status)

    async def _last_etcd_save(self, keeper: LeaseKeeper) -> None:
        if self.acting and not self.deposed.is_set():
            try:
                await self.save()
                log.info("control plane stopped; state saved in %s", self.state_where)
            except Exception as exc:  # etcd gone, or no longer the leader: said, not raised
                log.warning("control plane stopped; the last save to %s failed: %s", self.state_where, exc)
        try:
            await keeper.revoke()
        except EtcdError as exc:
            log.warning("could not hand back the leader's lease (it lapses in its TTL): %s", exc)

    async def _keep_lease(self, keeper: LeaseKeeper) -> None:
        try:
            await keeper.run()
        except EtcdLeaseLost as exc:
            log.error("stepping down: %s; another control plane may lead now", exc)
            raise SteppedDown(str(exc)) from exc

    async def _step_down_when_deposed(self) -> None:
        await self.deposed.wait()
        log.error("stepping down: a state write was refused, another control plane leads now")
        raise SteppedDown("a fenced state write was refused")

    async def _serve(self, router: Router, task_status: trio.TaskStatus[ControlPlane]) -> None:
        server = StreamServer(
            self.agents.handle,
            tls=self.config.tls,
            limits=ServerLimits(max_streams=50_000),
            methods=self.route_watch.methods(),
        )
        host, port = Listen.split(self.config.listen.agents)
        api_host, api_port = Listen.split(self.config.listen.api)
        async with trio.open_nursery() as nursery:
            self.agent_port = await nursery.start(server.serve, host, port)
            serve = functools.partial(serve_api, metrics=self.metrics)
            self.api_port = await nursery.start(serve, self.query, self.config.api, api_host, api_port)
            if self.config.listen.router:
                router_host, router_port = Listen.split(self.config.listen.router)
                self.router_port = await nursery.start(router.serve, router_host, router_port)
            nursery.start_soon(self._reconcile_loop)
            task_status.started(self)

    async def _load_joins(self) -> None:
        """Load (on a first start, create) the join token and node credentials, and say how agents
        join: one line naming the token's file and `ctl token`, never the token itself."""
        self._joins_loaded(await trio.to_thread.run_sync(JoinBook.load, self.config.state_dir))

    def _joins_loaded(self, joins: JoinBook) -> None:
        self.agents.joins = joins
        log.info(
            "%s join token in %s (mode 0600); print it with `python -m control ctl token`, and start "
            "agents with --token or LLMGW_AGENT_TOKEN set to it; %d node(s) joined before",
            "created a" if joins.created else "agents join with the",
            joins.token_path,
            len(joins.nodes()),
        )
        if self.config.insecure:
            log.warning(
                "insecure = true: agents are accepted with no authentication at all; anything that "
                "reaches %s can register as any node and have its engines stopped. Remove it and "
                "give agents the join token, or use mutual TLS",
                self.config.listen.agents,
            )

    async def _reconcile_loop(self) -> None:
        while True:
            self._wake = trio.Event()
            started = time.perf_counter()
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile pass failed; retrying")
            took = time.perf_counter() - started
            self.metrics.reconcile_pass(took)
            if took > 0.1:
                log.info("reconcile pass took %.0f ms (%d nodes)", took * 1000, len(self.fleet.nodes))
            now = self.clock()
            wait = min(self.config.reconcile_interval, max(self.fleet.next_deadline(now) - now, 0.05))
            with trio.move_on_after(wait):
                await self._wake.wait()
            # Coalesce bursts of changes (a registering fleet) into one pass, and keep passes to at most
            # about half of the event loop's time, so heartbeats are always read on time.
            await trio.sleep(max(0.05, took))


class PlaneQuery:
    """The control plane as the admin API sees it (``control.query.ControlQuery``): a view of what
    it knows, and the operators' commands, each delegated to the room that does it."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    def view(self) -> ControlView:
        plane = self._plane
        reconciler = plane.reconciler

        def backoff(node_id: str, shard_id: str) -> tuple[int, float | None]:
            return reconciler.failures(node_id, shard_id), reconciler.retry_at(node_id, shard_id)

        return ControlView(
            now=plane.clock(),
            nodes=MappingProxyType(plane.fleet.nodes),
            placements=plane.placements,
            plan=plane.plan,
            models=MappingProxyType(plane.models),
            cordons=MappingProxyType(plane.fleet.cordons),
            admitted_by=MappingProxyType(plane.agents.admitted_by),
            insecure=plane.config.insecure,
            backoff=backoff,
            events=plane.events,
            catalog=MappingProxyType({e.name: e for e in plane.catalog.entries()}),
            rollouts=MappingProxyType(plane.rollout_status),
            wall=plane.wall_clock(),
            load_stale_after=plane.fleet.unreachable_after,
        )

    async def request_logs(
        self, node_id: str, shard_id: str, lines: int, *, previous: bool = False, after: int | None = None
    ) -> schema.LogsReply:
        return await self._plane.agents.request_logs(node_id, shard_id, lines, previous=previous, after=after)

    async def cordon(self, node_id: str) -> Cordon:
        await self._plane.cordon_node(node_id)
        return self._plane.fleet.cordons[node_id]

    async def uncordon(self, node_id: str) -> Cordon | None:
        return await self._plane.uncordon_node(node_id)

    async def drain(self, node_id: str, *, force: bool = False) -> list[str]:
        return await self._plane.drain_node(node_id, force=force)

    def joins(self) -> JoinSecrets | None:
        return self._plane.agents.joins

    async def forget_lost(self, node_id: str) -> bool:
        return await self._plane.forget_lost(node_id)

    async def apply_models(self, models: list[ModelConfig]) -> list[Change]:
        return await self._plane.apply_models(models)

    async def scale_model(self, name: str, replicas: int) -> Change:
        return await self._plane.scale_model(name, replicas)

    async def delete_model(self, name: str) -> Change:
        return await self._plane.delete_model(name)


__all__ = [
    "ControlPlane",
    "DrainRefused",
    "PlaneQuery",
    "load_shard_key_secret",
    "model_name_of",
    "shard_key",
]
