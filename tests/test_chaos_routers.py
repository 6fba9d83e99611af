"""Chaos: two routers of their own (``python -m router --control``) under a streaming load while the
control plane is killed with SIGKILL, kept down for 10 s and started again.

The invariants: zero failed requests on either router (each serves its last table while the control
plane is away; the engines never stopped), and routes resynchronise afterwards: a replica that only
the restarted control plane places (its config asks for one more) is used by both routers.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

import schema
from tests.fleet_procs import Agent, ControlProcess, free_port, poll, sim_processes, terminate

pytestmark = pytest.mark.chaos

#: The route watch's read token (the routers present it; the admin API then wants it too).
TOKEN = "chaos-routers-read-token-0123456789"
OUTAGE = 10.0


def _config(state: Path, model: str, replicas: int, ports: tuple[int, int, int]) -> str:
    agents, api, router = ports
    return f"""
state_dir = "{state}"
reconcile_interval = 0.3
[listen]
agents = "127.0.0.1:{agents}"
api = "127.0.0.1:{api}"
router = "127.0.0.1:{router}"
[engines]
ports = "24400-24599"
[api]
read_tokens = ["{TOKEN}"]
[[models]]
name = "{model}"
replicas = {replicas}
[models.profile]
engine = "sim"
model = "m"
env = {{ LLMGW_SIM_LOAD_SECONDS = "0.3", LLMGW_SIM_TTFT_MS = "2", LLMGW_SIM_ITL_MS = "5" }}
"""


def _table(agent_port: int) -> schema.RouteTable:
    """The control plane's current route table, read with grpcio as any watcher would."""
    channel = grpc.insecure_channel(f"127.0.0.1:{agent_port}")
    try:
        call = channel.unary_stream(
            schema.WATCH_ROUTES_PATH, request_serializer=bytes, response_deserializer=schema.RouteTable.parse
        )(schema.WatchRoutesRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        table: schema.RouteTable = next(iter(call))
        call.cancel()
        return table
    finally:
        channel.close()


def _urls(agent_port: int, model: str, count: int) -> set[str] | None:
    """The model's upstream URLs once there are ``count`` of them (``None`` until then)."""
    try:
        table = _table(agent_port)
    except grpc.RpcError:
        return None
    urls = {u.url for m in table.models if m.model == model for u in m.upstreams}
    return urls if len(urls) == count else None


class RouterProcess:
    def __init__(self, workdir: Path, name: str, control: str) -> None:
        self.port = free_port()
        self.log = workdir / f"{name}.log"
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router", "--control", control, "--port", str(self.port)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "LLMGW_ROUTER_CONTROL_TOKEN": TOKEN},
            )

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited ({self.proc.returncode}):\n{self.log.read_text()}")
            return bool(re.search(r"llmgw router listening on \S+:\d+", self.log.read_text()))

        poll(f"{name} to listen", listening, timeout=30)

    def upstreams_used(self) -> set[str]:
        """Engine URLs this router has sent requests to (its per-upstream gauges, from /metrics)."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        return set(re.findall(r'llmgw_router_in_flight\{replica="[^"]*",url="([^"]+)"\}', text))

    def uses(self, url: str) -> bool:
        return url in self.upstreams_used()


class Load:
    """Streaming chat completions through one router from worker threads, counting outcomes."""

    def __init__(self, port: int, model: str, threads: int = 3) -> None:
        self.model = model
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _worker(self) -> None:
        n = 0
        while not self._stop.is_set():
            # A new prompt each time: prefix affinity sends one prompt to one replica, and the test
            # must see every replica used.
            n += 1
            prompt = f"{threading.get_ident()}-{n}: hello"
            try:
                stream = self.client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=16,
                    stream=True,
                    timeout=30,
                )
                chunks = sum(1 for _ in stream)
                assert chunks > 0, "empty stream"
            except Exception as exc:
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.ok += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, object]]:
    tag = f"cr{os.getpid()}"
    model = f"chat-{tag}"
    ports = (free_port(), free_port(), free_port())
    cp = ControlProcess(tmp_path / "cp", _config(tmp_path / "cp" / "state", model, 2, ports))
    agents: list[Agent] = []
    routers: list[RouterProcess] = []
    try:
        cp.start()
        for i, node in enumerate(("gpu01", "gpu02")):
            first = 24400 + 100 * i
            agent = Agent(
                tmp_path / "agents",
                node,
                f"http://127.0.0.1:{cp.agent_port}",
                None,
                "ib-a:mlx5_0:1",
                "127.0.0.1",
                extra=("--engine-ports", f"{first}-{first + 99}"),
            )
            agent.start()
            agents.append(agent)
        yield {"cp": cp, "model": model, "ports": ports, "routers": routers, "tmp": tmp_path}
    finally:
        for r in routers:
            terminate(r.proc)
        cp.terminate()
        for agent in agents:
            agent.stop_all()
        for pid in sim_processes(model):
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass


def test_two_routers_serve_through_a_control_plane_kill_and_resync(fleet: dict[str, object]) -> None:
    cp = fleet["cp"]
    model = fleet["model"]
    ports = fleet["ports"]
    routers = fleet["routers"]
    tmp = fleet["tmp"]
    assert isinstance(cp, ControlProcess) and isinstance(model, str) and isinstance(tmp, Path)
    assert isinstance(ports, tuple) and isinstance(routers, list)

    before = poll(
        "two ready replicas in the route table",
        lambda: _urls(cp.agent_port, model, 2),
        timeout=90,
    )
    control = f"http://127.0.0.1:{cp.agent_port}"
    routers.extend(RouterProcess(tmp, f"router{i}", control) for i in range(2))
    loads = [Load(r.port, model) for r in routers]
    try:
        poll("requests through both routers", lambda: all(load.ok >= 20 for load in loads), timeout=60)

        cp.kill9()
        down_since = time.monotonic()
        served = [load.ok for load in loads]
        # The outage lasts OUTAGE seconds (the fault, not a wait for an event); meanwhile both routers
        # must keep completing requests from their last table.
        poll(
            f"{OUTAGE:g} s of outage with both routers serving",
            lambda: (
                time.monotonic() - down_since >= OUTAGE
                and all(ld.ok > s + 20 for ld, s in zip(loads, served, strict=True))
            ),
            timeout=OUTAGE + 60,
        )

        cp.config.write_text(_config(cp.state_dir(), model, 3, ports))
        cp.start()
        assert cp.agent_port == ports[0]
        after = poll(
            "a third replica in the restarted control plane's table",
            lambda: _urls(cp.agent_port, model, 3),
            timeout=120,
        )
        assert before < after
        (added,) = after - before
        for r in routers:
            used = functools.partial(r.uses, added)
            poll(f"router on :{r.port} to use the added replica {added} (log {r.log})", used, timeout=60)
        resumed = [load.ok for load in loads]
        poll(
            "more requests after the resync",
            lambda: all(ld.ok > s + 20 for ld, s in zip(loads, resumed, strict=True)),
            timeout=60,
        )
    finally:
        for load in loads:
            load.stop()
    for i, load in enumerate(loads):
        print(f"router{i}: {load.ok} streamed completions, {len(load.failures)} failed")
        assert not load.failures, (
            f"router{i}: {len(load.failures)} failed of {load.ok + len(load.failures)}: {load.failures[:5]}"
        )
    logs = [r.log.read_text() for r in routers]
    for text in logs:
        assert "route watch on" in text and " lost: " in text and " recovered: " in text, text[-3000:]
