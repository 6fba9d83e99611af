"""Fault tests for the agent: ``kill -9`` around a start, damaged records, a SIGSTOPped engine.

Real agent processes against a grpcio control plane, real ``sim`` engines. The invariant is checked
from ``/proc`` itself: after every restart, exactly one engine process per shard (counted by the
marker in the engines' environment) and it serves. Where a real control plane would start a shard
again (the restarted agent does not list it), the test does what the control plane does.
Each test is bounded and ends every process it started, engines included, by pid.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import schema
from agent.supervise.records import ShardRecord
from agent.supervise.supervisor import TEST_KILL_AT_ENV
from tests.fleet_procs import Agent, free_port, pid_alive
from tests.grpcio_cp import GrpcioControlPlane, NodeStream, wait_for
from tests.test_agent import agent_process, registered, start_spec, state_of

pytestmark = pytest.mark.chaos

State = schema.ShardState
LIVE = (State.STARTING, State.READY, State.UNHEALTHY, State.DRAINING)

#: Milliseconds from sending StartShard to kill -9 of the agent: before it reads the command,
#: around the intent record and the spawn, and well after.
KILL_DELAYS_MS = (0, 5, 15, 30, 60, 100, 160, 250, 400, 700)


@pytest.fixture
def cp() -> Iterator[GrpcioControlPlane]:
    server = GrpcioControlPlane()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def agent(cp: GrpcioControlPlane, tmp_path: Path) -> Iterator[Agent]:
    proc = agent_process(cp.port, tmp_path)
    yield proc
    proc.stop_all()


def restart(cp: GrpcioControlPlane, agent: Agent, env: dict[str, str] | None = None) -> NodeStream:
    before = len(cp.streams)
    agent.start(env)
    return registered(cp, agent.node_id, after=before)


def ready_on(node: NodeStream, shard_id: str) -> schema.ShardStatus:
    """READY as the Register listed it, or as a later ShardStatus says."""

    def check() -> schema.ShardStatus | None:
        for s in node.register.shards:
            if s.shard_id == shard_id and s.state == State.READY:
                return s
        return state_of(node, shard_id, State.READY)

    return wait_for(f"{shard_id} READY", check, timeout=30)


def serves(port: int) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=10)
    reply = client.chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    return reply.choices[0].message.content or ""


def as_control_plane_would(node: NodeStream, spec: schema.StartShard) -> bool:
    """Start the shard again unless the restarted agent listed it live; whether it was listed."""
    listed = {s.shard_id: s for s in node.register.shards}
    if spec.shard_id in listed and listed[spec.shard_id].state in LIVE:
        return True
    node.send(start=spec)
    return False


def test_kill9_at_varied_instants_around_a_start_leaves_one_engine(
    cp: GrpcioControlPlane, agent: Agent
) -> None:
    agent.start()
    node = registered(cp, agent.node_id)
    outcomes = []
    for i, delay_ms in enumerate(KILL_DELAYS_MS):
        shard_id, port = f"kill{i}-r0-s0", free_port()
        spec = start_spec(shard_id, port)
        node.send(start=spec)
        # The fault's timing, not a wait for an event: the kill lands at a different instant each round.
        time.sleep(delay_ms / 1000)
        agent.kill9()
        node = restart(cp, agent)
        adopted = as_control_plane_would(node, spec)
        ready = ready_on(node, shard_id)
        engines = agent.marked_engines(shard_id)
        assert engines == [ready.pid], f"kill -9 {delay_ms} ms after StartShard: engines {engines}"
        assert serves(port).strip()
        outcomes.append((delay_ms, "adopted" if adopted else "started again"))
        node.send(stop=schema.StopShard(shard_id=shard_id, grace_seconds=5))
        wait_for(f"{shard_id} STOPPED", lambda: state_of(node, shard_id, State.STOPPED))  # noqa: B023
        assert agent.marked_engines(shard_id) == []
    print("kill -9 after StartShard -> outcome (one engine each):", outcomes)
    # The late kills land after the spawn: those engines were found again, not started twice.
    assert outcomes[-1][1] == "adopted"
    assert agent.marked_engines() == []


@pytest.mark.parametrize("point", ["after-intent", "after-spawn"])
def test_agent_killed_between_intent_spawn_and_record(
    cp: GrpcioControlPlane, agent: Agent, point: str
) -> None:
    """The test hook makes the agent SIGKILL itself at a named point of a start: deterministic, where
    the timing loop above is statistical. ``after-spawn`` is the fork-to-record window that used to
    leave an orphan serving while a second copy crash-looped on its port."""
    agent.start(env={TEST_KILL_AT_ENV: point})
    node = registered(cp, agent.node_id)
    shard_id, port = f"{point}-r0-s0", free_port()
    spec = start_spec(shard_id, port)
    node.send(start=spec)
    assert agent.proc is not None
    wait_for("the agent to kill itself", lambda: agent.proc is not None and agent.proc.poll() is not None)
    assert agent.proc.returncode == -signal.SIGKILL
    record = json.loads((agent.state_dir / "shards" / f"{shard_id}.json").read_text())
    assert record["pid"] == 0, "the intent is on disk before the spawn"
    if point == "after-spawn":
        orphan = wait_for("the orphan engine in /proc", lambda: agent.marked_engines(shard_id))
        assert len(orphan) == 1
    else:
        assert agent.marked_engines(shard_id) == []

    node = restart(cp, agent)
    listed = as_control_plane_would(node, spec)
    ready = ready_on(node, shard_id)
    assert listed is (point == "after-spawn")
    if point == "after-spawn":
        # Adopted from /proc, READY in the Register itself, and its record rebuilt with the pid.
        assert ready.pid == orphan[0]
        record = json.loads((agent.state_dir / "shards" / f"{shard_id}.json").read_text())
        assert record["pid"] == orphan[0]
    assert agent.marked_engines(shard_id) == [ready.pid]
    assert serves(port).strip()


def test_damaged_records_are_rebuilt_from_the_engines_marker(
    cp: GrpcioControlPlane, agent: Agent, tmp_path: Path
) -> None:
    """Three engines, then kill -9, then each record damaged a different way: every engine is
    adopted READY from its marker, none is started twice, and an agent sharing the host (its own
    state directory) adopts none of them."""
    agent.start()
    node = registered(cp, agent.node_id)
    damage = {"truncated": b"", "corrupt": b"\x00\xff{not json", "missing": None}
    ports = {}
    for how in damage:
        ports[how] = free_port()
        node.send(start=start_spec(f"{how}-r0-s0", ports[how]))
    pids = {how: wait_for(how, lambda: state_of(node, f"{how}-r0-s0", State.READY)).pid for how in damage}  # noqa: B023
    agent.kill9()
    records = agent.state_dir / "shards"
    for how, content in damage.items():
        path = records / f"{how}-r0-s0.json"
        if content is None:
            path.unlink()
        elif how == "truncated":
            path.write_bytes(path.read_bytes()[:37])
        else:
            path.write_bytes(content)
    # An intent with nothing behind it (a crash before the spawn): dropped, not reported.
    never = start_spec("never-r0-s0", free_port())
    intent = ShardRecord("never-r0-s0", "vllm", 0, 0, never.http_port, "/nowhere.log", never)
    (records / "never-r0-s0.json").write_text(intent.to_json())

    neighbour = agent_process(cp.port, tmp_path / "neighbour", node_id="gpu08")
    neighbour.start()
    try:
        node = restart(cp, agent)
        listed = {s.shard_id: s for s in node.register.shards}
        assert set(listed) == {f"{how}-r0-s0" for how in damage}
        for how, pid in pids.items():
            status = listed[f"{how}-r0-s0"]
            assert (status.state, status.pid) == (State.READY, pid), (how, status)
            assert agent.marked_engines(f"{how}-r0-s0") == [pid]
            rebuilt = json.loads((records / f"{how}-r0-s0.json").read_text())
            assert rebuilt["pid"] == pid
            assert serves(ports[how]).strip()
        assert not (records / "never-r0-s0.json").exists()
        assert list(registered(cp, "gpu08").register.shards) == []
        assert neighbour.marked_engines() == []
    finally:
        neighbour.stop_all()


def test_sigstopped_engine_is_reported_unhealthy_then_ready(cp: GrpcioControlPlane, tmp_path: Path) -> None:
    period, timeout, failures = 0.5, 0.5, 3
    agent = Agent(
        tmp_path,
        "gpu07",
        f"http://127.0.0.1:{cp.port}",
        "h100x8.toml",
        fabrics="ib-a:mlx5_0:1",
        mgmt_addr="127.0.0.1",
        extra=(
            "--liveness-period", str(period),
            "--liveness-timeout", str(timeout),
            "--liveness-failures", str(failures),
        ),
    )  # fmt: skip
    agent.start()
    try:
        node = registered(cp, "gpu07")
        port = free_port()
        node.send(start=start_spec("hang-r0-s0", port))
        pid = wait_for("READY", lambda: state_of(node, "hang-r0-s0", State.READY)).pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        unhealthy = wait_for("UNHEALTHY", lambda: state_of(node, "hang-r0-s0", State.UNHEALTHY), timeout=15)
        took = time.monotonic() - stopped
        assert unhealthy.error == (
            f"liveness probe failed {failures} times in a row: GET /health timed out after {timeout:g} s"
        )
        assert took < period * failures + timeout + 2.0, took
        seen = len(node.shard_updates("hang-r0-s0"))
        os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(
            "READY again",
            lambda: [u for u in node.shard_updates("hang-r0-s0")[seen:] if u.state == State.READY],
        )
        print(
            f"SIGSTOP -> UNHEALTHY at the control plane: {took:.2f} s; SIGCONT -> READY: {time.monotonic() - resumed:.2f} s"
        )
        assert pid_alive(pid) and serves(port).strip()
    finally:
        agent.stop_all()
