"""``rollout status MODEL [--wait]``: a model's rolling change (``control.rollout``), in kubectl's
words."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from control.ctl.base import Api, Verb, action, add_wait_options, model_name, wait_until


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
    states: list[str] = []

    def status() -> tuple[bool, str]:
        doc = api.get(f"/api/models/{name}")
        line, state = rollout_line(name, doc.get("rollout"))
        states.append(state)
        if args.output == "json":
            print(json.dumps(doc.get("rollout"), indent=2), flush=True)
        return state in ("failed", "complete") or not args.wait, line

    def show(line: str) -> None:
        if args.output != "json":
            print(line, file=sys.stderr if states[-1] == "failed" else sys.stdout, flush=True)

    wait_until(status, args.timeout, f"ctl: rollout status {name}: not complete", show=show)
    return 1 if states[-1] == "failed" else 0


def _arguments(rollout: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    status = action(
        rollout,
        "rollout_command",
        "status",
        "show MODEL's rollout: progress, done, or why it failed",
        "Show MODEL's rollout in one line (kubectl's words): how many replicas are "
        "updated and ready, old ones still to go, or why it failed or waits (a replica that cannot "
        "be placed). Exit 0 when the rollout is complete (or, without --wait, still progressing), "
        "1 when it failed or --timeout passed.",
    )
    status.add_argument("model", help="the model name, or model/NAME")
    add_wait_options(status, "print each change of progress until the rollout completes or fails")
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
