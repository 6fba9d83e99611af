"""``get KIND [NAME] [-w]``: nodes, replicas or models as kubectl lists pods: columns with a header,
more with ``-o wide``, ``KIND/NAME`` lines with ``-o name``, the API's JSON with ``-o json``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from control.ctl.base import POLL_SECONDS, Api, CtlFailed, Verb
from control.ctl.text import LOAD_HEADER, age, load_cells, table
from control.notfound import unknown, unknown_model, unknown_node

#: Keys of the API's documents that change with every read (ages and countdowns): a watch ignores
#: them when deciding whether anything changed, or it would reprint every second.
VOLATILE_KEYS = frozenset({"since_s", "heartbeat_age_s", "at_s_ago", "retry_in_s", "age_s"})

#: ``get`` and ``describe`` kinds, with the singular and short names kubectl users type.
KINDS = {
    "nodes": "nodes",
    "node": "nodes",
    "no": "nodes",
    "replicas": "replicas",
    "replica": "replicas",
    "models": "models",
    "model": "models",
}


def node_state(n: dict[str, Any]) -> str:
    """A node's state with its operator mark: ``ready,draining``, ``ready,cordoned``."""
    return str(n["state"]) + (",draining" if n["draining"] else ",cordoned" if n.get("cordoned") else "")


def _engine_versions(n: dict[str, Any]) -> str:
    found = [f"{e['engine']}={e['version']}" for e in n.get("engines", []) if e.get("version")]
    return ",".join(found) or "-"


def node_rows(docs: dict[str, Any], wide: bool) -> tuple[list[str], list[list[str]], set[int]]:
    """``get nodes``: header, rows, and the columns that change by themselves (ages)."""
    header = ["NAME", "STATUS", "GPUS", "SHARDS", "AGE"]
    if wide:
        header += ["GPU", "FABRICS", "ADDRESS", "AUTH", "ENGINES", "REASON"]
    rows = []
    for n in docs["nodes"]:
        row = [
            n["node_id"],
            node_state(n),
            f"{n['gpus'] - n['gpus_free']}/{n['gpus']}",
            str(len(n["shards"])),
            age(n["since_s"]),
        ]
        if wide:
            reason = n["reason"] + (f"; discovery: {n['discovery_error']}" if n["discovery_error"] else "")
            row += [
                n["gpu_model"] or "-",
                ",".join(n["fabrics"]) or "-",
                n["mgmt_addr"] or "-",
                n.get("auth") or "-",
                _engine_versions(n),
                reason or "-",
            ]
        rows.append(row)
    return header, rows, {4}


def replica_rows(docs: dict[str, Any], wide: bool) -> tuple[list[str], list[list[str]], set[int]]:
    """``get replicas``: one row per replica (its shards ready/total); wide adds where and what runs."""
    header = ["NAME", "MODEL", "STATUS", "READY", "NODES"]
    if wide:
        header += ["GPUS", "PIDS", "ENGINE", "VERSION", "PORTS", *LOAD_HEADER]
    engines = {m["model"]: m.get("engine", "") for m in docs.get("models", [])}
    versions = {
        n["node_id"]: {e["engine"]: e.get("version", "") for e in n.get("engines", [])}
        for n in docs.get("nodes", [])
    }
    rows = []
    for r in docs["replicas"]:
        shards = r["shards"]
        ready = sum(1 for s in shards if s["state"] == "ready")
        nodes = ",".join(dict.fromkeys(s["node_id"] for s in shards)) or "-"
        row = [r["replica_id"], r["model"], r["state"].replace(" ", "-"), f"{ready}/{len(shards)}", nodes]
        if wide:
            engine = engines.get(r["model"], "") or "-"
            found = {versions.get(s["node_id"], {}).get(engine, "") for s in shards} - {""}
            row += [
                ";".join(f"{s['node_id']}:{','.join(map(str, s['gpus'])) or '-'}" for s in shards) or "-",
                ",".join(str(s["pid"]) for s in shards if s.get("pid")) or "-",
                engine,
                ",".join(sorted(found)) or "-",
                ",".join(str(s["port"]) for s in shards if s.get("port")) or "-",
                *load_cells(r.get("load")),
            ]
        rows.append(row)
    return header, rows, set()


def model_rows(docs: dict[str, Any], wide: bool) -> tuple[list[str], list[list[str]], set[int]]:
    """``get models``: per model, replicas wanted, placed and ready (kubectl's READY is ready/wanted)."""
    header = ["NAME", "READY", "PLACED", "WANTED"]
    if wide:
        header += [
            "ENGINE",
            "SERVED-AS",
            "GPUS/SHARD",
            "NODES/REPLICA",
            "GENERATION",
            "SOURCE",
            "REVISION",
            "ROLLOUT",
            "REASON",
        ]
    rows = []
    for m in docs["models"]:
        row = [
            m["model"],
            f"{m['replicas_ready']}/{m['replicas_wanted']}",
            str(m["replicas_placed"]),
            str(m["replicas_wanted"]),
        ]
        if wide:
            row += [
                m["engine"],
                m["served_model_name"],
                str(m["gpus_per_shard"]),
                str(m["nodes_per_replica"]),
                str(m.get("generation") or "-"),
                model_source(m),
                m.get("revision") or "-",
                m.get("rollout") or "-",
                "deleting: its engines drain and stop"
                if m.get("deleting")
                else (m["unplaced"][0] if m["unplaced"] else "-"),
            ]
        rows.append(row)
    return header, rows, set()


def model_source(m: dict[str, Any]) -> str:
    """Where the definition in force came from (``file``, ``api``), and ``api (in file)`` when a
    model the file defines was changed by ctl since (the file wins again when its definition changes)."""
    source = str(m.get("source") or "-")
    return f"{source} (in file)" if source == "api" and m.get("in_file") else source


#: Per kind: the API documents it needs (wide needs more, to join engines and versions), the row
#: builder, the name of each object for ``-o name`` and ``get KIND NAME``, and what an unknown
#: name is told (the known ones named).
GET_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Callable[..., Any], str, Callable[..., str]]] = {
    "nodes": (("nodes",), ("nodes",), node_rows, "node_id", unknown_node),
    "replicas": (
        ("replicas",),
        ("replicas", "models", "nodes"),
        replica_rows,
        "replica_id",
        lambda name, known: unknown("replica", name, known),
    ),
    "models": (("models",), ("models",), model_rows, "model", unknown_model),
}


def _singular(kind: str) -> str:
    return kind[:-1]


def render_get(kind: str, docs: dict[str, Any], output: str | None) -> tuple[str, str]:
    """What ``get KIND`` prints, and the same with the self-changing parts blanked (what a watch
    compares to decide whether to print again)."""
    _, _, rows_of, key, _ = GET_KINDS[kind]
    if output == "json":
        doc = docs[kind]
        return json.dumps(doc, indent=2), json.dumps(_stable(doc), sort_keys=True)
    if output == "name":
        text = "\n".join(f"{_singular(kind)}/{item[key]}" for item in docs[kind])
        return text, text
    header, rows, volatile = rows_of(docs, output == "wide")
    stable = [[("" if i in volatile else c) for i, c in enumerate(r)] for r in rows]
    if not rows:
        text = f"No {kind} found."
        return text, text
    return table(rows, header), json.dumps(stable)


def _stable(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if k not in VOLATILE_KEYS}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


def _fetch(api: Api, kind: str, output: str | None, name: str | None) -> dict[str, Any]:
    basic, wide, _, key, not_found = GET_KINDS[kind]
    docs = {doc: api.get(f"/api/{doc}") for doc in (wide if output == "wide" else basic)}
    if name is not None:
        known = [item[key] for item in docs[kind]]
        docs[kind] = [item for item in docs[kind] if item[key] == name]
        if not docs[kind]:
            raise CtlFailed(f"ctl: get {kind}: {not_found(name, known)}")
    return docs


def run(api: Api, args: argparse.Namespace) -> int:
    kind = KINDS[args.kind]
    text, stable = render_get(kind, _fetch(api, kind, args.output, args.name), args.output)
    print(text, flush=True)
    if not args.watch:
        return 0
    # kubectl's watch: print again only when what is shown changed (ages aside).
    last = stable
    while True:
        time.sleep(POLL_SECONDS)
        text, stable = render_get(kind, _fetch(api, kind, args.output, args.name), args.output)
        if stable != last:
            print(("" if args.output in ("json", "name") else "\n") + text, flush=True)
            last = stable


def _arguments(get: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    get.add_argument("kind", choices=sorted(KINDS), metavar="KIND", help="nodes, replicas or models")
    get.add_argument("name", nargs="?", help="only this one (by node, replica or model name)")
    get.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="after the list, poll every second and print it again when a row changes; Ctrl-C ends (exit 0)",
    )
    return []


GET = Verb(
    "get",
    "list nodes, replicas or models as columns (-o wide for more, -w to watch)",
    run,
    _arguments,
    "List nodes, replicas or models.\n\n"
    "  nodes     each node: state, GPUs in use/total, shards, age of its state\n"
    "            (-o wide: GPU model, fabrics, address, auth, engine versions, reason)\n"
    "  replicas  each placed replica: model, state, shards ready/total, nodes\n"
    "            (-o wide: GPUs per node, engine pids, engine and version, ports)\n"
    "  models    each model: replicas ready/wanted, placed, wanted\n"
    "            (-o wide: engine, served name, GPUs per shard, nodes per replica, why not placed)",
)
