"""Control planes keeping their state in a real etcd (``[state] backend = "etcd"``), with real
agents and ``sim`` engines: a restart takes the state back from etcd and restarts no engine; of two
control planes on one prefix one leads, and when it is killed the other leads within the lease TTL
plus 2 s, the agents (given both URLs) go to it, and no engine is started twice."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.etcdproc import Member
from tests.fleet_procs import CHAT, LAYOUT_A, ControlProcess, Fleet, catalog, pid_alive, poll, sim_processes

TTL = 3


def etcd_state(member: Member, prefix: str = "/llmgw/") -> str:
    return f'[state]\nbackend = "etcd"\nendpoints = ["{member.endpoint}"]\nprefix = "{prefix}"\nlease_ttl = {TTL}\n'


def etcd_keys(member: Member, prefix: str) -> list[str]:
    import base64

    body = {
        "key": base64.b64encode(prefix.encode()).decode(),
        "range_end": base64.b64encode(prefix[:-1].encode() + b"0").decode(),
        "keys_only": True,
    }
    doc = httpx.post(f"{member.endpoint}/v3/kv/range", json=body, timeout=10).json()
    return sorted(base64.b64decode(kv["key"]).decode() for kv in doc.get("kvs", []))


@pytest.fixture
def etcd_fleet(tmp_path: Path, etcd: Member) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, "e", LAYOUT_A, extra=etcd_state(etcd), top="insecure = true")
    fleet.start()
    yield fleet
    fleet.stop()


def test_an_etcd_backed_restart_takes_the_state_from_etcd_and_restarts_no_engine(
    etcd_fleet: Fleet, etcd: Member
) -> None:
    chat = CHAT.format(tag="e")
    poll(f"2 ready replicas of {chat}", lambda: etcd_fleet.ready_replicas(chat, 2))
    keys = etcd_keys(etcd, "/llmgw/")
    assert {"/llmgw/leader", "/llmgw/format", "/llmgw/join-token", "/llmgw/shard-key-secret"} <= set(keys)
    assert {f"/llmgw/nodes/{n}" for n in ("gpu01", "gpu02", "gpu03")} <= set(keys)
    assert sum(k.startswith(f"/llmgw/placements/{chat}/") for k in keys) == 2
    assert not (etcd_fleet.cp.state_dir() / "control-state.json").exists()  # nothing on the disk
    before = sim_processes(chat)
    assert len(before) == 2
    etcd_fleet.cp.kill9()
    started = time.monotonic()
    etcd_fleet.cp.start()  # a standby until the killed process's lease lapses, then the leader
    took = time.monotonic() - started
    assert took < TTL + 2 + 5, f"took {took:.1f} s to lead again"
    log = etcd_fleet.cp.log.read_text()
    assert re.search(r"restored 3 node\(s\) \(0 of them lost\), 2 placement\(s\) .* from etcd", log), log[
        -3000:
    ]
    poll(
        "all three nodes ready again",
        lambda: (
            sorted(n["node_id"] for n in etcd_fleet.cp.api("/api/nodes") if n["state"] == "ready")
            == ["gpu01", "gpu02", "gpu03"]
        ),
    )
    poll(f"{chat} ready again", lambda: etcd_fleet.ready_replicas(chat, 2))
    assert sim_processes(chat) == before and all(pid_alive(p) for p in before)
    print(f"a restarted control plane led again after {took:.1f} s (lease TTL {TTL} s)")


def test_two_control_planes_one_leads_and_the_other_takes_over_after_a_kill9(
    tmp_path: Path, etcd: Member
) -> None:
    fleet = Fleet(tmp_path, "h", LAYOUT_A, extra=etcd_state(etcd), top="insecure = true")
    standby = ControlProcess(
        tmp_path / "cp2", catalog("h", tmp_path / "cp2" / "state", etcd_state(etcd), top="insecure = true")
    )
    chat = CHAT.format(tag="h")
    try:
        fleet.cp.start()
        offset = standby.spawn()
        poll("the second control plane to wait as a standby", lambda: "standby:" in standby.log.read_text())
        found = re.search(r'agents = "127.0.0.1:(\d+)"', standby.config.read_text())
        assert found is not None
        fleet.start(server=f"http://127.0.0.1:{fleet.cp.agent_port},http://127.0.0.1:{found.group(1)}")
        poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
        before = sim_processes(chat)
        assert len(before) == 2
        fleet.cp.kill9()
        killed = time.monotonic()
        poll("the standby to lead", lambda: "leading (epoch" in standby.log.read_text(), timeout=TTL + 10)
        took = time.monotonic() - killed
        assert took < TTL + 2, f"the standby led {took:.1f} s after the leader was killed (TTL {TTL} s)"
        standby.wait_ready(offset)
        poll(
            "all three nodes ready on the new leader",
            lambda: (
                sorted(n["node_id"] for n in standby.api("/api/nodes") if n["state"] == "ready")
                == ["gpu01", "gpu02", "gpu03"]
            ),
        )
        poll(
            f"{chat} ready on the new leader",
            lambda: [r for r in standby.api("/api/replicas") if r["model"] == chat and r["state"] == "ready"][
                1:
            ],
        )
        # The same two engines, and only they: none restarted, none started twice.
        assert sim_processes(chat) == before and all(pid_alive(p) for p in before)
        print(f"the standby led {took:.2f} s after the leader's kill -9 (lease TTL {TTL} s)")
    finally:
        fleet.stop()
        standby.terminate()


def test_a_stopped_leader_hands_over_at_once_and_a_standby_stops_on_sigterm(
    tmp_path: Path, etcd: Member
) -> None:
    """SIGTERM: the leader saves and revokes its lease, so the standby leads well within the TTL
    (10 s here); a standby, waiting to lead, stops on SIGTERM too (exit 0) and wrote nothing."""
    state = etcd_state(etcd).replace(f"lease_ttl = {TTL}", "lease_ttl = 10")
    planes = [
        ControlProcess(
            tmp_path / f"cp{i}", catalog("s", tmp_path / f"cp{i}" / "state", state, top="insecure = true")
        )
        for i in range(3)
    ]
    try:
        planes[0].start()
        offsets = [p.spawn() for p in planes[1:]]
        for p in planes[1:]:
            poll("a standby", lambda p=p: "standby:" in p.log.read_text())  # type: ignore[misc]
        planes[2].terminate()
        assert planes[2].proc is not None and planes[2].proc.returncode == 0, planes[2].log.read_text()[
            -2000:
        ]
        assert not (planes[2].state_dir() / "control-state.json").exists()
        stopped = time.monotonic()
        planes[0].terminate()
        assert planes[0].proc is not None and planes[0].proc.returncode == 0
        assert "state saved in etcd" in planes[0].log.read_text()
        planes[1].wait_ready(offsets[0])
        took = time.monotonic() - stopped
        assert took < 5, f"the standby led {took:.1f} s after the leader stopped (TTL 10 s)"
        print(f"handed over in {took:.2f} s (lease TTL 10 s)")
    finally:
        for p in planes:
            p.terminate()


def test_a_leader_whose_lease_is_gone_steps_down_and_the_standby_leads(tmp_path: Path, etcd: Member) -> None:
    """The leader's lease revoked behind its back (as when etcd expired it while the leader was
    paused): the leader logs that it steps down and exits 1, having sent nothing more; the standby
    leads at a larger epoch."""
    import base64

    state = etcd_state(etcd)
    planes = [
        ControlProcess(
            tmp_path / f"cp{i}", catalog("d", tmp_path / f"cp{i}" / "state", state, top="insecure = true")
        )
        for i in range(2)
    ]
    try:
        planes[0].start()
        offset = planes[1].spawn()
        poll("a standby", lambda: "standby:" in planes[1].log.read_text())
        key = base64.b64encode(b"/llmgw/leader").decode()
        [kv] = httpx.post(f"{etcd.endpoint}/v3/kv/range", json={"key": key}, timeout=10).json()["kvs"]
        httpx.post(
            f"{etcd.endpoint}/v3/lease/revoke", json={"ID": kv["lease"]}, timeout=10
        ).raise_for_status()
        old = planes[0].proc
        assert old is not None
        poll("the old leader to exit", lambda: old.poll() is not None, timeout=TTL + 10)
        assert old.returncode == 1
        log = planes[0].log.read_text()
        assert "stepping down" in log, log[-2000:]
        planes[1].wait_ready(offset)
        epochs = [int(m) for p in planes for m in re.findall(r"leading \(epoch (\d+)", p.log.read_text())]
        assert len(epochs) == 2 and epochs[1] > epochs[0]
    finally:
        for p in planes:
            p.terminate()


@pytest.mark.chaos
def test_a_leader_paused_past_its_lease_sends_nothing_when_resumed_and_steps_down(
    tmp_path: Path, etcd: Member
) -> None:
    """SIGSTOP the leader past its lease: the standby leads and the agents go to it; SIGCONT the old
    one: it sends no command (its lease is not valid for one), logs that it steps down and exits 1;
    the engines are the same processes throughout."""
    import os
    import signal

    fleet = Fleet(tmp_path, "p", LAYOUT_A, extra=etcd_state(etcd), top="insecure = true")
    standby = ControlProcess(
        tmp_path / "cp2", catalog("p", tmp_path / "cp2" / "state", etcd_state(etcd), top="insecure = true")
    )
    chat = CHAT.format(tag="p")
    old = None
    try:
        fleet.cp.start()
        offset = standby.spawn()
        poll("the second control plane to wait as a standby", lambda: "standby:" in standby.log.read_text())
        found = re.search(r'agents = "127.0.0.1:(\d+)"', standby.config.read_text())
        assert found is not None
        fleet.start(server=f"http://127.0.0.1:{fleet.cp.agent_port},http://127.0.0.1:{found.group(1)}")
        poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
        before = sim_processes(chat)
        old = fleet.cp.proc
        assert old is not None
        os.kill(old.pid, signal.SIGSTOP)
        poll("the standby to lead", lambda: "leading (epoch" in standby.log.read_text(), timeout=TTL + 10)
        standby.wait_ready(offset)
        poll(
            "all three nodes ready on the new leader",
            lambda: (
                sorted(n["node_id"] for n in standby.api("/api/nodes") if n["state"] == "ready")
                == ["gpu01", "gpu02", "gpu03"]
            ),
        )
        resumed_at = fleet.cp.log.stat().st_size
        os.kill(old.pid, signal.SIGCONT)
        poll("the old leader to step down and exit", lambda: old.poll() is not None, timeout=30)
        after = fleet.cp.log.read_bytes()[resumed_at:].decode(errors="replace")
        assert old.returncode == 1 and "stepping down" in after, after[-3000:]
        assert not re.search(r"llmgw.control: (start|stop|drain) ", after), after[-3000:]
        poll(
            f"{chat} ready on the new leader",
            lambda: [r for r in standby.api("/api/replicas") if r["model"] == chat and r["state"] == "ready"][
                1:
            ],
        )
        assert sim_processes(chat) == before and all(pid_alive(p) for p in before)
    finally:
        if old is not None and old.poll() is None:
            os.kill(old.pid, signal.SIGCONT)
        fleet.stop()
        standby.terminate()
