"""The verbs on models as objects (``control.catalog``): ``apply -f FILE``, ``scale MODEL N``,
``delete MODEL``, and ``why MODEL`` (where its replicas are placed, or why they cannot run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from control.ctl.base import Api, CtlFailed, Verb, add_wait_options, model_name, one_request, wait_until


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
    """``scale MODEL N``: one line, ``model/NAME scaled`` (or unchanged)."""
    doc = api.request("PUT", f"/api/models/{model_name(args.model)}/replicas", {"replicas": args.replicas})
    print(json.dumps(doc, indent=2) if args.output == "json" else doc["line"], flush=True)
    return 0


def run_delete(api: Api, args: argparse.Namespace) -> int:
    """``delete MODEL``: answered once the model has left the router's table (new requests for it
    get 404) and its replicas drain; ``--wait`` polls until it has left the catalog."""
    name = model_name(args.model)
    doc = api.request("DELETE", f"/api/models/{name}")
    print(json.dumps(doc, indent=2) if args.output == "json" else doc["line"], flush=True)
    if not args.wait:
        return 0

    def gone() -> tuple[bool, str]:
        model = next((m for m in api.get("/api/models") if m["model"] == name), None)
        if model is None:
            return True, f"model/{name} deleted"
        return False, (
            f"model/{name}: {model['replicas_placed']} replica(s) placed, "
            f"{model['replicas_ready']} ready; waiting for its engines to stop"
        )

    wait_until(gone, args.timeout, f"ctl: delete {name}: not gone")
    return 0


def why_text(doc: Any) -> str:
    """``why MODEL``: each replica placed and where, or why it cannot run, node by node."""
    out = [f"{doc['model']}: {len(doc['placed'])}/{doc['replicas_wanted']} replica(s) placed"]
    for r in doc["placed"]:
        where = ", ".join(f"{s['node_id']} GPUs {','.join(map(str, s['gpus'])) or '-'}" for s in r["shards"])
        out.append(f"  {r['replica_id']}: placed on {where} ({r['state']})")
        for sh in r["shards"]:
            # Why a placed shard is not serving, in the agent's (often the engine's) own words.
            if sh.get("error"):
                retry = f"; retry in {sh['retry_in_s']:g} s" if sh.get("retry_in_s") else ""
                out.append(f"      {sh['shard_id']} on {sh['node_id']}: {sh['state']}: {sh['error']}{retry}")
    for u in doc["unplaced"]:
        out.append(f"  {u['replica_id']}: cannot run: {u['reason']}")
        for node, reason in sorted(u["per_node"].items()):
            out.append(f"      {node}: {reason}")
    return "\n".join(out)


def _count(text: str) -> int:
    """A replica count: a whole number, 0 or more (argparse turns the ValueError into exit 2)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_count.__name__ = "replica count (0 or more)"


def _apply_arguments(apply: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    apply.add_argument(
        "-f",
        "--filename",
        dest="file",
        required=True,
        metavar="FILE",
        help="the TOML file with [[models]] tables; - reads standard input",
    )
    return []


def _scale_arguments(scale: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    scale.add_argument("model", help="the model name (ctl get models lists them)")
    scale.add_argument("replicas", type=_count, metavar="N", help="the number of replicas, 0 or more")
    return []


def _delete_arguments(delete: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    delete.add_argument("model", help="the model name, or model/NAME")
    add_wait_options(delete, "wait until the model is gone, showing progress")
    return []


def _why_arguments(why: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    why.add_argument("model", help="a model name from llmgw.toml")
    return []


APPLY = Verb(
    "apply",
    "create or update models from a file of [[models]] tables (-f FILE, - for stdin)",
    run_apply,
    _apply_arguments,
    "Create or update one or more models from TOML [[models]] tables: the same keys as "
    "llmgw.toml's [[models]], checked by the control plane with the same rules (a problem names "
    "the key and its line in FILE, and nothing is changed). Prints one line per model: "
    "model/NAME created, configured or unchanged.\n\n"
    "A model applied here stays across restarts. A model llmgw.toml also defines keeps what "
    "apply made of it until its [[models]] table in the file changes: then the file wins "
    "(README: Models as objects).",
)
SCALE = Verb(
    "scale",
    "set a model's replica count (0 stops every replica, the model stays)",
    run_scale,
    _scale_arguments,
    "Set MODEL's replica count. Replicas added are placed and started; replicas taken away are "
    "drained (a ready engine finishes its requests, the router sends it nothing new) and stopped, "
    "the highest-numbered first. Prints model/NAME scaled (or unchanged).",
)
DELETE = Verb(
    "delete",
    "delete a model: its replicas drain and stop, then it is gone",
    run_delete,
    _delete_arguments,
    "Delete MODEL: it leaves the router's table before the answer (new requests for it get 404), "
    "its replicas are drained (requests under way finish) and stopped, then the model leaves the "
    "catalog. A model llmgw.toml defines is refused (it would come back at the next start): remove "
    "it from the file and send the control plane SIGHUP.",
)
WHY = Verb(
    "why",
    "why MODEL's replicas are placed where they are, or why they cannot run",
    one_request(lambda args: ("GET", f"/api/why/{model_name(args.model)}"), why_text),
    _why_arguments,
    text=why_text,
)
