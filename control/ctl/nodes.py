"""The verbs on nodes: ``nodes`` (every node in one wide table), ``cordon``, ``uncordon``,
``drain [--force] [--wait]``, ``token`` (the join token) and ``node reset NODE`` (forget its
credential)."""

from __future__ import annotations

import argparse
from typing import Any

from control.ctl.base import Api, Verb, action, add_wait_options, one_request, wait_until
from control.ctl.text import OLD_GAP, table


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


def nodes_text(doc: Any) -> str:
    """``nodes``: the older wide table, two spaces apart (scripts read it)."""
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
    return warning + table(rows, header, OLD_GAP)


def cordon_text(doc: Any) -> str:
    """``cordon NODE``."""
    node = doc["node_id"]
    return f"{node}: {doc['cordon']}; takes no new replicas, keeps what runs (undo: ctl uncordon {node})"


def uncordon_text(doc: Any) -> str:
    """``uncordon NODE``: what was undone."""
    was = f"was {doc['undone']}" if doc["undone"] else "was not cordoned"
    return f"{doc['node_id']}: uncordoned ({was}); takes new replicas again"


def drain_text(doc: Any) -> str:
    """``drain NODE``: what the drain does, one line per replica."""
    forced = " (forced)" if doc.get("forced") else ""
    head = f"{doc['node_id']}: draining{forced}; its replicas move elsewhere, then its shards drain and stop"
    return "\n".join([head, *(f"  {line}" for line in doc.get("moves", []))])


def reset_text(doc: Any) -> str:
    """``node reset NODE``: whether a credential was forgotten, and a lost node with it."""
    node = doc["node_id"]
    if doc["forgotten"]:
        text = f"{node}: credential forgotten; it joins again with the join token (`ctl token`)"
    else:
        text = f"{node}: had no credential here; it joins with the join token (`ctl token`)"
    if doc.get("removed"):
        text += f"\n{node}: lost node removed, with the shards it last reported"
    return text


def drain_progress_line(doc: Any) -> str:
    """One line of ``ctl drain --wait``: what still runs on the node, and each replacement's state."""
    parts = []
    for s in doc["shards"]:
        where = f", replacement on {s['replacement']} {s['replacement_state']}" if s["replacement"] else ""
        parts.append(f"{s['shard_id']} {s['state']}{where}")
    return f"{doc['node_id']}: {len(parts)} shard(s) left: {'; '.join(parts)}"


def drain_wait(api: Api, node: str, timeout: float) -> int:
    """Show progress lines until nothing runs on ``node`` (0); ``CtlFailed`` once ``timeout`` passes."""

    def empty() -> tuple[bool, str]:
        doc = api.get(f"/api/drain/{node}")
        if doc["empty"]:
            return True, f"{node}: drained; nothing runs there any more"
        return False, drain_progress_line(doc)

    wait_until(empty, timeout, f"ctl: drain of {node} not done")
    return 0


_drain_once = one_request(
    lambda args: ("POST", f"/api/drain/{args.node}" + ("?force=1" if args.force else "")), drain_text
)


def run_drain(api: Api, args: argparse.Namespace) -> int:
    """``drain NODE``, and with ``--wait`` its progress until the node is empty."""
    _drain_once(api, args)
    return drain_wait(api, args.node, args.timeout) if args.wait else 0


def _node_argument(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    parser.add_argument("node", help="node id")
    return []


def _drain_arguments(drain: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    drain.add_argument("node", help="node id")
    drain.add_argument(
        "--force", action="store_true", help="drain even if a model is left without a ready replica"
    )
    add_wait_options(drain, "show progress until the node is empty")
    return []


def _node_arguments(node: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    reset = action(
        node,
        "node_command",
        "reset",
        "forget NODE's credential (it joins again with the join token), and NODE if lost",
        "Forget NODE's credential, so it can join again with the join token (a node "
        "reinstalled on purpose; until then nothing can speak for it with the token). A lost NODE is "
        "forgotten too, with the engines it last reported (as kubectl delete node).",
    )
    reset.add_argument("node", help="node id")
    return [reset]


def token_text(doc: Any) -> str:
    """``token``: the token alone, for ``$(ctl token)``."""
    return str(doc["token"])


NODES = Verb(
    "nodes",
    "every node in one wide table: state and why, auth, GPUs free/total, fabrics, engines",
    one_request(lambda args: ("GET", "/api/nodes"), nodes_text),
    text=nodes_text,
)
CORDON = Verb(
    "cordon",
    "NODE takes no new replicas; what runs there stays",
    one_request(lambda args: ("POST", f"/api/cordon/{args.node}"), cordon_text),
    _node_argument,
    text=cordon_text,
)
UNCORDON = Verb(
    "uncordon",
    "undo a cordon or a drain (replicas that already moved stay)",
    one_request(lambda args: ("POST", f"/api/uncordon/{args.node}"), uncordon_text),
    _node_argument,
    text=uncordon_text,
)
DRAIN = Verb(
    "drain",
    "cordon NODE and move its replicas elsewhere, replacements first",
    run_drain,
    _drain_arguments,
    "Cordon NODE and move its replicas elsewhere (replacements ready first), then drain and stop "
    "its shards. Refused when a model would be left without a ready replica, unless --force.",
    text=drain_text,
)
TOKEN = Verb(
    "token",
    "print the cluster join token (agents join with --token or LLMGW_AGENT_TOKEN)",
    one_request(lambda args: ("GET", "/api/token"), token_text),
    text=token_text,
)
NODE = Verb(
    "node",
    "node membership: node reset NODE",
    one_request(lambda args: ("POST", f"/api/reset/{args.node}"), reset_text),
    _node_arguments,
    text=reset_text,
)
