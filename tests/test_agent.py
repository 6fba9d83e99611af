"""The real agent process against a grpcio control plane, with real ``sim`` engines.

Profiles name engine ``vllm`` and the agent's vLLM binary is pointed at the simulator, so every start
runs the vLLM adapter's real argument construction end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import schema
from agent.config import ConfigError, load
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
    # The adopted engine was probed before Register: it is READY in the Register itself, so the
    # router never loses it for a moment, and it is never started again.
    assert listed["keep-r0-s0"].state == State.READY, listed["keep-r0-s0"]
    assert state_of(node2, "keep-r0-s0", State.STARTING) is None
    assert all(u.pid == pid for u in node2.shard_updates("keep-r0-s0"))
    assert agent.marked_engines("keep-r0-s0") == [pid]
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

    # A shard listed in this session's Register and then started again on the same stream is a new
    # engine whose states count from the start: every one of them reaches the control plane.
    node2.send(stop=schema.StopShard(shard_id="steady-r0-s0", grace_seconds=5))
    wait_for("steady-r0-s0 STOPPED", lambda: state_of(node2, "steady-r0-s0", State.STOPPED))
    node2.send(start=start_spec("steady-r0-s0", port))
    again = wait_for("steady-r0-s0 READY again", lambda: state_of(node2, "steady-r0-s0", State.READY))
    assert again.pid != pid and pid_alive(again.pid)


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


def test_start_refusals_name_the_field_and_spawn_nothing(cp: GrpcioControlPlane, agent: Agent) -> None:
    """No served name, or a shard id that is empty, folds into another's file or leaves the state
    directory: refused in the Ack, nothing recorded, nothing spawned."""
    node = registered(cp, "gpu07")
    unnamed = node.send(start=start_spec("noname-r0-s0", free_port(), served_model_name=""))
    ack = wait_for("the unnamed start's ack", lambda: node.acks().get(unnamed))
    assert (
        not ack.ok
        and "gpu07: StartShard noname-r0-s0 refused: profile.served_model_name is required" in ack.error
    )
    for bad, shown in (("", "shard_id is empty"), ("llama/r0", "shard_id 'llama/r0' is not valid")):
        mid = node.send(start=start_spec(bad, free_port()))
        ack = wait_for(f"the ack for shard id {bad!r}", lambda: node.acks().get(mid))  # noqa: B023
        assert not ack.ok and ack.error.startswith(f"gpu07: StartShard refused: {shown}"), ack.error
        assert "letters, digits" in ack.error
    # The one valid id of the pair gets its own file, and runs.
    node.send(start=start_spec("llama_r0", free_port()))
    wait_for("llama_r0 READY", lambda: state_of(node, "llama_r0", State.READY))
    assert sorted(p.name for p in (agent.state_dir / "shards").iterdir()) == ["llama_r0.json"]
    assert sorted(p.name for p in (agent.state_dir / "logs").iterdir()) == ["llama_r0.log"]
    assert [s for s in node.shard_updates("") if s.state == State.FAILED] == []
    assert len(agent.marked_engines()) == 1


def test_engine_serving_another_name_is_a_failed_start_at_once(cp: GrpcioControlPlane, agent: Agent) -> None:
    """/health passes, but /v1/models lists another name: FAILED naming both, engine stopped, long
    before the ready timeout (today: READY, and every request through the router is a 404)."""
    node = registered(cp, "gpu07")
    spec = start_spec("named-r0-s0", free_port(), extra_args=["--served-model-name", "someone-else"])
    spec.ready_timeout_seconds = 300
    node.send(start=spec)
    pid = wait_for("STARTING", lambda: state_of(node, "named-r0-s0", State.STARTING)).pid
    failed = wait_for("FAILED", lambda: state_of(node, "named-r0-s0", State.FAILED), timeout=30)
    assert "engine serves 'someone-else', StartShard asked for 'llama-8b'" in failed.error
    assert state_of(node, "named-r0-s0", State.READY) is None
    wait_for("the engine gone", lambda: not pid_alive(pid))


def test_register_lists_live_shards_and_ended_ones_once(cp: GrpcioControlPlane, agent: Agent) -> None:
    node = registered(cp, "gpu07")
    node.send(start=start_spec("ends-r0-s0", free_port()))
    node.send(start=start_spec("runs-r0-s0", free_port()))
    wait_for("ends-r0-s0 READY", lambda: state_of(node, "ends-r0-s0", State.READY))
    wait_for("runs-r0-s0 READY", lambda: state_of(node, "runs-r0-s0", State.READY))
    node.send(stop=schema.StopShard(shard_id="ends-r0-s0", grace_seconds=5))
    wait_for("ends-r0-s0 STOPPED", lambda: state_of(node, "ends-r0-s0", State.STOPPED))
    port = cp.port
    shards_per_register = []
    for _ in range(2):
        cp.stop()
        wait_for("the agent to notice", lambda: cp.streams[-1].closed.is_set())
        before = len(cp.streams)
        cp.start(port)
        reg = registered(cp, "gpu07", after=before).register
        shards_per_register.append({s.shard_id: State(s.state) for s in reg.shards})
    # The ended shard is listed once after it ended, then no more; the live one every time.
    assert shards_per_register == [
        {"ends-r0-s0": State.STOPPED, "runs-r0-s0": State.READY},
        {"runs-r0-s0": State.READY},
    ]


def test_liveness_settings_are_validated_like_the_others() -> None:
    base = ["--node-id", "gpu07", "--server", "http://cp:7443"]
    config = load(base, environ={"LLMGW_AGENT_LIVENESS_PERIOD": "2.5"})
    assert (config.liveness_period, config.liveness_timeout, config.liveness_failures) == (2.5, 5.0, 3)
    for argv, env, message in (
        (
            ["--liveness-failures", "0"],
            {},
            "liveness_failures must be at least 1, got 0 (liveness_failures from --liveness-failures)",
        ),
        (
            [],
            {"LLMGW_AGENT_LIVENESS_TIMEOUT": "0"},
            "liveness_timeout must be greater than 0, got 0.0 (liveness_timeout from LLMGW_AGENT_LIVENESS_TIMEOUT)",
        ),
        (
            ["--liveness-failures", "2.5"],
            {},
            "liveness_failures: invalid value for type, expected int (from --liveness-failures)",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            load(base + argv, environ=env)
        assert message in str(err.value)


def test_liveness_settings_from_toml_name_their_line(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.toml"
    config_file.write_text('node_id = "gpu07"\nserver = "http://cp:7443"\nliveness_period = -1\n')
    with pytest.raises(ConfigError) as err:
        load(["--config", str(config_file)], environ={})
    assert (
        f"liveness_period must be greater than 0, got -1.0 (liveness_period from {config_file} line 3)"
        in str(err.value)
    )


@pytest.mark.parametrize("which", ["state", "log"])
def test_unwritable_state_or_log_directory_is_one_line_and_status_2(tmp_path: Path, which: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    argv = [sys.executable, "-m", "agent", "--node-id", "gpu07", "--server", "http://127.0.0.1:9"]
    env = dict(os.environ)
    if which == "state":
        argv += ["--state-dir", str(blocker / "state")]
        expected = (
            f"llmgw-agent: cannot write the state directory {blocker / 'state'} (Not a directory); "
            "it was chosen by state_dir from --state-dir: make it writable for this user, or set "
            "--state-dir (or LLMGW_AGENT_STATE_DIR) to a directory that is"
        )
    else:
        argv += ["--state-dir", str(tmp_path / "state")]
        env["LLMGW_AGENT_LOG_DIR"] = str(blocker)
        expected = (
            f"llmgw-agent: cannot write the log directory {blocker} (it is a file, not a directory); "
            "it was chosen by log_dir from LLMGW_AGENT_LOG_DIR"
        )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(expected), proc.stderr
