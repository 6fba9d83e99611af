"""``logs SHARD [--tail N] [-f] [--previous]``: a shard's engine log, read by its agent and sent
over its stream (the control plane asks; the node needs no shell access)."""

from __future__ import annotations

import argparse
import json
import time

from control.ctl.base import POLL_SECONDS, Api, CtlFailed, Verb


def run(api: Api, args: argparse.Namespace) -> int:
    # --tail is checked where its bound is defined, by the API (400 naming the range and the value).
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


def _arguments(logs: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
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
    return []


LOGS = Verb(
    "logs",
    "a shard's engine log, fetched from its agent (-f to follow, --previous for the last run)",
    run,
    _arguments,
    "Print the tail of a shard's engine log, read by its agent and sent over its stream.",
)
