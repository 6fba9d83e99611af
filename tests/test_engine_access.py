"""Only the router reaches the engines: a management-address bind, a key per shard, no agent secrets.

- The control plane derives each shard's key from a cluster secret (``state_dir/shard-key-secret``)
  and the same key again after a restart; trtllm shards get none.
- An engine's environment has none of the agent's settings (``LLMGW_AGENT_*``, the token), read
  from ``/proc/PID/environ`` of a real engine.
- In a real fleet (control plane, agent, ``sim`` engine through the vLLM adapter), the engine
  listens on the node's management address only, answers 401 to a request without its key, and
  serves the router's (the ``openai`` client through the router, with the router's own key). The
  key is nowhere a person or a file outside the agent's state would show it, the engine's command
  line included (vLLM and the sim take it from ``VLLM_API_KEY``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

import schema
from agent.supervise import procfs
from agent.supervise.supervisor import engine_environment, redact_argv, remove_files, write_files
from control.config import parse
from control.plane import SHARD_KEY_SECRET, ControlPlane, load_shard_key_secret, shard_key
from router.config import RouterConfig
from router.routes import ModelRoutes, Upstream
from router.server import Router
from tests.fleet_procs import Agent, ControlProcess, free_port, poll
from tests.support import cmdline
from tests.test_supervisor import end_engines, make_supervisor, sim_spec, wait_state

State = schema.ShardState

#: The router's own key, which clients send; never the engines'.
CLIENT_KEY = "client-key-for-the-router-0123456789"
AGENT_TOKEN = "agent-token-0123456789abcdef"


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_shard_keys_survive_a_restart_and_the_secret_is_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    secret = load_shard_key_secret(state)
    path = state / SHARD_KEY_SECRET
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_shard_key_secret(state) == secret  # a restart: the same secret, the same keys
    key = shard_key(secret, "chat-r0-s0-abc")
    assert key == hmac.new(secret, b"chat-r0-s0-abc", hashlib.sha256).hexdigest()
    assert key != shard_key(secret, "chat-r1-s0-abc")
    assert shard_key(load_shard_key_secret(tmp_path / "other"), "chat-r0-s0-abc") != key
    path.write_text("short\n")
    with pytest.raises(ValueError, match=r"shard-key-secret.*64 hex digits"):
        load_shard_key_secret(state)


def test_each_shard_gets_its_key_but_trtllm_none_and_the_router_has_them(tmp_path: Path) -> None:
    """StartShard carries the shard's key (none for trtllm-serve, which has no key option), the
    routes carry the same key, and a Register that lists a key is saved without it."""
    cfg = parse(
        f'state_dir = "{tmp_path}"\n'
        '[[models]]\nname = "v"\n[models.gpus]\ncount = 1\n[models.profile]\nengine = "vllm"\nmodel = "org/v"\n'
        '[[models]]\nname = "t"\n[models.gpus]\ncount = 1\n[models.profile]\nengine = "trtllm"\nmodel = "org/t"\n'
    )
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    plane.shard_key_secret = load_shard_key_secret(tmp_path)
    register = schema.Register(
        node_id="n1",
        mgmt_addr="10.0.0.1",
        engine_ports=schema.PortRange(first=8000, last=8010),
        gpus=[schema.Gpu(index=i, memory_total_mib=81559) for i in range(2)],
    )
    plane.fleet.registered(register, 0)
    plan = trio.run(plane.replan)
    specs = {r.model: plane.start_spec(r, s) for r in plan.replicas for s in r.shards}
    assert set(specs) == {"v", "t"}
    assert specs["v"].api_key == shard_key(plane.shard_key_secret, specs["v"].shard_id)
    assert specs["t"].api_key == ""
    # Both READY (as their agent would report, the spec without the key): routed with the key.
    for spec in specs.values():
        status = schema.ShardStatus(
            node_id="n1",
            replica_id=spec.replica_id,
            shard_id=spec.shard_id,
            state=State.READY,
            http_port=spec.http_port,
            spec=schema.StartShard.parse(bytes(spec)),
        )
        assert status.spec is not None
        status.spec.api_key = ""
        plane.fleet.shard_status("n1", status)
    plane.build_routes()
    keys = {name: [u.api_key for u in r.upstreams] for name, r in plane.routes().items()}
    assert keys == {"v": [specs["v"].api_key], "org/t": [""]}
    # An agent that reported a key anyway: it is not written to the state file.
    leaky = schema.Register.parse(bytes(register))
    leaky.shards = [schema.ShardStatus(node_id="n1", shard_id="v-x", spec=specs["v"])]
    plane.fleet.registered(leaky, 1)
    trio.run(plane.save_now)
    assert specs["v"].api_key not in (tmp_path / "control-state.json").read_text()
    doc = json.loads((tmp_path / "control-state.json").read_text())
    assert specs["v"].api_key.encode() not in base64.b64decode(doc["nodes"]["n1"])


def test_agent_settings_and_secrets_are_left_out_of_an_engine_environment() -> None:
    base = {
        "PATH": "/usr/bin",
        "LLMGW_AGENT_TOKEN": AGENT_TOKEN,
        "LLMGW_AGENT_SERVER": "https://cp:7443",
        "MY_WRAPPER_TOKEN": AGENT_TOKEN,  # the token under another name
        "LLMGW_TEST_AGENT_KILL_AT": "after-spawn",
    }
    env = engine_environment(base, {"VLLM_LOGGING_LEVEL": "INFO"}, (AGENT_TOKEN, ""))
    assert env == {"PATH": "/usr/bin", "VLLM_LOGGING_LEVEL": "INFO"}
    assert redact_argv(["vllm", "serve", "--api-key", "k3y"], "k3y") == "vllm serve --api-key ***"
    assert "k3y" not in repr(Upstream("r0", "http://127.0.0.1:1", api_key="k3y"))


def test_a_port_holders_command_line_in_a_message_hides_its_key() -> None:
    """ "Port in use by pid N (its command line)" goes to ``ctl``: another engine's key must not."""
    script = (
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
        " print(s.getsockname()[1], flush=True); sys.stdin.read()"
    )
    argv = [sys.executable, "-c", script, "--api-key", "k3y-one-0123", "--api-key=k3y-two-0123"]
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        said = procfs.port_in_use(port)
        assert f"pid {holder.pid} (" in said and "k3y" not in said
        whole = procfs.command_line(holder.pid, limit=10_000)
        assert whole.endswith(" --api-key *** --api-key=***") and "k3y" not in whole
    finally:
        holder.kill()
        holder.wait(10)


# ---------------------------------------------------------------------------------------------
# The router's upstream head


async def recording_engine(nursery: trio.Nursery) -> tuple[str, list[bytes]]:
    """An engine that records each request head and answers a small completion."""
    heads: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        match = re.search(rb"content-length: *(\d+)", head, re.I)
        length = int(match.group(1)) if match else 0
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        heads.append(head.lower())
        body = json.dumps({"id": "x", "object": "text_completion", "choices": [{"text": "ok"}]}).encode()
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", heads


async def test_the_router_sends_the_shards_key_in_place_of_the_clients(nursery: trio.Nursery) -> None:
    url, heads = await recording_engine(nursery)
    keyed = {"m": ModelRoutes((Upstream("m-r0", url, api_key="shard-key-0123"),))}
    router = Router(lambda: keyed, RouterConfig(api_keys=(CLIENT_KEY,)))
    port = await nursery.start(router.serve, "127.0.0.1", 0)
    doc = {"model": "m", "prompt": "hi", "max_tokens": 1}

    def ask(key: str) -> httpx.Response:
        return httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json=doc,
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        )

    assert (await trio.to_thread.run_sync(ask, CLIENT_KEY)).status_code == 200
    [head] = heads
    assert b"\r\nauthorization: bearer shard-key-0123" in head
    assert CLIENT_KEY.lower().encode() not in head and head.count(b"authorization:") == 1
    # An open router (no api_keys) in front of a keyed engine: still the shard's key, never the
    # client's, whatever the client sends.
    open_router = Router(lambda: keyed, RouterConfig())
    open_port = await nursery.start(open_router.serve, "127.0.0.1", 0)
    answer = await trio.to_thread.run_sync(
        lambda: httpx.post(
            f"http://127.0.0.1:{open_port}/v1/completions",
            json=doc,
            headers={"Authorization": "Bearer clients-own"},
            timeout=10,
        )
    )
    assert answer.status_code == 200
    assert b"bearer shard-key-0123" in heads[1] and b"clients-own" not in heads[1]


# ---------------------------------------------------------------------------------------------
# A real engine under the supervisor


async def test_a_started_engines_environ_has_no_agent_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_AGENT_TOKEN", AGENT_TOKEN)
    monkeypatch.setenv("LLMGW_AGENT_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("NODE_JOIN_SECRET", AGENT_TOKEN)
    sup = make_supervisor(tmp_path, secrets=(AGENT_TOKEN,))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        try:
            shard = await sup.start(sim_spec("env-s0", free_port()))
            await wait_state(sup, "env-s0", State.READY)
            environ = procfs.read_environ(shard.pid)
        finally:
            end_engines(sup)
            nursery.cancel_scope.cancel()
    assert environ is not None and environ[procfs.MARK_SHARD] == "env-s0"
    assert not [k for k in environ if k.startswith("LLMGW_AGENT_")]
    assert AGENT_TOKEN not in environ.values()
    assert "PATH" in environ  # the rest of the agent's environment is still passed on


async def test_a_sim_engines_key_is_out_of_sight_and_enforced(tmp_path: Path) -> None:
    """The shard's key reaches the engine as vLLM takes it, in VLLM_API_KEY: not on its command line
    (/proc/PID/cmdline, which ps shows every local user), and the engine enforces it."""
    key = "shard-key-0123456789abcdef0123456789"
    port = free_port()
    sup = make_supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        try:
            shard = await sup.start(sim_spec("key-s0", port, api_key=key))
            await wait_state(sup, "key-s0", State.READY)
            argv = b"\0".join(cmdline(shard.pid) or [])
            environ = procfs.read_environ(shard.pid)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with httpx.AsyncClient(timeout=10) as client:
                refused = [
                    (await client.post(url, json=body, headers=headers)).status_code
                    for headers in ({}, {"Authorization": "Bearer wrong"})
                ]
                served = await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        finally:
            end_engines(sup)
            nursery.cancel_scope.cancel()
    assert b"agent.engines.sim" in argv and b"--served-model-name" in argv
    assert key.encode() not in argv and b"--api-key" not in argv
    assert environ is not None and environ["VLLM_API_KEY"] == key
    assert refused == [401, 401]
    assert served.status_code == 200, served.text
    # The start line in the engine's log has no key to hide.
    assert key not in (tmp_path / "logs" / "key-s0.log").read_text()


async def test_a_restarted_supervisor_removes_the_key_files_no_engine_needs(tmp_path: Path) -> None:
    """An engine that died while the agent was away leaves its key file; the next start removes it
    (the files of adopted engines stay until they exit)."""
    keys = trio.Path(tmp_path / "state" / "keys")
    await keys.mkdir(parents=True)
    stale = keys / "gone-s0.key"
    await stale.write_text("old-key\n")
    sup = make_supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        nursery.cancel_scope.cancel()
    assert not await stale.exists()
    assert stat.S_IMODE((await keys.stat()).st_mode) == 0o700


def test_key_files_are_private_from_their_creation_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "s1.key"
    path.write_text("stale, world-readable")
    path.chmod(0o644)
    write_files({str(path): "k3y\n"})
    assert path.read_text() == "k3y\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    remove_files({str(path): "k3y\n", str(tmp_path / "never-written.key"): ""})
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# A real fleet


MODEL = "access-chat"


def _catalog(state: Path) -> str:
    return f"""
state_dir = "{state}"
api_keys = ["{CLIENT_KEY}"]
reconcile_interval = 0.3
backoff_initial = 0.5
stop_grace = 3
[engines]
ports = "20000-29999"
[listen]
agents = "127.0.0.1:{free_port()}"
api = "127.0.0.1:0"
router = "127.0.0.1:0"
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


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ControlProcess, Agent]]:
    cp = ControlProcess(tmp_path / "cp", _catalog(tmp_path / "cp" / "state"))
    agent: Agent | None = None
    try:
        cp.start()
        agent = Agent(
            tmp_path / "agents",
            "gpu09",
            f"http://127.0.0.1:{cp.agent_port}",
            "h100x4.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.2",  # the node's management address: the engine binds there, not 0.0.0.0
            extra=("--engine-ports", "23400-23499", "--mgmt-interface", "lo"),
        )
        # A setting of the agent's own in its environment, which must not reach the engine.
        agent.start(env={"LLMGW_AGENT_LIVENESS_PERIOD": "5"})
        yield cp, agent
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()


def _ready_shard(cp: ControlProcess) -> dict[str, Any] | None:
    for replica in cp.api("/api/replicas"):
        if replica["model"] == MODEL and replica["state"] == "ready":
            shard: dict[str, Any] = replica["shards"][0]
            return shard
    return None


def test_only_the_router_reaches_the_engine(fleet: tuple[ControlProcess, Agent]) -> None:
    cp, agent = fleet
    shard = poll(f"a ready replica of {MODEL}", lambda: _ready_shard(cp), timeout=60)
    url, port, shard_id = shard["url"], shard["port"], shard["shard_id"]
    assert url == f"http://127.0.0.2:{port}"
    key = shard_key(load_shard_key_secret(cp.state_dir()), shard_id)

    # Bound to the management address only: the same port on another loopback address is closed.
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass

    # The engine's environment: the marker, none of the agent's own settings or token.
    [pid] = agent.marked_engines(shard_id)
    environ = procfs.read_environ(pid)
    assert environ is not None and environ[procfs.MARK_SHARD] == shard_id
    agent_env = procfs.read_environ(agent.proc.pid) if agent.proc else None
    assert agent_env is not None and agent_env.get("LLMGW_AGENT_LIVENESS_PERIOD") == "5"
    assert not [k for k in environ if k.startswith("LLMGW_AGENT_")]
    token = agent_env.get("LLMGW_AGENT_TOKEN", "")
    assert not token or token not in environ.values()

    # A direct request without the shard's key, or with the router's, is refused by the engine.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}, {"Authorization": "Bearer wrong"}):
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert answer.status_code == 401, (headers, answer.text)
    direct = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert direct.status_code == 200

    # Through the router with the openai client and the router's key: served (the router sent the
    # shard's key upstream in place of the client's, which the engine refuses).
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key=CLIENT_KEY)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True, max_tokens=8
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="not-the-key").models.list()

    # The key is nowhere a person or a file outside the agent's state shows it.
    shown = [
        json.dumps(cp.api("/api/replicas")),
        json.dumps(cp.api("/api/nodes")),
        *(cp.ctl(*verb).stdout for verb in (("nodes",), ("replicas",), ("logs", shard_id))),
        cp.log.read_text(),
        agent.log.read_text(),
        (agent.state_dir / "logs" / f"{shard_id}.log").read_text().split("\n", 1)[0],
    ]
    # vLLM takes the key from VLLM_API_KEY: it is not on the engine's command line, which any
    # local user reads (ps), and the start line has no key option to hide.
    assert "--api-key" not in shown[-1]
    assert key.encode() not in b"\0".join(cmdline(pid) or [])
    state_file = cp.state_dir() / "control-state.json"
    poll("the control plane's state file", state_file.exists, timeout=15)
    doc = json.loads(state_file.read_text())
    shown += [state_file.read_text(), *(base64.b64decode(v).decode("latin-1") for v in doc["nodes"].values())]
    for text in shown:
        assert key not in text
    # The agent's record keeps the spec (a restarted agent probes with the key): its owner only.
    record = agent.state_dir / "shards" / f"{shard_id}.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE(record.parent.stat().st_mode) == 0o700


def test_ctl_logs_reads_across_a_rotation(tmp_path: Path) -> None:
    """``ctl logs`` through the control plane and the agent, for a log that was just rotated."""
    cp = ControlProcess(tmp_path / "cp", _catalog(tmp_path / "cp" / "state"))
    agent: Agent | None = None
    try:
        cp.start()
        agent = Agent(
            tmp_path / "agents",
            "gpu08",
            f"http://127.0.0.1:{cp.agent_port}",
            "h100x4.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", "23500-23599", "--mgmt-interface", "lo", "--log-max-bytes", "1500"),
        )
        agent.start()
        shard = poll(f"a ready replica of {MODEL}", lambda: _ready_shard(cp), timeout=60)
        log = agent.state_dir / "logs" / f"{shard['shard_id']}.log"
        rotated = log.with_name(log.name + ".1")
        sent = 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key=CLIENT_KEY)

        def rotated_now() -> bool:
            nonlocal sent
            client.models.list()  # through the router: no engine request; the engine's own lines:
            httpx.get(f"{shard['url']}/health", timeout=5)
            sent += 1
            return rotated.exists()

        poll("the engine's log rotated", rotated_now, timeout=60)
        live = log.read_text().splitlines()
        out = cp.ctl("logs", shard["shard_id"], "-n", str(len(live) + 3))
        assert out.returncode == 0, out.stderr
        previous = rotated.read_text().splitlines()
        # The last lines of the previous generation, then the live file's.
        shown = out.stdout.splitlines()
        assert previous[-1] in shown, out.stdout
        assert all(line in shown for line in live)
        if live:
            assert shown.index(previous[-1]) < shown.index(live[0])
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()
