"""The agent says nothing before it knows who it talks to, and names the port mistakes it meets.

Real agents (``python -m agent``) against peers that are not an agent port: a listener that accepts
and never answers (it must receive the HTTP/2 preface and SETTINGS and nothing else: no HEADERS with
the node's metadata, no Register with its inventory or token), the router and the admin API of a
real control plane, and a TLS port spoken to in plaintext and the other way round.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme
from hyperframe.frame import SettingsFrame

from tests.fleet_procs import FIXTURES, ControlProcess, catalog, poll, terminate
from tests.rawh2 import PREFACE, split_frames
from tests.wirepeers import echo_handler, register
from transport import (
    CallOptions,
    ClientTLS,
    ConnectionLost,
    GoAwayReceived,
    ServerLimits,
    ServerTLS,
    StreamServer,
    open_stream,
)

NODE = "gpu-s2-node"
TOKEN = "tok-s2-never-on-the-wire"


class SilentListener:
    """Accepts connections and never writes a byte; keeps everything each connection sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.received: list[bytearray] = []
        self.closed: list[bool] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                index = len(self.received)
                self.received.append(bytearray())
                self.closed.append(False)
            threading.Thread(target=self._read, args=(conn, index), daemon=True).start()

    def _read(self, conn: socket.socket, index: int) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self.closed[index] = True
                    return
                with self._lock:
                    self.received[index] += data

    def close(self) -> None:
        self.sock.close()


def start_agent(workdir: Path, server: str) -> tuple[subprocess.Popen[bytes], Path]:
    state = workdir / "agent"
    state.mkdir(parents=True, exist_ok=True)
    log = workdir / "agent.log"
    env = {**os.environ, "LLMGW_AGENT_TOKEN": TOKEN}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "--node-id",
                NODE,
                "--server",
                server,
                "--state-dir",
                str(state),
                "--inventory",
                str(FIXTURES / "inventory" / "h100x8.toml"),
                "--mgmt-addr",
                "127.0.0.1",
                "--reconnect-base",
                "0.2",
                "--reconnect-max",
                "0.5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return proc, log


def session_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "session with" in line]


@pytest.fixture
def silent() -> Iterator[SilentListener]:
    listener = SilentListener()
    yield listener
    listener.close()


def test_agent_sends_nothing_to_a_listener_that_never_answers(tmp_path: Path, silent: SilentListener) -> None:
    proc, log = start_agent(tmp_path, f"http://127.0.0.1:{silent.port}")
    try:
        # The first connection ends at the agent's bound on the server's SETTINGS (5 s); a second
        # one shows the agent goes on retrying.
        poll("the agent to give up on the silent listener and dial again", lambda: len(silent.closed) >= 2
             and silent.closed[0], timeout=30)  # fmt: skip
        lines = poll("the agent's line about it", lambda: session_lines(log), timeout=10)
    finally:
        terminate(proc)
    got = bytes(silent.received[0])
    assert got.startswith(PREFACE), got[:64]
    frames = split_frames(got[len(PREFACE) :])
    assert frames and all(isinstance(f, SettingsFrame) for f in frames), frames
    assert sum(9 + len(f.serialize_body()) for f in frames) == len(got) - len(PREFACE)
    assert NODE.encode() not in got and TOKEN.encode() not in got
    assert "did not answer our HTTP/2 connection preface within 5 s" in lines[0], lines
    assert "[listen] agents" in lines[0] and "https://" in lines[0], lines
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlProcess]:
    workdir = tmp_path_factory.mktemp("cp")
    cp = ControlProcess(workdir, catalog("s2", workdir / "state"))
    try:
        cp.start()
        yield cp
    finally:
        terminate(cp.proc)


@pytest.mark.parametrize(
    ("port", "says"),
    [
        ("router", r"answered with HTTP/1.1 ('HTTP/1.1 400 Bad Request'): is this the router or admin port?"),
        ("api", "speaks HTTP/2 but takes no streams (SETTINGS_MAX_CONCURRENT_STREAMS 0): is this the admin API port?"),
    ],
)  # fmt: skip
def test_agent_at_the_router_or_admin_port_names_the_mistake_and_retries(
    tmp_path: Path, control: ControlProcess, port: str, says: str
) -> None:
    number = control.router_port if port == "router" else control.api_port
    proc, log = start_agent(tmp_path, f"http://127.0.0.1:{number}")
    try:
        lines = poll("two reconnect lines", lambda: len(ls := session_lines(log)) >= 2 and ls, timeout=30)
    finally:
        terminate(proc)
    for line in lines:
        assert says in line and "agents connect to the control plane's [listen] agents address" in line, line
        assert "reconnecting in" in line
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(d / "server.pem")
    server.private_key_pem.write_to_path(d / "server.key")
    return d / "ca.pem", d / "server.pem", d / "server.key"


async def test_plaintext_url_for_a_tls_port_is_named(
    nursery: trio.Nursery, certs: tuple[Path, Path, Path]
) -> None:
    """The TLS port answers a plaintext client in its own protocol (HTTP/2 GOAWAY, HTTP/1.1 400)
    with the fix, instead of closing the connection and leaving the agent to guess; it still
    serves a TLS client afterwards."""
    ca, cert, key = certs
    server = StreamServer(echo_handler, tls=ServerTLS(cert, key), limits=ServerLimits(handshake_timeout=2))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    hint = "this port speaks TLS: use an https:// (or wss://) server URL"
    with trio.fail_after(10), pytest.raises(GoAwayReceived) as info:
        async with open_stream(f"http://127.0.0.1:{port}", CallOptions(settings_timeout=3)):
            pass
    assert hint in str(info.value)
    with trio.fail_after(10), pytest.raises(ConnectionLost) as refused:
        async with open_stream(f"ws://127.0.0.1:{port}"):
            pass
    assert f"refused: HTTP 400: '{hint}'" in str(refused.value)
    async with open_stream(f"https://127.0.0.1:{port}", CallOptions(tls=ClientTLS(ca_file=ca))) as stream:
        await stream.send(register("hello"))
        assert (await stream.receive()) is not None


async def test_websocket_url_for_the_router_is_named(control: ControlProcess) -> None:
    with trio.fail_after(10), pytest.raises(ConnectionLost) as info:
        async with open_stream(f"ws://127.0.0.1:{control.router_port}"):
            pass
    assert "refused: HTTP 404" in str(info.value)
    assert "is this the router or admin port? agents connect to the control plane's [listen] agents" in str(
        info.value
    )


async def test_tls_url_for_a_plaintext_port_is_named(
    echo_server: tuple[StreamServer, int], certs: tuple[Path, Path, Path]
) -> None:
    _, port = echo_server
    ca, _, _ = certs
    with trio.fail_after(10), pytest.raises(ConnectionLost) as info:
        async with open_stream(f"https://127.0.0.1:{port}", CallOptions(tls=ClientTLS(ca_file=ca))):
            pass
    assert "the server answered in plaintext HTTP/2: the port does not use TLS; use an http://" in str(
        info.value
    )


async def test_our_server_still_answers_at_once(echo_server: tuple[StreamServer, int]) -> None:
    """Waiting for SETTINGS costs nothing against a real agent port (and grpcio's: test_wire_client)."""
    _, port = echo_server
    with trio.fail_after(2):
        async with open_stream(f"http://127.0.0.1:{port}", CallOptions(settings_timeout=1)) as stream:
            await stream.send(register("hello"))
            reply = await stream.receive()
    assert reply is not None and reply.ack is not None and reply.ack.ok
