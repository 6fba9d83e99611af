"""Real processes for fleet tests: a control plane and agents, each started and ended by the test.

Engines outlive agents by design (that is the point of the supervisor), so a test that started agents
also ends the engines they spawned, found through the agents' own state directories.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.grpcio_cp import wait_for

FIXTURES = Path(__file__).parent / "fixtures"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


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
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "control", "--config", str(self.config)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def ready() -> tuple[int, int] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"control plane exited ({self.proc.returncode}):\n{self.log.read_text()}"
                )
            # Only this start's announcement counts, not an earlier run's in the same log.
            for line in reversed(self.log.read_bytes()[offset:].decode().splitlines()):
                m = re.match(r"llmgw control plane ready: agents :(\d+) api :(\d+) router :(\d+|-)", line)
                if m:
                    self.router_port = int(m.group(3)) if m.group(3) != "-" else 0
                    return int(m.group(1)), int(m.group(2))
            return None

        self.agent_port, self.api_port = wait_for("the control plane to listen", ready)

    def api(self, path: str, method: str = "GET") -> Any:
        resp = httpx.request(method, f"http://127.0.0.1:{self.api_port}{path}", timeout=15)
        return resp.json()

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "control", "ctl", "--api", f"http://127.0.0.1:{self.api_port}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

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

    def start(self) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                self.argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def engine_pids(self) -> list[int]:
        pids = []
        for record in (self.state_dir / "shards").glob("*.json"):
            try:
                pids.append(int(json.loads(record.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                continue
        return pids

    def stop_all(self) -> None:
        """End the agent, then the engines it started (they outlive it by design)."""
        terminate(self.proc)
        for pid in self.engine_pids():
            if pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def sim_processes(marker: str) -> list[int]:
    """Engine processes whose command line names ``marker`` (a served model name unique to a test)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.engines.sim" in cmd and marker.encode() in cmd and pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return sorted(pids)


def poll(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    return wait_for(what, check, timeout=timeout, interval=0.2)
