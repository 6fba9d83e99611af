"""The wire's edges with real processes: a control plane stopped with SIGTERM, an agent killed.

One control plane, one agent (four GPUs from a static inventory) and one ``sim`` engine. What is
checked is what an operator reads: the exit status and how long the stop took, the state file a
restart needs, and logs on both sides with no protocol error and no traceback.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet_procs import Agent, ControlProcess, free_port, poll, sim_processes

pytestmark = pytest.mark.chaos

MODEL = "wire-chat"
#: SIGTERM to exit: the stream server's shutdown_grace (5 s) plus its bounded steps (about 7 s) is
#: the worst case with hung agents; a healthy agent leaves at the GOAWAY, so this is generous.
STOP_BOUND_S = 15.0


def catalog(state_dir: Path, agent_port: int) -> str:
    return f"""
state_dir = "{state_dir}"
reconcile_interval = 0.3
backoff_initial = 0.5
[engines]
ports = "23000-23099"
[listen]
agents = "127.0.0.1:{agent_port}"
api = "127.0.0.1:0"
router = "127.0.0.1:0"
[liveness]
unreachable_after = 1.5
lost_after = 30.0
startup_grace = 30.0

[[models]]
name = "{MODEL}"
replicas = 1
[models.gpus]
count = 1
[models.profile]
engine = "vllm"
model = "meta-llama/Llama-3.1-8B-Instruct"
served_model_name = "{MODEL}"
env = {{ LLMGW_SIM_LOAD_SECONDS = "0.3", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "1" }}
"""


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.state_dir = tmp / "cp" / "state"
        self.cp = ControlProcess(tmp / "cp", catalog(self.state_dir, free_port()))
        self.agent: Agent | None = None

    def start(self) -> Agent:
        self.cp.start()
        self.agent = Agent(
            self.cp.workdir.parent / "agents",
            "gpu01",
            f"http://127.0.0.1:{self.cp.agent_port}",
            "h100x4.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", "23000-23099", "--mgmt-interface", "lo"),
        )
        self.agent.start()
        return self.agent

    def node_ready(self) -> bool:
        return any(n["node_id"] == "gpu01" and n["state"] == "ready" for n in self.cp.api("/api/nodes"))

    def replica_ready(self) -> bool:
        return any(r["model"] == MODEL and r["state"] == "ready" for r in self.cp.api("/api/replicas"))

    def stop(self) -> None:
        self.cp.terminate()
        if self.agent is not None:
            self.agent.stop_all()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.stop()


def _no_fault_lines(text: str, who: str) -> None:
    for bad in ("Traceback", "protocol error", " ERROR "):
        assert bad not in text, f"{who} log has {bad!r}:\n{text}"


def test_sigterm_says_goaway_saves_state_exits_0_and_agents_come_back(pair: Pair) -> None:
    agent = pair.start()
    poll(f"a ready replica of {MODEL}", pair.replica_ready)
    engines = sim_processes(MODEL)
    assert len(engines) == 1
    agent_log_at = agent.log.stat().st_size
    cp_log_at = pair.cp.log.stat().st_size

    assert pair.cp.proc is not None
    began = time.monotonic()
    pair.cp.proc.send_signal(signal.SIGTERM)
    rc = pair.cp.proc.wait(STOP_BOUND_S + 5)
    took = time.monotonic() - began
    print(f"SIGTERM to exit: {took:.2f} s")
    assert rc == 0
    assert took < STOP_BOUND_S

    # The state file a restart needs: the node's Register and the replica's placement.
    state = json.loads((pair.state_dir / "control-state.json").read_text())
    assert "gpu01" in state["nodes"]
    assert [p["replica_id"] for p in state["placements"]] == [f"{MODEL}-r0"]

    cp_text = pair.cp.log.read_bytes()[cp_log_at:].decode()
    _no_fault_lines(cp_text, "control plane")
    assert re.search(r"agent streams shut down in [\d.]+ s: GOAWAY to 1 connection", cp_text), cp_text

    # The agent read an orderly goodbye, and reconnects with its backoff (to nothing, for now).
    poll("the agent to try again", lambda: "cannot connect" in agent.log.read_bytes()[agent_log_at:].decode())
    agent_text = agent.log.read_bytes()[agent_log_at:].decode()
    _no_fault_lines(agent_text, "agent")
    assert "GoAwayReceived: peer sent GOAWAY (NO_ERROR" in agent_text, agent_text
    # A goodbye is expected, not a fault: the session's end is information.
    assert re.search(r" INFO llmgw\.agent: session with \S+ ended \(GoAwayReceived", agent_text), agent_text

    # A new control plane on the same port: the agent registers with it, and the engine that kept
    # serving is adopted, not started again.
    pair.cp.start()
    poll("gpu01 ready with the restarted control plane", pair.node_ready)
    poll(f"{MODEL} ready again", pair.replica_ready)
    assert sim_processes(MODEL) == engines
    _no_fault_lines(agent.log.read_bytes()[agent_log_at:].decode(), "agent")


def test_killed_agent_is_one_info_line_naming_node_and_address(pair: Pair) -> None:
    agent = pair.start()
    poll("gpu01 ready", pair.node_ready)
    agent.kill9()

    def ended() -> list[str]:
        text = pair.cp.log.read_text()
        return [
            line for line in text.splitlines() if "llmgw.transport.server" in line and "stream ended" in line
        ]

    lines = poll("the control plane to log the stream's end", ended, timeout=15)
    assert len(lines) == 1
    assert re.search(
        r" INFO llmgw\.transport\.server: node 'gpu01' \(127\.0\.0\.1:\d+\): grpc stream ended: ", lines[0]
    ), lines[0]
    poll("gpu01 unreachable", lambda: not pair.node_ready())
    _no_fault_lines(pair.cp.log.read_text(), "control plane")


def test_sigterm_with_a_hung_agent_still_exits_0_within_the_bound(pair: Pair) -> None:
    """A SIGSTOPped agent never answers the GOAWAY: the stop waits out the stream server's grace
    (5 s), ends that stream with UNAVAILABLE and exits; the agent, resumed, reconnects cleanly."""
    agent = pair.start()
    poll("gpu01 ready", pair.node_ready)
    assert agent.proc is not None and pair.cp.proc is not None
    agent_log_at = agent.log.stat().st_size
    agent.proc.send_signal(signal.SIGSTOP)
    try:
        began = time.monotonic()
        pair.cp.proc.send_signal(signal.SIGTERM)
        rc = pair.cp.proc.wait(STOP_BOUND_S + 5)
        took = time.monotonic() - began
        print(f"SIGTERM to exit with a SIGSTOPped agent: {took:.2f} s")
    finally:
        agent.proc.send_signal(signal.SIGCONT)
    assert rc == 0
    assert 4.5 < took < STOP_BOUND_S
    cp_text = pair.cp.log.read_text()
    assert "1 ended with UNAVAILABLE after the 5 s grace" in cp_text, cp_text
    _no_fault_lines(cp_text, "control plane")

    pair.cp.start()
    poll("gpu01 ready with the restarted control plane", pair.node_ready)
    _no_fault_lines(agent.log.read_bytes()[agent_log_at:].decode(), "agent")
