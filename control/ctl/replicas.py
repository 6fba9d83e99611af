"""``replicas``: every shard of every replica in one table (the verb that predates ``get replicas``),
with a failed engine's last words under it."""

from __future__ import annotations

from typing import Any

from control.ctl.base import Verb, one_request
from control.ctl.text import OLD_GAP, table


def replicas_text(doc: Any) -> str:
    """``replicas``: one row per shard, two spaces apart; a failed engine's output tail below."""
    rows = []
    for r in doc:
        for s in r["shards"]:
            detail = s["error"] or s.get("note", "")
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
    text = table(rows, ["REPLICA", "SHARD", "NODE", "STATE", "GPUS", "URL", "RANK", "DETAIL"], OLD_GAP)
    # A failed engine's last words, under the table: the reason is usually in them.
    tails = [
        f"\n{s['shard_id']} output (last {len(s['output_tail'])} lines):\n"
        + "\n".join(f"  | {line}" for line in s["output_tail"])
        for r in doc
        for s in r["shards"]
        if s["state"] == "failed" and s.get("output_tail")
    ]
    return "\n".join([text, *tails])


REPLICAS = Verb(
    "replicas",
    "every shard of every replica in one table: node, state, GPUs, URL, rank, errors",
    one_request(lambda args: ("GET", "/api/replicas"), replicas_text),
    text=replicas_text,
)
