"""Real etcd servers for tests: one member, or a cluster of three on loopback, each in a temporary
data directory on ports the kernel said were free, started by the test and ended by pid.

The binary is Debian's ``etcd-server`` (``/usr/bin/etcd``; ``.ci/run`` installs it when absent);
``LLMGW_ETCD`` names another. Without one the tests that need it fail, saying how to install it,
rather than skip.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest

from tests.fleet_procs import terminate
from tests.support import free_port, poll


def etcd_binary() -> str:
    """The etcd server to run; fails the test (naming the package) when there is none."""
    path = os.environ.get("LLMGW_ETCD") or shutil.which("etcd")
    if not path:
        pytest.fail(
            "no etcd server: install Debian's etcd-server (apt-get install etcd-server) or set LLMGW_ETCD"
        )
    return path


@attrs.frozen
class Tls:
    """Files for an etcd that serves TLS and wants client certificates (made with trustme)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path) -> Tls:
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("llmgw-control")
        files = cls(
            *(directory / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"))
        )
        ca.cert_pem.write_to_path(str(files.ca))
        server.private_key_pem.write_to_path(str(files.server_key))
        files.server_cert.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
        client.private_key_pem.write_to_path(str(files.client_key))
        files.client_cert.write_bytes(b"".join(blob.bytes() for blob in client.cert_chain_pems))
        return files

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


class Member:
    """One etcd member: its name, ports and data directory survive a kill, so ``start`` again brings
    the same member back with its data."""

    def __init__(
        self, workdir: Path, name: str, *, tls: Tls | None = None, extra: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = workdir / f"{name}.data"
        self.log_path = workdir / f"{name}.log"
        self.tls = tls
        self.extra = list(extra)
        self.cluster: list[Member] = [self]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def argv(self) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.cluster)
        argv = [
            etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=llmgw-test-{self.cluster[0].peer_port}",
            # Short raft timers: an election after a killed leader takes about a second, not five.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
            "--logger=zap",
        ]
        if self.tls is not None:
            argv += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        return argv + self.extra

    def start(self) -> None:
        """Start the process (it becomes healthy only with a quorum: see ``wait_healthy``)."""
        assert self.proc is None or self.proc.poll() is not None, f"etcd {self.name} is already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def healthy(self) -> bool:
        """Whether this member answers ``/health`` with true (it has a leader and serves reads)."""
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(
                f"etcd {self.name} exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}"
            )
        try:
            context = self.tls.context() if self.tls else None
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=2, context=context) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        try:
            poll(f"etcd {self.name} on {self.endpoint} to be healthy", self.healthy, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL this member (by its pid) and reap it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        terminate(self.proc)


class Cluster:
    """``size`` members on loopback forming one cluster."""

    def __init__(
        self, workdir: Path, size: int = 3, *, tls: Tls | None = None, extra: Sequence[str] = ()
    ) -> None:
        self.members = [Member(workdir, f"etcd{i}", tls=tls, extra=extra) for i in range(size)]
        for member in self.members:
            member.cluster = self.members

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def start(self) -> None:
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_healthy()

    def stop(self) -> None:
        for member in self.members:
            member.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Member]:
    """A single etcd member, healthy, for this test alone (``tmp_path`` holds its data and log)."""
    member = Member(tmp_path, "etcd0")
    member.start()
    try:
        member.wait_healthy()
        yield member
    finally:
        member.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Three etcd members on loopback, all healthy; a test may kill one and ``start`` it again."""
    cluster = Cluster(tmp_path, 3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
