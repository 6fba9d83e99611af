"""Idle and slow clients cannot pile up on the router, and its /metrics is not open to everyone.

Each test runs a router-only process (``python -m router``) with its own flags and talks to
it over real sockets: hundreds of connections that send nothing, connections that send a request
head a byte at a time (slowloris), keep-alive connections left idle after a response, and more
connections than the cap. The ``openai`` client is the peer that has to read the cap's 503.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests.fleet_procs import poll, terminate

#: A router-only run needs an engine URL; nothing here is proxied, so nothing listens there.
NO_ENGINE = "m=http://127.0.0.1:9"


class RouterProcess:
    def __init__(
        self,
        tmp_path: Path,
        *flags: str,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        nofile: int = 0,
    ):
        def limit() -> None:  # in the child, before exec: its descriptor limit, soft and hard
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.log = tmp_path / "router.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router",
                    "--static",
                    NO_ENGINE,
                    "--host",
                    host,
                    "--port",
                    "0",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=limit if nofile else None,
            )

        def ready() -> int | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited ({self.proc.returncode}):\n{self.log.read_text()}")
            m = re.search(r"llmgw router listening on \S+:(\d+)", self.log.read_text())
            return int(m.group(1)) if m else None

        self.port: int = poll("the router to listen", ready, timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[list[RouterProcess]]:
    started: list[RouterProcess] = []
    yield started
    for router in started:
        terminate(router.proc)


async def _closed_after(sock: trio.socket.SocketType, began: float) -> float:
    """Seconds from ``began`` until the router closes ``sock`` (EOF or reset); what it sends is read
    and dropped (a keep-alive connection's earlier response)."""
    while True:
        try:
            data = await sock.recv(65536)
        except OSError:
            break
        if not data:
            break
    return trio.current_time() - began


async def _connect(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    return sock


async def test_idle_and_slowloris_clients_are_closed_within_their_timeouts(
    routers: list[RouterProcess], tmp_path: Path
) -> None:
    """300 connections that send nothing and 100 that send a head a byte every 0.2 s are closed
    about one header timeout (1 s) after they opened, the slow ones although they keep sending;
    50 keep-alive connections idle after a response are closed one idle timeout (2 s) after it,
    not at the header timeout. Today's router keeps all of them for 300 s."""
    header_timeout, idle_timeout = 1.0, 2.0
    router = RouterProcess(
        tmp_path, "--header-timeout", str(header_timeout), "--client-idle-timeout", str(idle_timeout)
    )
    routers.append(router)
    idle_closed: list[float] = []
    slow_closed: list[float] = []
    kept_closed: list[float] = []
    sent_by_slow: list[int] = []

    async def idle_one() -> None:
        began = trio.current_time()
        sock = await _connect(router.port)
        with sock:
            idle_closed.append(await _closed_after(sock, began))

    async def slow_one() -> None:
        began = trio.current_time()
        sock = await _connect(router.port)
        head = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-slow: " + b"a" * 1000
        sent = 0

        async def drip() -> None:
            nonlocal sent
            for byte in head:
                try:
                    await sock.send(bytes([byte]))
                except OSError:
                    return
                sent += 1
                await trio.sleep(0.2)  # the attack's pace, not a wait for an event

        with sock:
            async with trio.open_nursery() as drips:
                drips.start_soon(drip)
                slow_closed.append(await _closed_after(sock, began))
                drips.cancel_scope.cancel()
        sent_by_slow.append(sent)

    async def kept_one() -> None:
        sock = await _connect(router.port)
        with sock:
            await sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}\n'):
                data = await sock.recv(65536)
                assert data, "the router closed a keep-alive connection before answering"
                answer += data
            assert answer.startswith(b"HTTP/1.1 200 ")
            kept_closed.append(await _closed_after(sock, trio.current_time()))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(idle_one)
            for _ in range(100):
                nursery.start_soon(slow_one)
            for _ in range(50):
                nursery.start_soon(kept_one)

    slack = 2.5  # two shared cores and 450 connections: the close is within the timeout plus this
    assert len(idle_closed) == 300 and len(slow_closed) == 100 and len(kept_closed) == 50
    assert header_timeout - 0.2 <= min(idle_closed) and max(idle_closed) <= header_timeout + slack, (
        idle_closed
    )
    assert header_timeout - 0.2 <= min(slow_closed) and max(slow_closed) <= header_timeout + slack, (
        slow_closed
    )
    assert min(sent_by_slow) >= 2, "the slow clients were cut off before they had sent anything"
    # Idle after a response: the idle timeout applies, not the header timeout.
    assert idle_timeout - 0.2 <= min(kept_closed) and max(kept_closed) <= idle_timeout + slack, kept_closed
    metrics = (await trio.to_thread.run_sync(lambda: httpx.get(f"{router.url}/metrics", timeout=10))).text
    closed = dict(
        re.findall(r'llmgw_router_client_connections_closed_total\{reason="(\w+)"\} (\d+)\.0$', metrics, re.M)
    )
    assert int(closed["head"]) + int(closed.get("idle", 0)) >= 400, metrics  # the idle and slow ones
    assert re.search(r"^llmgw_router_client_connections 1\.0$", metrics, re.M), metrics  # the scrape's own


def test_connections_over_the_cap_get_a_503_and_a_freed_slot_serves_again(
    routers: list[RouterProcess], tmp_path: Path
) -> None:
    """With --max-connections 20 and 20 connections held open, the openai client's next request
    is answered 503 (retry-after: 1), read whole rather than reset; once one held connection
    closes, requests are served again."""
    router = RouterProcess(tmp_path, "--max-connections", "20", "--header-timeout", "60")
    routers.append(router)
    held = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(20)]

    def counted() -> bool:
        metrics = httpx.get(f"{router.url}/metrics", timeout=10)
        # The scrape is the 21st connection while there are 20 held: it is refused itself.
        return metrics.status_code == 503

    poll("the router to count 20 held connections", counted, timeout=20)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=10)
    for _ in range(5):
        with pytest.raises(openai.InternalServerError) as refused:
            client.models.list()
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert "router_max_connections" in refused.value.message
    held.pop().close()

    def served() -> bool:
        try:
            return [m.id for m in client.models.list()] == ["m"]
        except openai.InternalServerError:
            return False

    poll("a freed slot to serve again", served, timeout=20)
    for sock in held:
        sock.close()
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert re.search(r'closed_total\{reason="over_capacity"\} ([6-9]|\d\d+)\.0$', metrics, re.M), metrics


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback, or None (then the test is skipped)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route's source
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_metrics_answer_loopback_only_without_a_key_and_the_key_holder_with_one(
    routers: list[RouterProcess], tmp_path: Path
) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback to reach the router from")
    (tmp_path / "a").mkdir()
    open_router = RouterProcess(tmp_path / "a", host="0.0.0.0")
    routers.append(open_router)
    assert httpx.get(f"http://127.0.0.1:{open_router.port}/metrics", timeout=10).status_code == 200
    far = httpx.get(f"http://{address}:{open_router.port}/metrics", timeout=10)
    assert far.status_code == 403 and "metrics_key" in far.json()["error"]["message"]
    assert httpx.get(f"http://{address}:{open_router.port}/health", timeout=10).status_code == 200

    key = "m" * 32
    (tmp_path / "b").mkdir()
    env = {**os.environ, "LLMGW_ROUTER_METRICS_KEY": key}
    keyed = RouterProcess(tmp_path / "b", host="0.0.0.0", env=env)
    routers.append(keyed)
    for host in ("127.0.0.1", address):
        base = f"http://{host}:{keyed.port}/metrics"
        assert httpx.get(base, timeout=10).status_code == 401
        assert httpx.get(base, headers={"authorization": "Bearer wrong"}, timeout=10).status_code == 401
        scraped = httpx.get(base, headers={"authorization": f"Bearer {key}"}, timeout=10)
        assert scraped.status_code == 200 and "llmgw_router_requests_total" in scraped.text


def test_the_client_limits_are_in_the_config_with_their_defaults_and_checked_at_load() -> None:
    from control.config import ConfigError, parse
    from router.limits import DEFAULT_CLIENT_IDLE_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS

    endpoints = '[[endpoints]]\nmodel = "m"\nurl = "http://127.0.0.1:9"\n'
    limits = parse(endpoints).router_config.client_limits
    assert (limits.header_timeout, limits.idle_timeout, limits.max_connections) == (
        DEFAULT_HEADER_TIMEOUT,
        DEFAULT_CLIENT_IDLE_TIMEOUT,
        DEFAULT_MAX_CONNECTIONS,
    )
    custom = parse(
        "router_header_timeout = 2.5\nrouter_client_idle_timeout = 30\nrouter_max_connections = 64\n"
        f'metrics_key = "{"k" * 16}"\n' + endpoints
    )
    assert custom.router_config.client_limits.max_connections == 64 and custom.metrics_key == "k" * 16
    for line, words in (
        (
            "router_header_timeout = 0",
            "router_header_timeout must be a number of seconds more than 0, got 0 (<config> line 2)",
        ),
        ("router_max_connections = 0", "router_max_connections must be at least 1, got 0 (<config> line 2)"),
        ('metrics_key = "short"', "metrics_key must be empty or at least 16 characters"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            parse(f"\n{line}\n" + endpoints)


def test_a_cap_the_descriptor_limit_cannot_hold_is_lowered_with_one_warning(
    routers: list[RouterProcess], tmp_path: Path
) -> None:
    """A router allowed 400 descriptors (hard limit) asked for 1,000 connections says so once at
    start and serves 48 ((400 - 256 reserved) / 3 per connection): the 49th gets the 503, where an
    uncapped accept loop would run out of descriptors."""
    router = RouterProcess(tmp_path, "--max-connections", "1000", "--header-timeout", "60", nofile=400)
    routers.append(router)
    log = router.log.read_text()
    assert "serving at most 48 client connections" in log and log.count("WARNING") == 1, log
    held = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(48)]
    try:

        def refused() -> bool:
            return httpx.get(f"{router.url}/health", timeout=10).status_code == 503

        poll("the 49th connection to be refused", refused, timeout=20)
    finally:
        for sock in held:
            sock.close()


def test_the_control_planes_router_applies_the_configs_limits_and_metrics_key(tmp_path: Path) -> None:
    """The keys in llmgw.toml reach the router the control plane runs (a router-only catalog here):
    its /metrics wants the key, and a connection that sends nothing closes at the header timeout."""
    # A catalog with a model (no node needed): the control plane's own run, with its router.
    from tests.fleet_procs import ControlProcess, free_port

    key = "k" * 32
    cp = ControlProcess(
        tmp_path / "cp",
        f'state_dir = "{tmp_path / "state"}"\nmetrics_key = "{key}"\nrouter_header_timeout = 1.0\n'
        f'[listen]\nagents = "127.0.0.1:{free_port()}"\napi = "127.0.0.1:0"\nrouter = "127.0.0.1:0"\n'
        '[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n',
    )
    try:
        cp.start()
        url = f"http://127.0.0.1:{cp.router_port}/metrics"
        assert httpx.get(url, timeout=10).status_code == 401
        ok = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert ok.status_code == 200 and b"llmgw_router" in ok.content
        with socket.create_connection(("127.0.0.1", cp.router_port), timeout=15) as silent:
            began = time.monotonic()
            assert silent.recv(1) == b""  # closed by the router, not by our 15 s timeout
            assert time.monotonic() - began < 10
    finally:
        cp.terminate()
