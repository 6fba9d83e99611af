"""``python -m control --config llmgw.toml`` runs the control plane; ``python -m control ctl ...`` asks it.

``ctl`` subcommands (``--api http://127.0.0.1:7080``, or ``LLMGW_API``), each as a readable table or
with ``--json`` as the API's JSON:

    nodes            every node, its state and why, GPUs free/total, fabrics
    replicas         every placed replica, its shards, where they run and in what state
    why MODEL        why MODEL's replicas are placed where they are, or why they cannot run
    logs SHARD       the tail of a shard's engine log, fetched from its agent over the stream
    drain NODE       cordon NODE and move its replicas elsewhere (replacements first)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from control.config import ConfigError, load
from control.plane import ControlPlane

log = logging.getLogger("llmgw.control")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]
    ]
    return "\n".join(lines)


def render(command: str, doc: Any) -> str:
    if command == "nodes":
        rows = [
            [
                n["node_id"],
                n["state"] + (" (draining)" if n["draining"] else ""),
                f"{n['since_s']:g}s",
                f"{n['gpus_free']}/{n['gpus']}",
                n["gpu_model"] or "-",
                ",".join(n["fabrics"]) or "-",
                n["mgmt_addr"],
                n["reason"] + (f"; discovery: {n['discovery_error']}" if n["discovery_error"] else ""),
            ]
            for n in doc
        ]
        return _table(rows, ["NODE", "STATE", "SINCE", "GPUS FREE", "GPU", "FABRICS", "ADDRESS", "REASON"])
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
        for u in doc["unplaced"]:
            out.append(f"  {u['replica_id']}: cannot run: {u['reason']}")
            for node, reason in sorted(u["per_node"].items()):
                out.append(f"      {node}: {reason}")
        return "\n".join(out)
    if command == "logs":
        return "\n".join(doc["lines"])
    if command == "drain":
        return f"{doc['node_id']}: draining; its replicas move elsewhere, then its shards drain and stop"
    return json.dumps(doc, indent=2)


def ctl(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m control ctl", description="Ask a running control plane.")
    parser.add_argument("--api", default=os.environ.get("LLMGW_API", "http://127.0.0.1:7080"))
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes")
    sub.add_parser("replicas")
    sub.add_parser("why").add_argument("model")
    logs = sub.add_parser("logs")
    logs.add_argument("shard")
    logs.add_argument("-n", "--lines", type=int, default=100)
    sub.add_parser("drain").add_argument("node")
    args = parser.parse_args(argv)
    method, path = "GET", f"/api/{args.command}"
    if args.command == "why":
        path += f"/{args.model}"
    elif args.command == "logs":
        path += f"/{args.shard}?lines={args.lines}"
    elif args.command == "drain":
        method, path = "POST", f"/api/drain/{args.node}"
    try:
        resp = httpx.request(method, args.api.rstrip("/") + path, timeout=30)
    except httpx.HTTPError as exc:
        print(f"ctl: cannot reach the control plane at {args.api}: {exc}", file=sys.stderr)
        return 2
    try:
        doc = resp.json()
    except ValueError:
        print(
            f"ctl: {args.api} answered HTTP {resp.status_code} without JSON: {resp.text[:200]}",
            file=sys.stderr,
        )
        return 1
    if resp.status_code != 200:
        print(f"ctl: {doc.get('error', resp.text)}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else render(args.command, doc))
    return 0


async def _serve(plane: ControlPlane) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(plane.run)
            if plane.config.runs_control_plane:
                print(
                    f"llmgw control plane ready: agents :{plane.agent_port} api :{plane.api_port} "
                    f"router :{plane.router_port or '-'}",
                    flush=True,
                )
            else:
                print(f"llmgw router ready (router-only run): router :{plane.router_port}", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        return ctl(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m control", description="llmgw control plane")
    parser.add_argument("--config", type=Path, default=Path(os.environ.get("LLMGW_CONFIG", "llmgw.toml")))
    args = parser.parse_args(argv)
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"llmgw-control: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    trio.run(_serve, ControlPlane(config))
    return 0


def tune_gc() -> None:
    """Make full garbage collections rare. A control plane holds a large, long-lived heap (a stream,
    an h2 connection and a node record per node); with CPython's default thresholds a full
    collection walks all of it every few thousand allocations, which at 5,000 nodes measured 3 s
    pauses, long enough for every node to look silent. The heap has few reference cycles, so
    collecting rarely costs little memory."""
    gc.freeze()  # what exists at start-up (modules, config) is never garbage
    gc.set_threshold(100_000, 50, 1000)


if __name__ == "__main__":
    sys.exit(main())
