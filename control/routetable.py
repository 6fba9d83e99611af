"""The router's table, from what the control plane knows: a pure function, no clock, no I/O.

``route_table(...)`` maps each served model name to the replicas that may take its traffic (rank 0's
URL and key), or to the reason none can. The control plane rebuilds it after every reconcile pass and
hands the same value to its embedded router and to the routers that watch it, so the rules below are
written once:

- A replica counts while every shard last reported READY and no node of it is lost: an
  unreachable agent says nothing about its engines, which keep serving (the router ejects an engine
  that really fails).
- A DRAINING engine gets no new request, ever: its agent stops it once its in-flight requests are
  done, and new ones would keep that from happening (and be cut off at the deadline). The control
  plane drains an engine only once it is not needed: a rollout's or a scale's old replica, a
  deleted model's.
- READY replicas on a node being drained, and READY engines no placement wants any more (the old
  copy of a replica moving off a drained or returning node, before it is drained), are used only
  when nothing else is ready, so a drain moves traffic as soon as the replacement is up and not
  before.
- Static ``[[endpoints]]`` are appended to their model's upstreams.

Status follows the same rules (``serving_replicas``): a replica is ready while the router may send
it traffic, so ``ctl get models`` never shows fewer ready replicas than engines serve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import schema
from control.config import EndpointConfig, ModelConfig
from control.fleet import Node, NodeState
from control.placement import ReplicaPlacement, Unplaced, model_name_of
from router.routes import ModelRoutes, Upstream

State = schema.ShardState
#: Shard states whose engine takes new requests (a draining one only finishes what it has).
_SERVING = (State.READY,)

#: ``key_for(shard_id, engine)``: the API key the router sends to that shard's engine ("" for none).
KeyFor = Callable[[str, str], str]


def route_table(
    models: Sequence[ModelConfig],
    placements: Iterable[ReplicaPlacement],
    nodes: Mapping[str, Node],
    unplaced: Iterable[Unplaced] = (),
    endpoints: Sequence[EndpointConfig] = (),
    key_for: KeyFor = lambda shard_id, engine: "",
) -> Mapping[str, ModelRoutes]:
    """Served model name -> ready replicas (or the fallbacks), with the reason when there are none.

    ``unplaced`` gives the reason for a model with no replica (placement's own words); ``key_for``
    derives each shard's key (see the module docstring for which replicas count).
    """
    placements = tuple(placements)
    unplaced = tuple(unplaced)
    table: dict[str, ModelRoutes] = {}
    placed = _placed_keys(placements)
    for model in models:
        ready: list[Upstream] = []
        leaving: list[Upstream] = []
        for replica in placements:
            if replica.model != model.name or not _placed_serves(replica, nodes):
                continue
            leader = min(replica.shards, key=lambda s: s.node_rank)
            node = nodes[leader.node_id]
            upstream = Upstream(
                replica.replica_id,
                f"http://{node.register.mgmt_addr}:{leader.port}",
                api_key=key_for(leader.shard_id, model.profile.engine),
            )
            is_leaving = any(nodes[s.node_id].draining for s in replica.shards)
            (leaving if is_leaving else ready).append(upstream)
        for node, st, spec in _unplaced_serving(nodes, placed):
            if model_name_of(st.replica_id) != model.name:
                continue
            engine = spec.profile.engine if spec.profile else model.profile.engine
            leaving.append(
                Upstream(
                    st.replica_id,
                    f"http://{node.register.mgmt_addr}:{spec.http_port}",
                    api_key=key_for(st.shard_id, engine),
                )
            )
        reasons = [u.reason for u in unplaced if u.model == model.name]
        reason = reasons[0] if reasons else f"no replica of {model.name} is ready yet"
        table[model.served_name] = ModelRoutes(tuple(ready or leaving), reason)
    for endpoint in endpoints:
        current = table.get(endpoint.model)
        ups = (
            *(current.upstreams if current else ()),
            Upstream(f"static:{endpoint.url}", endpoint.url.rstrip("/")),
        )
        table[endpoint.model] = ModelRoutes(ups, current.reason if current else "")
    return MappingProxyType(table)


def _placed_keys(placements: Iterable[ReplicaPlacement]) -> set[tuple[str, str]]:
    return {(s.node_id, s.shard_id) for r in placements for s in r.shards}


def _placed_serves(replica: ReplicaPlacement, nodes: Mapping[str, Node]) -> bool:
    """Every shard of the placed replica last reported READY, and none is on a lost node."""
    if not replica.shards:
        return False
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        if node is None or node.state is NodeState.LOST:
            return False
        status = node.shards.get(shard.shard_id)
        if status is None or status.state not in _SERVING:
            return False
    return True


def _unplaced_serving(
    nodes: Mapping[str, Node], placed: set[tuple[str, str]]
) -> Iterator[tuple[Node, schema.ShardStatus, schema.StartShard]]:
    """Serving single-node engines that no placement accounts for (the old copy of a replica
    moving off a drained or returning node, before it is drained): still the fallback until their
    replacement is ready (the reconciler stops them then)."""
    for node in nodes.values():
        if node.state is NodeState.LOST:
            continue
        for st in node.shards.values():
            spec = st.spec
            if (
                (node.node_id, st.shard_id) in placed
                or st.state not in _SERVING
                or spec is None
                or max(spec.nnodes, 1) > 1
            ):
                continue
            yield node, st, spec


def serving_replicas(placements: Iterable[ReplicaPlacement], nodes: Mapping[str, Node]) -> frozenset[str]:
    """The replica ids ``route_table`` gives an upstream, preferred or fallback: those whose placed
    shards all serve, and those with a READY engine no placement accounts for.

    Status is told from this (``control.api``): a replica whose old engine serves while its new
    placement loads is ready, as the router sees it, not "not ready" for the second it takes."""
    placements = tuple(placements)
    ids = {r.replica_id for r in placements if _placed_serves(r, nodes)}
    ids.update(st.replica_id for _, st, _ in _unplaced_serving(nodes, _placed_keys(placements)))
    return frozenset(ids)


__all__ = ["KeyFor", "route_table", "serving_replicas"]
