"""The control plane with three real agents and real ``sim`` engines (profiles through the vLLM adapter).

Layout A: gpu01 (8 GPUs) and gpu02 (4 GPUs) on fabric ib-a, gpu03 (8 GPUs) on ib-b. Each agent has its
own loopback address as mgmt_addr (127.0.0.1-3), so master addresses and engine URLs are checkable.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme

from control.plane import load_shard_key_secret, shard_key
from tests.fleet_procs import (
    BIG,
    CHAT,
    LAYOUT_A,
    Agent,
    ControlProcess,
    Fleet,
    free_port,
    pid_alive,
    poll,
    sim_processes,
)
from tests.support import cmdline, environ


@pytest.fixture
def fleet_a(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, "a", LAYOUT_A)
    fleet.start()
    yield fleet
    fleet.stop()


def test_two_replicas_ready_and_a_cross_fabric_model_explained(fleet_a: Fleet) -> None:
    chat = CHAT.format(tag="a")
    big = BIG.format(tag="a")
    ready = poll(f"2 ready replicas of {chat}", lambda: fleet_a.ready_replicas(chat, 2))
    secret = load_shard_key_secret(fleet_a.cp.state_dir())
    for replica in ready:
        for shard in replica["shards"]:
            # Each engine answers its shard's key (what the router sends), and nobody without it.
            url, body = f"{shard['url']}/v1/completions", {"model": chat, "prompt": "hi", "max_tokens": 4}
            assert httpx.post(url, json=body, timeout=10).status_code == 401
            key = {"Authorization": f"Bearer {shard_key(secret, shard['shard_id'])}"}
            answer = httpx.post(url, json=body, headers=key, timeout=10)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    # Through the router, with the openai client: a streamed chat completion.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet_a.cp.router_port}/v1", api_key="none")
    stream = client.chat.completions.create(
        model=chat, messages=[{"role": "user", "content": "hello"}], stream=True, max_tokens=8
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    assert {m.id for m in client.models.list()} == {chat}
    with pytest.raises(openai.APIStatusError) as unplaced:
        client.completions.create(model=big, prompt="hi", max_tokens=2)
    assert unplaced.value.status_code == 503 and "fabric" in str(unplaced.value)
    # The 16-GPU model needs two 8-GPU nodes on one fabric: gpu01 (ib-a) and gpu03 (ib-b) share none.
    why = fleet_a.cp.ctl("why", big)
    assert why.returncode == 0, why.stderr
    assert "cannot run" in why.stdout and "fabric" in why.stdout
    assert "gpu02" in why.stdout and "insufficient" in why.stdout.lower()
    nodes = fleet_a.cp.ctl("nodes")
    assert nodes.returncode == 0 and all(n in nodes.stdout for n in ("gpu01", "gpu02", "gpu03"))
    assert "ready" in nodes.stdout
    as_json = fleet_a.cp.ctl("--json", "replicas")
    assert as_json.returncode == 0 and '"replica_id"' in as_json.stdout


@pytest.mark.chaos
def test_kill9_agent_unreachable_then_lost_replicas_move(fleet_a: Fleet) -> None:
    chat = CHAT.format(tag="a")
    ready = poll(f"2 ready replicas of {chat}", lambda: fleet_a.ready_replicas(chat, 2))
    victim = ready[0]["shards"][0]["node_id"]
    fleet_a.agents[victim].kill9()

    def node_state(state: str) -> bool:
        return any(n["node_id"] == victim and n["state"] == state for n in fleet_a.cp.api("/api/nodes"))

    poll(f"{victim} unreachable", lambda: node_state("unreachable"))
    # Its engine keeps serving through the router while the agent is unreachable.
    served_by_victim = ready[0]["shards"][0]["url"]
    assert httpx.get(f"{served_by_victim}/health", timeout=5).status_code == 200
    router = f"http://127.0.0.1:{fleet_a.cp.router_port}/v1/completions"
    for _ in range(4):
        answer = httpx.post(router, json={"model": chat, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert answer.status_code == 200
    poll(f"{victim} lost", lambda: node_state("lost"))

    def moved() -> list[dict[str, Any]] | None:
        reps = fleet_a.ready_replicas(chat, 2)
        if reps and all(s["node_id"] != victim for r in reps for s in r["shards"] if s["placed"]):
            return reps
        return None

    poll(f"{chat} placed off {victim} and ready", moved)
    nodes = fleet_a.cp.ctl("nodes").stdout
    assert "lost" in nodes and "unreachable for" in nodes


@pytest.mark.chaos
def test_control_plane_restart_restarts_no_engine(fleet_a: Fleet) -> None:
    chat = CHAT.format(tag="a")
    poll(f"2 ready replicas of {chat}", lambda: fleet_a.ready_replicas(chat, 2))
    before = sim_processes(chat)
    assert len(before) == 2
    fleet_a.cp.kill9()
    fleet_a.cp.start()
    # Every node registers again with the new process.
    poll(
        "all three nodes ready again",
        lambda: (
            sorted(n["node_id"] for n in fleet_a.cp.api("/api/nodes") if n["state"] == "ready")
            == ["gpu01", "gpu02", "gpu03"]
        ),
    )
    poll(f"{chat} ready again", lambda: fleet_a.ready_replicas(chat, 2))
    # Zero engines restarted, zero duplicates: the same two processes, and only they.
    assert sim_processes(chat) == before
    assert all(pid_alive(p) for p in before)


def test_multinode_model_placed_on_a_shared_fabric(tmp_path: Path) -> None:
    layout_b = [
        ("gpu01", "h100x8.toml", "ib-a", "127.0.0.1"),
        ("gpu04", "h100x8.toml", "ib-a", "127.0.0.4"),
        ("gpu03", "h100x8.toml", "ib-b", "127.0.0.3"),
    ]
    # Placement keeps what it placed (no preemption): were a chat replica placed on an ib-a node
    # before the other joined, no two free 8-GPU nodes would share a fabric. A selector keeps chat
    # on gpu03, whatever order the nodes register in.
    fleet = Fleet(tmp_path, "b", layout_b, chat_extra='selector = { pool = "small" }')
    fleet.start(agent_extra={"gpu03": ("--labels", "pool=small")})
    try:
        big = BIG.format(tag="b")
        replica = poll(f"{big} ready across two nodes", lambda: fleet.ready_replicas(big, 1))[0]
        shards = sorted(replica["shards"], key=lambda s: s["node_rank"])
        assert replica["fabric"] == "ib-a"
        assert {s["node_id"] for s in shards} == {"gpu01", "gpu04"}
        assert [s["node_rank"] for s in shards] == [0, 1] and all(s["nnodes"] == 2 for s in shards)
        leader_addr = "127.0.0.1" if shards[0]["node_id"] == "gpu01" else "127.0.0.4"
        assert (
            shards[0]["master"].startswith(f"{leader_addr}:") and shards[1]["master"] == shards[0]["master"]
        )
        # The engines got the rank flags and the NCCL environment.
        for shard in shards:
            agent = fleet.agents[shard["node_id"]]
            pid = next(p for p in agent.engine_pids() if pid_alive(p))
            argv, env = cmdline(pid) or [], environ(pid) or {}
            rank = str(shard["node_rank"]).encode()
            assert argv[argv.index(b"--node-rank") + 1] == rank and argv[argv.index(b"--nnodes") + 1] == b"2"
            assert argv[argv.index(b"--master-addr") + 1] == leader_addr.encode()
            assert (b"--headless" in argv) == (shard["node_rank"] == 1)
            assert env[b"NCCL_SOCKET_IFNAME"] == b"lo" and env[b"GLOO_SOCKET_IFNAME"] == b"lo"
            assert env[b"NCCL_IB_HCA"] == b"mlx5_0:1,mlx5_1:1"
            assert env[b"CUDA_VISIBLE_DEVICES"] == b"0,1,2,3,4,5,6,7"
    finally:
        fleet.stop()


def test_register_naming_another_node_than_its_certificate_is_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca.cert_pem.write_to_path(pki / "ca.pem")
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(pki / "server.pem")
    server.private_key_pem.write_to_path(pki / "server.key")
    for node in ("gpu01", "gpu03"):
        cert = ca.issue_cert(f"{node}.nodes", common_name=node)
        cert.cert_chain_pems[0].write_to_path(pki / f"{node}.pem")
        cert.private_key_pem.write_to_path(pki / f"{node}.key")
    tls = f"""[tls]
cert = "{pki / "server.pem"}"
key = "{pki / "server.key"}"
client_ca = "{pki / "ca.pem"}"
require_client_cert = true
"""
    layout = [("gpu01", "h100x8.toml", "ib-a", "127.0.0.1"), ("gpu02", "h100x4.toml", "ib-a", "127.0.0.2")]
    fleet = Fleet(tmp_path, "c", layout, extra=tls)
    creds = {
        "gpu01": (
            "--tls-ca",
            str(pki / "ca.pem"),
            "--tls-cert",
            str(pki / "gpu01.pem"),
            "--tls-key",
            str(pki / "gpu01.key"),
        ),
        # gpu02 presents gpu03's certificate.
        "gpu02": (
            "--tls-ca",
            str(pki / "ca.pem"),
            "--tls-cert",
            str(pki / "gpu03.pem"),
            "--tls-key",
            str(pki / "gpu03.key"),
        ),
    }
    try:
        fleet.start(agent_extra=creds, scheme="https")
        poll(
            "gpu01 registered over mutual TLS",
            lambda: any(n["node_id"] == "gpu01" for n in fleet.cp.api("/api/nodes")),
        )
        poll(
            "gpu02's refusal in its log",
            lambda: (
                "Register names node 'gpu02' but the client certificate is for gpu03"
                in fleet.agents["gpu02"].log.read_text()
            ),
        )
        assert "gpu02" not in [n["node_id"] for n in fleet.cp.api("/api/nodes")]
        assert "refused a stream" in fleet.cp.log.read_text()
    finally:
        fleet.stop()


def test_drain_waits_for_replacements_and_old_engines_stay_listed_and_reachable(tmp_path: Path) -> None:
    """Layout A with engines that take 2 s to load, so the drain's middle can be watched: the old
    engines stay in `ctl replicas` as draining and keep serving while their replacements load; `ctl
    drain --wait` shows progress until the node is empty; each placement has a shard id of its own,
    so `ctl logs` still reaches the old engine's log after the move."""
    fleet = Fleet(tmp_path, "d", LAYOUT_A, chat_load_seconds=2.0)
    # gpu02 alone first, so both replicas start there whatever order the agents would register in.
    fleet.start(only={"gpu02"})
    try:
        chat = CHAT.format(tag="d")
        ready = poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
        old = [s for r in ready for s in r["shards"]]
        node = "gpu02"
        assert {s["node_id"] for s in old} == {node}
        fleet.start()
        poll(
            "gpu01 and gpu03 ready",
            lambda: sum(n["state"] == "ready" for n in fleet.cp.api("/api/nodes")) == 3,
        )
        logs = fleet.cp.ctl("logs", old[0]["shard_id"], "-n", "50")
        assert logs.returncode == 0, logs.stderr
        assert "sim: ready on port" in logs.stdout  # the engine's own output, fetched over the stream
        old_pids = fleet.agents[node].engine_pids()

        waiting = subprocess.Popen(
            [*fleet.cp.ctl_argv(), "drain", node, "--wait", "--timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:

            def old_listed_as_draining() -> list[dict[str, Any]] | None:
                shards = [s for r in fleet.replicas(chat) for s in r["shards"]]
                leaving = [s for s in shards if not s["placed"] and s["state"] == "draining"]
                return leaving if len(leaving) == 2 and all(s["node_id"] == node for s in leaving) else None

            leaving = poll("the old engines listed as draining", old_listed_as_draining, timeout=30)
            assert {s["shard_id"] for s in leaving} == {s["shard_id"] for s in old}
            # Still serving: the router has nothing else until the replacements are ready.
            router = f"http://127.0.0.1:{fleet.cp.router_port}/v1/completions"
            answer = httpx.post(router, json={"model": chat, "prompt": "hi", "max_tokens": 2}, timeout=10)
            assert answer.status_code == 200
            out, err = waiting.communicate(timeout=90)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()
        assert waiting.returncode == 0, err
        lines = out.splitlines()
        assert lines[0].startswith(f"{node}: draining;") and "moves to gpu01" in out
        assert any(f"{node}: 2 shard(s) left:" in line for line in lines), out
        assert lines[-1] == f"{node}: drained; nothing runs there any more"

        new = fleet.placed_shards(chat)
        assert all(s["node_id"] != node and s["state"] == "ready" for s in new)
        assert not {s["shard_id"] for s in new} & {s["shard_id"] for s in old}
        poll("the drained engines gone", lambda: not any(pid_alive(p) for p in old_pids), timeout=30)
        assert all(len(s["shards"]) == 1 for s in fleet.replicas(chat))  # the old copies left the list
        old_logs = fleet.cp.ctl("logs", old[0]["shard_id"], "-n", "50")
        assert old_logs.returncode == 0 and "sim: ready on port" in old_logs.stdout, old_logs.stderr
        assert "(draining)" in fleet.cp.ctl("nodes").stdout
    finally:
        fleet.stop()


def test_drain_refused_for_a_last_replica_then_forced_and_remembered_across_restarts(
    tmp_path: Path,
) -> None:
    """One 4-GPU node runs both chat replicas; nowhere else can take them."""
    fleet = Fleet(tmp_path, "e", [("gpu02", "h100x4.toml", "ib-a", "127.0.0.2")])
    fleet.start()
    try:
        chat = CHAT.format(tag="e")
        poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
        pids = sim_processes(chat)
        assert len(pids) == 2

        refused = fleet.cp.ctl("drain", "gpu02")
        assert refused.returncode == 1 and "HTTP 409" in refused.stderr
        assert f"drain of gpu02 refused: {chat} would have no ready replica: nowhere else can take" in (
            refused.stderr
        )
        assert "--force" in refused.stderr
        node = next(n for n in fleet.cp.api("/api/nodes") if n["node_id"] == "gpu02")
        assert not node["draining"] and not node["cordoned"]
        # What `ctl describe` reads: the node's transitions where they happened, oldest first.
        described = fleet.cp.api("/api/nodes/gpu02")
        events = [(e["kind"], e["to"]) for e in described["events"]]
        assert events[0] == ("node", "ready") and events[-1] == ("operator", "drain refused")
        assert events.count(("command", "start")) == 2 and events.count(("shard", "ready")) == 2
        assert all(e["time"].endswith("Z") and e["at_s_ago"] >= 0 for e in described["events"])
        model = fleet.cp.api(f"/api/models/{chat}")
        assert [e["to"] for e in model["events"]].count("ready") == 2 and len(model["placed"]) == 2

        # A cordon survives a restart, and keeps what runs.
        cordoned = fleet.cp.ctl("cordon", "gpu02")
        assert cordoned.returncode == 0 and "gpu02: cordoned" in cordoned.stdout
        fleet.cp.terminate()
        fleet.cp.start()
        poll("gpu02 registered again", lambda: fleet.cp.api("/api/nodes")[0]["state"] == "ready")
        assert "ready (cordoned)" in fleet.cp.ctl("nodes").stdout
        # A restarted control plane starts a new history: the restart, then what the agent reported.
        events = [(e["kind"], e["from"], e["to"]) for e in fleet.cp.api("/api/nodes/gpu02")["events"]]
        assert events[:2] == [("node", "", "unreachable"), ("node", "unreachable", "ready")]
        assert events.count(("shard", "", "ready")) == 2 and ("command", "", "start") not in events
        poll(f"{chat} ready after the restart", lambda: fleet.ready_replicas(chat, 2))
        assert sim_processes(chat) == pids

        forced = fleet.cp.ctl("drain", "gpu02", "--force", "--wait", "--timeout", "60")
        assert forced.returncode == 0, forced.stderr
        assert "draining (forced)" in forced.stdout and "cannot move" in forced.stdout
        assert forced.stdout.splitlines()[-1] == "gpu02: drained; nothing runs there any more"
        poll("the engines stopped", lambda: not sim_processes(chat))

        # The drain survives a restart too: the node stays out of placement.
        fleet.cp.terminate()
        fleet.cp.start()
        poll("gpu02 registered again", lambda: fleet.cp.api("/api/nodes")[0]["state"] == "ready")
        assert "ready (draining)" in fleet.cp.ctl("nodes").stdout
        why = fleet.cp.ctl("why", chat)
        assert why.returncode == 0 and "gpu02: draining" in why.stdout

        undone = fleet.cp.ctl("uncordon", "gpu02")
        assert undone.returncode == 0 and "gpu02: uncordoned (was draining)" in undone.stdout
        poll(
            f"{chat} placed on gpu02 again",
            lambda: [s["node_id"] for s in fleet.placed_shards(chat)] == ["gpu02", "gpu02"],
        )
        poll("its two engines running again", lambda: len(sim_processes(chat)) == 2)
    finally:
        fleet.stop()


def docs_catalog() -> str:
    """The ``[[models]]`` example of ``control/config.py``'s docstring, verbatim (the README's llama-70b)."""
    import textwrap

    import control.config

    doc = control.config.__doc__ or ""
    example = textwrap.dedent(doc.split("::\n", 1)[1].split("\nUnknown keys", 1)[0])
    return example[example.index("[[models]]") :]


def test_the_documented_catalog_example_serves_its_catalog_name(tmp_path: Path) -> None:
    """The example names no ``served_model_name``: clients use the catalog name, and so must the engine.

    Only test values are swapped in: listen addresses, state_dir, engine ports, and the engine binary
    (the agent runs vLLM profiles on the sim). The node satisfies the example's requirements as an
    operator reads them: an 8x H100 80GB node (the recorded inventory fixture), labelled zone=a.
    """
    catalog_text = docs_catalog()
    assert 'name = "llama-70b"' in catalog_text and "served_model_name" not in catalog_text
    inventory = Path(__file__).parent / "fixtures" / "inventory" / "h100x8.toml"
    cp = ControlProcess(
        tmp_path / "cp",
        f"""state_dir = "{tmp_path / "cp" / "state"}"
[listen]
agents = "127.0.0.1:{free_port()}"
api = "127.0.0.1:0"
router = "127.0.0.1:0"
[engines]
ports = "21000-21099"

{catalog_text}""",
    )
    agent = None
    try:
        cp.start()
        agent = Agent(
            tmp_path / "agents",
            "gpu07",
            f"http://127.0.0.1:{cp.agent_port}",
            None,
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--inventory", str(inventory), "--labels", "zone=a", "--engine-ports", "21000-21099"),
        )
        agent.start()

        def two_ready() -> list[dict[str, Any]] | None:
            reps = [r for r in cp.api("/api/replicas") if r["state"] == "ready"]
            return reps if len(reps) == 2 else None

        replicas = poll("both llama-70b replicas ready", two_ready, timeout=90)
        assert {r["served_model_name"] for r in replicas} == {"llama-70b"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="llama-70b", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert answer.choices[0].message.content
        # The engines were started under that name, not under the profile's model.
        for pid in agent.engine_pids():
            argv = cmdline(pid) or []
            assert argv[argv.index(b"--served-model-name") + 1] == b"llama-70b"
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()


def _chat_on_gpu02_then_all(fleet: Fleet) -> str:
    """Start gpu02 alone until both chat replicas are ready there (whatever order the agents would
    register in), then the other nodes of layout A; the chat model's name."""
    fleet.start(only={"gpu02"})
    chat = CHAT.format(tag=fleet.tag)
    poll(f"2 ready replicas of {chat}", lambda: fleet.ready_replicas(chat, 2))
    fleet.start()
    poll("gpu01 and gpu03 ready", lambda: sum(n["state"] == "ready" for n in fleet.cp.api("/api/nodes")) == 3)
    return chat


def test_ready_replicas_never_drop_during_a_drain_while_engines_serve(tmp_path: Path) -> None:
    """Both replicas of chat on gpu02, whose replacements take 2 s to load: while gpu02 drains, the
    old engines serve until the new ones are ready, so the model is 2/2 ready at every instant, as
    `ctl get models` and the API say (it showed 0 for about a second: a replica counted only its
    newly placed, still loading shards). The old engines' rows say draining meanwhile."""
    fleet = Fleet(tmp_path, "s", LAYOUT_A, chat_load_seconds=2.0)
    try:
        chat = _chat_on_gpu02_then_all(fleet)
        # Sampled as fast as the API answers (ctl renders these documents), from before the drain to
        # after it: each sample the model's ready count and how many old engines were listed draining.
        samples: list[tuple[int, int]] = []
        done = threading.Event()

        def sample() -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{fleet.cp.api_port}", timeout=15) as api:
                while not done.is_set():
                    [model] = [m for m in api.get("/api/models").json() if m["model"] == chat]
                    shards = [
                        s for r in api.get("/api/replicas").json() if r["model"] == chat for s in r["shards"]
                    ]
                    old = sum(1 for s in shards if not s["placed"] and s["state"] == "draining")
                    samples.append((model["replicas_ready"], old))

        sampler = threading.Thread(target=sample)
        sampler.start()
        seen_by_ctl: list[str] = []
        try:
            assert fleet.cp.ctl("drain", "gpu02").returncode == 0
            while True:
                got = fleet.cp.ctl("get", "models")
                assert got.returncode == 0, got.stderr
                # NAME READY PLACED WANTED: READY as kubectl writes it, "2/2".
                seen_by_ctl.append(
                    next(line.split()[1] for line in got.stdout.splitlines() if line.startswith(chat))
                )
                placed = fleet.placed_shards(chat)
                if all(s["node_id"] != "gpu02" and s["state"] == "ready" for s in placed) and not any(
                    s["node_id"] == "gpu02" for r in fleet.replicas(chat) for s in r["shards"]
                ):
                    break
                assert len(seen_by_ctl) < 200, seen_by_ctl
        finally:
            done.set()
            sampler.join(timeout=30)
        middle = [ready for ready, old in samples if old]
        print(f"{len(samples)} samples, {len(middle)} while old engines drained; ctl said {seen_by_ctl}")
        assert middle, "no sample caught the old engines listed as draining"
        assert min(ready for ready, _ in samples) == 2, samples
        assert set(seen_by_ctl) == {"2/2"}, seen_by_ctl
    finally:
        fleet.stop()


def test_a_lost_nodes_shards_say_what_is_known_across_a_restart_until_reset_or_stopped(
    tmp_path: Path,
) -> None:
    """gpu02 runs both replicas of chat, and its agent is killed -9 (its engines run on). Once it is
    lost and the replicas run elsewhere, its two engines are listed for what is known of them: state
    unknown, on a lost node, last seen at T, what it last reported; not "draining" forever (no agent
    can drain them). A restarted control plane lists them the same, with the same T (they vanished
    before). `ctl node reset gpu02` forgets the node and them; the agent, back, joins again and its
    leftover engines are stopped."""
    fleet = Fleet(tmp_path, "l", LAYOUT_A)
    try:
        chat = _chat_on_gpu02_then_all(fleet)
        gpu02 = fleet.agents["gpu02"]
        old_pids = gpu02.engine_pids()
        assert len(old_pids) == 2
        gpu02.kill9()

        def lost_listed() -> list[dict[str, Any]] | None:
            shards = [s for r in fleet.replicas(chat) for s in r["shards"] if s["node_id"] == "gpu02"]
            moved = [
                s for s in fleet.placed_shards(chat) if s["state"] == "ready" and s["node_id"] != "gpu02"
            ]
            return shards if len(shards) == 2 and len(moved) == 2 else None

        shards = poll("gpu02 lost and its replicas ready elsewhere", lost_listed, timeout=60)
        for s in shards:
            assert (s["state"], s["node_state"], s["reported"], s["placed"]) == (
                "unknown",
                "lost",
                "ready",
                False,
            )
            assert "node lost: last seen 20" in s["note"] and "ctl node reset gpu02" in s["note"], s
        last_seen = {s["note"].split("last seen ")[1].split(",")[0] for s in shards}
        [model] = [m for m in fleet.cp.api("/api/models") if m["model"] == chat]
        assert (model["replicas_ready"], model["replicas_placed"]) == (2, 2)
        listing = fleet.cp.ctl("replicas")
        assert listing.returncode == 0, listing.stderr
        rows = [line for line in listing.stdout.splitlines() if "gpu02 (lost)" in line]
        assert len(rows) == 2 and all(" unknown " in row and "last seen" in row for row in rows), (
            listing.stdout
        )
        assert all(pid_alive(p) for p in old_pids)  # nothing could stop them

        # A restart keeps what is known: the lost node, its engines, when it was last seen.
        fleet.cp.terminate()
        fleet.cp.start()
        again = poll("gpu02's engines listed after the restart", lost_listed, timeout=60)
        assert {s["note"].split("last seen ")[1].split(",")[0] for s in again} == last_seen
        assert all(s["state"] == "unknown" and s["node_state"] == "lost" for s in again)
        assert [n["state"] for n in fleet.cp.api("/api/nodes") if n["node_id"] == "gpu02"] == ["lost"]

        reset = fleet.cp.ctl("node", "reset", "gpu02")
        assert reset.returncode == 0 and "gpu02: lost node removed" in reset.stdout, reset
        assert not any(s["node_id"] == "gpu02" for r in fleet.replicas(chat) for s in r["shards"])
        assert "gpu02" not in [n["node_id"] for n in fleet.cp.api("/api/nodes")]

        # Back, the node joins again (the join token), reports its two engines, and they are stopped:
        # the replicas run elsewhere.
        gpu02.start()
        poll("gpu02's leftover engines stopped", lambda: not any(pid_alive(p) for p in old_pids), timeout=60)
        poll(
            "gpu02 listed ready with nothing on it",
            lambda: (
                not any(s["node_id"] == "gpu02" for r in fleet.replicas(chat) for s in r["shards"])
                and [n["state"] for n in fleet.cp.api("/api/nodes") if n["node_id"] == "gpu02"] == ["ready"]
            ),
            timeout=30,
        )
        assert fleet.ready_replicas(chat, 2)
    finally:
        fleet.stop()
