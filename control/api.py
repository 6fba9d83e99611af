"""The admin HTTP JSON API that ``ctl`` speaks: nodes, replicas, why, logs, drain.

A small ASGI app served by hypercorn over HTTP/1.1 on the admin address (never on the agent port: the
agent port's HTTP/2 is ours, for the reasons in ``control.transport``). Times are reported as
"seconds ago" on the control plane's monotonic clock, the only clock liveness is judged on.

    GET  /api/nodes                 every node: state, why, GPUs (free/total), fabrics, shards,
                                    engines (each one's version, or why it is unknown)
    GET  /api/replicas              every placed replica and its shards' observed states
    GET  /api/why/MODEL             placed and unplaced replicas of MODEL, with the reasons
    GET  /api/logs/SHARD?lines=N    the tail of the shard's engine log, fetched from its agent
    POST /api/cordon/NODE           NODE takes no new replicas; what runs there stays
    POST /api/drain/NODE[?force=1]  cordon NODE and move its replicas (replacements first); 409 with
                                    the reason when a model would be left without a ready replica
    GET  /api/drain/NODE            what still runs on NODE, and where each replacement stands
    POST /api/uncordon/NODE         undo a cordon or a drain (replicas already moved stay moved)

Cordons and drains are written to the state file before the answer, so they survive a restart.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, unquote

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

import schema
from control.fleet import LIVE_SHARD_STATES
from control.plane import ControlPlane, DrainRefused, engine_views, model_name_of

log = logging.getLogger("llmgw.control.api")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def nodes_doc(plane: ControlPlane) -> list[dict[str, Any]]:
    now = plane.clock()
    used: dict[str, set[int]] = {}
    for replica in plane.placements:
        for shard in replica.shards:
            used.setdefault(shard.node_id, set()).update(shard.gpu_indices)
    out = []
    for node in sorted(plane.fleet.nodes.values(), key=lambda n: n.node_id):
        reg = node.register
        last = node.history[-1] if node.history else None
        out.append(
            {
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
                    {"engine": name, "version": e.version, "error": e.error}
                    for name, e in engine_views(reg).items()
                ],
                "discovery_error": reg.discovery_error,
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
        )
    return out


#: Where a shard runs: (GPUs, port, node rank, nnodes, master address, master port).
_Shape = tuple[tuple[int, ...], int, int, int, str, int]


def _shard_doc(
    plane: ControlPlane,
    shard_id: str,
    node_id: str,
    status: schema.ShardStatus | None,
    now: float,
    shape: _Shape,
    placed: bool,
) -> dict[str, Any]:
    gpus, port, node_rank, nnodes, master_addr, master_port = shape
    node = plane.fleet.nodes.get(node_id)
    retry = plane.reconciler.retry_at(node_id, shard_id) if placed else None
    state = schema.ShardState(status.state).name.lower() if status else "pending"
    if not placed and state == "ready":
        state = "draining"  # serving until its replacement is ready, then drained or stopped
    return {
        "shard_id": shard_id,
        "node_id": node_id,
        "node_state": node.state.value if node else "unknown",
        "state": state,
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
        "failures": plane.reconciler.failures(node_id, shard_id) if placed else 0,
        "retry_in_s": round(max(retry - now, 0.0), 1) if retry else None,
    }


def replicas_doc(plane: ControlPlane) -> list[dict[str, Any]]:
    """Every placed replica with its shards, and the engines still running for a replica that no
    placement accounts for (old copies being drained or waiting for their replacement) after them."""
    now = plane.clock()
    placed_keys = {(s.node_id, s.shard_id) for r in plane.placements for s in r.shards}
    leaving: dict[str, list[dict[str, Any]]] = {}
    for node in sorted(plane.fleet.nodes.values(), key=lambda n: n.node_id):
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
                _shard_doc(plane, status.shard_id, node.node_id, status, now, shape, placed=False)
            )
    out = []
    replica_ids = [r.replica_id for r in plane.placements]
    by_id = {r.replica_id: r for r in plane.placements}
    for rid in [*replica_ids, *sorted(set(leaving) - set(replica_ids))]:
        replica = by_id.get(rid)
        shards = []
        for shard in replica.shards if replica else ():
            holder = plane.fleet.nodes.get(shard.node_id)
            observed = holder.shards.get(shard.shard_id) if holder else None
            shape = (
                shard.gpu_indices,
                shard.port,
                shard.node_rank,
                shard.nnodes,
                shard.master_addr,
                shard.master_port,
            )
            shards.append(_shard_doc(plane, shard.shard_id, shard.node_id, observed, now, shape, placed=True))
        model = replica.model if replica else model_name_of(rid)
        if replica is None:
            state = "draining"
        else:
            state = "ready" if all(s["state"] == "ready" for s in shards) else "not ready"
        out.append(
            {
                "model": model,
                "replica_id": rid,
                "served_model_name": plane.models[model].served_name if model in plane.models else "",
                "fabric": replica.fabric if replica else "",
                "state": state,
                "shards": shards + leaving.get(rid, []),
            }
        )
    return out


def why_doc(plane: ControlPlane, model: str) -> dict[str, Any]:
    if model not in plane.models:
        raise ApiError(
            404, f"no model {model!r} in the catalog; models: {', '.join(sorted(plane.models)) or 'none'}"
        )
    cfg = plane.models[model]
    placed = [r for r in replicas_doc(plane) if r["model"] == model]
    unplaced = [
        {"replica_id": u.replica_id, "reason": u.reason, "per_node": dict(u.per_node)}
        for u in plane.plan.unplaced
        if u.model == model
    ]
    return {"model": model, "replicas_wanted": cfg.replicas, "placed": placed, "unplaced": unplaced}


async def logs_doc(plane: ControlPlane, shard_id: str, lines: int) -> dict[str, Any]:
    # Nodes that report the shard first, then those it is placed on; each asked once.
    holders = [n.node_id for n in plane.fleet.nodes.values() if shard_id in n.shards]
    holders += [s.node_id for r in plane.placements for s in r.shards if s.shard_id == shard_id]
    holders = list(dict.fromkeys(holders))
    if not holders:
        raise ApiError(404, f"no shard {shard_id!r} is placed or reported on any node")
    errors = []
    for node_id in holders:
        try:
            reply = await plane.agents.request_logs(node_id, shard_id, lines)
        except LookupError as exc:
            errors.append(str(exc))
            continue
        if reply.error:
            errors.append(reply.error)
            continue
        return {"shard_id": shard_id, "node_id": node_id, "lines": list(reply.lines)}
    raise ApiError(503, f"logs of {shard_id} unavailable: {'; '.join(errors)}")


def make_app(plane: ControlPlane) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
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
        query = parse_qs(scope.get("query_string", b"").decode())
        parts = [p for p in path.split("/") if p]
        status: int = 200
        body: Any = None
        try:
            if parts == ["healthz"]:
                body = {"ok": True}
            elif method == "GET" and parts == ["api", "nodes"]:
                body = nodes_doc(plane)
            elif method == "GET" and parts == ["api", "replicas"]:
                body = replicas_doc(plane)
            elif method == "GET" and len(parts) == 3 and parts[:2] == ["api", "why"]:
                body = why_doc(plane, parts[2])
            elif method == "GET" and len(parts) == 3 and parts[:2] == ["api", "logs"]:
                lines = int(query.get("lines", ["100"])[0])
                body = await logs_doc(plane, parts[2], lines)
            elif method == "POST" and len(parts) == 3 and parts[:2] == ["api", "drain"]:
                force = query.get("force", ["0"])[0] in ("1", "true", "yes")
                try:
                    moves = await plane.drain_node(parts[2], force=force)
                except KeyError as exc:
                    raise ApiError(404, str(exc.args[0])) from exc
                except DrainRefused as exc:
                    raise ApiError(409, str(exc)) from exc
                body = {"node_id": parts[2], "draining": True, "forced": force, "moves": moves}
            elif method == "GET" and len(parts) == 3 and parts[:2] == ["api", "drain"]:
                try:
                    body = plane.drain_progress(parts[2])
                except KeyError as exc:
                    raise ApiError(404, str(exc.args[0])) from exc
            elif method == "POST" and len(parts) == 3 and parts[:2] == ["api", "cordon"]:
                try:
                    await plane.cordon_node(parts[2])
                except KeyError as exc:
                    raise ApiError(404, str(exc.args[0])) from exc
                body = {"node_id": parts[2], "cordon": plane.fleet.cordons[parts[2]].value}
            elif method == "POST" and len(parts) == 3 and parts[:2] == ["api", "uncordon"]:
                try:
                    undone = await plane.uncordon_node(parts[2])
                except KeyError as exc:
                    raise ApiError(404, str(exc.args[0])) from exc
                body = {"node_id": parts[2], "undone": undone.value if undone else ""}
            else:
                raise ApiError(404, f"no route {method} {path}")
        except ApiError as exc:
            status, body = exc.status, {"error": str(exc)}
        except ValueError as exc:
            status, body = 400, {"error": str(exc)}
        except Exception as exc:
            log.exception("admin API: %s %s failed", method, path)
            status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        data = json.dumps(body, indent=2).encode() + b"\n"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return app


async def serve_api(
    plane: ControlPlane, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the admin API; reports the bound port."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.h2_max_concurrent_streams = 0
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(serve, make_app(plane), config)
        task_status.started(int(urls[0].rsplit(":", 1)[1]))
