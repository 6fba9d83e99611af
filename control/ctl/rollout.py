"""``rollout status MODEL [--wait]``: a model's rolling change (``control.rollout``), in kubectl's
words."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from control.ctl.base import EXIT_CODES, POLL_SECONDS, Api, CtlFailed, Formatter, Verb, model_name


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
    name = model_name(args.model)
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


def _arguments(rollout: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    actions = rollout.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    status = actions.add_parser(
        "status",
        help="show MODEL's rollout: progress, done, or why it failed",
        description="Show MODEL's rollout in one line (kubectl's words): how many replicas are "
        "updated and ready, old ones still to go, or why it failed or waits (a replica that cannot "
        "be placed). Exit 0 when the rollout is complete (or, without --wait, still progressing), "
        "1 when it failed or --timeout passed.",
        epilog=EXIT_CODES,
        formatter_class=Formatter,
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
    return [status]


ROLLOUT = Verb(
    "rollout",
    "a model's rolling change: rollout status MODEL",
    run_rollout,
    _arguments,
    "A change of a model's profile, GPUs, selector or nodes per replica replaces its replicas "
    "one by one: a new replica is ready before an old one is drained (max_surge and "
    "max_unavailable in [models.rollout]). A new replica that fails stops the rollout; the old "
    "ones keep serving until the model is applied again.",
)
