"""``describe node NAME`` and ``describe model NAME``: one object in detail, kubectl describe's way
(fields, then its shards, then its recent events)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from control.ctl.base import Api, CtlFailed, Verb
from control.ctl.get import model_source, node_state
from control.ctl.text import age, indented, load_words, table
from control.notfound import unknown_model, unknown_node


def describe_node(node: dict[str, Any]) -> str:
    """kubectl describe's layout: fields, then shards, then events (the node's recent events, or
    its state history from a control plane that keeps no event log)."""
    node_id = node["node_id"]
    replicas = node["replicas"]
    out = [
        f"Name:          {node['node_id']}",
        f"State:         {node_state(node)} for {age(node['since_s'])}",
        f"Reason:        {node['reason'] or '-'}",
        f"Connected:     {'yes' if node['connected'] else 'no'} (last heartbeat {node['heartbeat_age_s']:g}s ago)",
        f"Address:       {node['mgmt_addr'] or '-'}",
        f"Auth:          {node.get('auth') or '-'}",
        f"GPUs:          {node['gpus'] - node['gpus_free']}/{node['gpus']} in use ({node['gpu_model'] or 'no GPUs'})",
        f"Fabrics:       {', '.join(node['fabrics']) or '-'}",
        f"Labels:        {', '.join(f'{k}={v}' for k, v in sorted(node['labels'].items())) or '-'}",
        "Engines:",
    ]
    for e in node.get("engines", []) or []:
        out.append(
            f"  {e['engine']:<10} {e['version'] or '?'}{('  (' + e['error'] + ')') if e['error'] else ''}"
        )
    if node.get("discovery_error"):
        out.append(f"Discovery:     {node['discovery_error']}")
    out += gpu_devices_section(node.get("gpu_devices", []))
    shards = [(r, s) for r in replicas for s in r["shards"] if s["node_id"] == node_id]
    out.append("Shards:" if shards else "Shards:        none")
    if shards:
        rows = [
            [
                s["shard_id"],
                r["model"],
                s["state"] + ("" if s["placed"] else " (leaving)"),
                ",".join(map(str, s["gpus"])) or "-",
                str(s["pid"] or "-"),
                str(s["port"] or "-"),
                s["error"] or "-",
            ]
            for r, s in shards
        ]
        header = ["SHARD", "MODEL", "STATE", "GPUS", "PID", "PORT", "ERROR"]
        out += indented(table(rows, header))
    if "events" in node:
        out += events_section(node["events"])
        return "\n".join(out)
    out.append("Events:" if node["history"] else "Events:        none")
    if node["history"]:
        rows = [
            [f"{age(h['at_s_ago'])} ago", h["from"] or "-", h["to"], h["reason"] or "-"]
            for h in node["history"]  # oldest first, as the event log's
        ]
        out += indented(table(rows, ["WHEN", "FROM", "TO", "REASON"]))
    return "\n".join(out)


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f}"


def gpu_devices_section(devices: list[dict[str, Any]]) -> list[str]:
    """Each GPU with memory used/total and utilization as of the node's latest heartbeat, its NVLink
    peers and the shards placed on it (a node without GPUs shows none)."""
    if not devices:
        return []
    rows = [
        [
            str(d["index"]),
            d["name"] or "-",
            f"{_gib(d['memory_used_mib'])}/{_gib(d['memory_total_mib'])} GiB",
            f"{d['utilization_percent']}%",
            ",".join(map(str, d["nvlink_peers"])) or "-",
            d["pci_bus_id"] or "-",
            ",".join(d["shards"]) or "-",
        ]
        for d in devices
    ]
    header = ["GPU", "NAME", "MEMORY", "UTIL", "NVLINK", "BUS", "SHARDS"]
    return ["GPU devices:", *indented(table(rows, header))]


def events_section(events: list[dict[str, Any]]) -> list[str]:
    """kubectl's Events: newest last, each with its age, what it is about, the change and why."""
    if not events:
        return ["Events:        none"]
    rows = [
        [
            f"{age(e['at_s_ago'])} ago",
            e["kind"],
            e["shard_id"] or e["node_id"],
            f"{e['from'] or '-'} -> {e['to'] or '-'}" if e["from"] else e["to"] or "-",
            e["reason"] or "-",
        ]
        for e in events
    ]
    return [
        "Events:",
        *indented(table(rows, ["WHEN", "KIND", "OBJECT", "CHANGE", "REASON"])),
    ]


def describe_model(model: dict[str, Any]) -> str:
    """A model: its wanted/placed/ready counts, each replica's shards, why any cannot run, and its
    shards' recent events (when the control plane keeps them)."""
    why = model
    out = [
        f"Name:          {model['model']}",
        f"Served as:     {model['served_model_name']}",
        f"Engine:        {model['engine']}",
        f"Replicas:      {model['replicas_ready']} ready, {model['replicas_placed']} placed, "
        f"{model['replicas_wanted']} wanted",
        f"Per replica:   {model['nodes_per_replica']} node(s), {model['gpus_per_shard']} GPU(s) each",
    ]
    if model.get("generation"):
        deleting = "; deleting: its engines drain and stop, then it is gone" if model.get("deleting") else ""
        out.append(f"Generation:    {model['generation']} (source {model_source(model)}){deleting}")
    if rollout := model.get("rollout"):
        out.append(
            f"Rollout:       {rollout['state']}, revision {rollout['revision']}: "
            f"{rollout['updated_ready_replicas']}/{rollout['replicas']} updated and ready, "
            f"{rollout['old_replicas']} old" + (f"; {rollout['reason']}" if rollout.get("reason") else "")
        )
    out += [
        "Placed:" if why["placed"] else "Placed:        none",
    ]
    for r in why["placed"]:
        out.append(f"  {r['replica_id']}  {r['state']}  {load_words(r.get('load'))}")
        for s in r["shards"]:
            where = f"{s['node_id']} GPUs {','.join(map(str, s['gpus'])) or '-'}"
            pid = f" pid {s['pid']}" if s.get("pid") else ""
            out.append(f"    {s['shard_id']}  {s['state']}  on {where}{pid}  {s['url'] or ''}".rstrip())
            if s.get("error"):
                retry = f"; retry in {s['retry_in_s']:g}s" if s.get("retry_in_s") else ""
                out.append(f"      error: {s['error']}{retry} (failures: {s['failures']})")
            for line in s.get("output_tail", [])[-5:] if s["state"] == "failed" else []:
                out.append(f"      | {line}")
    if why["unplaced"]:
        out.append("Cannot run:")
        for u in why["unplaced"]:
            out.append(f"  {u['replica_id']}: {u['reason']}")
            for node, reason in sorted(u["per_node"].items()):
                out.append(f"    {node}: {reason}")
    if "events" in model:
        out += events_section(model["events"])
    else:
        out.append("Events:        <this control plane keeps no event log; shard states above are current>")
    return "\n".join(out)


def run(api: Api, args: argparse.Namespace) -> int:
    """``describe``: from ``GET /api/nodes/NODE`` or ``/api/models/MODEL`` (the object with its
    recent events), or, from a control plane that serves neither, built from the list documents
    (a node's own state history then stands in for its events; a model has none)."""
    if args.kind.startswith("node"):
        node = api.get_if_served(f"/api/nodes/{args.name}")
        if node is None:
            nodes, replicas = api.get("/api/nodes"), api.get("/api/replicas")
            node = next((n for n in nodes if n["node_id"] == args.name), None)
            if node is None:
                known = [n["node_id"] for n in nodes]
                raise CtlFailed(f"ctl: describe node: {unknown_node(args.name, known)}")
            node = {
                **node,
                "replicas": [r for r in replicas if any(s["node_id"] == args.name for s in r["shards"])],
            }
        print(json.dumps(node, indent=2) if args.output == "json" else describe_node(node), flush=True)
        return 0
    doc = api.get_if_served(f"/api/models/{args.name}") or api.get(f"/api/why/{args.name}")
    models = api.get("/api/models")
    counts = next((m for m in models if m["model"] == args.name), None)
    if counts is None:
        known = [m["model"] for m in models]
        raise CtlFailed(f"ctl: describe model: {unknown_model(args.name, known)}")
    model = {**counts, **doc}
    print(json.dumps(model, indent=2) if args.output == "json" else describe_model(model), flush=True)
    return 0


def _arguments(describe: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    describe.add_argument(
        "kind", choices=("node", "nodes", "model", "models"), metavar="KIND", help="node or model"
    )
    describe.add_argument("name", help="the node id or model name")
    return []


DESCRIBE = Verb(
    "describe",
    "one node or model in detail: state, history, shards, reasons",
    run,
    _arguments,
    "Show one node (state and why, GPUs, fabrics, engines, its shards, its state history) or one "
    "model (replicas wanted/placed/ready, each shard's state, node and pid, errors with the "
    "engine's last words, and why replicas that cannot run cannot).",
)
