"""Real processes for fleet tests: a control plane and agents, each started and ended by the test.

Engines outlive agents by design (that is the point of the supervisor), so a test that started agents
also ends the engines they spawned, found through the agents' own state directories.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.support import cmdline, processes
from tests.support import free_port as free_port  # re-exported: fleet tests import them from here
from tests.support import pid_alive as pid_alive
from tests.support import poll as poll

FIXTURES = Path(__file__).parent / "fixtures"

#: The join-token file of each control plane a test started, by its agent port: an ``Agent`` pointed
#: at that port joins with it (``LLMGW_AGENT_TOKEN``), the way an operator passes ``--token``.
JOIN_TOKENS: dict[int, Path] = {}

#: Where the control plane keeps its join token, in its state directory (``control.joins``).
JOIN_TOKEN_FILE = "join-token"


class ControlProcess:
    def __init__(self, workdir: Path, config_text: str) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "llmgw.toml"
        self.config.write_text(config_text)
        self.log = workdir / "control.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent_port = 0
        self.api_port = 0
        self.router_port = 0

    def start(self) -> None:
        self.wait_ready(self.spawn())

    def spawn(self) -> int:
        """Start the process and return where this start's lines begin in the log (for
        ``wait_ready``): a standby control plane (etcd) announces itself only once it leads."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "control", "--config", str(self.config)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return offset

    def wait_ready(self, offset: int, timeout: float = 30) -> None:
        """Wait for this start's "ready" line (its ports), failing if the process exits."""

        def ready() -> tuple[int, int] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"control plane exited ({self.proc.returncode}):\n{self.log.read_text()}"
                )
            # Only this start's announcement counts, not an earlier run's in the same log.
            for line in reversed(self.log.read_bytes()[offset:].decode().splitlines()):
                # search, not match: with --log-format json the line is a JSON record holding these words.
                m = re.search(r"llmgw control plane ready: agents :(\d+) api :(\d+) router :(\d+|-)", line)
                if m:
                    self.router_port = int(m.group(3)) if m.group(3) != "-" else 0
                    return int(m.group(1)), int(m.group(2))
            return None

        self.agent_port, self.api_port = poll("the control plane to listen", ready, timeout=timeout)
        JOIN_TOKENS[self.agent_port] = self.state_dir() / JOIN_TOKEN_FILE

    def state_dir(self) -> Path:
        """The ``state_dir`` of this control plane's config."""
        return Path(tomllib.loads(self.config.read_text())["state_dir"])

    def join_token(self) -> str:
        """The cluster join token this control plane created at its first start ("" without one)."""
        try:
            return (self.state_dir() / JOIN_TOKEN_FILE).read_text().strip()
        except FileNotFoundError:
            return ""

    def api(self, path: str, method: str = "GET") -> Any:
        resp = httpx.request(method, f"http://127.0.0.1:{self.api_port}{path}", timeout=15)
        return resp.json()

    def ctl_argv(self) -> list[str]:
        return [sys.executable, "-m", "control", "ctl", "--api", f"http://127.0.0.1:{self.api_port}"]

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.ctl_argv(), *args], capture_output=True, text=True, timeout=90)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> None:
        terminate(self.proc)


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM a process this test started, SIGKILL if it does not go within 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Agent:
    def __init__(
        self,
        workdir: Path,
        node_id: str,
        server: str,
        inventory: str | None,
        fabrics: str,
        mgmt_addr: str,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.node_id = node_id
        self.state_dir = workdir / node_id
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.state_dir / "agent.log"
        self.argv = [
            sys.executable, "-m", "agent",
            "--node-id", node_id,
            "--server", server,
            "--state-dir", str(self.state_dir),
            "--heartbeat-interval", "0.3",
            "--reconnect-base", "0.2",
            "--reconnect-max", "1",
            "--stop-grace", "3",
            "--fabrics", fabrics,
            "--mgmt-addr", mgmt_addr,
            "--engines", f"vllm={sys.executable} -m agent.engines.sim",
            *(["--inventory", str(FIXTURES / "inventory" / inventory)] if inventory else []),
            *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Start the agent; ``env`` adds variables for this start only (a test hook, say).

        An agent pointed at a control plane this test started joins with its join token (in the
        environment, as an operator would keep it out of ``ps``), unless the argv or ``env`` give one.
        """
        env = {**self._join_env(), **(env or {})}
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env} if env else None,
            )

    def _join_env(self) -> dict[str, str]:
        if "--token" in self.argv:
            return {}
        server = self.argv[self.argv.index("--server") + 1]
        m = re.search(r":(\d+)/?$", server)
        path = JOIN_TOKENS.get(int(m.group(1))) if m else None
        try:
            token = path.read_text().strip() if path is not None else ""
        except FileNotFoundError:
            token = ""
        return {"LLMGW_AGENT_TOKEN": token} if token else {}

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def engine_pids(self) -> list[int]:
        """Engines this agent started: those its records name, and those carrying its marker
        (an engine whose record is missing or damaged is still this agent's)."""
        pids = set(self.marked_engines())
        for record in (self.state_dir / "shards").glob("*.json"):
            try:
                pid = int(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if pid > 0:  # 0 is an intent: no process yet (and killpg(0) is our own group)
                pids.add(pid)
        return sorted(pids)

    def marked_engines(self, shard_id: str | None = None) -> list[int]:
        """Running process-group leaders carrying this agent's marker (``agent.supervise.procfs``),
        for ``shard_id`` or any shard: how a test counts engines per slot from ``/proc`` itself."""
        from agent.supervise import procfs

        owner = os.path.abspath(self.state_dir)
        return sorted(e.pid for e in procfs.find_engines(owner) if shard_id is None or e.shard_id == shard_id)

    def stop_all(self) -> None:
        """End the agent, then the engines it started (they outlive it by design)."""
        terminate(self.proc)
        # Records and markers both: an engine whose record a test damaged is still this agent's.
        for pid in {*self.engine_pids(), *self.marked_engines()}:
            if pid > 0 and pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def sim_processes(marker: str) -> list[int]:
    """Engine processes whose command line names ``marker`` (a served model name unique to a test)."""
    return processes(lambda argv: b"agent.engines.sim" in argv and marker.encode() in argv)


def engines_by_port(marker: str) -> dict[int, list[int]]:
    """Live sim engines whose command line names ``marker``, by the port they serve on (``--port``)."""
    out: dict[int, list[int]] = {}
    for pid in sim_processes(marker):
        argv = cmdline(pid) or []
        try:
            port = int(argv[argv.index(b"--port") + 1])
        except (ValueError, IndexError):
            continue
        out.setdefault(port, []).append(pid)
    return out


# -- a whole fleet: one control plane, agents of a layout, the test catalog ------------------------------

CHAT = "chat-{tag}"
BIG = "big-{tag}"


def catalog(
    tag: str,
    state_dir: Path,
    extra: str = "",
    chat_extra: str = "",
    chat_load_seconds: float = 0.3,
    top: str = "",
) -> str:
    """The test catalog; ``top`` adds top-level keys, ``extra`` lines under ``[liveness]`` or tables."""
    return f"""
state_dir = "{state_dir}"
{top}
reconcile_interval = 0.3
backoff_initial = 0.5
stop_grace = 3
drain_deadline = 5
[engines]
ports = "20000-29999"
[listen]
agents = "127.0.0.1:{free_port()}"
api = "127.0.0.1:0"
router = "127.0.0.1:0"
[liveness]
unreachable_after = 1.5
lost_after = 4.0
startup_grace = 8.0
{extra}
[[models]]
name = "{BIG.format(tag=tag)}"
replicas = 1
nodes_per_replica = 2
[models.gpus]
count = 8
min_memory_gib = 70
min_compute_capability = "9.0"
[models.profile]
engine = "vllm"
model = "meta-llama/Llama-3.1-405B-Instruct"
served_model_name = "{BIG.format(tag=tag)}"
tensor_parallel_size = 8
pipeline_parallel_size = 2
dtype = "bfloat16"
env = {{ LLMGW_SIM_LOAD_SECONDS = "0.3", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "1" }}

[[models]]
name = "{CHAT.format(tag=tag)}"
replicas = 2
{chat_extra}
[models.gpus]
count = 2
[models.profile]
engine = "vllm"
model = "meta-llama/Llama-3.1-8B-Instruct"
served_model_name = "{CHAT.format(tag=tag)}"
tensor_parallel_size = 2
dtype = "bfloat16"
env = {{ LLMGW_SIM_LOAD_SECONDS = "{chat_load_seconds}", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "1" }}
"""


class Fleet:
    def __init__(
        self,
        tmp: Path,
        tag: str,
        layout: list[tuple[str, str, str, str]],
        extra: str = "",
        chat_extra: str = "",
        chat_load_seconds: float = 0.3,
        top: str = "",
    ) -> None:
        self.tag = tag
        self.cp = ControlProcess(
            tmp / "cp", catalog(tag, tmp / "cp" / "state", extra, chat_extra, chat_load_seconds, top)
        )
        self.layout = layout
        self.tmp = tmp
        self.agents: dict[str, Agent] = {}

    def start(
        self,
        agent_extra: Mapping[str, tuple[str, ...]] | None = None,
        scheme: str = "http",
        only: set[str] | None = None,
        server: str = "",
    ) -> None:
        """Start the control plane (once) and the agents of the layout (or only those named);
        ``server``: the agents' ``--server`` instead of this control plane's URL."""
        if self.cp.proc is None:
            self.cp.start()
        for index, (node_id, inventory, fabric, addr) in enumerate(self.layout):
            if node_id in self.agents or (only is not None and node_id not in only):
                continue
            # All "nodes" share this machine, so each gets its own engine port range.
            first = 21000 + 100 * index
            agent = Agent(
                self.tmp / "agents",
                node_id,
                server or f"{scheme}://127.0.0.1:{self.cp.agent_port}",
                inventory,
                f"{fabric}:mlx5_0:1,{fabric}:mlx5_1:1",
                addr,
                extra=(
                    "--engine-ports",
                    f"{first}-{first + 99}",
                    "--mgmt-interface",
                    "lo",
                    *(agent_extra or {}).get(node_id, ()),
                ),
            )
            agent.start()
            self.agents[node_id] = agent

    def stop(self) -> None:
        """End the control plane, the agents (resumed first, should a test have paused one) and every
        engine of this fleet's models: those its agents recorded, then any other with its markers (an
        engine whose record a fault test made its agent lose is still this test's)."""
        self.cp.terminate()
        for agent in self.agents.values():
            if agent.proc is not None and agent.proc.poll() is None:
                os.kill(agent.proc.pid, signal.SIGCONT)
            agent.stop_all()
        for marker in (CHAT.format(tag=self.tag), BIG.format(tag=self.tag)):
            for pid in sim_processes(marker):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.cp.api("/api/replicas") if r["model"] == model]

    def placed_shards(self, model: str) -> list[dict[str, Any]]:
        """The shards of the model's placements (not the old copies still draining)."""
        return [s for r in self.replicas(model) for s in r["shards"] if s["placed"]]

    def ready_replicas(self, model: str, count: int) -> list[dict[str, Any]] | None:
        reps = [r for r in self.replicas(model) if r["state"] == "ready"]
        return reps if len(reps) >= count else None


LAYOUT_A = [
    ("gpu01", "h100x8.toml", "ib-a", "127.0.0.1"),
    ("gpu02", "h100x4.toml", "ib-a", "127.0.0.2"),
    ("gpu03", "h100x8.toml", "ib-b", "127.0.0.3"),
]


def sim_version() -> str:
    """The vLLM version the simulator imitates, as its own ``--version`` says (and the agent's
    version probe reads it), so tests follow whichever version it imitates."""
    out = subprocess.run(
        [sys.executable, "-m", "agent.engines.sim", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@contextlib.contextmanager
def one_node(
    tmp: Path, models: str, ports: str, engines: str = "", agent_extra: tuple[str, ...] = ()
) -> Iterator[tuple[ControlProcess, Agent]]:
    """A real control plane with ``models`` (its ``[[models]]`` tables) and one CPU-only agent,
    gpu07 on loopback, whose vLLM binary is the simulator (plus ``engines``, ``;``-separated), both
    ended (engines included) when the block ends."""
    cp = ControlProcess(
        tmp / "cp",
        f'state_dir = "{tmp / "cp" / "state"}"\nreconcile_interval = 0.3\n[listen]\n'
        f'agents = "127.0.0.1:{free_port()}"\napi = "127.0.0.1:0"\nrouter = "127.0.0.1:0"\n'
        f'[engines]\nports = "{ports}"\n{models}',
    )
    agent = None
    try:
        cp.start()
        sim = f"vllm={sys.executable} -m agent.engines.sim"
        agent = Agent(
            tmp / "agents",
            "gpu07",
            f"http://127.0.0.1:{cp.agent_port}",
            None,
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=(
                "--engine-ports",
                ports,
                "--engines",
                f"{sim};{engines}" if engines else sim,
                *agent_extra,
            ),
        )
        agent.start()
        yield cp, agent
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()
