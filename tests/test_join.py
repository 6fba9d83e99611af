"""Joining is authenticated out of the box (issue 16, item 1), with a real control plane and agents.

The control plane creates a join token on its first start; an agent that joins with it is issued a
credential of its own, and from then on a second process holding only the join token cannot take
over that node id (its real agent's stream and engines are untouched) until an admin forgets the
credential with ``ctl node reset``. No authentication at all takes ``insecure = true``, said loudly.
"""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import schema
from tests.fleet_procs import CHAT, Agent, Fleet, poll, sim_processes

LAYOUT = [("gpu01", "h100x8.toml", "ib-a", "127.0.0.1")]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _state_registers(fleet: Fleet) -> dict[str, schema.Register]:
    path = fleet.cp.state_dir() / "control-state.json"
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    return {k: schema.Register.parse(base64.b64decode(v)) for k, v in doc.get("nodes", {}).items()}


def test_first_start_creates_a_join_token_and_an_agent_joins_with_it(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "join1", LAYOUT)
    try:
        fleet.start()
        token_file = fleet.cp.state_dir() / "join-token"
        token = fleet.cp.join_token()
        assert token and _mode(token_file) == 0o600
        result = fleet.cp.ctl("token")
        assert result.returncode == 0 and result.stdout.strip() == token, result
        poll("gpu01 registered", lambda: [n["node_id"] for n in fleet.cp.api("/api/nodes")] == ["gpu01"])
        node = fleet.cp.api("/api/nodes")[0]
        assert node["auth"] == "join token" and node["insecure"] is False

        # The agent keeps the credential it was issued, readable by itself only; the control plane
        # keeps only its digest, and neither secret is in the state file or in any log.
        agent = fleet.agents["gpu01"]
        cred_file = agent.state_dir / "node-credential.json"
        poll("the agent to keep its credential", cred_file.exists)
        credential = json.loads(cred_file.read_text())["credential"]
        assert credential and _mode(cred_file) == 0o600
        bindings = fleet.cp.state_dir() / "node-credentials.json"
        assert _mode(bindings) == 0o600 and credential not in bindings.read_text()
        assert "gpu01" in json.loads(bindings.read_text())
        poll("gpu01 in the state file", lambda: "gpu01" in _state_registers(fleet))
        saved = _state_registers(fleet)["gpu01"]
        assert saved.token == "" and saved.node_credential == ""
        raw = (fleet.cp.state_dir() / "control-state.json").read_text()
        assert token not in raw and credential not in raw
        cp_log = fleet.cp.log.read_text()
        assert "ctl token" in cp_log and str(token_file) in cp_log
        assert token not in cp_log and credential not in cp_log
        assert token not in agent.log.read_text() and credential not in agent.log.read_text()

        # Once joined, the node speaks with its credential: after a reconnect, it is that which counts.
        agent.kill9()
        agent.start()
        poll(
            "gpu01 back with its credential",
            lambda: (
                [(n["node_id"], n["auth"], n["connected"]) for n in fleet.cp.api("/api/nodes")]
                == [("gpu01", "credential", True)]
            ),
        )
    finally:
        fleet.stop()


def test_a_forged_register_with_the_join_token_cannot_take_over_a_joined_node(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "join2", LAYOUT)
    forger: Agent | None = None
    chat = CHAT.format(tag="join2")
    try:
        fleet.start()
        real = fleet.agents["gpu01"]
        poll("both chat replicas ready", lambda: fleet.ready_replicas(chat, 2))
        engines = sim_processes(chat)
        assert len(engines) == 2

        # Another process with the join token (every node has it) claims to be gpu01.
        forger = Agent(
            tmp_path / "forger",
            "gpu01",
            f"http://127.0.0.1:{fleet.cp.agent_port}",
            "h100x4.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.9",
            extra=("--engine-ports", "23000-23099"),
        )
        forger.start()
        poll(
            "the forger's refusal",
            lambda: "already joined with a credential of its own" in forger.log.read_text(),
        )
        assert "ctl node reset gpu01" in forger.log.read_text()
        cp_log = fleet.cp.log.read_text()
        assert "refused a stream" in cp_log and "replaces the previous one" not in cp_log
        # The real agent's stream and engines are untouched: the same engines, still ready.
        node = fleet.cp.api("/api/nodes")[0]
        assert node["connected"] and node["mgmt_addr"] == "127.0.0.1" and node["auth"] == "join token"
        assert sim_processes(chat) == engines and fleet.ready_replicas(chat, 2)
        assert real.proc is not None and real.proc.poll() is None

        # Re-joining on purpose is an admin's act: forget gpu01's credential, and the join token works.
        result = fleet.cp.ctl("node", "reset", "gpu01")
        assert result.returncode == 0 and "credential forgotten" in result.stdout, result
        poll(
            "the forger let in after the reset",
            lambda: "joined the cluster as gpu01" in forger.log.read_text(),
        )
        poll(
            "gpu01 now from the other process",
            lambda: fleet.cp.api("/api/nodes")[0]["mgmt_addr"] == "127.0.0.9",
        )
    finally:
        if forger is not None:
            forger.stop_all()
        fleet.stop()


def test_without_the_token_refused_and_insecure_true_is_explicit_and_loud(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "a", "join3", LAYOUT)
    try:
        fleet.start(agent_extra={"gpu01": ("--token", "not-the-join-token")})
        agent = fleet.agents["gpu01"]
        poll("the refusal", lambda: "wrong join token from node 'gpu01'" in agent.log.read_text())
        assert fleet.cp.api("/api/nodes") == []
        assert "not-the-join-token" not in fleet.cp.log.read_text()
    finally:
        fleet.stop()

    open_fleet = Fleet(tmp_path / "b", "join4", LAYOUT, top="insecure = true")
    try:
        open_fleet.start(agent_extra={"gpu01": ("--token", "")})
        poll("gpu01 registered", lambda: [n["node_id"] for n in open_fleet.cp.api("/api/nodes")] == ["gpu01"])
        assert "WARNING llmgw.control: insecure = true" in open_fleet.cp.log.read_text()
        result = open_fleet.cp.ctl("nodes")
        assert result.returncode == 0, result
        assert result.stdout.startswith("WARNING: insecure = true") and " insecure " in result.stdout
    finally:
        open_fleet.stop()


def test_an_agent_stops_at_start_on_a_node_id_the_control_plane_would_refuse(tmp_path: Path) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "agent", "--state-dir", str(tmp_path), "--server", "http://127.0.0.1:9"]
    result = subprocess.run([*argv, "--node-id", "gpu07\x1b[2J"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "node_id 'gpu07\\x1b[2J' is not valid" in result.stderr and "\x1b" not in result.stderr


def test_mutual_tls_needs_no_token(tmp_path: Path) -> None:
    """The strong option: the node id is bound to the client certificate, so no token is asked for;
    a client without a certificate on the same TLS port still needs the join token."""
    import trustme

    ca = trustme.CA()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca.cert_pem.write_to_path(pki / "ca.pem")
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(pki / "server.pem")
    server.private_key_pem.write_to_path(pki / "server.key")
    node = ca.issue_cert("gpu01.nodes", common_name="gpu01")
    node.cert_chain_pems[0].write_to_path(pki / "gpu01.pem")
    node.private_key_pem.write_to_path(pki / "gpu01.key")
    # require_client_cert = false: the issue's case, where a peer without a certificate got in.
    tls = f"""[tls]
cert = "{pki / "server.pem"}"
key = "{pki / "server.key"}"
client_ca = "{pki / "ca.pem"}"
require_client_cert = false
"""
    layout = [*LAYOUT, ("gpu02", "h100x4.toml", "ib-a", "127.0.0.2")]
    fleet = Fleet(tmp_path, "join5", layout, extra=tls)
    ca_args = ("--tls-ca", str(pki / "ca.pem"), "--token", "")
    try:
        fleet.start(
            scheme="https",
            agent_extra={
                "gpu01": (
                    *ca_args,
                    "--tls-cert",
                    str(pki / "gpu01.pem"),
                    "--tls-key",
                    str(pki / "gpu01.key"),
                ),
                "gpu02": ca_args,  # no certificate, no token
            },
        )
        poll(
            "gpu01 in over mutual TLS",
            lambda: [(n["node_id"], n["auth"]) for n in fleet.cp.api("/api/nodes")] == [("gpu01", "mtls")],
        )
        poll("gpu02 refused", lambda: "presents no join token" in fleet.agents["gpu02"].log.read_text())
        assert [n["node_id"] for n in fleet.cp.api("/api/nodes")] == ["gpu01"]
        assert not (fleet.agents["gpu01"].state_dir / "node-credential.json").exists()
    finally:
        fleet.stop()


def test_a_state_file_written_with_a_token_in_it_loses_it_at_the_next_save(tmp_path: Path) -> None:
    """Before this issue the saved Registers kept their token (mode 0644): a control plane that
    restores such a file keeps no secret in memory and writes the file again without it."""
    fleet = Fleet(tmp_path, "join6", LAYOUT)
    state = fleet.cp.state_dir()
    state.mkdir(parents=True)
    old = schema.Register(
        node_id="gpu01", mgmt_addr="127.0.0.1", token="old-secret-token", node_credential="c"
    )
    (state / "control-state.json").write_text(
        json.dumps({"nodes": {"gpu01": base64.b64encode(bytes(old)).decode()}, "placements": []})
    )
    try:
        fleet.cp.start()
        poll("the state file saved again", lambda: _state_registers(fleet)["gpu01"].token == "")
        saved = _state_registers(fleet)["gpu01"]
        assert saved.mgmt_addr == "127.0.0.1" and saved.token == "" and saved.node_credential == ""
    finally:
        fleet.stop()
