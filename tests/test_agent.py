"""The real agent process against a grpcio control plane, with real ``sim`` engines.

Profiles name engine ``vllm`` and the agent's vLLM binary is pointed at the simulator, so every start
runs the vLLM adapter's real argument construction end to end.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import schema
from tests.fleet_procs import Agent, free_port, pid_alive
from tests.grpcio_cp import GrpcioControlPlane, NodeStream, wait_for

State = schema.ShardState


def agent_process(
    cp_port: int, workdir: Path, node_id: str = "gpu07", inventory: str | None = "h100x8.toml"
) -> Agent:
    return Agent(
        workdir,
        node_id,
        f"http://127.0.0.1:{cp_port}",
        inventory,
        fabrics="ib-a:mlx5_0:1,ib-a:mlx5_1:1",
        mgmt_addr="127.0.0.1",
        extra=("--stop-grace", "5", "--labels", "zone=a,pool=test"),
    )


@pytest.fixture
def cp() -> Iterator[GrpcioControlPlane]:
    server = GrpcioControlPlane()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def agent(cp: GrpcioControlPlane, tmp_path: Path) -> Iterator[Agent]:
    proc = agent_process(cp.port, tmp_path)
    proc.start()
    yield proc
    proc.stop_all()


def start_spec(shard_id: str, port: int, **profile: object) -> schema.StartShard:
    env = {"LLMGW_SIM_LOAD_SECONDS": "0.5", "LLMGW_SIM_ITL_MS": "1", "LLMGW_SIM_TTFT_MS": "1"}
    env.update(profile.pop("env", {}))  # type: ignore[arg-type]
    fields: dict[str, object] = {
        "engine": "vllm",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "served_model_name": "llama-8b",
        "tensor_parallel_size": 2,
        "dtype": "bfloat16",
        "env": env,
    }
    fields.update(profile)
    return schema.StartShard(
        shard_id=shard_id,
        replica_id=shard_id.rsplit("-", 1)[0],
        profile=schema.EngineProfile(**fields),  # type: ignore[arg-type]
        gpu_indices=[0, 1],
        http_port=port,
        ready_timeout_seconds=30,
    )


def registered(cp: GrpcioControlPlane, node_id: str, after: int = 0) -> NodeStream:
    return wait_for(
        f"{node_id} to register (stream #{after + 1})",
        lambda: cp.latest(node_id, after),
    )


def state_of(node: NodeStream, shard_id: str, state: schema.ShardState) -> schema.ShardStatus | None:
    for update in node.shard_updates(shard_id):
        if update.state == state:
            return update
    return None


def test_register_carries_inventory_fabrics_and_heartbeats(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    reg = node.register
    assert [g.index for g in reg.gpus] == list(range(8))
    assert reg.gpus[0].name == "NVIDIA H100 80GB HBM3" and reg.gpus[0].compute_capability == "9.0"
    assert reg.gpus[5].nvlink_peers == [0, 1, 2, 3, 4, 6, 7]
    assert [(f.fabric, f.hca, f.port) for f in reg.fabrics] == [("ib-a", "mlx5_0", 1), ("ib-a", "mlx5_1", 1)]
    assert reg.labels == {"zone": "a", "pool": "test"}
    assert reg.mgmt_addr == "127.0.0.1" and reg.mgmt_interface == "eth0"
    assert reg.driver_version == "550.54.15" and reg.discovery_error == ""
    assert reg.engine_ports.first == 8000 and reg.engine_ports.last == 8999
    beats = wait_for(
        "three heartbeats",
        lambda: (
            [m for m in node.received if m.heartbeat]
            if len([m for m in node.received if m.heartbeat]) >= 3
            else None
        ),
    )
    assert {g.index for g in beats[0].heartbeat.gpus} == set(range(8))


def test_start_ready_stream_kill_stop_duplicate_and_refusal(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    port = free_port()
    start_id = node.send(start=start_spec("llama-r0-s0", port))
    ready = wait_for("llama-r0-s0 READY", lambda: state_of(node, "llama-r0-s0", State.READY))
    assert node.acks()[start_id].ok
    assert state_of(node, "llama-r0-s0", State.STARTING) is not None, "STARTING must precede READY"
    pid = ready.pid
    assert pid_alive(pid) and ready.http_port == port

    # The engine answers a streaming chat completion (the openai client, an independent peer).
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    chunks = list(
        client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hello"}], stream=True, max_tokens=8
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()

    # The vLLM adapter's argv reached the engine: its log shows what it was started with.
    logs_id = node.send(logs=schema.LogsRequest(shard_id="llama-r0-s0", lines=200))
    reply = wait_for(
        "LogsReply",
        lambda: next((m.logs for m in node.received if m.logs and m.logs.request_id == logs_id), None),
    )
    joined = "\n".join(reply.lines)
    assert "--served-model-name llama-8b" in joined and "--tensor-parallel-size 2" in joined

    # A duplicate start spawns nothing and reports the live shard.
    before = len(node.shard_updates("llama-r0-s0"))
    dup_id = node.send(start=start_spec("llama-r0-s0", port))
    wait_for("ack of the duplicate start", lambda: dup_id in node.acks())
    wait_for("a status for the duplicate", lambda: len(node.shard_updates("llama-r0-s0")) > before)
    assert node.shard_updates("llama-r0-s0")[-1].pid == pid
    assert node.shard_updates("llama-r0-s0")[-1].state == State.READY

    # The engine killed: FAILED with its exit code and the tail of its output.
    os.kill(pid, signal.SIGKILL)
    failed = wait_for("llama-r0-s0 FAILED", lambda: state_of(node, "llama-r0-s0", State.FAILED))
    assert failed.exit_code == 128 + signal.SIGKILL
    assert "killed by SIGKILL after it was ready" in failed.error
    assert failed.output_tail and any("llama-8b" in line or "ready" in line for line in failed.output_tail)

    # Start again, then stop: STOPPED and the process group is gone.
    node.send(start=start_spec("llama-r0-s0", port))
    ready2 = wait_for(
        "second READY",
        lambda: [u for u in node.shard_updates("llama-r0-s0") if u.state == State.READY and u.pid != pid],
    )
    pid2 = ready2[-1].pid
    node.send(stop=schema.StopShard(shard_id="llama-r0-s0", grace_seconds=5))
    stopped = wait_for("llama-r0-s0 STOPPED", lambda: state_of(node, "llama-r0-s0", State.STOPPED))
    assert stopped.exit_code == 0
    wait_for("engine process gone", lambda: not pid_alive(pid2))

    # An invalid profile is refused before launch, with the reason, and no process.
    refused_id = node.send(start=start_spec("big-r0-s0", free_port(), tensor_parallel_size=8))
    ack = wait_for("refusal ack", lambda: node.acks().get(refused_id))
    assert not ack.ok and "gpu07: StartShard big-r0-s0 refused" in ack.error
    assert "8" in ack.error and "2 given" in ack.error
    failed_status = wait_for("big-r0-s0 FAILED", lambda: state_of(node, "big-r0-s0", State.FAILED))
    assert failed_status.pid == 0 and "refused" in failed_status.error


@pytest.mark.chaos
def test_agent_kill9_restart_adopts_engines(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    port = free_port()
    node.send(start=start_spec("keep-r0-s0", port))
    pid = wait_for("keep-r0-s0 READY", lambda: state_of(node, "keep-r0-s0", State.READY)).pid

    agent.kill9()
    assert pid_alive(pid), "the engine must outlive the agent"
    streams_before = len(cp.streams)
    agent.start()
    node2 = registered(cp, "gpu07", after=streams_before)
    listed = {s.shard_id: s for s in node2.register.shards}
    assert "keep-r0-s0" in listed and listed["keep-r0-s0"].pid == pid
    # The adopted engine is re-checked and reported ready; never started again.
    wait_for("adopted shard READY", lambda: state_of(node2, "keep-r0-s0", State.READY))
    assert all(u.pid == pid for u in node2.shard_updates("keep-r0-s0"))
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200

    # The restarted agent keeps watching the adopted engine: its death is reported.
    os.killpg(pid, signal.SIGKILL)
    failed = wait_for("adopted shard FAILED", lambda: state_of(node2, "keep-r0-s0", State.FAILED))
    assert "exit code unknown" in failed.error and "after it was ready" in failed.error


def test_drain_stops_taking_work_then_stops(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    port = free_port()
    node.send(start=start_spec("drain-r0-s0", port))
    pid = wait_for("drain-r0-s0 READY", lambda: state_of(node, "drain-r0-s0", State.READY)).pid
    drain_id = node.send(drain=schema.DrainShard(shard_id="drain-r0-s0", deadline_seconds=10))
    wait_for("DRAINING", lambda: state_of(node, "drain-r0-s0", State.DRAINING))
    assert node.acks()[drain_id].ok
    stopped = wait_for("STOPPED after the drain", lambda: state_of(node, "drain-r0-s0", State.STOPPED))
    assert stopped.exit_code == 0
    wait_for("engine gone", lambda: not pid_alive(pid))


def test_control_plane_outage_reconnects_while_engine_serves(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    port = free_port()
    node.send(start=start_spec("steady-r0-s0", port))
    pid = wait_for("steady-r0-s0 READY", lambda: state_of(node, "steady-r0-s0", State.READY)).pid
    cp_port = cp.port

    cp.stop()
    wait_for("the agent to notice", lambda: node.closed.is_set())
    # The engine keeps answering while there is no control plane at all.
    for _ in range(3):
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200

    streams_before = len(cp.streams)
    cp.start(cp_port)
    node2 = registered(cp, "gpu07", after=streams_before)
    assert [s.pid for s in node2.register.shards if s.shard_id == "steady-r0-s0"] == [pid]
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    log = agent.log.read_text()
    assert "reconnecting in" in log


def test_node_without_nvidia_tooling_registers_with_the_reason(
    cp: GrpcioControlPlane, tmp_path: Path
) -> None:
    proc = agent_process(cp.port, tmp_path, node_id="cpu01", inventory=None)
    proc.start()
    try:
        reg = registered(cp, "cpu01").register
    finally:
        proc.stop_all()
    assert list(reg.gpus) == []
    assert "NVML" in reg.discovery_error and "nvidia-smi" in reg.discovery_error
    assert reg.cpu_count >= 1 and reg.memory_total_mib > 0
