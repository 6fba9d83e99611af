"""Fault tests of the control plane with real processes: agents paused (SIGSTOP) and resumed (SIGCONT).

The fleet: gpu01 (8 GPUs) and gpu02 (4 GPUs), both on ib-a; the test catalog's chat model wants two
2-GPU replicas, and both start on gpu02 (started first), the victim. Liveness is 1.5 s to unreachable and
4 s more to lost. Each test prints the time from SIGCONT to the node being ready again, as
``/api/nodes`` shows it (polled every 0.2 s, so the figure is up to 0.2 s high).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet_procs import CHAT, Fleet, engines_by_port, pid_alive, poll

pytestmark = pytest.mark.chaos

LAYOUT = [("gpu01", "h100x8.toml", "ib-a", "127.0.0.1"), ("gpu02", "h100x4.toml", "ib-a", "127.0.0.2")]


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    tag = "paused-" + request.node.name.split("_")[3]  # unreachable / lost: unique engine markers
    fleet = Fleet(tmp_path, tag, LAYOUT)
    try:
        # gpu02 alone first: both chat replicas start there whatever order the agents would register in.
        fleet.start(only={"gpu02"})
        poll("2 ready chat replicas on gpu02", lambda: fleet.ready_replicas(CHAT.format(tag=tag), 2))
        fleet.start()
        poll("gpu01 ready", lambda: any(n["node_id"] == "gpu01" for n in fleet.cp.api("/api/nodes")))
        yield fleet
    finally:
        fleet.stop()


def node_of(fleet: Fleet, node_id: str) -> dict[str, Any]:
    return next(n for n in fleet.cp.api("/api/nodes") if n["node_id"] == node_id)


def slots(fleet: Fleet, chat: str) -> dict[str, tuple[str, str, int]]:
    """replica id -> (shard id, node, port) of the placed shard."""
    return {
        r["replica_id"]: (s["shard_id"], s["node_id"], s["port"])
        for r in fleet.replicas(chat)
        for s in r["shards"]
        if s["placed"]
    }


def pause_until(fleet: Fleet, victim: str, state: str) -> float:
    """SIGSTOP the victim's agent until the control plane calls it ``state``, then SIGCONT it; returns
    the seconds from SIGCONT until the node is ready again, printed for the closing note."""
    agent = fleet.agents[victim]
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        poll(f"{victim} {state}", lambda: node_of(fleet, victim)["state"] == state, timeout=30)
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    poll(f"{victim} ready after SIGCONT", lambda: node_of(fleet, victim)["state"] == "ready", timeout=30)
    took = time.monotonic() - resumed
    reason = node_of(fleet, victim)["reason"]
    print(f"\nSIGCONT to ready ({state} before): {took:.2f} s ({reason})")
    return took


def test_paused_past_unreachable_after_is_ready_again_and_nothing_moves(fleet: Fleet) -> None:
    chat = CHAT.format(tag=fleet.tag)
    poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
    before = slots(fleet, chat)
    engines = engines_by_port(chat)
    victim = next(iter(before.values()))[1]
    took = pause_until(fleet, victim, "unreachable")
    # Well inside lost_after (4 s): the agent's next heartbeat, 0.3 s apart, is enough.
    assert took < 3.0
    history = [h["to"] for h in node_of(fleet, victim)["history"]]
    assert "lost" not in history and history[-2:] == ["unreachable", "ready"]
    # No replica moved, no engine was started or stopped.
    assert slots(fleet, chat) == before
    assert fleet.ready_replicas(chat, 2) is not None
    assert engines_by_port(chat) == engines


def test_paused_past_lost_after_ends_with_one_engine_per_slot(fleet: Fleet) -> None:
    chat = CHAT.format(tag=fleet.tag)
    poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
    before = slots(fleet, chat)
    victim = next(iter(before.values()))[1]
    assert {node for _, node, _ in before.values()} == {victim}  # both on gpu02, started first
    old_pids = [p for pids in engines_by_port(chat).values() for p in pids]
    assert len(old_pids) == 2

    def moved() -> bool:
        now = slots(fleet, chat)
        return all(node != victim for _, node, _ in now.values()) and bool(fleet.ready_replicas(chat, 2))

    agent = fleet.agents[victim]
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        poll(f"{victim} lost", lambda: node_of(fleet, victim)["state"] == "lost", timeout=30)
        poll(f"{chat} ready off {victim}", moved, timeout=60)
        # The paused node's engines kept running: two engines per slot for now.
        assert all(pid_alive(p) for p in old_pids) and len(engines_by_port(chat)) == 4
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    poll(f"{victim} ready after SIGCONT", lambda: node_of(fleet, victim)["state"] == "ready", timeout=30)
    print(
        f"\nSIGCONT to ready (lost before): {time.monotonic() - resumed:.2f} s "
        f"({node_of(fleet, victim)['reason']})"
    )
    after = slots(fleet, chat)

    def one_engine_per_slot() -> dict[int, list[int]] | None:
        found = engines_by_port(chat)
        placed = {port for _, _, port in after.values()}
        if set(found) == placed and all(len(pids) == 1 for pids in found.values()):
            return found
        return None

    final = poll("exactly one engine per replica slot", one_engine_per_slot, timeout=60)
    print(f"engines per slot after the node came back: {[len(p) for p in final.values()]}")
    # An old engine may be mid-exit (its command line already gone, not yet reaped): wait it out.
    poll("the paused node's old engines gone", lambda: not any(pid_alive(p) for p in old_pids), timeout=30)
    assert slots(fleet, chat) == after  # the new placements won; nothing moved back
    answer = httpx.post(
        f"http://127.0.0.1:{fleet.cp.router_port}/v1/completions",
        json={"model": chat, "prompt": "hi", "max_tokens": 2},
        timeout=10,
    )
    assert answer.status_code == 200
