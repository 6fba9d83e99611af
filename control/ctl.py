"""``ctl``: ask a running control plane, the way operators ask kubectl or nomad.

Every verb reads or writes the admin API (``control.api``) over HTTP(S) and prints either aligned
columns with a header (the default), more columns (``-o wide``), ``KIND/NAME`` lines (``-o name``)
or the API's JSON (``-o json``, ``--json``). Global options (``--api``, ``-o``, ``--json``, the token
and TLS files) are accepted anywhere on the command line, before or after the verb and its
arguments, so a command can be edited at its end the way kubectl's can.

Exit status, kept as documented in ``ctl --help``: 0 done; 1 the operation failed (the API said no,
or could not be reached); 2 a usage mistake (argparse's own status for those). A watch (``get -w``)
or a follow (``logs -f``) ends with 0 on Ctrl-C: that is how a person ends one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

#: Printed by ``ctl --help`` and ``python -m control --help``: scripts rely on these staying put.
EXIT_CODES = """exit status:
  0  done (a watch or follow ended with Ctrl-C included)
  1  the operation failed: the API refused it (its reason is printed) or could not be reached
  2  a usage mistake: an unknown verb, option or value"""

#: Keys of the API's documents that change with every read (ages and countdowns): a watch ignores
#: them when deciding whether anything changed, or it would reprint every second.
VOLATILE_KEYS = frozenset({"since_s", "heartbeat_age_s", "at_s_ago", "retry_in_s"})

#: How often ``get -w`` and ``logs -f`` poll the API.
POLL_SECONDS = 1.0

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


def version() -> str:
    """llmgw's version from the installed package's metadata ("unknown" in a bare checkout)."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class CtlFailed(Exception):
    """An operation that failed (exit 1), with the line that says what, where and why."""


# -- tables --------------------------------------------------------------------------------------


def table(rows: list[list[str]], header: list[str]) -> str:
    """kubectl's layout: a header, columns left-aligned and three spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "   ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]
    ]
    return "\n".join(lines)


def _age(seconds: float) -> str:
    """kubectl's ages: 45s, 12m, 3h, 2d."""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _node_state(n: dict[str, Any]) -> str:
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
            _node_state(n),
            f"{n['gpus'] - n['gpus_free']}/{n['gpus']}",
            str(len(n["shards"])),
            _age(n["since_s"]),
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
        header += ["GPUS", "PIDS", "ENGINE", "VERSION", "PORTS"]
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
                _model_source(m),
                m.get("revision") or "-",
                m.get("rollout") or "-",
                "deleting: its engines drain and stop"
                if m.get("deleting")
                else (m["unplaced"][0] if m["unplaced"] else "-"),
            ]
        rows.append(row)
    return header, rows, set()


def _model_source(m: dict[str, Any]) -> str:
    """Where the definition in force came from (``file``, ``api``), and ``api (in file)`` when a
    model the file defines was changed by ctl since (the file wins again when its definition changes)."""
    source = str(m.get("source") or "-")
    return f"{source} (in file)" if source == "api" and m.get("in_file") else source


#: Per kind: the API documents it needs (wide needs more, to join engines and versions), the row
#: builder, and the name of each object for ``-o name`` and for ``get KIND NAME``.
GET_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Callable[..., Any], str]] = {
    "nodes": (("nodes",), ("nodes",), node_rows, "node_id"),
    "replicas": (("replicas",), ("replicas", "models", "nodes"), replica_rows, "replica_id"),
    "models": (("models",), ("models",), model_rows, "model"),
}


def _singular(kind: str) -> str:
    return kind[:-1]


def render_get(kind: str, docs: dict[str, Any], output: str | None) -> tuple[str, str]:
    """What ``get KIND`` prints, and the same with the self-changing parts blanked (what a watch
    compares to decide whether to print again)."""
    _, _, rows_of, key = GET_KINDS[kind]
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


# -- describe ------------------------------------------------------------------------------------


def describe_node(node: dict[str, Any]) -> str:
    """kubectl describe's layout: fields, then shards, then events (the node's recent events, or
    its state history from a control plane that keeps no event log)."""
    node_id = node["node_id"]
    replicas = node["replicas"]
    out = [
        f"Name:          {node['node_id']}",
        f"State:         {_node_state(node)} for {_age(node['since_s'])}",
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
        out += ["  " + line for line in table(rows, header).splitlines()]
    if "events" in node:
        out += events_section(node["events"])
        return "\n".join(out)
    out.append("Events:" if node["history"] else "Events:        none")
    if node["history"]:
        rows = [
            [f"{_age(h['at_s_ago'])} ago", h["from"] or "-", h["to"], h["reason"] or "-"]
            for h in node["history"]  # oldest first, as the event log's
        ]
        out += ["  " + line for line in table(rows, ["WHEN", "FROM", "TO", "REASON"]).splitlines()]
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
    return ["GPU devices:", *("  " + line for line in table(rows, header).splitlines())]


def events_section(events: list[dict[str, Any]]) -> list[str]:
    """kubectl's Events: newest last, each with its age, what it is about, the change and why."""
    if not events:
        return ["Events:        none"]
    rows = [
        [
            f"{_age(e['at_s_ago'])} ago",
            e["kind"],
            e["shard_id"] or e["node_id"],
            f"{e['from'] or '-'} -> {e['to'] or '-'}" if e["from"] else e["to"] or "-",
            e["reason"] or "-",
        ]
        for e in events
    ]
    return [
        "Events:",
        *("  " + line for line in table(rows, ["WHEN", "KIND", "OBJECT", "CHANGE", "REASON"]).splitlines()),
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
        out.append(f"Generation:    {model['generation']} (source {_model_source(model)}){deleting}")
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
        out.append(f"  {r['replica_id']}  {r['state']}")
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


# -- the command line ----------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs keep their line breaks (the exit codes are a list)."""


def _add_global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every verb takes, on the top parser with their defaults and on each verb with
    none (argparse.SUPPRESS), so ``ctl -o json get nodes`` and ``ctl get nodes -o json`` both work
    and a verb's parse never overwrites what was given before it."""
    group = parser.add_argument_group("global options (anywhere on the command line)")
    none = None if defaults else argparse.SUPPRESS
    group.add_argument(
        "--api",
        default=os.environ.get("LLMGW_API", "http://127.0.0.1:7080") if defaults else argparse.SUPPRESS,
        metavar="URL",
        help="the control plane's admin API (default: $LLMGW_API, else http://127.0.0.1:7080)",
    )
    group.add_argument(
        "-o",
        "--output",
        choices=("json", "wide", "name"),
        default=none,
        help="json: the API's JSON; wide: more columns; name: KIND/NAME lines (default: columns)",
    )
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", default=none, help="the same as -o json"
    )
    group.add_argument(
        "--token-file",
        type=Path,
        default=none,
        metavar="PATH",
        help="a file holding the admin API token (default: $LLMGW_API_TOKEN; none: only a control plane "
        "on this machine without [api] tokens answers)",
    )
    group.add_argument(
        "--cacert",
        type=Path,
        default=Path(os.environ["LLMGW_API_CACERT"])
        if defaults and os.environ.get("LLMGW_API_CACERT")
        else none,
        metavar="PATH",
        help="https: the CA that signs the admin API's certificate (default: $LLMGW_API_CACERT, else the system's)",
    )
    group.add_argument(
        "--cert",
        type=Path,
        default=none,
        metavar="PATH",
        help="https with [api.tls] client_ca: this client's certificate (PEM; with --key, or the key inside it)",
    )
    group.add_argument(
        "--key", type=Path, default=none, metavar="PATH", help="the private key of --cert, if not inside it"
    )


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """What every request of this ``ctl`` run carries: the bearer token (``--token-file``, else
    ``$LLMGW_API_TOKEN``) and the TLS settings. Raises ``ValueError`` naming the file it cannot read."""
    token = os.environ.get("LLMGW_API_TOKEN", "").strip()
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--token-file {args.token_file}: cannot read it: {reason}") from exc
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty; put the admin API token in it")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    options: dict[str, Any] = {"headers": headers, "timeout": 30}
    if args.cacert is not None:
        options["verify"] = ssl.create_default_context(cafile=str(args.cacert))
    if args.cert is not None:
        context = options.get("verify") or ssl.create_default_context()
        context.load_cert_chain(str(args.cert), str(args.key) if args.key else None)
        options["verify"] = context
    return options


def build_parser() -> tuple[argparse.ArgumentParser, list[argparse.ArgumentParser]]:
    """The parser, and every verb's parser (each gets the global options)."""
    parser = argparse.ArgumentParser(
        prog="ctl",
        description="Ask a running llmgw control plane (python -m control ctl ...).\n\n"
        "Global options go anywhere: before the verb, after it or after its arguments.",
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"ctl (llmgw) {version()}")
    _add_global_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    verbs: list[argparse.ArgumentParser] = []

    def verb(name: str, help_: str, description: str = "") -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help_, description=description or help_, epilog=EXIT_CODES, formatter_class=_Formatter
        )
        verbs.append(p)
        return p

    get = verb(
        "get",
        "list nodes, replicas or models as columns (-o wide for more, -w to watch)",
        "List nodes, replicas or models.\n\n"
        "  nodes     each node: state, GPUs in use/total, shards, age of its state\n"
        "            (-o wide: GPU model, fabrics, address, auth, engine versions, reason)\n"
        "  replicas  each placed replica: model, state, shards ready/total, nodes\n"
        "            (-o wide: GPUs per node, engine pids, engine and version, ports)\n"
        "  models    each model: replicas ready/wanted, placed, wanted\n"
        "            (-o wide: engine, served name, GPUs per shard, nodes per replica, why not placed)",
    )
    get.add_argument("kind", choices=sorted(KINDS), metavar="KIND", help="nodes, replicas or models")
    get.add_argument("name", nargs="?", help="only this one (by node, replica or model name)")
    get.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="after the list, poll every second and print it again when a row changes; Ctrl-C ends (exit 0)",
    )
    describe = verb(
        "describe",
        "one node or model in detail: state, history, shards, reasons",
        "Show one node (state and why, GPUs, fabrics, engines, its shards, its state history) or one "
        "model (replicas wanted/placed/ready, each shard's state, node and pid, errors with the "
        "engine's last words, and why replicas that cannot run cannot).",
    )
    describe.add_argument(
        "kind", choices=("node", "nodes", "model", "models"), metavar="KIND", help="node or model"
    )
    describe.add_argument("name", help="the node id or model name")
    logs = verb(
        "logs",
        "a shard's engine log, fetched from its agent (-f to follow, --previous for the last run)",
        "Print the tail of a shard's engine log, read by its agent and sent over its stream.",
    )
    logs.add_argument("shard", help="the shard id, as get replicas -o wide or describe model shows it")
    logs.add_argument(
        "--tail",
        "-n",
        "--lines",
        dest="lines",
        type=int,
        default=100,
        metavar="N",
        help="the last N lines (default 100; at most what the agent reads, 256 KiB per file)",
    )
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new lines as the engine writes them (polls every second); Ctrl-C ends (exit 0)",
    )
    logs.add_argument(
        "-p",
        "--previous",
        action="store_true",
        help="the engine's output before its last (re)start, instead of the current run's (with -f: "
        "printed once, nothing followed)",
    )
    _add_model_verbs(verb)
    _add_rollout_verb(verb, verbs)
    verb("nodes", "every node in one wide table: state and why, auth, GPUs free/total, fabrics, engines")
    verb("replicas", "every shard of every replica in one table: node, state, GPUs, URL, rank, errors")
    verb("why", "why MODEL's replicas are placed where they are, or why they cannot run").add_argument(
        "model", help="a model name from llmgw.toml"
    )
    verb("cordon", "NODE takes no new replicas; what runs there stays").add_argument("node", help="node id")
    verb("uncordon", "undo a cordon or a drain (replicas that already moved stay)").add_argument(
        "node", help="node id"
    )
    drain = verb(
        "drain",
        "cordon NODE and move its replicas elsewhere, replacements first",
        "Cordon NODE and move its replicas elsewhere (replacements ready first), then drain and stop "
        "its shards. Refused when a model would be left without a ready replica, unless --force.",
    )
    drain.add_argument("node", help="node id")
    drain.add_argument(
        "--force", action="store_true", help="drain even if a model is left without a ready replica"
    )
    drain.add_argument("--wait", action="store_true", help="show progress until the node is empty")
    drain.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="with --wait: give up after S seconds (600)"
    )
    verb("token", "print the cluster join token (agents join with --token or LLMGW_AGENT_TOKEN)")
    node_parser = verb("node", "node membership: node reset NODE")
    node_sub = node_parser.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    reset = node_sub.add_parser(
        "reset",
        help="forget NODE's credential; it joins again with the join token",
        description="Forget NODE's credential, so it can join again with the join token (a node "
        "reinstalled on purpose; until then nothing can speak for it with the token).",
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    reset.add_argument("node", help="node id")
    verbs.append(reset)
    for p in verbs:
        _add_global_options(p, defaults=False)
    return parser, verbs


def _count(text: str) -> int:
    """A replica count: a whole number, 0 or more (argparse turns the ValueError into exit 2)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_count.__name__ = "replica count (0 or more)"


def _add_model_verbs(verb: Callable[..., argparse.ArgumentParser]) -> None:
    """``apply``, ``scale`` and ``delete``: models as objects (``control.catalog``)."""
    apply = verb(
        "apply",
        "create or update models from a file of [[models]] tables (-f FILE, - for stdin)",
        "Create or update one or more models from TOML [[models]] tables: the same keys as "
        "llmgw.toml's [[models]], checked by the control plane with the same rules (a problem names "
        "the key and its line in FILE, and nothing is changed). Prints one line per model: "
        "model/NAME created, configured or unchanged.\n\n"
        "A model applied here stays across restarts. A model llmgw.toml also defines keeps what "
        "apply made of it until its [[models]] table in the file changes: then the file wins "
        "(README: Models as objects).",
    )
    apply.add_argument(
        "-f",
        "--filename",
        dest="file",
        required=True,
        metavar="FILE",
        help="the TOML file with [[models]] tables; - reads standard input",
    )
    scale = verb(
        "scale",
        "set a model's replica count (0 stops every replica, the model stays)",
        "Set MODEL's replica count. Replicas added are placed and started; replicas taken away are "
        "drained (a ready engine finishes its requests, the router sends it nothing new) and stopped, "
        "the highest-numbered first. Prints model/NAME scaled (or unchanged).",
    )
    scale.add_argument("model", help="the model name (ctl get models lists them)")
    scale.add_argument("replicas", type=_count, metavar="N", help="the number of replicas, 0 or more")
    delete = verb(
        "delete",
        "delete a model: its replicas drain and stop, then it is gone",
        "Delete MODEL: its replicas are drained (the router sends them nothing new, requests under "
        "way finish) and stopped, then the model leaves the catalog and the router answers 404 for "
        "it. A model llmgw.toml defines is refused (it would come back at the next start): remove it "
        "from the file and send the control plane SIGHUP.",
    )
    delete.add_argument("model", help="the model name, or model/NAME")
    delete.add_argument("--wait", action="store_true", help="wait until the model is gone, showing progress")
    delete.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="with --wait: give up after S seconds (600)"
    )


def _add_rollout_verb(
    verb: Callable[..., argparse.ArgumentParser], verbs: list[argparse.ArgumentParser]
) -> None:
    """``rollout status MODEL``: a model's rolling change (``control.rollout``), as kubectl's."""
    rollout = verb(
        "rollout",
        "a model's rolling change: rollout status MODEL",
        "A change of a model's profile, GPUs, selector or nodes per replica replaces its replicas "
        "one by one: a new replica is ready before an old one is drained (max_surge and "
        "max_unavailable in [models.rollout]). A new replica that fails stops the rollout; the old "
        "ones keep serving until the model is applied again.",
    )
    actions = rollout.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    status = actions.add_parser(
        "status",
        help="show MODEL's rollout: progress, done, or why it failed",
        description="Show MODEL's rollout in one line (kubectl's words): how many replicas are "
        "updated and ready, old ones still to go, or why it failed or waits (a replica that cannot "
        "be placed). Exit 0 when the rollout is complete (or, without --wait, still progressing), "
        "1 when it failed or --timeout passed.",
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    status.add_argument("model", help="the model name, or model/NAME")
    status.add_argument(
        "--wait",
        action="store_true",
        help="print each change of progress until the rollout completes or fails",
    )
    status.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="with --wait: give up after S seconds (600)"
    )
    verbs.append(status)


def rollout_line(name: str, rollout: dict[str, Any] | None) -> tuple[str, str]:
    """One line on a model's rollout, kubectl's way, and its state (progressing|complete|failed)."""
    if rollout is None:
        return f"Waiting for rollout to finish: model/{name} has not been reconciled yet...", "progressing"
    state = str(rollout["state"])
    updated, wanted = rollout["updated_replicas"], rollout["replicas"]
    if rollout["observed_generation"] < rollout["generation"]:
        # Asked right after an apply: the status is of the definition before it (kubectl's check).
        line = f"Waiting for rollout to finish: generation {rollout['generation']} not acted on yet..."
        return line, "progressing"
    if state == "complete":
        return f"model/{name} successfully rolled out", state
    if state == "failed":
        return f"error: model/{name} rollout failed: {rollout['reason']}", state
    if updated < wanted:
        line = f"{updated} out of {wanted} new replicas have been updated"
    elif rollout["old_replicas"]:
        line = f"{rollout['old_replicas']} old replicas are pending termination"
    else:
        line = f"{rollout['updated_ready_replicas']} of {updated} updated replicas are ready"
    placing = "; ".join(p for p in str(rollout["reason"]).split("; ") if "cannot be placed" in p)
    return f"Waiting for rollout to finish: {line}..." + (f" ({placing})" if placing else ""), state


def run_rollout(api: Api, args: argparse.Namespace) -> int:
    """``rollout status MODEL [--wait]``: exit 0 when complete (or progressing without --wait), 1
    when failed or past --timeout."""
    name = args.model.removeprefix("model/").removeprefix("models/")
    deadline = time.monotonic() + args.timeout
    last = ""
    while True:
        doc = api.get(f"/api/models/{name}")
        line, state = rollout_line(name, doc.get("rollout"))
        if args.output == "json":
            print(json.dumps(doc.get("rollout"), indent=2), flush=True)
        elif line != last:
            print(line, file=sys.stderr if state == "failed" else sys.stdout, flush=True)
        last = line
        if state == "failed":
            return 1
        if state == "complete" or not args.wait:
            return 0
        if time.monotonic() >= deadline:
            raise CtlFailed(f"ctl: rollout status {name}: not complete after {args.timeout:g} s; {line}")
        time.sleep(min(POLL_SECONDS / 2, max(deadline - time.monotonic(), 0.0)))


class Api:
    """The admin API as ``ctl`` reads it: GETs and POSTs that either return the JSON document or
    raise ``CtlFailed`` with one line naming the method, URL and reason."""

    def __init__(self, base: str, http: dict[str, Any]) -> None:
        self.base = base.rstrip("/")
        self.http = http

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base + path
        try:
            # Writes carry a JSON body: the API refuses any other content type for them (see
            # control/api.py: ApiGuard, why a browser's text/plain POST must not get through).
            payload = body if body is not None or method == "GET" else {}
            resp = httpx.request(method, url, json=payload, **self.http)
        except httpx.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise CtlFailed(
                f"ctl: cannot reach the control plane: {method} {url}: {reason}; "
                "is it running, and is --api (or LLMGW_API) its admin API address?"
            ) from None
        try:
            doc = resp.json()
        except ValueError:
            text = " ".join(resp.text[:200].split())
            raise CtlFailed(f"ctl: {method} {url}: HTTP {resp.status_code} without JSON: {text}") from None
        if resp.status_code != 200:
            error = doc.get("error") if isinstance(doc, dict) else None
            # One line per line of the server's message (an apply's several problems stay a list).
            reason = "\n  ".join(
                " ".join(line.split()) for line in str(error or resp.text[:200]).splitlines()
            )
            raise CtlFailed(f"ctl: {method} {url}: HTTP {resp.status_code}: {reason}")
        return doc

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def get_if_served(self, path: str) -> Any:
        """``get``, or None from a control plane that has no such route (an older one)."""
        try:
            return self.request("GET", path)
        except CtlFailed as exc:
            if "HTTP 404: no route " in str(exc):
                return None
            raise


def _fetch(api: Api, kind: str, output: str | None, name: str | None) -> dict[str, Any]:
    basic, wide, _, key = GET_KINDS[kind]
    docs = {doc: api.get(f"/api/{doc}") for doc in (wide if output == "wide" else basic)}
    if name is not None:
        docs[kind] = [item for item in docs[kind] if item[key] == name]
        if not docs[kind]:
            raise CtlFailed(f"ctl: get {kind}: no {_singular(kind)} {name!r}")
    return docs


def run_get(api: Api, args: argparse.Namespace) -> int:
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


def run_describe(api: Api, args: argparse.Namespace) -> int:
    """``describe``: from ``GET /api/nodes/NODE`` or ``/api/models/MODEL`` (the object with its
    recent events), or, from a control plane that serves neither, built from the list documents
    (a node's own state history then stands in for its events; a model has none)."""
    if args.kind.startswith("node"):
        node = api.get_if_served(f"/api/nodes/{args.name}")
        if node is None:
            nodes, replicas = api.get("/api/nodes"), api.get("/api/replicas")
            node = next((n for n in nodes if n["node_id"] == args.name), None)
            if node is None:
                known = ", ".join(n["node_id"] for n in nodes) or "none"
                raise CtlFailed(f"ctl: describe node: no node {args.name!r}; nodes: {known}")
            node = {
                **node,
                "replicas": [r for r in replicas if any(s["node_id"] == args.name for s in r["shards"])],
            }
        print(json.dumps(node, indent=2) if args.output == "json" else describe_node(node), flush=True)
        return 0
    doc = api.get_if_served(f"/api/models/{args.name}") or api.get(f"/api/why/{args.name}")
    counts = next((m for m in api.get("/api/models") if m["model"] == args.name), None)
    if counts is None:
        raise CtlFailed(f"ctl: describe model: no model {args.name!r}")
    model = {**counts, **doc}
    print(json.dumps(model, indent=2) if args.output == "json" else describe_model(model), flush=True)
    return 0


def run_logs(api: Api, args: argparse.Namespace) -> int:
    if args.lines < 0:
        raise CtlFailed(f"ctl: logs: --tail {args.lines}: give a count of lines, 0 or more")
    query = f"lines={args.lines}" + ("&previous=1" if args.previous else "")
    doc = api.get(f"/api/logs/{args.shard}?{query}")
    if args.output == "json" and not args.follow:
        print(json.dumps(doc, indent=2), flush=True)
        return 0
    for line in doc["lines"]:
        print(line, flush=True)
    if not args.follow or args.previous:
        return 0
    offset = doc.get("offset")
    if offset is None:
        raise CtlFailed(
            "ctl: logs -f: this control plane's API gives no log offset to follow from; upgrade it"
        )
    while True:
        time.sleep(POLL_SECONDS)
        doc = api.get(f"/api/logs/{args.shard}?lines=1000&after={offset}")
        for line in doc["lines"]:
            print(line, flush=True)
        offset = doc["offset"]


def ctl(argv: Sequence[str]) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    if not re.fullmatch(r"https?://[^/\s?#]+/?", args.api):
        parser.error(f"--api {args.api!r} is not the admin API's URL; write it as http://HOST:PORT")
    try:
        http = http_options(args)
    except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError: a bad --cacert, --cert or --key
        print(f"ctl: {exc}", file=sys.stderr)
        return 2
    api = Api(args.api, http)
    try:
        if args.command == "get":
            return run_get(api, args)
        if args.command == "describe":
            return run_describe(api, args)
        if args.command == "logs":
            return run_logs(api, args)
        if args.command in MODEL_VERBS:
            return MODEL_VERBS[args.command](api, args)
        return run_verb(api, args, http)
    except CtlFailed as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0  # how a watch or a follow is ended
    except BrokenPipeError:
        # The reader went away (`ctl logs -f | head`): done, without a traceback, and without
        # Python's own complaint when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run_apply(api: Api, args: argparse.Namespace) -> int:
    """``apply -f FILE``: the file's text goes to the control plane, which parses it (the server's
    rules, so the errors are the ones llmgw.toml gets); one line per model comes back."""
    source = "<stdin>" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CtlFailed(f"ctl: apply -f {source}: cannot read it: {reason}") from None
    try:
        doc = api.request("POST", "/api/models", {"toml": text, "source": source})
    except CtlFailed as exc:
        raise CtlFailed(f"ctl: apply -f {source}: {str(exc).removeprefix('ctl: ')}") from None
    if args.output == "json":
        print(json.dumps(doc, indent=2), flush=True)
    elif args.output == "name":
        print("\n".join(f"model/{c['model']}" for c in doc["changes"]), flush=True)
    else:
        print("\n".join(c["line"] for c in doc["changes"]), flush=True)
    return 0


def run_scale(api: Api, args: argparse.Namespace) -> int:
    doc = api.request("PUT", f"/api/models/{args.model}/replicas", {"replicas": args.replicas})
    print(json.dumps(doc, indent=2) if args.output == "json" else doc["line"], flush=True)
    return 0


def run_delete(api: Api, args: argparse.Namespace) -> int:
    """``delete MODEL``: marked deleting at once; ``--wait`` polls until it has left the catalog."""
    name = args.model.removeprefix("model/").removeprefix("models/")
    doc = api.request("DELETE", f"/api/models/{name}")
    print(json.dumps(doc, indent=2) if args.output == "json" else doc["line"], flush=True)
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    last = ""
    while True:
        model = next((m for m in api.get("/api/models") if m["model"] == name), None)
        if model is None:
            print(f"model/{name} deleted", flush=True)
            return 0
        line = (
            f"model/{name}: {model['replicas_placed']} replica(s) placed, "
            f"{model['replicas_ready']} ready; waiting for its engines to stop"
        )
        if line != last:
            print(line, flush=True)
            last = line
        if time.monotonic() >= deadline:
            raise CtlFailed(f"ctl: delete {name}: not gone after {args.timeout:g} s; {line}")
        time.sleep(min(POLL_SECONDS / 2, max(deadline - time.monotonic(), 0.0)))


#: The verbs on models as objects, each a function of the API and the parsed arguments.
MODEL_VERBS: dict[str, Callable[[Api, argparse.Namespace], int]] = {
    "apply": run_apply,
    "scale": run_scale,
    "delete": run_delete,
    "rollout": run_rollout,
}


def run_verb(api: Api, args: argparse.Namespace, http: dict[str, Any]) -> int:
    """The verbs that predate ``get``: one request, one document, printed as before."""
    method, path = "GET", f"/api/{args.command}"
    if args.command == "why":
        path += f"/{args.model}"
    elif args.command == "drain":
        method, path = "POST", f"/api/drain/{args.node}" + ("?force=1" if args.force else "")
    elif args.command in ("cordon", "uncordon"):
        method, path = "POST", f"/api/{args.command}/{args.node}"
    elif args.command == "node":
        method, path = "POST", f"/api/reset/{args.node}"
    doc = api.request(method, path)
    print(json.dumps(doc, indent=2) if args.output == "json" else render(args.command, doc), flush=True)
    if args.command == "drain" and args.wait:
        return _drain_wait(args.api, args.node, args.timeout, http=http)
    return 0


# -- the verbs that predate get: their text forms -----------------------------------------------


def _table(rows: list[list[str]], header: list[str]) -> str:
    """The older verbs' layout (two spaces apart), kept so their output does not move."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]
    ]
    return "\n".join(lines)


def engines_cell(engines: list[dict[str, str]]) -> str:
    """``ctl nodes``' ENGINES column: each installed engine with its version, then those the node
    lacks ("sim 0.18.0, vllm 0.18.0; missing: sglang, trtllm"); an engine whose version could not
    be read is "NAME ?" (``--json`` has every reason in full)."""
    found, missing = [], []
    for e in engines:
        if e["version"]:
            found.append(f"{e['engine']} {e['version']}")
        elif "command not found" in e["error"] or "not installed" in e["error"]:
            missing.append(e["engine"])
        else:
            found.append(f"{e['engine']} ?")
    text = ", ".join(found) or ("none" if engines else "-")
    return text + (f"; missing: {', '.join(missing)}" if missing else "")


def render(command: str, doc: Any) -> str:
    if command == "nodes":
        insecure = any(n.get("insecure") for n in doc)
        warning = (
            "WARNING: insecure = true: this control plane accepts agents with no authentication\n"
            if insecure
            else ""
        )
        rows = [
            [
                n["node_id"],
                n["state"] + (" (draining)" if n["draining"] else " (cordoned)" if n.get("cordoned") else ""),
                f"{n['since_s']:g}s",
                f"{n['gpus_free']}/{n['gpus']}",
                n["gpu_model"] or "-",
                ",".join(n["fabrics"]) or "-",
                n["mgmt_addr"],
                engines_cell(n.get("engines", [])),
                n["reason"] + (f"; discovery: {n['discovery_error']}" if n["discovery_error"] else ""),
            ]
            for n in doc
        ]
        for row, n in zip(rows, doc, strict=True):
            row.insert(2, n.get("auth") or "-")
        header = [
            "NODE",
            "STATE",
            "AUTH",
            "SINCE",
            "GPUS FREE",
            "GPU",
            "FABRICS",
            "ADDRESS",
            "ENGINES",
            "REASON",
        ]
        return warning + _table(rows, header)
    if command == "token":
        return str(doc["token"])
    if command == "node":
        if doc["forgotten"]:
            return f"{doc['node_id']}: credential forgotten; it joins again with the join token (`ctl token`)"
        return f"{doc['node_id']}: had no credential here; it joins with the join token (`ctl token`)"
    if command == "replicas":
        rows = []
        for r in doc:
            for s in r["shards"]:
                detail = s["error"]
                if s["retry_in_s"] is not None:
                    detail = f"{detail}; retry in {s['retry_in_s']:g}s (failures: {s['failures']})"
                rows.append(
                    [
                        r["replica_id"],
                        s["shard_id"],
                        s["node_id"] + ("" if s["node_state"] == "ready" else f" ({s['node_state']})"),
                        s["state"],
                        ",".join(map(str, s["gpus"])) or "-",
                        s["url"],
                        f"{s['node_rank']}/{s['nnodes']}" + (f" {s['master']}" if s["master"] else ""),
                        detail,
                    ]
                )
        table = _table(rows, ["REPLICA", "SHARD", "NODE", "STATE", "GPUS", "URL", "RANK", "DETAIL"])
        # A failed engine's last words, under the table: the reason is usually in them.
        tails = [
            f"\n{s['shard_id']} output (last {len(s['output_tail'])} lines):\n"
            + "\n".join(f"  | {line}" for line in s["output_tail"])
            for r in doc
            for s in r["shards"]
            if s["state"] == "failed" and s.get("output_tail")
        ]
        return "\n".join([table, *tails])
    if command == "why":
        out = [f"{doc['model']}: {len(doc['placed'])}/{doc['replicas_wanted']} replica(s) placed"]
        for r in doc["placed"]:
            where = ", ".join(
                f"{s['node_id']} GPUs {','.join(map(str, s['gpus'])) or '-'}" for s in r["shards"]
            )
            out.append(f"  {r['replica_id']}: placed on {where} ({r['state']})")
            for sh in r["shards"]:
                # Why a placed shard is not serving, in the agent's (often the engine's) own words.
                if sh.get("error"):
                    retry = f"; retry in {sh['retry_in_s']:g} s" if sh.get("retry_in_s") else ""
                    out.append(
                        f"      {sh['shard_id']} on {sh['node_id']}: {sh['state']}: {sh['error']}{retry}"
                    )
        for u in doc["unplaced"]:
            out.append(f"  {u['replica_id']}: cannot run: {u['reason']}")
            for node, reason in sorted(u["per_node"].items()):
                out.append(f"      {node}: {reason}")
        return "\n".join(out)
    if command == "logs":
        return "\n".join(doc["lines"])
    if command == "drain":
        forced = " (forced)" if doc.get("forced") else ""
        head = (
            f"{doc['node_id']}: draining{forced}; its replicas move elsewhere, then its shards drain and stop"
        )
        return "\n".join([head, *(f"  {line}" for line in doc.get("moves", []))])
    if command == "cordon":
        node = doc["node_id"]
        return f"{node}: {doc['cordon']}; takes no new replicas, keeps what runs (undo: ctl uncordon {node})"
    if command == "uncordon":
        was = f"was {doc['undone']}" if doc["undone"] else "was not cordoned"
        return f"{doc['node_id']}: uncordoned ({was}); takes new replicas again"
    return json.dumps(doc, indent=2)


def drain_progress_line(doc: Any) -> str:
    """One line of ``ctl drain --wait``: what still runs on the node, and each replacement's state."""
    parts = []
    for s in doc["shards"]:
        where = f", replacement on {s['replacement']} {s['replacement_state']}" if s["replacement"] else ""
        parts.append(f"{s['shard_id']} {s['state']}{where}")
    return f"{doc['node_id']}: {len(parts)} shard(s) left: {'; '.join(parts)}"


def _drain_wait(
    api: str, node: str, timeout: float, poll_every: float = 0.5, *, http: dict[str, Any] | None = None
) -> int:
    """Show progress lines until nothing runs on ``node`` (0) or ``timeout`` passes (1)."""

    url = f"{api.rstrip('/')}/api/drain/{node}"
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            resp = httpx.get(url, **(http or {"timeout": 30}))
            doc = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"ctl: GET {url}: {exc}", file=sys.stderr)
            return 1
        if resp.status_code != 200:
            print(f"ctl: GET {url}: HTTP {resp.status_code}: {doc.get('error', '')}", file=sys.stderr)
            return 1
        if doc["empty"]:
            print(f"{node}: drained; nothing runs there any more", flush=True)
            return 0
        line = drain_progress_line(doc)
        if line != last:
            print(line, flush=True)
            last = line
        if time.monotonic() >= deadline:
            print(f"ctl: drain of {node} not done after {timeout:g} s; {line}", file=sys.stderr)
            return 1
        time.sleep(min(poll_every, max(deadline - time.monotonic(), 0.0)))


def main() -> int:
    """``ctl`` as its own command (a console script), the same as ``python -m control ctl``."""
    return ctl(sys.argv[1:])
