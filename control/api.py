"""The admin HTTP JSON API that ``ctl`` speaks: nodes, replicas, why, logs, drain.

A small ASGI app served by hypercorn over HTTP/1.1 on the admin address (never on the agent port: the
agent port's HTTP/2 is ours, for the reasons in ``transport.server``). Times are reported as
"seconds ago" on the control plane's monotonic clock, the only clock liveness is judged on (events
carry a UTC wall-clock time as well).

It depends on ``control.query`` only, never on ``control.plane``: the documents are pure functions
of a ``ControlView`` (what the plane knows at one instant), and the writes go through the
``ControlQuery`` commands (cordon, uncordon, drain) and the join book.

    GET  /api/nodes                 every node: state, why, GPUs (free/total), fabrics, shards,
                                    engines (each one's version, or why it is unknown)
    GET  /api/nodes/NODE            one node, the replicas on it, and its recent events
    GET  /api/replicas              every placed replica and its shards' observed states, with each
                                    engine's load from its agent's heartbeats (``load``: running,
                                    waiting, kv_usage, hit_rate, tokens_per_second, age_s, stale,
                                    error; null when none was sent) and the replica's together
    GET  /api/models                every model: replicas wanted, placed and ready, and why not placed
    GET  /api/models/MODEL          MODEL's replicas (as why), and its shards' recent events
    POST /api/models                create or update models: {"toml": "[[models]] ...", "source":
                                    "model.toml"}, the same keys as llmgw.toml's [[models]] (400
                                    naming the key and line); one change per model (created,
                                    configured, unchanged)
    PUT  /api/models/MODEL/replicas {"replicas": N}
    POST /api/models/MODEL/scale    the same
    DELETE /api/models/MODEL        drain and stop MODEL's replicas, then forget it (409 for a model
                                    llmgw.toml defines, or one being deleted for a scale or apply)
    GET  /api/why/MODEL             placed and unplaced replicas of MODEL, with the reasons
    GET  /api/logs/SHARD?lines=N    the tail of the shard's engine log (N from 1 to 10,000, default
                                    100), fetched from its agent
                                    (&previous=1: the run before its last restart; &after=OFFSET:
                                    the lines past a reply's offset, for ctl logs -f)
    POST /api/cordon/NODE           NODE takes no new replicas; what runs there stays
    POST /api/drain/NODE[?force=1]  cordon NODE and move its replicas (replacements first); 409 with
                                    the reason when a model would be left without a ready replica
    GET  /api/drain/NODE            what still runs on NODE, and where each replacement stands
    POST /api/uncordon/NODE         undo a cordon or a drain (replicas already moved stay moved)
    GET  /api/token                 the cluster join token agents join with (a secret: admin only)
    POST /api/reset/NODE            forget NODE's credential: it joins again with the join token; a
                                    lost NODE is forgotten too, with the shards it last reported
    GET  /                          the fleet page for a browser (``control.page``: how it authenticates)
    GET  /fleet                     the page's live part, an HTML fragment its script fetches every 2 s
    GET  /metrics                   the fleet's Prometheus metrics (``control.fleetmetrics``)
    GET  /healthz                   {"ok": true}: the process answers (no token needed)

Cordons and drains are written to the state file before the answer, so they survive a restart.

The routes are one table, ``ROUTES``: each route's method, path, role and query parameters with
its handler. A path no route has is 404, a method its path lacks 405 with ``Allow``, and a query
parameter a route does not take, or out of its range, 400 naming it and what was expected.

Who may ask (``ApiGuard``): a bearer token from ``[api]`` in llmgw.toml, ``read_tokens`` for the
routes whose role is read (every GET) and ``admin_tokens`` for those too and the admin routes (every
write, and ``GET /api/token``, which hands out a secret).
With no token configured the API answers loopback clients only, and warns at start. Requests with
an ``Origin`` or a foreign ``Host`` are refused (403), and a write needs ``Content-Type:
application/json`` (415). ``[api.tls]`` serves HTTPS, with client certificates from its
``client_ca`` required when ``require_client_cert`` (mutual TLS).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, unquote

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

import schema
from control import page
from control.config import AdminApi, ConfigError, parse_models
from control.events import Event
from control.fleet import LIVE_SHARD_STATES, Node, NodeState
from control.fleetmetrics import FleetMetrics
from control.notfound import unknown_model, unknown_node
from control.placement import ReplicaPlacement, model_name_of
from control.query import (
    CatalogConflict,
    Change,
    ControlQuery,
    ControlView,
    DrainRefused,
    engine_views,
    replica_load,
    shard_load,
)
from control.routetable import serving_replicas
from transport.addresses import is_loopback

log = logging.getLogger("llmgw.control.api")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def nodes_doc(view: ControlView) -> list[dict[str, Any]]:
    used: dict[str, set[int]] = {}
    for replica in view.placements:
        for shard in replica.shards:
            used.setdefault(shard.node_id, set()).update(shard.gpu_indices)
    return [_node_entry(view, node, used) for node in sorted(view.nodes.values(), key=lambda n: n.node_id)]


def _node_entry(view: ControlView, node: Node, used: dict[str, set[int]]) -> dict[str, Any]:
    now = view.now
    reg = node.register
    last = node.history[-1] if node.history else None
    return {
        "node_id": node.node_id,
        "state": node.state.value,
        "reason": last.reason if last else "",
        "since_s": round(now - node.since, 1),
        "connected": node.connected,
        "draining": node.draining,
        "cordoned": node.cordoned,
        "heartbeat_age_s": round(now - node.last_heartbeat, 1),
        "mgmt_addr": reg.mgmt_addr,
        "gpus": len(reg.gpus),
        "gpus_free": len(reg.gpus) - len(used.get(node.node_id, set())),
        "gpu_model": reg.gpus[0].name if reg.gpus else "",
        "fabrics": sorted({f.fabric for f in reg.fabrics}),
        "labels": dict(reg.labels),
        # Each engine's version as the agent found it at start, or why it is unknown.
        "engines": [
            {"engine": name, "version": e.version, "error": e.error} for name, e in engine_views(reg).items()
        ],
        "discovery_error": reg.discovery_error,
        # How its stream proved it speaks for the node: mtls, node token, credential, join
        # token, or insecure (no authentication: `insecure = true`).
        "auth": view.admitted_by.get(node.node_id, ""),
        "insecure": view.insecure,
        "shards": sorted(node.shards),
        "history": [
            {
                "at_s_ago": round(now - t.at, 1),
                "from": t.old.value if t.old else "",
                "to": t.new.value,
                "reason": t.reason,
            }
            for t in node.history[-10:]
        ],
    }


#: Where a shard runs: (GPUs, port, node rank, nnodes, master address, master port).
_Shape = tuple[tuple[int, ...], int, int, int, str, int]


def _shard_doc(
    view: ControlView,
    shard_id: str,
    node_id: str,
    status: schema.ShardStatus | None,
    now: float,
    shape: _Shape,
    placed: bool,
) -> dict[str, Any]:
    gpus, port, node_rank, nnodes, master_addr, master_port = shape
    node = view.nodes.get(node_id)
    failures, retry = view.backoff(node_id, shard_id) if placed else (0, None)
    state = schema.ShardState(status.state).name.lower() if status else "pending"
    reported, note = state, ""
    if node is not None and node.state is NodeState.LOST:
        # Nothing reaches the node: what runs there is unknown, only what it last said and when.
        seen = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(view.wall - (now - node.last_heartbeat)))
        state = "unknown"
        note = (
            f"node lost: last seen {seen}, not reachable; it last reported {reported}. Listed until "
            f"the node returns and stops it, or `ctl node reset {node_id}` forgets the node"
        )
    elif not placed and state == "ready":
        state = "draining"  # serving until its replacement is ready, then drained or stopped
    return {
        "shard_id": shard_id,
        "node_id": node_id,
        "node_state": node.state.value if node else "unknown",
        "state": state,
        # The state its agent last reported (``state`` is "unknown" while the node is lost), when
        # the node was last heard from, and what that means for this shard.
        "reported": reported,
        "last_seen_s_ago": round(now - node.last_heartbeat, 1) if node else None,
        "note": note,
        #: False for an engine no placement wants any more that still runs (the old copy of a
        #: replica moving off a drained or returning node): listed until it stops.
        "placed": placed,
        "gpus": list(gpus),
        "port": port,
        "url": f"http://{node.register.mgmt_addr}:{port}" if node else "",
        "node_rank": node_rank,
        "nnodes": nnodes,
        "master": f"{master_addr}:{master_port}" if nnodes > 1 else "",
        "error": status.error if status else "",
        "exit_code": status.exit_code if status else None,
        # The engine process and, for a failed one, the last lines it wrote: why it died
        # is in the engine's own words, and a person should not need a shell on the node.
        "pid": status.pid if status else 0,
        "output_tail": list(status.output_tail) if status else [],
        "failures": failures,
        "retry_in_s": round(max(retry - now, 0.0), 1) if retry else None,
        # The engine's latest load from its agent's heartbeat (EngineLoad.doc), or null.
        "load": load.doc() if (load := shard_load(view, node_id, shard_id)) else None,
    }


def replicas_doc(view: ControlView) -> list[dict[str, Any]]:
    """Every placed replica with its shards, and the engines still running for a replica that no
    placement accounts for (old copies being drained or waiting for their replacement) after them."""
    now = view.now
    placed_keys = {(s.node_id, s.shard_id) for r in view.placements for s in r.shards}
    leaving: dict[str, list[dict[str, Any]]] = {}
    for node in sorted(view.nodes.values(), key=lambda n: n.node_id):
        for status in sorted(node.shards.values(), key=lambda s: s.shard_id):
            spec = status.spec
            if (node.node_id, status.shard_id) in placed_keys or status.state not in LIVE_SHARD_STATES:
                continue
            shape: _Shape = ((), 0, 0, 1, "", 0)
            if spec is not None:
                shape = (
                    tuple(spec.gpu_indices),
                    spec.http_port,
                    spec.node_rank,
                    max(spec.nnodes, 1),
                    spec.master_addr,
                    spec.master_port,
                )
            leaving.setdefault(status.replica_id, []).append(
                _shard_doc(view, status.shard_id, node.node_id, status, now, shape, placed=False)
            )
    out = []
    serving = serving_replicas(view.placements, view.nodes)
    replica_ids = [r.replica_id for r in view.placements]
    by_id = {r.replica_id: r for r in view.placements}
    for rid in [*replica_ids, *sorted(set(leaving) - set(replica_ids))]:
        replica = by_id.get(rid)
        shards = []
        for shard in replica.shards if replica else ():
            holder = view.nodes.get(shard.node_id)
            observed = holder.shards.get(shard.shard_id) if holder else None
            shape = (
                shard.gpu_indices,
                shard.port,
                shard.node_rank,
                shard.nnodes,
                shard.master_addr,
                shard.master_port,
            )
            shards.append(_shard_doc(view, shard.shard_id, shard.node_id, observed, now, shape, placed=True))
        model = replica.model if replica else model_name_of(rid)
        if replica is None:
            # Engines no placement wants: drained by their agents, or unknown on a lost node.
            old = leaving.get(rid, [])
            state = "lost" if old and all(s["node_state"] == "lost" for s in old) else "draining"
        else:
            # Ready while the router may send it traffic (control.routetable): its placed shards
            # serve, or its old engine does while the new placement loads (that row says draining).
            state = "ready" if rid in serving else "not ready"
        out.append(
            {
                "model": model,
                "replica_id": rid,
                "served_model_name": view.models[model].served_name if model in view.models else "",
                "fabric": replica.fabric if replica else "",
                "state": state,
                "shards": shards + leaving.get(rid, []),
                # The placed shards' loads together (control.query.replica_load), or null.
                "load": _replica_load_doc(view, replica),
            }
        )
    return out


def _replica_load_doc(view: ControlView, replica: ReplicaPlacement | None) -> dict[str, object] | None:
    if replica is None:
        return None
    load = replica_load([shard_load(view, s.node_id, s.shard_id) for s in replica.shards])
    return load.doc() if load else None


def why_doc(view: ControlView, model: str) -> dict[str, Any]:
    if model not in view.models:
        raise ApiError(404, unknown_model(model, view.models))
    cfg = view.models[model]
    placed = [r for r in replicas_doc(view) if r["model"] == model]
    unplaced = [
        {"replica_id": u.replica_id, "reason": u.reason, "per_node": dict(u.per_node)}
        for u in view.plan.unplaced
        if u.model == model
    ]
    return {"model": model, "replicas_wanted": cfg.replicas, "placed": placed, "unplaced": unplaced}


def models_doc(
    view: ControlView, replicas_of_view: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every model in the catalog: replicas wanted, placed and ready (``ctl get models``), what a
    replica needs, and why the replicas that cannot run cannot (the plan's reasons).
    ``replicas_of_view``: the view's ``replicas_doc``, when the caller has built it already."""
    if replicas_of_view is None:
        replicas_of_view = replicas_doc(view)
    replicas = [r for r in replicas_of_view if r["state"] not in ("draining", "lost")]
    out = []
    for name in sorted(view.models):
        cfg = view.models[name]
        mine = [r for r in replicas if r["model"] == name]
        entry = view.catalog.get(name)
        out.append(
            {
                "model": name,
                "served_model_name": cfg.served_name,
                "engine": cfg.profile.engine,
                "replicas_wanted": cfg.replicas,
                "replicas_placed": len(mine),
                "replicas_ready": sum(1 for r in mine if r["state"] == "ready"),
                "gpus_per_shard": cfg.gpus.count,
                "nodes_per_replica": cfg.nodes_per_replica,
                "unplaced": [u.reason for u in view.plan.unplaced if u.model == name],
                # The catalog's: +1 on every change of the definition or replicas (control.catalog),
                # where the definition in force came from (file, api), and whether it is deleted.
                "generation": entry.generation if entry else 0,
                "source": entry.source.value if entry else "",
                "in_file": entry is not None and entry.file_definition is not None,
                "deleting": entry.deleting if entry else False,
                # The template revision and its rollout's state (control.rollout), "" before a pass.
                "revision": rollout.revision if (rollout := view.rollouts.get(name)) else "",
                "rollout": rollout.phase.value if rollout else "",
            }
        )
    return out


#: The largest request body the API reads (an apply of many models is some KB).
MAX_BODY = 1 << 20


async def read_json_body(receive: Receive) -> Any:
    """The request's JSON body (bounded by ``MAX_BODY``); ``ApiError`` 400/413 naming what is wrong."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ApiError(400, "the client went away before its request body arrived")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes; send fewer models at a time")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from exc


def change_doc(change: Change) -> dict[str, Any]:
    """One model's change, with kubectl's line (``model/chat configured``)."""
    return {
        "model": change.name,
        "action": change.action.value,
        "generation": change.generation,
        "line": str(change),
    }


async def apply_models(query: ControlQuery, body: Any) -> dict[str, Any]:
    """``POST /api/models``: ``{"toml": TEXT, "source": NAME}``, parsed in a worker thread with
    llmgw.toml's own rules (``control.config.parse_models``), so errors name the key and the line."""
    if not isinstance(body, dict) or not isinstance(body.get("toml"), str):
        raise ApiError(400, 'POST /api/models wants {"toml": "<[[models]] tables>", "source": "FILE"}')
    source = str(body.get("source") or "<request>")[:200]
    try:
        models = await trio.to_thread.run_sync(parse_models, body["toml"], source)
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from exc
    try:
        changes = await query.apply_models(list(models))
    except CatalogConflict as exc:
        raise ApiError(409, str(exc)) from exc
    return {"changes": [change_doc(c) for c in changes]}


async def scale_model(query: ControlQuery, name: str, body: Any) -> dict[str, Any]:
    """``PUT /api/models/MODEL/replicas``: ``{"replicas": N}``."""
    replicas = body.get("replicas") if isinstance(body, dict) else None
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ApiError(
            400, f'scale {name}: want {{"replicas": N}} with N a whole number, 0 or more, got {replicas!r}'
        )
    try:
        change = await query.scale_model(name, replicas)
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0])) from exc
    except CatalogConflict as exc:
        raise ApiError(409, str(exc)) from exc
    return change_doc(change)


async def delete_model(query: ControlQuery, name: str) -> dict[str, Any]:
    """``DELETE /api/models/MODEL``."""
    try:
        change = await query.delete_model(name)
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0])) from exc
    except CatalogConflict as exc:
        raise ApiError(409, str(exc)) from exc
    return change_doc(change)


#: Events a node's or a model's document shows, the newest (``control.events`` keeps 50 a node, 20 a shard).
EVENTS_SHOWN = 50


def events_doc(view: ControlView, events: Iterable[Event]) -> list[dict[str, Any]]:
    """Events oldest first: seconds ago on the control plane's monotonic clock, and the wall-clock
    time (UTC, ISO 8601) to set against other logs."""
    return [
        {
            "at_s_ago": round(view.now - e.at, 1),
            "time": datetime.fromtimestamp(e.wall, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "kind": e.kind.value,
            "node_id": e.node_id,
            "shard_id": e.shard_id,
            "replica_id": e.replica_id,
            "from": e.old,
            "to": e.new,
            "reason": e.reason,
        }
        for e in events
    ]


def _gpu_devices(node: Node, holders: dict[int, list[str]]) -> list[dict[str, Any]]:
    """Each GPU as the node registered it, with its memory used and utilization from the latest
    heartbeat (the Register's figures until one came) and the shards placed on it: what an operator
    compares when a replica is placed but its engine cannot allocate."""
    devices = []
    for gpu in node.register.gpus:
        used, utilization = node.usage.get(gpu.index, (gpu.memory_used_mib, gpu.utilization_percent))
        devices.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "compute_capability": gpu.compute_capability,
                "pci_bus_id": gpu.pci_bus_id,
                "memory_total_mib": gpu.memory_total_mib,
                "memory_used_mib": used,
                "utilization_percent": utilization,
                "nvlink_peers": list(gpu.nvlink_peers),
                "shards": sorted(holders.get(gpu.index, ())),
            }
        )
    return devices


def node_doc(view: ControlView, node_id: str) -> dict[str, Any]:
    """One node for ``ctl describe node``: its ``/api/nodes`` entry, the replicas with a shard on
    it, and its recent events (liveness, operators' decisions, its shards' states and commands)."""
    node = view.nodes.get(node_id)
    if node is None:
        raise ApiError(404, unknown_node(node_id, view.nodes))
    used: dict[str, set[int]] = {}
    holders: dict[int, list[str]] = {}
    for replica in view.placements:
        for shard in replica.shards:
            if shard.node_id == node_id:
                used.setdefault(node_id, set()).update(shard.gpu_indices)
                for index in shard.gpu_indices:
                    holders.setdefault(index, []).append(shard.shard_id)
    doc = _node_entry(view, node, used)
    doc["gpu_devices"] = _gpu_devices(node, holders)
    doc["replicas"] = [r for r in replicas_doc(view) if any(s["node_id"] == node_id for s in r["shards"])]
    shard_ids = {
        *node.shards,
        *(s.shard_id for r in view.placements for s in r.shards if s.node_id == node_id),
    }
    shard_events = [e for e in view.events.for_shards(shard_ids) if e.node_id == node_id]
    events = sorted([*view.events.for_node(node_id), *shard_events], key=lambda e: e.seq)
    doc["events"] = events_doc(view, events[-EVENTS_SHOWN:])
    return doc


def model_doc(view: ControlView, model: str) -> dict[str, Any]:
    """One model for ``ctl describe model``: what ``/api/why/MODEL`` says (replicas wanted, placed
    with their shards, unplaced with the reasons), its names and engine, and the recent events of
    its shards, those that no longer run included."""
    doc = why_doc(view, model)
    cfg = view.models[model]
    doc["served_model_name"] = cfg.served_name
    doc["engine"] = cfg.profile.engine
    # The rolling change of its template (control.rollout): null before the first reconcile pass.
    rollout = view.rollouts.get(model)
    entry = view.catalog.get(model)
    generation = entry.generation if entry is not None else None
    doc["rollout"] = rollout.to_doc(generation) if rollout is not None else None
    placed = {s["shard_id"] for r in doc["placed"] for s in r["shards"]}
    shard_ids = [*placed, *view.events.shards_of(lambda rid: model_name_of(rid) == model)]
    # The model's own events (created, configured, scaled, deleting) with its shards', in order.
    events = sorted(
        [*view.events.for_node(f"model/{model}"), *view.events.for_shards(shard_ids)], key=lambda e: e.seq
    )
    doc["events"] = events_doc(view, events[-EVENTS_SHOWN:])
    return doc


async def _fleet_html(view: ControlView) -> str:
    """The fleet page's live part from one view, through the same documents ``ctl`` reads: built
    here, on the trio thread (the view is live; at 2,000 nodes and 8,000 replicas they take about
    0.35 s), and made HTML in a worker thread."""
    replicas = replicas_doc(view)
    nodes, models = nodes_doc(view), models_doc(view, replicas)
    return await trio.to_thread.run_sync(page.fleet_html, nodes, models, replicas)


def drain_doc(view: ControlView, node_id: str) -> dict[str, Any]:
    """What still runs on a node being drained, and where each replica's replacement stands."""
    node = view.nodes.get(node_id)
    if node is None:
        raise ApiError(404, unknown_node(node_id, view.nodes))
    shards = []
    for st in sorted(node.shards.values(), key=lambda s: s.shard_id):
        if st.state not in LIVE_SHARD_STATES:
            continue
        replacement = view.plan.replica(st.replica_id)
        moved = replacement is not None and node_id not in replacement.node_ids
        states = []
        if replacement is not None and moved:
            for shard in replacement.shards:
                other = view.nodes.get(shard.node_id)
                status = other.shards.get(shard.shard_id) if other else None
                states.append(schema.ShardState(status.state).name.lower() if status else "pending")
        shards.append(
            {
                "shard_id": st.shard_id,
                "replica_id": st.replica_id,
                "state": schema.ShardState(st.state).name.lower(),
                "replacement": ", ".join(replacement.node_ids) if replacement is not None and moved else "",
                "replacement_state": "/".join(states),
            }
        )
    mark = view.cordons.get(node_id)
    return {
        "node_id": node_id,
        "cordon": mark.value if mark else "",
        "node_state": node.state.value,
        "shards": shards,
        "empty": not shards,
    }


async def logs_doc(
    query: ControlQuery, shard_id: str, lines: int, *, previous: bool = False, after: int | None = None
) -> dict[str, Any]:
    """The tail of a shard's log from the first node that can give it (``lines`` and ``after`` as
    the route's parameters checked them: ``ROUTES``); 404 for a shard no node has, 503 with each
    node's reason when none could answer."""
    # Nodes that report the shard first, then those it is placed on; each asked once.
    view = query.view()
    holders = [n.node_id for n in view.nodes.values() if shard_id in n.shards]
    holders += [s.node_id for r in view.placements for s in r.shards if s.shard_id == shard_id]
    holders = list(dict.fromkeys(holders))
    if not holders:
        raise ApiError(404, f"no shard {shard_id!r} is placed or reported on any node")
    errors = []
    for node_id in holders:
        try:
            reply = await query.request_logs(node_id, shard_id, lines, previous=previous, after=after)
        except LookupError as exc:
            errors.append(str(exc))
            continue
        if reply.error:
            errors.append(reply.error)
            continue
        return {
            "shard_id": shard_id,
            "node_id": node_id,
            "lines": list(reply.lines),
            "previous": previous,
            # Where these lines end in the live log: ``ctl logs -f`` asks for ``after=offset`` next.
            "offset": reply.offset,
        }
    raise ApiError(503, f"logs of {shard_id} unavailable: {'; '.join(errors)}")


# -- who may ask: tokens, roles, Host, Origin, content type ---------------------------------------

#: The two roles: ``read`` may GET, ``admin`` may also write (each route says which it needs).
READ = "read"
ADMIN = "admin"
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@attrs.define
class ApiGuard:
    """Decides whether a request to the admin API is answered, and with which role.

    Why each check exists:

    - ``Origin`` (and ``Sec-Fetch-Site`` other than same-origin or none): a browser adds them to
      requests a web page makes. ``ctl``, curl and scripts never send them, so any request with one
      is a web page reaching in (a cross-origin ``text/plain`` POST needs no CORS preflight and
      would drain a node): refused, 403. The fleet page's own fetches are same-origin GETs, which
      carry no ``Origin`` and say ``Sec-Fetch-Site: same-origin``: they pass, and need the token.
    - ``Host`` must name the API itself (its listen address, localhost or 127.0.0.1 with its port,
      any IP literal when it listens on every address, or a name in ``[api] hosts``). A page on
      an attacker's name that re-resolves to 127.0.0.1 (DNS rebinding) sends its own name: 403.
    - Bearer tokens (``[api] read_tokens``, ``admin_tokens``), compared in constant time against
      every token. Without any, the API answers loopback clients only, as admin (a start-up warning
      says so): one operator's machine, never the network.
    - A write must say ``Content-Type: application/json`` (415 otherwise): HTML forms cannot send
      it and a script sending it cross-origin needs a preflight, which the API never answers."""

    read_tokens: tuple[bytes, ...] = ()
    admin_tokens: tuple[bytes, ...] = ()
    #: Host names (lower case, no port) that are the API's own.
    hosts: frozenset[str] = frozenset()
    #: Listening on every address: any IP literal in ``Host`` is the API's own.
    any_ip: bool = False
    #: The port ``Host`` must carry; 0 until bound (then every request is refused).
    port: int = 0
    tls: bool = False

    @classmethod
    def from_config(cls, api: AdminApi, listen_host: str, port: int, *, tls: bool = False) -> ApiGuard:
        listen_host = listen_host.strip("[]").lower()
        hosts = {*_LOOPBACK_NAMES, *(h.strip("[]").lower().rstrip(".") for h in api.hosts)}
        if listen_host not in _WILDCARDS:
            hosts.add(listen_host)
        return cls(
            read_tokens=tuple(t.encode() for t in api.read_tokens),
            admin_tokens=tuple(t.encode() for t in api.admin_tokens),
            hosts=frozenset(hosts),
            any_ip=listen_host in _WILDCARDS,
            port=port,
            tls=tls,
        )

    @property
    def has_tokens(self) -> bool:
        return bool(self.read_tokens or self.admin_tokens)

    def own_host(self, value: str) -> bool:
        """Whether a Host header value names this API: its port, and one of its names (above)."""
        value = value.strip().lower()
        if value.startswith("["):
            name, _, rest = value[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ("" if not rest else "x")
        elif value.count(":") == 1:
            name, _, port_text = value.partition(":")
        else:
            name, port_text = value, ""
        default = 443 if self.tls else 80
        if port_text and not port_text.isdigit():
            return False
        if (int(port_text) if port_text else default) != self.port:
            return False
        name = name.rstrip(".")
        return name in self.hosts or (self.any_ip and _is_ip(name))

    def check(
        self, method: str, path: str, needed: str | None, headers: dict[bytes, bytes], client: str | None
    ) -> str | None:
        """Raise ``ApiError`` (401, 403, 415) unless the request may be answered with the role
        ``needed`` (its route's); return the role the requester holds (None for a public route
        asked without credentials)."""
        origin = headers.get(b"origin")
        fetch_site = headers.get(b"sec-fetch-site", b"none").decode(errors="replace").lower()
        if origin is not None or fetch_site not in ("none", "same-origin"):
            shown = (
                origin.decode(errors="replace")[:100]
                if origin is not None
                else f"Sec-Fetch-Site: {fetch_site}"
            )
            raise ApiError(
                403,
                f"cross-site request refused ({shown!r}): the admin API answers ctl and scripts, never a "
                "web page",
            )
        host = headers.get(b"host", b"").decode(errors="replace")
        if not self.own_host(host):
            raise ApiError(
                403,
                f"Host {host[:100]!r} is not this admin API's address (port {self.port}); use its listen "
                "address, localhost, or add the name to [api] hosts in llmgw.toml",
            )
        if needed is None:
            try:  # a public route: whether the requester could read says what it is shown
                return self.role(headers, client)
            except ApiError:
                return None
        role = self.role(headers, client)
        if needed == ADMIN and role != ADMIN:
            raise ApiError(
                403,
                f"{method} {path[:200]} needs an admin token; this one may only read "
                "([api] admin_tokens in llmgw.toml)",
            )
        if needed == ADMIN and method not in ("GET", "HEAD"):
            ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if ctype != b"application/json":
                raise ApiError(
                    415,
                    f"a write needs Content-Type: application/json, got {ctype.decode(errors='replace')[:100]!r}",
                )
        return role

    def role(self, headers: dict[bytes, bytes], client: str | None) -> str:
        """The role the request's credentials give (``ApiError`` 401/403 when they give none)."""
        if not self.has_tokens:
            if client is None or not is_loopback(client):
                raise ApiError(
                    403,
                    "the admin API answers only this machine while no tokens are configured; set "
                    "[api] read_tokens / admin_tokens in llmgw.toml and use ctl with LLMGW_API_TOKEN "
                    "or --token-file",
                )
            return ADMIN
        return self._role(headers.get(b"authorization", b""))

    def _role(self, authorization: bytes) -> str:
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            raise ApiError(
                401,
                "this admin API wants a token: Authorization: Bearer TOKEN (ctl: LLMGW_API_TOKEN or "
                "--token-file)",
            )
        # Every token is compared, whatever matched: the time taken says nothing about which is close.
        admin = read = False
        for known in self.admin_tokens:
            admin |= hmac.compare_digest(known, token)
        for known in self.read_tokens:
            read |= hmac.compare_digest(known, token)
        if admin:
            return ADMIN
        if read:
            return READ
        raise ApiError(401, "unknown admin API token; check LLMGW_API_TOKEN or --token-file")


# -- the route table: each route's method, path, role, query parameters and handler ---------------

#: The largest log offset a follower may send (the wire's ``after`` is a uint64; a file is smaller).
MAX_LOG_OFFSET = (1 << 63) - 1


@attrs.frozen
class Param:
    """One query parameter a route takes: a whole number in ``low..high`` or a flag (``1``/``0``,
    ``true``/``false``, ``yes``/``no``; given bare, ``?force``, it means yes). ``default`` is what an
    absent one means (None: absent stays None)."""

    name: str
    flag: bool = False
    low: int = 0
    high: int = 0
    default: int | bool | None = None

    def parse(self, values: list[str]) -> int | bool | None:
        """The value, or ``ApiError`` 400 saying what was expected and what came."""
        if not values:
            return self.default
        if len(values) > 1:
            raise ApiError(400, f"query parameter {self.name} is given {len(values)} times; give it once")
        text = values[0]
        shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
        if self.flag:
            word = text.strip().lower()
            if word in ("", "1", "true", "yes"):
                return True
            if word in ("0", "false", "no"):
                return False
            raise ApiError(400, f"{self.name} must be 1 or 0 (true or false), got {shown}")
        # int() takes " 12", "1_000" and "+5": the API takes plain digits only.
        if not text.isascii() or not text.isdigit() or not self.low <= int(text) <= self.high:
            raise ApiError(
                400, f"{self.name} must be a whole number from {self.low} to {self.high}, got {shown}"
            )
        return int(text)


@attrs.frozen
class Request:
    """What a handler gets: the control plane's query interface, the path's parameters in order
    (``/api/nodes/{node}`` gives one), the checked query parameters, the role the requester holds
    (None on a public route asked without credentials), the request's body and headers, and the
    control plane's metrics registry."""

    query: ControlQuery
    args: tuple[str, ...]
    params: Mapping[str, int | bool | None]
    role: str | None
    receive: Receive
    headers: Mapping[bytes, bytes]
    metrics: FleetMetrics
    #: Whether the API has tokens configured (the page then shows its token form).
    tokens: bool = False

    async def json_body(self) -> Any:
        return await read_json_body(self.receive)


@attrs.frozen
class Raw:
    """An answer that is not JSON (the page, the metrics): its bytes, content type and headers."""

    data: bytes
    content_type: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


Handler = Callable[[Request], Awaitable[Any]]


@attrs.frozen
class Route:
    """One route: ``path`` is the URL path with ``{name}`` for a segment that is a parameter;
    ``role`` is what the requester needs (``READ``, ``ADMIN``, or None for the two public routes:
    ``/healthz`` says only that the process answers, and ``/`` holds fleet data only for a request
    that may read: ``control.page``). Every route is checked by ``ApiGuard`` with its own role, so
    a new route cannot skip authentication."""

    method: str
    path: str
    role: str | None
    handler: Handler
    params: tuple[Param, ...] = ()

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(p for p in self.path.split("/") if p)

    def match(self, parts: list[str]) -> tuple[str, ...] | None:
        """The path's parameters when ``parts`` is this route's path, else None."""
        mine = self.segments
        if len(mine) != len(parts):
            return None
        args = []
        for want, got in zip(mine, parts, strict=True):
            if want.startswith("{"):
                args.append(got)
            elif want != got:
                return None
        return tuple(args)

    def parse_params(self, given: Mapping[str, list[str]]) -> dict[str, int | bool | None]:
        """Every query parameter checked: one this route does not take is 400 naming those it does."""
        known = {p.name: p for p in self.params}
        for name in given:
            if name not in known:
                takes = ", ".join(known) if known else "none"
                raise ApiError(
                    400,
                    f"{self.method} {self.path} takes no query parameter {name[:40]!r} (it takes: {takes})",
                )
        return {p.name: p.parse(given.get(p.name, [])) for p in self.params}


async def _healthz(req: Request) -> Any:
    return {"ok": True}


async def _page(req: Request) -> Raw:
    # The fleet's data only for a request that may read it (see control.page).
    shown = await _fleet_html(req.query.view()) if req.role is not None else None
    return Raw(page.page_html(shown, tokens=req.tokens), page.CONTENT_TYPE, tuple(page.HEADERS))


async def _fleet(req: Request) -> Raw:
    return Raw((await _fleet_html(req.query.view())).encode(), page.CONTENT_TYPE, tuple(page.HEADERS))


async def _metrics(req: Request) -> Raw:
    accept = req.headers.get(b"accept", b"").decode(errors="replace")
    data, ctype = await req.metrics.scrape(req.query.view(), accept)
    return Raw(data, ctype.encode())


async def _nodes(req: Request) -> Any:
    return nodes_doc(req.query.view())


async def _node(req: Request) -> Any:
    return node_doc(req.query.view(), req.args[0])


async def _replicas(req: Request) -> Any:
    return replicas_doc(req.query.view())


async def _models(req: Request) -> Any:
    return models_doc(req.query.view())


async def _model(req: Request) -> Any:
    return model_doc(req.query.view(), req.args[0])


async def _apply(req: Request) -> Any:
    return await apply_models(req.query, await req.json_body())


async def _scale(req: Request) -> Any:
    return await scale_model(req.query, req.args[0], await req.json_body())


async def _delete(req: Request) -> Any:
    return await delete_model(req.query, req.args[0])


async def _why(req: Request) -> Any:
    return why_doc(req.query.view(), req.args[0])


async def _logs(req: Request) -> Any:
    after = req.params["after"]
    return await logs_doc(
        req.query,
        req.args[0],
        int(req.params["lines"] or 0),
        previous=bool(req.params["previous"]),
        after=None if after is None else int(after),
    )


async def _drain(req: Request) -> Any:
    node_id, force = req.args[0], bool(req.params["force"])
    try:
        moves = await req.query.drain(node_id, force=force)
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0])) from exc
    except DrainRefused as exc:
        raise ApiError(409, str(exc)) from exc
    return {"node_id": node_id, "draining": True, "forced": force, "moves": moves}


async def _drain_progress(req: Request) -> Any:
    return drain_doc(req.query.view(), req.args[0])


async def _cordon(req: Request) -> Any:
    try:
        mark = await req.query.cordon(req.args[0])
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0])) from exc
    return {"node_id": req.args[0], "cordon": mark.value}


async def _uncordon(req: Request) -> Any:
    try:
        undone = await req.query.uncordon(req.args[0])
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0])) from exc
    return {"node_id": req.args[0], "undone": undone.value if undone else ""}


async def _token(req: Request) -> Any:
    joins = req.query.joins()
    if joins is None:
        raise ApiError(503, "the join token is not loaded yet; try again in a moment")
    return {"token": joins.join_token(), "file": str(joins.token_path)}


async def _reset(req: Request) -> Any:
    joins = req.query.joins()
    if joins is None:
        raise ApiError(503, "the node credentials are not loaded yet; try again in a moment")
    node_id = req.args[0]
    forgotten = await joins.reset(node_id)
    if forgotten:
        log.info("node %r: credential forgotten by an admin; it joins again with the join token", node_id)
    # A lost node goes from the fleet too, with what it last reported (kubectl's delete node):
    # nothing can reach its engines, the operator says they are gone.
    removed = await req.query.forget_lost(node_id)
    return {"node_id": node_id, "forgotten": forgotten, "removed": removed}


_FLAG = functools.partial(Param, flag=True, default=False)

#: Every route of the admin API (the module docstring says what each answers). Reads need ``READ``,
#: writes ``ADMIN``, and so does ``GET /api/token``: it hands out a secret.
ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", None, _healthz),
    Route("GET", "/", None, _page),
    Route("GET", "/fleet", READ, _fleet),
    Route("GET", "/metrics", READ, _metrics),
    Route("GET", "/api/nodes", READ, _nodes),
    Route("GET", "/api/nodes/{node}", READ, _node),
    Route("GET", "/api/replicas", READ, _replicas),
    Route("GET", "/api/models", READ, _models),
    Route("POST", "/api/models", ADMIN, _apply),
    Route("GET", "/api/models/{model}", READ, _model),
    Route("DELETE", "/api/models/{model}", ADMIN, _delete),
    Route("PUT", "/api/models/{model}/replicas", ADMIN, _scale),
    Route("POST", "/api/models/{model}/scale", ADMIN, _scale),
    Route("GET", "/api/why/{model}", READ, _why),
    Route(
        "GET",
        "/api/logs/{shard}",
        READ,
        _logs,
        (
            Param("lines", low=1, high=schema.MAX_LOG_LINES, default=100),
            _FLAG("previous"),
            Param("after", low=0, high=MAX_LOG_OFFSET),
        ),
    ),
    Route("POST", "/api/drain/{node}", ADMIN, _drain, (_FLAG("force"),)),
    Route("GET", "/api/drain/{node}", READ, _drain_progress),
    Route("POST", "/api/cordon/{node}", ADMIN, _cordon),
    Route("POST", "/api/uncordon/{node}", ADMIN, _uncordon),
    Route("GET", "/api/token", ADMIN, _token),
    Route("POST", "/api/reset/{node}", ADMIN, _reset),
)


def find_route(routes: Sequence[Route], method: str, parts: list[str]) -> tuple[Route, tuple[str, ...]]:
    """The route for ``method`` and the path ``parts``, with the path's parameters (every GET route
    answers HEAD too); ``ApiError`` 404 when no route has the path, 405 (with the methods it has)
    when none has the method."""
    allowed: list[str] = []
    for route in routes:
        args = route.match(parts)
        if args is None:
            continue
        # HEAD is GET without the body (a load balancer's health check sends it).
        if route.method == method or (route.method == "GET" and method == "HEAD"):
            return route, args
        allowed += ["GET", "HEAD"] if route.method == "GET" else [route.method]
    path = "/" + "/".join(parts)
    if allowed:
        raise MethodNotAllowed(allowed, f"{method[:20]} {path[:200]}: this path takes {', '.join(allowed)}")
    raise ApiError(404, f"no route {method[:20]} {path[:200]}")


class MethodNotAllowed(ApiError):
    """405: the path exists, with other methods (sent in ``Allow``)."""

    def __init__(self, allowed: list[str], message: str) -> None:
        super().__init__(405, message)
        self.allowed = allowed


def make_app(
    query: ControlQuery, guard: ApiGuard, metrics: FleetMetrics | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The admin API as an ASGI app over ``query``; ``guard`` decides who may ask (``serve_api``
    builds it from the config and sets its port once bound); ``metrics`` is the control plane's
    registry for ``/metrics`` (without one, the fleet's gauges and the process metrics only).

    A request is matched against ``ROUTES`` (404 for no such path, 405 with ``Allow`` for a path
    with other methods), checked by the guard with its route's role (a path that matches nothing
    needs the read role before it is told so, a write the admin role), its query parameters
    checked (400 naming the one that is wrong), then answered by the route's handler."""
    fleet_metrics = metrics if metrics is not None else FleetMetrics()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], unquote(scope["path"])
        parts = [p for p in path.split("/") if p]
        status: int = 200
        body: Any = None
        extra: list[tuple[bytes, bytes]] = []
        #: An answer that is not JSON (the page, the metrics).
        raw: Raw | None = None
        try:
            client_addr = scope.get("client")
            client = client_addr[0] if client_addr else None
            headers: dict[bytes, bytes] = dict(scope.get("headers", ()))
            try:
                route, args = find_route(ROUTES, method, parts)
            except ApiError:
                # Told only to whoever may ask: a read needs the read role, a write the admin role.
                guard.check(method, path, READ if method in ("GET", "HEAD") else ADMIN, headers, client)
                raise
            role = guard.check(method, path, route.role, headers, client)
            query_string = scope.get("query_string", b"").decode(errors="replace")
            params = route.parse_params(parse_qs(query_string, keep_blank_values=True))
            request = Request(query, args, params, role, receive, headers, fleet_metrics, guard.has_tokens)
            answer = await route.handler(request)
            if isinstance(answer, Raw):
                raw = answer
                extra.extend(answer.headers)
            else:
                body = answer
        except ApiError as exc:
            status, body = exc.status, {"error": str(exc)}
            if exc.status == 401:
                extra.append((b"www-authenticate", b'Bearer realm="llmgw admin API"'))
            if isinstance(exc, MethodNotAllowed):
                extra.append((b"allow", ", ".join(exc.allowed).encode()))
        except ValueError as exc:
            status, body = 400, {"error": str(exc)}
        except Exception as exc:
            log.exception("admin API: %s %s failed", method, path)
            status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        if raw is not None and status == 200:
            data, content_type = raw.data, raw.content_type
        else:
            data, content_type = json.dumps(body, indent=2).encode() + b"\n", b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(data)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else data})

    return app


async def serve_api(
    query: ControlQuery,
    api: AdminApi,
    host: str,
    port: int,
    *,
    metrics: FleetMetrics | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API; reports the bound port. With ``[api.tls]`` it is HTTPS, and with its
    ``client_ca`` and ``require_client_cert`` every client needs a certificate from that CA (the same
    settings, and the same checks, as the agent port's ``[tls]``)."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.h2_max_concurrent_streams = 0
    if api.tls is not None:
        # Built once here so that a bad certificate or CA fails at start, naming the file.
        api.tls.context()
        config.certfile = str(api.tls.cert)
        config.keyfile = str(api.tls.key)
        if api.tls.client_ca is not None:
            config.ca_certs = str(api.tls.client_ca)
            config.verify_mode = ssl.CERT_REQUIRED if api.tls.require_client_cert else ssl.CERT_OPTIONAL
    guard = ApiGuard.from_config(api, host, 0, tls=api.tls is not None)
    if not guard.has_tokens:
        log.warning(
            "admin API: no tokens in [api] (read_tokens, admin_tokens): it answers only clients on "
            "this machine%s; set tokens to use ctl from elsewhere",
            "" if is_loopback(host) or host == "localhost" else f" although it listens on {host}",
        )
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(serve, make_app(query, guard, metrics), config)
        guard.port = int(urls[0].rsplit(":", 1)[1])
        task_status.started(guard.port)
