"""Interop with ``@connectrpc/connect-node`` (v2), a Connect implementation nobody here wrote.

Both directions speak the Connect protocol (``application/connect+proto``) over HTTP/2 cleartext:

- connect-node's client (``tests/connect_node/client.mjs``) against our ``StreamServer``;
- our ``open_stream(..., protocol="connect")`` against connect-node's server
  (``tests/connect_node/server.mjs``, ``connectNodeAdapter`` on ``http2.createServer``, gRPC turned off).

The Node side needs no generated code: it reads a FileDescriptorSet that protoc builds from
``schema/llmgw/v1/agent.proto`` at test time. ``npm ci`` installs the pinned packages of
``tests/connect_node/package-lock.json`` once into a cache outside the checkout
(``$XDG_CACHE_HOME/llmgw/connect-node/<lock hash>/``, default ``~/.cache``) and later runs reuse it.
Without ``node`` and ``npm`` on PATH these tests are skipped; a failed install is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.wirepeers import heartbeat, register
from transport import CallOptions, Code, RpcError, StreamServer, open_stream

REPO = Path(__file__).resolve().parent.parent
NODE_DIR = Path(__file__).resolve().parent / "connect_node"
SCRIPTS = ("schema.mjs", "client.mjs", "server.mjs")
#: ``npm ci`` downloads; give it time. Everything after it is local and quick.
NPM_TIMEOUT = 600.0
CLIENT_DEADLINE = 30.0
PORT_DEADLINE = 15.0
EXCHANGE_DEADLINE = 30.0

REFUSE_TEXT = "refusé ✓ 100%"
HEARTBEATS = 1000
PUSHED = 50
BIG = 1 << 20


@dataclass(frozen=True)
class NodePeer:
    node: str
    #: Holds the scripts, a ``node_modules`` link into the cache, and the descriptor set.
    workdir: Path
    descriptor_set: Path


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "connect-node"


def _npm_ci(npm: str) -> Path:
    """The cache directory for this lock file, installed by ``npm ci`` unless a finished one is there."""
    lock = NODE_DIR / "package-lock.json"
    target = _cache_root() / hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Install beside the target and rename: an interrupted install is never mistaken for a finished one,
    # and concurrent runs do not install into the same directory.
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        for name in ("package.json", "package-lock.json"):
            shutil.copy2(NODE_DIR / name, staging / name)
        cmd = [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"]
        try:
            done = subprocess.run(
                cmd, cwd=staging, capture_output=True, text=True, timeout=NPM_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as exc:
            # TimeoutExpired carries bytes even with text=True.
            output = b"\n".join(
                o if isinstance(o, bytes) else o.encode() for o in (exc.stdout, exc.stderr) if o
            )
            pytest.fail(
                f"`npm ci` in {staging} took over {NPM_TIMEOUT:.0f} s:\n{output.decode(errors='replace')}"
            )
        if done.returncode != 0:
            pytest.fail(
                f"`npm ci` in {staging} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        (staging / ".complete").touch()
        if target.exists() and not (target / ".complete").exists():
            shutil.rmtree(target)  # left by something other than this function
        try:
            staging.rename(target)
        except OSError:
            if not (target / ".complete").exists():
                raise
            # Another run finished first; its install is as good as ours.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def node_peer(tmp_path_factory: pytest.TempPathFactory) -> NodePeer:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("npm not found: install Node.js 20+ to run the connect-node interop tests")
    installed = _npm_ci(npm)
    workdir = tmp_path_factory.mktemp("connect-node")
    for name in SCRIPTS:
        shutil.copy2(NODE_DIR / name, workdir / name)
    # Node resolves packages from the script's directory upwards (ESM ignores NODE_PATH).
    (workdir / "node_modules").symlink_to(installed / "node_modules", target_is_directory=True)
    descriptor_set = workdir / "agent.binpb"
    protoc = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{REPO / 'schema'}",
        "--include_imports",
        f"--descriptor_set_out={descriptor_set}",
        str(REPO / "schema" / "llmgw" / "v1" / "agent.proto"),
    ]
    done = subprocess.run(protoc, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        pytest.fail(f"protoc failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return NodePeer(node=node, workdir=workdir, descriptor_set=descriptor_set)


async def test_connect_node_client_against_our_server(
    echo_server: tuple[StreamServer, int], node_peer: NodePeer
) -> None:
    _, port = echo_server
    config = {
        "descriptorSet": str(node_peer.descriptor_set),
        "baseUrl": f"http://127.0.0.1:{port}",
        "heartbeats": HEARTBEATS,
        "push": PUSHED,
        "bigBytes": BIG,
        "refuseText": REFUSE_TEXT,
        "watchdogMs": int((CLIENT_DEADLINE - 5) * 1000),
    }
    cmd = [node_peer.node, str(node_peer.workdir / "client.mjs"), json.dumps(config)]
    with trio.fail_after(CLIENT_DEADLINE):
        done = await trio.run_process(
            cmd, cwd=node_peer.workdir, capture_stdout=True, capture_stderr=True, check=False
        )
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    context = f"connect-node client exited {done.returncode}\nstdout: {stdout}\nstderr: {stderr}"
    lines = stdout.strip().splitlines()
    assert lines, context
    summary: dict[str, Any] = json.loads(lines[-1])
    assert summary == {
        "failures": [],
        "heartbeats": {"sent": HEARTBEATS, "acked": HEARTBEATS, "inOrder": True},
        "push": {"received": PUSHED, "inOrder": True, "requestSideOpen": True},
        "big": {"messageId": HEARTBEATS + 1, "errorLength": BIG, "allX": True},
        "cleanEnd": True,
        "refuse": {
            "code": 7,
            "codeName": "PermissionDenied",
            "rawMessage": REFUSE_TEXT,
            "unexpected": [],
        },
    }, context
    assert done.returncode == 0, context


async def _read_text(path: Path) -> str:
    return await trio.Path(path).read_text(errors="replace")


@asynccontextmanager
async def _connect_node_server(peer: NodePeer, stderr_path: Path) -> AsyncIterator[int]:
    """Runs server.mjs; yields its port; terminates it (this process's own child) on the way out."""
    async with await trio.open_file(stderr_path, "wb") as stderr_file:
        proc = await trio.lowlevel.open_process(
            [peer.node, str(peer.workdir / "server.mjs"), str(peer.descriptor_set)],
            cwd=peer.workdir,
            stdin=subprocess.PIPE,  # the server exits if this closes, so it never outlives the test
            stdout=subprocess.PIPE,
            stderr=stderr_file.wrapped,
        )
    try:
        assert proc.stdout is not None
        first = b""
        with trio.move_on_after(PORT_DEADLINE):
            while b"\n" not in first:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    break
                first += chunk
        line = first.split(b"\n", 1)[0].decode()
        if b"\n" not in first or not line.isdigit():
            pytest.fail(
                f"connect-node server gave no port line (read {first!r} before end of output or the "
                f"{PORT_DEADLINE} s deadline):\n{await _read_text(stderr_path)}"
            )
        yield int(line)
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    await pipe.aclose()
    # server.mjs exits 0 on SIGTERM; anything else means it crashed on its own.
    if proc.returncode != 0:
        pytest.fail(f"connect-node server exited {proc.returncode}:\n{await _read_text(stderr_path)}")


async def test_our_client_against_connect_node_server(node_peer: NodePeer, tmp_path: Path) -> None:
    opts = CallOptions(protocol="connect")
    async with _connect_node_server(node_peer, tmp_path / "server.stderr") as port:
        url = f"http://127.0.0.1:{port}"
        with trio.fail_after(EXCHANGE_DEADLINE):
            async with open_stream(url, opts) as stream:
                for i in range(HEARTBEATS):  # lock-step
                    await stream.send(heartbeat(i))
                    reply = await stream.receive()
                    assert reply is not None and reply.ack is not None, reply
                    assert reply.ack.message_id == i and reply.ack.ok
                await stream.close_send()
                assert await stream.receive() is None  # connect-node ends the stream with OK

            async with open_stream(url, opts) as stream:
                await stream.send(register("refuse", hostname=REFUSE_TEXT))
                with pytest.raises(RpcError) as info:
                    await stream.receive()
        assert info.value.code is Code.PERMISSION_DENIED
        assert info.value.message == REFUSE_TEXT
