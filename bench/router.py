"""Router benchmark: our router against the strongest peers, each its own process on one engine, in one run.

``python -m bench.router`` (part of ``nox -s bench``) starts one simulated engine
(``python -m agent.engines.sim``: 64 tokens per request, a fixed inter-token latency) and, each as
its own process on that engine:

- ``router``: our router, ``python -m router --static bench=URL``, default settings;
- ``router-c0``: the same with ``--relay-coalesce-us 0`` (no coalescing pause);
- ``router-py``: the same with its Python relay pump (``LLMGW_RELAY=python``, what a build without a
  C compiler runs), so the native pump's share can be read off directly;
- ``relay``: a bare TCP relay in Python (no HTTP: the floor a Python process pays for two socket hops);
- the peers from the package registry, at the versions pinned in noxfile.py's bench session:
  ``vllm-router`` (the vLLM project's Rust router, ``--policy round_robin``), ``sglang-router`` (SGLang's
  Rust gateway, ``launch --policy round_robin``) and ``litellm`` (LiteLLM's proxy, offline: ``api_base``
  at the same engine, ``LITELLM_LOCAL_MODEL_COST_MAP=True``). The Rust routers run at log level
  warning, as our router logs no line per request either. A peer that cannot start is reported with
  its reason and the run goes on without it.

It drives the same streaming chat workload at each concurrency against each target and prints:

- requests per second;
- time to first byte (the first SSE event) p50/p99, and what each proxy adds to the direct figure;
- inter-token gap p50/p99 as the client sees it, and what each proxy adds;
- proxy CPU time per relayed SSE event (the process's on-CPU time over the events the clients
  received), and the proxy's RSS at the end;
- our routers over each peer, as ratios, at each concurrency; and the issues' targets, met or missed.

CPU time is the kernel's process CPU-time clock (``clock_getcpuclockid``): every thread's scheduler
runtime to the nanosecond, threads that exited during the point included. A sum over the live
threads' ``schedstat`` misses those (a thread pool that retires threads under load loses their
time); it is kept as a cross-check, and the report says where the two disagree.

The load generator is this process: trio, plain non-blocking sockets, one keep-alive connection per
simulated client, and the router's own sans-IO response parser, so that it costs little next to
what it measures. Everything shares this machine's cores, which is why the CPU figures are per
event (they do not depend on who else is busy) and why the top concurrency is checked: when the
direct run cannot hold the engine's inter-token latency, the machine cannot generate that load,
and the output says so. The bench's temporary directory (logs, LiteLLM's config) is removed when
it ends, on an error, Ctrl-C or SIGTERM too.

``--quick`` (CI's ``nox -s bench -- --quick``) runs it at a tiny size against one peer, vllm-router,
in seconds: its figures compare with nothing, it only shows that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import attrs
import httpx
import trio

from router.framing import CHUNKED, LENGTH, ChunkedScanner, parse_response_head

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
TOKENS = 64
# The peers' versions; noxfile.py's bench session installs the same (a benchmark's peer must not
# move under it): change both together.
PINS = {
    "litellm": "litellm[proxy]==1.106.12",
    "vllm-router": "vllm-router==0.1.17",
    "sglang-router": "sglang-router==0.3.2",
}
OPTIONAL = ("relay", "router-c0", "router-py", "vllm-router", "sglang-router", "litellm")
OURS = ("router", "router-c0")
PEERS = ("vllm-router", "sglang-router", "litellm")


# ---------------------------------------------------------------------------------------------
# CPU time, RSS, process trees


def process_cpu(pid: int) -> float:
    """On-CPU seconds of process ``pid``, all its threads, exited ones included.

    The kernel's process CPU-time clock (what ``clock_getcpuclockid(pid)`` returns, built here as
    the kernel encodes it, ``~pid << 3 | CPUCLOCK_SCHED``: Python has no binding) is the scheduler's
    runtime of the live threads plus what exited threads left to the thread group, in nanoseconds.
    /proc/PID/stat's utime+stime counts the same time but in 10 ms ticks, too coarse for a point
    at concurrency 1 (a few tens of ms of router CPU); it is the fallback where the clock fails."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live_threads_cpu(pid: int) -> float:
    """On-CPU seconds of the threads of ``pid`` alive now (the sum of their ``schedstat``): the
    cross-check of :func:`process_cpu`, short by whatever threads exited."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (LiteLLM may run workers as children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


@attrs.frozen
class Cpu:
    """A process tree's CPU seconds by both counts: the process clocks (the figure) and the live
    threads' schedstat (the cross-check)."""

    clock: float
    live: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.clock - other.clock, self.live - other.live)


def tree_cpu(pid: int) -> Cpu:
    clock = live = 0.0
    for p in tree(pid):
        try:
            clock += process_cpu(p)
            live += live_threads_cpu(p)
        except OSError:  # exited between the listing and the read
            pass
    return Cpu(clock, live)


def tree_rss(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += rss_mib(p)
        except OSError:
            pass
    return total


# ---------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only what we started
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start(
    name: str,
    argv: Sequence[str],
    env: dict[str, str],
    tmp: Path,
    port: int,
    *,
    procs: list[Proc],
    cwd: Path = ROOT,
) -> Proc:
    """Start ``argv`` in its own session, its output in ``tmp/NAME.log``, and add it to ``procs``
    (what the bench stops when it ends, however it ends)."""
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    started = Proc(name, proc, log, port)
    procs.append(started)
    return started


def drop(p: Proc, procs: list[Proc]) -> None:
    """Stop a target that failed to start; the run goes on without it."""
    p.stop()
    procs.remove(p)


def wait_http(p: Proc, path: str, timeout: float, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{p.port}{path}", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p.name}: {path} not 200 after {timeout:g}s:\n{p.log.read_text()[-3000:]}")
        time.sleep(0.1)


def probe(p: Proc, key: str | None = None, timeout: float = 60) -> None:
    """One short streamed chat request through ``p``: a target that answers /health but cannot
    relay a stream (an unknown model, a refused key) is not measured. Bounded as a whole: a target
    that trickles bytes for ever is not waited for."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    deadline = time.monotonic() + timeout
    received = bytearray()
    with httpx.stream(
        "POST", f"http://127.0.0.1:{p.port}/v1/chat/completions", json=body, headers=headers, timeout=timeout
    ) as response:
        for chunk in response.iter_bytes():
            received += chunk
            if time.monotonic() > deadline:
                raise RuntimeError(f"a probe request through {p.name} was not over after {timeout:g} s")
    text = received.decode(errors="replace")
    if response.status_code != 200 or "data: [DONE]" not in text:
        raise RuntimeError(f"a probe request answered {response.status_code}: {text[:300]}")


def find_exe(name: str, env_var: str) -> str | None:
    """``$env_var``, else ``name`` beside this interpreter (the nox session's venv), else on PATH."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    sibling = Path(sys.executable).parent / name
    if sibling.exists():
        return str(sibling)
    return shutil.which(name)


def installed_version(exe: str, dist: str) -> str:
    """The version of ``dist`` in the environment of console script ``exe`` (its shebang's
    interpreter), or why it is unknown: a peer found on PATH may not be the pinned one."""
    try:
        first = Path(exe).read_bytes()[:512].split(b"\n", 1)[0]
        if not first.startswith(b"#!"):
            return "version unknown (not a console script)"
        python = first[2:].decode().split()[0]
        out = subprocess.run(
            [python, "-c", "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", dist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, UnicodeDecodeError, IndexError, subprocess.SubprocessError):
        return "version unknown"


@attrs.frozen
class RustPeer:
    """A Rust router from the package registry (a Python launcher around a Rust extension), started
    as its own process on the same engine, round robin over one worker, like ours."""

    name: str  # the console script's and the distribution's name
    env_var: str  # names the executable when it is not beside this interpreter
    subcommand: tuple[str, ...]
    log_level: str  # warning: our router logs no line per request; at info both log every request

    def argv(self, exe: str, port: int, engine_port: int, metrics_port: int) -> list[str]:
        return [
            exe, *self.subcommand, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", f"http://127.0.0.1:{engine_port}", "--policy", "round_robin",
            "--worker-startup-timeout-secs", "60",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", self.log_level,
        ]  # fmt: skip


RUST_PEERS = (
    RustPeer("vllm-router", "LLMGW_BENCH_VLLM_ROUTER", (), "warning"),
    RustPeer("sglang-router", "LLMGW_BENCH_SGLANG_ROUTER", ("launch",), "warn"),
)


def start_rust_peer(
    peer: RustPeer, tmp: Path, engine_port: int, procs: list[Proc]
) -> tuple[Proc | None, str]:
    """(the started peer, what it is) or (None, why it did not run)."""
    pin = PINS[peer.name]
    exe = find_exe(peer.name, peer.env_var)
    if exe is None:
        return (
            None,
            f"{peer.name} NOT RUN: no {peer.name} executable (pip install '{pin}', or set {peer.env_var})",
        )
    port = free_port()
    # cwd: the bench's temporary directory, so that nothing a peer writes stays behind.
    argv = peer.argv(exe, port, engine_port, free_port())
    try:
        proc = start(peer.name, argv, dict(os.environ), tmp, port, procs=procs, cwd=tmp)
    except OSError as exc:
        return None, f"{peer.name} NOT RUN: {exe} did not start: {exc}"
    try:
        wait_http(proc, "/health", 90)
        probe(proc)
    except (RuntimeError, httpx.HTTPError) as exc:
        drop(proc, procs)
        return None, f"{peer.name} NOT RUN: it did not start and relay a stream: {str(exc)[:800]}"
    version = installed_version(exe, peer.name)
    pinned = pin.rsplit("==", 1)[1]
    drift = "" if version == pinned else f" (NOT the pinned {pinned}: figures do not compare with the notes)"
    return proc, f"{peer.name} {version}{drift}: {' '.join(argv[1:])}"


def start_litellm(tmp: Path, engine_port: int, key: str, procs: list[Proc]) -> tuple[Proc | None, str]:
    """LiteLLM's proxy, offline, on the same engine; (None, why) when it cannot run."""
    exe = find_exe("litellm", "LLMGW_BENCH_LITELLM")
    if exe is None:
        return (
            None,
            f"litellm NOT RUN: no litellm executable (pip install '{PINS['litellm']}', or set LLMGW_BENCH_LITELLM)",
        )
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{engine_port}/v1\n"
        "      api_key: unused\n"
    )
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no fetch of the model price list
        "LITELLM_MASTER_KEY": key,  # it refuses to start without one
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
    }
    argv = [exe, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    try:
        proc = start("litellm", argv, env, tmp, port, procs=procs, cwd=tmp)
    except OSError as exc:
        return None, f"litellm NOT RUN: {exe} did not start: {exc}"
    try:
        wait_http(proc, "/health/liveliness", 240)
        probe(proc, key)
    except (RuntimeError, httpx.HTTPError) as exc:
        drop(proc, procs)
        return None, f"litellm NOT RUN: it did not start and answer offline: {str(exc)[:800]}"
    version = installed_version(exe, "litellm")
    return proc, f"litellm {version}: --num_workers 1, offline"


def start_ours(
    name: str, extra: Sequence[str], env: dict[str, str], tmp: Path, engine_port: int, procs: list[Proc]
) -> tuple[Proc | None, str]:
    """Our router, as its own process (``python -m router``) with ``extra`` flags; (None, why) when
    it cannot start (a variant whose flag or pump this build lacks)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "router", "--static", f"{MODEL}=http://127.0.0.1:{engine_port}",
        "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    proc = start(name, argv, env, tmp, port, procs=procs)
    try:
        wait_http(proc, "/health", 30)
        probe(proc)
    except (RuntimeError, httpx.HTTPError) as exc:
        drop(proc, procs)
        return None, f"{name} NOT RUN: {str(exc)[:800]}"
    pump = next((line for line in proc.log.read_text().splitlines() if "relay pump" in line), "")
    return proc, f"{name}: python -m router {' '.join(extra)}".rstrip() + (
        f" ({pump.split('(', 1)[-1].rstrip(')')})" if pump else ""
    )


def relay(listen_port: int, upstream_port: int) -> None:
    """A bare TCP relay (one selector loop, bytes in, bytes out, no HTTP): the floor any proxy
    process pays on this machine for two extra socket hops and its wake-ups. Measured beside the
    router so that its figures can be read against what the machine itself costs."""
    import selectors

    sel = selectors.DefaultSelector()
    listener = socket.create_server(("127.0.0.1", listen_port))
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)
    print(f"relay listening on 127.0.0.1:{listen_port}", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                client_sock, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", upstream_port))
                for sock, peer in ((client_sock, upstream), (upstream, client_sock)):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setblocking(False)
                    sel.register(sock, selectors.EVENT_READ, peer)
                continue
            src, peer = key.fileobj, key.data
            if not isinstance(src, socket.socket) or not isinstance(peer, socket.socket):
                continue
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, peer):
                    try:
                        sel.unregister(s)
                    except (KeyError, ValueError):
                        pass
                    s.close()
                continue
            peer.setblocking(True)
            peer.sendall(data)
            peer.setblocking(False)


# ---------------------------------------------------------------------------------------------
# Load generator


@attrs.define
class Level:
    """What one target did at one concurrency."""

    requests: int = 0
    errors: int = 0
    events: int = 0
    ttfb: list[float] = attrs.Factory(list)
    gaps: list[float] = attrs.Factory(list)
    seconds: float = 0.0
    cpu: float = 0.0  # the process clocks' on-CPU seconds over the point (exited threads included)
    cpu_live: float = 0.0  # the same by the live threads' schedstat: the cross-check
    rss: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def us_per_event(self) -> float:
        """The process's on-CPU microseconds per SSE event the clients got."""
        return self.cpu / self.events * 1e6 if self.events else float("nan")

    def add(self, more: Level) -> None:
        """Fold another round of the same target at the same concurrency into this one."""
        self.requests += more.requests
        self.errors += more.errors
        self.events += more.events
        self.ttfb += more.ttfb
        self.gaps += more.gaps
        self.seconds += more.seconds
        self.cpu += more.cpu
        self.cpu_live += more.cpu_live
        self.rss = max(self.rss, more.rss)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.connect(("127.0.0.1", port))
    except BlockingIOError:
        await trio.lowlevel.wait_writable(sock)
    return sock


async def _recv(sock: socket.socket) -> bytes:
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(65536)
        except BlockingIOError:
            continue


async def _send(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def client(port: int, request: bytes, record_from: float, level: Level) -> None:
    """One simulated user: sequential streamed requests on a keep-alive connection until cancelled.
    A request counts when it completes inside the measured window."""
    sock: socket.socket | None = None
    try:
        while True:
            if sock is None:
                sock = await _connect(port)
            started = time.perf_counter()
            await _send(sock, request)
            buf = b""
            while (parsed := parse_response_head(buf)) is None:
                data = await _recv(sock)
                if not data:
                    raise ConnectionError("closed before the response head")
                buf += data
            head, used = parsed
            body = buf[used:]
            scanner = ChunkedScanner() if head.framing == CHUNKED else None
            remaining = head.length if head.framing == LENGTH else -1
            first = last = 0.0
            gaps: list[float] = []
            events = 0
            while True:
                if body:
                    now = time.perf_counter()
                    n = body.count(b"data: ")
                    if n:
                        if not events:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        events += n
                        # Counted as they arrive, not when the response ends: the CPU column is
                        # the proxy's time over the events of the same span, and the streams cut
                        # at the end of a round were relayed in part.
                        level.events += n
                    if scanner is not None:
                        scanner.feed(body)
                        if scanner.done:
                            break
                    elif remaining >= 0:
                        remaining -= len(body)
                        if remaining <= 0:
                            break
                body = await _recv(sock)
                if not body:
                    if scanner is None and remaining < 0:
                        break
                    raise ConnectionError("closed mid-response")
            if not head.keep_alive or (scanner is None and remaining < 0):
                sock.close()
                sock = None
            if time.perf_counter() < record_from:
                continue
            if head.status != 200 or not events:
                level.errors += 1
                continue
            level.requests += 1
            level.ttfb.append(first - started)
            level.gaps += gaps
    except (OSError, ConnectionError):
        level.errors += 1
    finally:
        if sock is not None:
            sock.close()


def request_bytes(port: int, path: str, key: str | None) -> bytes:
    body = (
        b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"benchmark prompt"}],'
        b'"max_tokens":' + str(TOKENS).encode() + b',"stream":true}'
    )
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
    if key:
        head += f"authorization: Bearer {key}\r\n"
    head += f"content-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def drive(port: int, request: bytes, concurrency: int, warmup: float, seconds: float) -> Level:
    """Closed loop: ``concurrency`` clients for ``warmup + seconds``, then every one is cancelled (a
    client leaving mid-stream, which the proxies must pass on); throughput is what completed in
    the last ``seconds``."""
    level = Level(seconds=seconds)
    record_from = time.perf_counter() + warmup
    with trio.move_on_after(warmup + seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client, port, request, record_from, level)
    return level


def settle(pids: Sequence[int], timeout: float = 20.0) -> str:
    """Wait until every process under test is idle (under 5% of a CPU together over 0.25 s), so one
    point's leftovers do not run on the next: a proxy that fell behind keeps working through
    abandoned streams after its clients left (LiteLLM at concurrency 256 did for seconds). Returns
    a note when the deadline passed first."""
    deadline = time.monotonic() + timeout
    before = sum(tree_cpu(p).clock for p in pids)
    while True:
        time.sleep(0.25)
        after = sum(tree_cpu(p).clock for p in pids)
        if after - before < 0.05 * 0.25:
            return ""
        if time.monotonic() > deadline:
            return f"the processes under test were still busy {timeout:g} s after the point ended"
        before = after


def measure(port: int, request: bytes, concurrency: int, warmup: float, seconds: float, pid: int) -> Level:
    cpu0 = tree_cpu(pid)
    level = trio.run(drive, port, request, concurrency, warmup, seconds)
    used = tree_cpu(pid) - cpu0
    level.cpu, level.cpu_live = used.clock, used.live
    level.rss = tree_rss(pid)
    return level


# ---------------------------------------------------------------------------------------------
# The run


@attrs.frozen
class MeasuredServer:
    """One server the load is driven against: the engine itself, the bare relay, one of our routers
    or a peer, with the API key it wants (LiteLLM's master key)."""

    name: str
    proc: Proc
    key: str | None = None


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, so that the processes started and the temporary directory go
    too. It is passed on as a SIGINT rather than raised here: inside ``trio.run`` only trio's own
    SIGINT handler may interrupt the run loop safely."""
    os.kill(os.getpid(), signal.SIGINT)


#: ``--quick``: a tiny size (seconds), to check that the benchmark runs (CI). Explicit flags still win.
QUICK_DEFAULTS = {"concurrency": "1,8", "seconds": 1.0, "warmup": 0.3, "rounds": 1, "min_requests": 5}
#: ``--quick`` compares with one peer only, vllm-router (one wheel, seconds to install and start, and
#: the peer the targets name); LiteLLM's proxy brings a hundred packages and takes a minute to start.
QUICK_SKIPS = ("sglang-router", "litellm")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["relay"]:
        relay(int(argv[1]), int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench.router", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny size (seconds) to check that the benchmark runs: concurrency 1,8, 1 s points in "
        f"one round, and of the peers only vllm-router (skips {', '.join(QUICK_SKIPS)})",
    )
    parser.add_argument("--concurrency", default="1,32,256", help="comma list (default 1,32,256)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each round's measurement")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="split each point into this many rounds, the targets taking turns (default 3), so that "
        "a neighbour's load on a shared machine falls on every target alike",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=60,
        help="lengthen a point until the engine could complete this many requests (default 60): at "
        "concurrency 1, 4 s is a dozen requests, too few for a p50, let alone a p99",
    )
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--ttft-ms", type=float, default=10.0)
    parser.add_argument(
        "--skip",
        default="",
        help=f"comma list of targets not to run, of: {', '.join(OPTIONAL)} (direct and router always run)",
    )
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (--skip litellm)")
    parser.add_argument(
        "--no-python-pump",
        action="store_true",
        help="skip the router run with its Python relay pump (--skip router-py)",
    )
    if "--quick" in argv:
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(OPTIONAL)
    if unknown:
        parser.error(
            f"--skip {','.join(sorted(unknown))}: not a target that can be skipped ({', '.join(OPTIONAL)})"
        )
    skip |= {"litellm"} if args.no_litellm else set()
    skip |= {"router-py"} if args.no_python_pump else set()
    if args.quick:
        skip |= set(QUICK_SKIPS)

    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-router-"))
    previous = signal.signal(signal.SIGTERM, _terminate)
    procs: list[Proc] = []
    try:
        results = run(args, skip, tmp, procs)
    except KeyboardInterrupt:
        print("bench.router: interrupted; the processes it started are stopped", file=sys.stderr)
        return 130
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    if args.quick:
        # CI's check that the benchmark still works: our routers must have relayed, without errors.
        broken = [
            f"{name} at concurrency {c}: {level.requests} requests, {level.errors} errors"
            for (name, c), level in results.items()
            if name in ("direct", *OURS) and (level.errors or not level.requests)
        ]
        if broken:
            print("bench.router --quick: FAILED: " + "; ".join(broken), file=sys.stderr)
            return 1
    return 0


def run(
    args: argparse.Namespace, skip: set[str], tmp: Path, procs: list[Proc]
) -> dict[tuple[str, int], Level]:
    """Measure every target at every level, print the table and the report; the figures."""
    levels = [int(c) for c in args.concurrency.split(",")]

    def window(c: int) -> float:
        """Measured seconds at concurrency ``c``: enough for ``--min-requests`` at the engine's pace."""
        ideal_rps = c / (args.ttft_ms / 1000 + TOKENS * args.itl_ms / 1000)
        least: float = args.min_requests / ideal_rps
        return max(float(args.seconds), least)

    cpus = os.cpu_count() or 1
    py = sys.executable
    engine_port = free_port()
    env = {
        **os.environ,
        "LLMGW_SIM_LOAD_SECONDS": "0",
        "LLMGW_SIM_TTFT_MS": str(args.ttft_ms),
        "LLMGW_SIM_ITL_MS": str(args.itl_ms),
        # A fixed-latency engine: the capacity model's per-token and per-sequence costs off, so
        # the engine's pace does not change with the concurrency this benchmark steps through.
        "LLMGW_SIM_PREFILL_MS_PER_TOKEN": "0",
        "LLMGW_SIM_DECODE_MS_PER_SEQ": "0",
        "LLMGW_SIM_CONTEXT_MS_PER_TOKEN": "0",
    }
    engine = start(
        "engine",
        [py, "-m", "agent.engines.sim", "serve", "org/bench", "--served-model-name", MODEL,
         "--host", "127.0.0.1", "--port", str(engine_port)],
        env, tmp, engine_port, procs=procs,
    )  # fmt: skip
    wait_http(engine, "/health", 30)

    said: list[str] = []  # what each target is, or why it did not run
    targets = [MeasuredServer("direct", engine)]
    if "relay" not in skip:
        relay_port = free_port()
        floor = start(
            "relay", [py, "-m", "bench.router", "relay", str(relay_port), str(engine_port)],
            dict(os.environ), tmp, relay_port, procs=procs,
        )  # fmt: skip
        wait_http(floor, "/health", 30)
        targets.append(MeasuredServer("relay", floor))
    ours = [("router", (), dict(os.environ)), ("router-c0", ("--relay-coalesce-us", "0"), dict(os.environ))]
    ours.append(("router-py", (), {**os.environ, "LLMGW_RELAY": "python"}))
    for name, extra, ours_env in ours:
        if name in skip:
            continue
        proc, what = start_ours(name, extra, ours_env, tmp, engine_port, procs)
        if proc is None and name == "router":
            raise RuntimeError(f"our router did not start, nothing to measure: {what}")
        said.append(what)
        if proc is not None:
            targets.append(MeasuredServer(name, proc))
    for peer in RUST_PEERS:
        if peer.name in skip:
            said.append(f"{peer.name} skipped ({'--quick' if args.quick else '--skip'})")
            continue
        proc, what = start_rust_peer(peer, tmp, engine_port, procs)
        said.append(what)
        if proc is not None:
            targets.append(MeasuredServer(peer.name, proc))
    if "litellm" in skip:
        said.append(f"litellm skipped ({'--quick' if args.quick else '--skip litellm'})")
    else:
        key = "sk-" + secrets.token_hex(32)
        proc, what = start_litellm(tmp, engine_port, key, procs)
        said.append(what)
        if proc is not None:
            targets.append(MeasuredServer("litellm", proc, key))

    longer = ", ".join(f"{window(c):.0f} s at concurrency {c}" for c in levels if window(c) > args.seconds)
    if args.quick:
        print("--quick: a tiny size, to check that the benchmark runs; its figures compare with nothing")
    print(
        f"router bench: one sim engine, {TOKENS} tokens per streamed chat request, ITL {args.itl_ms:g} ms, "
        f"TTFT {args.ttft_ms:g} ms; {args.seconds:g} s per point ({longer or 'none longer'}) "
        f"in {args.rounds} rounds, the targets taking turns, each after {args.warmup:g} s of warm-up; "
        f"{cpus} CPUs shared by the engine, the proxies and this load generator"
    )
    print(
        "targets: direct = the engine itself (the physical limit); relay = a bare TCP relay, no HTTP (the floor "
        "any proxy process pays here); router = python -m router (default settings); router-c0 = the same "
        "with --relay-coalesce-us 0; router-py = the same with its Python relay pump (LLMGW_RELAY=python); "
        "vllm-router, sglang-router, litellm = the peers, each its own process on the same engine"
    )
    for what in said:
        print("  " + what)
    print(
        "times in ms; ttfb = to the first SSE event; gap = between SSE events as received; +x = added over "
        "direct at the same concurrency; cpu = the process's on-CPU time per SSE event the clients got "
        "(for direct: the engine's own cost per event)"
    )
    cols = ("conc", "target", "req/s", "ttfb p50", "p99", "+p50", "+p99", "gap p50", "p99", "+gap",
            "cpu us/ev", "rss MiB", "err")  # fmt: skip
    widths = (5, 13, 8, 9, 8, 8, 8, 8, 8, 7, 9, 8, 4)

    def fmt(values: Sequence[str]) -> str:
        return " ".join(
            v.rjust(w) if i != 1 else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    print(fmt(cols))
    results: dict[tuple[str, int], Level] = {}
    notes: list[str] = []
    path = "/v1/chat/completions"
    for c in levels:
        # Rounds, each target in turn and the order turned each round: the machine is shared, and
        # what runs beside the bench changes by the minute; interleaved, every target sees it alike.
        for r in range(args.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for t in order:
                busy = settle([u.proc.proc.pid for u in targets])
                if busy:
                    notes.append(f"before {t.name} at concurrency {c}: {busy}")
                request = request_bytes(t.proc.port, path, t.key)
                part = measure(t.proc.port, request, c, args.warmup, window(c) / args.rounds, t.proc.proc.pid)
                results.setdefault((t.name, c), Level()).add(part)
        for t in targets:
            level = results[t.name, c]
            missed = level.cpu - level.cpu_live
            if level.cpu > 0 and missed > max(0.05 * level.cpu, 0.002):
                notes.append(
                    f"{t.name} at concurrency {c}: {missed * 1000:.0f} ms of its {level.cpu * 1000:.0f} ms on-CPU "
                    f"({missed / level.cpu:.0%}) ran in threads that exited during the point; a sum over the live "
                    "threads' schedstat would have missed it (the cpu column counts it)"
                )
            d = results["direct", c]
            proxied = t.name != "direct"
            row = (
                str(c),
                t.name,
                f"{level.rps:.1f}",
                ms(pct(level.ttfb, 0.5)),
                ms(pct(level.ttfb, 0.99)),
                ms(pct(level.ttfb, 0.5) - pct(d.ttfb, 0.5)) if proxied else "",
                ms(pct(level.ttfb, 0.99) - pct(d.ttfb, 0.99)) if proxied else "",
                ms(pct(level.gaps, 0.5)),
                ms(pct(level.gaps, 0.99)),
                f"{(pct(level.gaps, 0.5) - pct(d.gaps, 0.5)) * 1000:.3f}" if proxied else "",
                f"{level.us_per_event:.1f}" if level.events else "-",
                f"{level.rss:.1f}",
                str(level.errors),
            )
            print(fmt(row), flush=True)
        direct = results["direct", c]
        gap = pct(direct.gaps, 0.5)
        ideal = c / (args.ttft_ms / 1000 + TOKENS * args.itl_ms / 1000)
        if gap > 1.5 * args.itl_ms / 1000 or direct.rps < 0.6 * ideal:
            notes.append(
                f"concurrency {c}: this {cpus}-CPU machine cannot drive it at ITL {args.itl_ms:g} ms: "
                f"straight to the engine the gap p50 is {gap * 1000:.1f} ms and {direct.rps:.0f} req/s of an "
                f"ideal {ideal:.0f} (the simulated engine and the load generator saturate the CPUs); at this "
                "level the proxies are compared on a saturated machine"
            )
    print()
    for note in notes:
        print("NOTE " + note)
    report(results, levels, [t.name for t in targets])
    return results


# ---------------------------------------------------------------------------------------------
# Report


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``0.52x``, or ``-`` where it means nothing (a negative figure or a zero
    denominator: an added time inside the noise)."""
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b <= 0:
        return "-"
    return f"{a / b:.2f}x"


def report(results: dict[tuple[str, int], Level], levels: list[int], names: list[str]) -> None:
    def added(name: str, c: int, q: float) -> float:
        return pct(results[name, c].ttfb, q) - pct(results["direct", c].ttfb, q)

    def added_gap(name: str, c: int) -> float:
        return pct(results[name, c].gaps, 0.5) - pct(results["direct", c].gaps, 0.5)

    def per_event(name: str) -> float:
        events = sum(results[name, c].events for c in levels)
        return sum(results[name, c].cpu for c in levels) / events * 1e6 if events else float("nan")

    ours = [n for n in OURS if n in names]
    peers = [n for n in PEERS if n in names]
    if peers:
        print(
            "ours / each peer, same run (each cell: ours/peer and the ratio; below 1x is better for ours, "
            "except req/s):"
        )
        cols = ("conc", "ours", "peer", "req/s", "+ttfb p50 ms", "+ttfb p99 ms", "+gap p50 ms",
                "cpu us/ev", "rss MiB")  # fmt: skip
        widths = (5, 9, 13, 6, 18, 19, 19, 17, 15)
        print(
            " ".join(
                v.rjust(w) if i > 2 else v.ljust(w) for i, (v, w) in enumerate(zip(cols, widths, strict=True))
            )
        )
        for c in levels:
            for o in ours:
                for p in peers:
                    mine, theirs = results[o, c], results[p, c]

                    def cell(x: float, y: float, digits: int) -> str:
                        return f"{x:.{digits}f}/{y:.{digits}f} {ratio(x, y)}"

                    values = (
                        str(c),
                        o,
                        p,
                        ratio(mine.rps, theirs.rps),
                        cell(added(o, c, 0.5) * 1000, added(p, c, 0.5) * 1000, 2),
                        cell(added(o, c, 0.99) * 1000, added(p, c, 0.99) * 1000, 2),
                        cell(added_gap(o, c) * 1000, added_gap(p, c) * 1000, 3),
                        cell(mine.us_per_event, theirs.us_per_event, 1),
                        cell(mine.rss, theirs.rss, 0),
                    )
                    print(
                        " ".join(
                            v.rjust(w) if i > 2 else v.ljust(w)
                            for i, (v, w) in enumerate(zip(values, widths, strict=True))
                        )
                    )

    print("targets (issue 17; router = python -m router, default settings):")
    if 1 in levels:
        a = added("router", 1, 0.5)
        if "vllm-router" in names:
            v = added("vllm-router", 1, 0.5)
            met = a <= 0.0005 and a < v
            print(
                f"  added TTFB p50 at concurrency 1: router {a * 1000:.2f} ms, vllm-router {v * 1000:.2f} ms "
                f"(at most 0.5 ms and below vllm-router's): {'met' if met else 'MISSED'}"
            )
        else:
            print(
                f"  added TTFB p50 at concurrency 1: router {a * 1000:.2f} ms (at most 0.5 ms: "
                f"{'met' if a <= 0.0005 else 'MISSED'}); below vllm-router's: not measured"
            )
    if "vllm-router" in names:
        parts = [
            (c, results["router", c].us_per_event / results["vllm-router", c].us_per_event)
            for c in levels
            if results["router", c].events and results["vllm-router", c].events
        ]
        met = len(parts) == len(levels) and all(x <= 0.6 for _, x in parts)
        print(
            "  CPU per relayed event, router / vllm-router: "
            + ", ".join(f"concurrency {c} {x:.2f}x" for c, x in parts)
            + f" (at most 0.6x at each): {'met' if met else 'MISSED'}"
        )
    else:
        print("  CPU per relayed event against vllm-router: not measured (see above)")

    print("earlier targets (the router's issue):")
    if 1 in levels:
        a = added("router", 1, 0.5)
        print(
            f"  added TTFB p50 at concurrency 1: router {a * 1000:.2f} ms (target < 1 ms: {'met' if a < 0.001 else 'MISSED'})"
            + (f"; bare relay {added('relay', 1, 0.5) * 1000:.2f} ms" if "relay" in names else "")
        )
    r, engine = per_event("router"), per_event("direct")
    floor = per_event("relay") if "relay" in names else float("nan")
    print(
        f"  CPU per relayed event, all levels: router {r:.1f} us (target < 30 us: {'met' if r < 30 else 'MISSED'}); "
        f"bare relay {floor:.1f} us (router/relay {ratio(r, floor)}); the engine's own cost per event {engine:.1f} us"
    )
    if "relay" in names:
        print(
            "  CPU per relayed event by level (router / bare relay): "
            + "; ".join(
                f"concurrency {c}: {results['router', c].us_per_event:.1f} / "
                f"{results['relay', c].us_per_event:.1f} us"
                for c in levels
                if results["router", c].events and results["relay", c].events
            )
        )
    if "router-py" in names:
        py = per_event("router-py")
        print(
            f"  CPU per relayed event with the Python relay pump, all levels: {py:.1f} us "
            f"({ratio(py, r)} the router as built)"
        )
    if "litellm" not in names:
        print("  LiteLLM ratios: not measured (see above)")
        return
    # At equal added p99: LiteLLM's best throughput, against the router's best throughput among the
    # points where its added p99 is no worse than LiteLLM's there.
    best = max(levels, key=lambda c: results["litellm", c].rps)
    ll = results["litellm", best]
    ll_p99 = added("litellm", best, 0.99)
    within = [results["router", c] for c in levels if added("router", c, 0.99) <= ll_p99]
    if within and ll.rps:
        top = max(within, key=lambda level: level.rps)
        x = top.rps / ll.rps
        print(
            f"  at equal added p99 (LiteLLM's best: {ll.rps:.1f} req/s at concurrency {best}, +{ll_p99 * 1000:.1f} ms): "
            f"router {top.rps:.1f} req/s, {x:.2f}x (target >= 3x: {'met' if x >= 3 else 'MISSED'})"
        )
    else:
        print(
            f"  at equal added p99: the router never had an added p99 as high as LiteLLM's best point "
            f"(+{ll_p99 * 1000:.1f} ms)"
        )


if __name__ == "__main__":
    sys.exit(main())
