"""Rolling change of a model: which replicas to keep, add and retire while its template changes.

A model's **revision** (``revision``) is a short hash of what defines one replica's engine: the
profile, the GPU needs, the node selector and ``nodes_per_replica``. The replica count and the
rollout settings are not in it: changing ``replicas`` is a scale, not a rollout. Every placement
carries the revision it was placed with (``ReplicaPlacement.revision``, saved in the state file);
a placement from an older state file, or one adopted from what agents report, gets it back from
the spec its engine runs with (``spec_matches``).

The rollout follows a Kubernetes Deployment's rolling update, one reconcile pass at a time
(``decide``, pure; ``Rollouts`` holds the little it must remember between passes):

- Replicas of the model's revision are *updated*; the others are *old*. Old replicas are kept as
  they are placed (placement does not reshape or move them: the rollout replaces them instead).
- New replicas are added while there are fewer than ``replicas`` updated ones and the total stays
  within ``replicas + max_surge``. They take replica ids no placement or agent report of the model
  uses (the lowest free index), so old and new copies are placed and routed side by side, and a
  new replica never inherits an old one's failures or engine records.
- Old replicas are retired (the reconciler drains them: the router stops sending them requests,
  in-flight streams finish, then the engine stops) while the ready replicas stay at least
  ``replicas - max_unavailable`` and new ones not yet ready are counted as missing: with the
  defaults (1 and 0) a new replica is ready before an old one is drained. Old replicas that are not
  ready go first, then the highest index.
- A new replica that fails while old ones remain (its engine reported FAILED or UNHEALTHY, or it
  was not ready within the model's ``ready_timeout`` of being placed) **fails the rollout**: no new
  replica is added, no old one is retired, the new ones not ready are given up (their GPUs freed),
  and the status names the shard and its error. The failure holds until the model's revision
  changes: applying a new definition starts over, and applying the old one back makes the old
  replicas current again, which completes the rollout at once.
- A new replica that cannot be placed (no free GPUs for the surge) is not a failure: the rollout
  waits, and its status gives placement's reason. With ``max_unavailable >= 1`` an old replica is
  retired first and its GPUs are used once its engine stops.

What is remembered (``Rollouts``) is lost with the control plane: after a restart a failed rollout
is tried once more, which fails it again at its new replica's first failure.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

import schema
from control.config import ModelConfig
from control.fleet import Node
from control.placement import ReplicaPlacement

State = schema.ShardState

#: The revision of a replica whose engine runs a template the control plane no longer knows (its
#: placement predates revisions, and its spec is not of the model's template now).
UNKNOWN_REVISION = "unknown"

#: The most of an engine's last output line a failure's words carry.
_MAX_OUTPUT = 240

#: Hex digits of a revision (40 bits: a collision between two revisions of one model is not a concern).
REVISION_LENGTH = 10


def _non_default(attribute: attrs.Attribute[Any], value: object) -> bool:
    default: Any = attribute.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    return bool(value != default)


def revision(model: ModelConfig) -> str:
    """The short hash of what defines one replica's engine (profile, GPUs, selector, nodes per
    replica). Keys left at their defaults are left out, so a release that adds a key with a
    default does not change every revision (and roll every model out) on upgrade."""
    template = {
        "profile": attrs.asdict(model.profile, filter=_non_default),
        "gpus": attrs.asdict(model.gpus, filter=_non_default),
        "selector": dict(model.selector),
        "nodes_per_replica": model.nodes_per_replica,
    }
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LENGTH]


def spec_matches(model: ModelConfig, profile: schema.EngineProfile, spec: schema.StartShard) -> bool:
    """Whether an engine running ``spec`` is of the model's template, given the ``profile`` the
    control plane sends for it now: what a placement that carries no revision is judged by."""
    return (
        spec.profile == profile
        and len(spec.gpu_indices) == model.gpus.count
        and max(spec.nnodes, 1) == model.nodes_per_replica
    )


def replica_index(model: str, replica_id: str) -> int | None:
    """``chat-r3`` -> 3 for model ``chat``; None when the id is not one of the model's."""
    prefix = f"{model}-r"
    digits = replica_id[len(prefix) :]
    if not replica_id.startswith(prefix) or not digits.isdigit() or str(int(digits)) != digits:
        return None
    return int(digits)


class Phase(enum.StrEnum):
    PROGRESSING = "progressing"
    COMPLETE = "complete"
    FAILED = "failed"


@attrs.frozen
class RolloutGoal:
    """What the model asks for: ``replicas`` replicas of ``revision``, rolled out within these bounds."""

    name: str
    replicas: int
    revision: str
    max_surge: int = 1
    max_unavailable: int = 0


@attrs.frozen
class ReplicaView:
    """One placed replica of the model, as the rollout judges it."""

    replica_id: str
    revision: str
    #: Every shard reports READY.
    ready: bool
    #: Why it failed ("chat-r2-s0-1a2b3c on gpu01: exited with 1: ..."); "" while it has not.
    failure: str = ""


@attrs.frozen
class Decision:
    """One pass's answer: the replicas wanted now, in index order."""

    #: Old replicas kept as they are placed (placement keeps them, never places them anew).
    old: tuple[str, ...]
    #: Updated replicas wanted: those placed and those to place now.
    new: tuple[str, ...]
    #: Old replicas let go this pass (the reconciler drains them).
    retired: tuple[str, ...] = ()
    #: New replicas given up this pass because the rollout failed (the reconciler stops them).
    abandoned: tuple[str, ...] = ()
    #: Why the rollout failed; "" when it has not.
    failure: str = ""

    @property
    def wanted(self) -> tuple[str, ...]:
        return (*self.old, *self.new)


def _by_index(name: str, ids: Collection[str]) -> list[str]:
    return sorted(ids, key=lambda rid: (replica_index(name, rid) or 0, rid))


def decide(
    goal: RolloutGoal, replicas: Sequence[ReplicaView], *, failure: str = "", taken: Collection[str] = ()
) -> Decision:
    """The replicas ``goal`` wants now, from those placed (see the module docstring).

    ``failure``: the rollout of ``goal.revision`` failed earlier (what ``Rollouts`` remembers);
    ``taken``: replica ids agents still report for the model (not reused for new replicas).
    """
    n = goal.replicas
    if n == 0:
        failure = ""  # a model scaled to zero or deleted: everything goes, failed rollout or not
    new = [r for r in replicas if r.revision == goal.revision]
    old = [r for r in replicas if r.revision != goal.revision]
    if old and not failure:
        failure = next((r.failure for r in _by_view(goal.name, new) if r.failure and not r.ready), "")
    if failure and old:
        # Stopped: everything old stays, the updated replicas that serve stay, the others go.
        keep = [r for r in new if r.ready and not r.failure]
        abandoned = [r.replica_id for r in new if r not in keep]
        return Decision(
            old=tuple(_by_index(goal.name, [r.replica_id for r in old])),
            new=tuple(_by_index(goal.name, [r.replica_id for r in keep])),
            abandoned=tuple(_by_index(goal.name, abandoned)),
            failure=failure,
        )
    # A scale down of the updated replicas: the ones not ready first, then the highest index.
    new_ids = [r.replica_id for r in _retire_order(goal.name, new)]
    excess = max(0, len(new) - n)
    dropped, new_ids = new_ids[:excess], new_ids[excess:]
    new = [r for r in new if r.replica_id in new_ids]

    retired: list[str] = []
    min_ready = n - goal.max_unavailable
    new_unready = sum(1 for r in new if not r.ready)
    # Old replicas beyond what the surge allows go whatever their readiness (a scale down mid-rollout).
    over = max(0, len(old) + len(new) - (n + goal.max_surge))
    room = max(0, len(old) + len(new) - min_ready - new_unready)
    ready = sum(1 for r in (*old, *new) if r.ready)
    for r in _retire_order(goal.name, old):
        if over > 0:
            over -= 1
        elif room > 0 and (not r.ready or ready - 1 >= min_ready):
            room -= 1
        else:
            continue
        retired.append(r.replica_id)
        ready -= r.ready
    kept_old = [r.replica_id for r in old if r.replica_id not in retired]

    wanted_new = list(new_ids)
    used = {r.replica_id for r in replicas} | set(taken)
    add = min(n - len(wanted_new), n + goal.max_surge - len(kept_old) - len(wanted_new))
    index = 0
    while add > 0:
        rid = f"{goal.name}-r{index}"
        if rid not in used:
            wanted_new.append(rid)
            used.add(rid)
            add -= 1
        index += 1
    return Decision(
        old=tuple(_by_index(goal.name, kept_old)),
        new=tuple(_by_index(goal.name, wanted_new)),
        retired=tuple(_by_index(goal.name, [*retired, *dropped])),
    )


def _by_view(name: str, views: Sequence[ReplicaView]) -> list[ReplicaView]:
    return sorted(views, key=lambda r: (replica_index(name, r.replica_id) or 0, r.replica_id))


def _retire_order(name: str, views: Sequence[ReplicaView]) -> list[ReplicaView]:
    """Not ready first, then the highest index."""
    return sorted(views, key=lambda r: (r.ready, -(replica_index(name, r.replica_id) or 0), r.replica_id))


@attrs.frozen
class RolloutStatus:
    """A model's rollout as ``GET /api/models/MODEL`` and ``ctl rollout status`` show it."""

    model: str
    revision: str
    #: The model's generation (``control.catalog``) when the rollout last acted on it: a status whose
    #: generation is below the catalog's is from before the latest change (``ctl rollout status`` waits).
    observed_generation: int
    replicas: int
    #: Updated replicas placed, and of them ready; every ready replica; old replicas still placed.
    updated: int
    updated_ready: int
    ready: int
    old: int
    phase: Phase
    reason: str = ""

    def to_doc(self, generation: int | None = None) -> dict[str, Any]:
        """The document ``GET /api/models/MODEL`` serves; ``generation``: the catalog's now."""
        return {
            "revision": self.revision,
            "generation": self.observed_generation if generation is None else generation,
            "observed_generation": self.observed_generation,
            "replicas": self.replicas,
            "updated_replicas": self.updated,
            "updated_ready_replicas": self.updated_ready,
            "ready_replicas": self.ready,
            "old_replicas": self.old,
            "state": self.phase.value,
            "reason": self.reason,
        }


def status_of(
    goal: RolloutGoal,
    placed: Sequence[ReplicaView],
    unplaced: Mapping[str, str],
    *,
    failure: str = "",
    generation: int = 0,
) -> RolloutStatus:
    """The rollout's status after a pass: ``placed`` the model's placed replicas, ``unplaced``
    replica id -> placement's reason for the wanted ones it could not place."""
    new = [r for r in placed if r.revision == goal.revision]
    old = [r for r in placed if r.revision != goal.revision]
    new_ready = sum(1 for r in new if r.ready)
    ready = sum(1 for r in placed if r.ready)
    n = goal.replicas
    if failure and old:
        phase, reason = Phase.FAILED, failure
    elif not old and len(new) == n and new_ready == n and not unplaced:
        phase, reason = Phase.COMPLETE, ""
    else:
        phase = Phase.PROGRESSING
        parts = [f"{rid} cannot be placed: {why}" for rid, why in sorted(unplaced.items())]
        waiting = [r.replica_id for r in _by_view(goal.name, new) if not r.ready]
        if waiting:
            parts.append(f"waiting for {', '.join(waiting)} to be ready")
        if old:
            parts.append(f"{len(old)} old replica(s) to replace")
        reason = "; ".join(parts)
    return RolloutStatus(
        goal.name,
        goal.revision,
        generation,
        n,
        len(new),
        new_ready,
        ready,
        len(old),
        phase,
        reason,
    )


def observed_view(
    replica: ReplicaPlacement,
    nodes: Mapping[str, Node],
    failures: Callable[[str, str], int],
    current: str,
) -> ReplicaView:
    """How a placed replica stands, from what its nodes report: ready when every shard is READY;
    failed (the first shard's words) when one reports FAILED or UNHEALTHY, or the reconciler has
    counted a failure of it. A replica of unknown revision counts as ``current``."""
    ready = True
    failure = ""
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        status = node.shards.get(shard.shard_id) if node is not None else None
        if status is None or status.state != State.READY:
            ready = False
        if failure:
            continue
        if status is not None and status.state in (State.FAILED, State.UNHEALTHY):
            state = State(status.state).name.lower()
            error = _printable(status.error[:_MAX_OUTPUT]) or "no error reported"
            failure = f"{shard.shard_id} on {shard.node_id} {state}: {error}"
            last = next((line.strip() for line in reversed(status.output_tail) if line.strip()), "")
            if last:
                # The engine's last words (what failed), bounded and escaped: a node's strings reach
                # logs, ctl and the fleet page.
                failure += f"; its last output: {_printable(last[:_MAX_OUTPUT])}"
        elif count := failures(shard.node_id, shard.shard_id):
            failure = f"{shard.shard_id} on {shard.node_id} failed {count} time(s)"
    return ReplicaView(replica.replica_id, replica.revision or current, ready, failure)


def _printable(text: str) -> str:
    """``text`` with control characters escaped (``\x1b`` for ESC), so it cannot move a terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def recovered(
    replica: ReplicaPlacement,
    nodes: Mapping[str, Node],
    model: ModelConfig,
    profile: schema.EngineProfile,
    current: str,
) -> ReplicaPlacement:
    """A placement that carries no revision (from an older state file, or adopted from agents'
    reports) with the one its engines show: ``current`` when every shard's running spec is of the
    model's template now, ``UNKNOWN_REVISION`` (an old one: rolled out) when one is not, and
    unchanged while a shard's engine has not reported (a replica with no revision yet counts as
    current: nothing is replaced on a guess)."""
    if replica.revision:
        return replica
    specs = []
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        status = node.shards.get(shard.shard_id) if node is not None else None
        if status is None or status.spec is None:
            return replica
        specs.append(status.spec)
    if not specs:
        return replica
    matches = all(spec_matches(model, profile, spec) for spec in specs)
    return attrs.evolve(replica, revision=current if matches else UNKNOWN_REVISION)


@attrs.define
class _Memory:
    revision: str = ""
    failure: str = ""
    #: replica id -> when it was first seen placed (for ``ready_timeout``).
    placed_at: dict[str, float] = attrs.field(factory=dict)


@attrs.define
class Rollouts:
    """What the rollouts remember between passes: each model's failure, and when its new replicas
    were placed. Sans-IO: the caller passes ``now``."""

    memory: dict[str, _Memory] = attrs.field(factory=dict)

    def decide(
        self,
        goal: RolloutGoal,
        replicas: Sequence[ReplicaView],
        *,
        ready_timeout: float,
        now: float,
        taken: Collection[str] = (),
    ) -> Decision:
        """``decide`` with this model's memory: a new revision forgets the last one's failure, and
        a new replica not ready ``ready_timeout`` seconds after it was first seen placed fails."""
        mem = self.memory.setdefault(goal.name, _Memory())
        if mem.revision != goal.revision:
            mem.revision, mem.failure, mem.placed_at = goal.revision, "", {}
        placed_ids = {r.replica_id for r in replicas}
        for rid in [rid for rid in mem.placed_at if rid not in placed_ids]:
            del mem.placed_at[rid]
        views = []
        for r in replicas:
            if r.revision == goal.revision:
                since = mem.placed_at.setdefault(r.replica_id, now)
                if not r.ready and not r.failure and now - since >= ready_timeout:
                    r = attrs.evolve(r, failure=f"{r.replica_id} not ready within {ready_timeout:g} s")
            views.append(r)
        decision = decide(goal, views, failure=mem.failure, taken=taken)
        mem.failure = decision.failure
        return decision

    def failure(self, name: str) -> str:
        mem = self.memory.get(name)
        return mem.failure if mem else ""

    def forget(self, names: Collection[str]) -> None:
        """Drop the memory of models no longer in the catalog."""
        for name in [n for n in self.memory if n not in names]:
            del self.memory[name]


__all__ = [
    "REVISION_LENGTH",
    "UNKNOWN_REVISION",
    "Decision",
    "Phase",
    "ReplicaView",
    "RolloutGoal",
    "RolloutStatus",
    "Rollouts",
    "decide",
    "observed_view",
    "recovered",
    "replica_index",
    "revision",
    "spec_matches",
    "status_of",
]
