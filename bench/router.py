"""Router benchmark: direct to an engine, through our router, and through LiteLLM's proxy, in one run.

``python -m bench.router`` (part of ``nox -s bench``) starts one simulated engine
(``python -m agent.engines.sim``: 64 tokens per request, a fixed inter-token latency), our router as
its own process (``python -m router --static bench=URL``) and LiteLLM's proxy as its own
process (offline: ``api_base`` at the same engine, ``LITELLM_LOCAL_MODEL_COST_MAP=True``), then
drives the same streaming chat workload at each concurrency against each of the three and prints:

- requests per second;
- time to first byte (the first SSE event) p50/p99, and what each proxy adds to the direct figure;
- inter-token gap p50/p99 as the client sees it, and what each proxy adds;
- proxy CPU time per relayed SSE event (the proxy process's user+system time over the events the
  clients received), and the proxy's RSS at the end.

Beside them, in the same run: a bare TCP relay in Python (no HTTP: the floor a Python process pays
for two socket hops), and the router once more with its Python relay pump (``LLMGW_RELAY=python``,
what a build without a C compiler runs), so the native pump's share can be read off directly.

Targets (the router's issue): added p50 under 1 ms at concurrency 1; at least 3x LiteLLM's requests
per second at equal added p99; under 30 us of router CPU per relayed chunk.

The load generator is this process: trio, plain non-blocking sockets, one keep-alive connection per
simulated client, and the router's own sans-IO response parser, so that it costs little next to
what it measures. Everything shares this machine's cores, which is why the CPU figures are per
event (they do not depend on who else is busy) and why the top concurrency is checked: when the
direct run cannot hold the engine's inter-token latency, the machine cannot generate that load,
and the output says so.
"""

from __future__ import annotations

import argparse
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

import attrs
import httpx
import trio

from router.framing import CHUNKED, LENGTH, ChunkedScanner, parse_response_head

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
TOKENS = 64
LITELLM_INSTALL = "pip install 'litellm[proxy]==1.106.12'"


# ---------------------------------------------------------------------------------------------
# Processes


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of ``pid`` from the scheduler (``schedstat``, nanoseconds):
    /proc/PID/stat's ticks are sampled every 1/HZ s and overcharge timer-driven processes such as
    a streaming proxy, whose wake-ups line up with the tick."""
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


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
    return total


def tree_rss(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += rss_mib(p)
        except OSError:
            pass
    return total


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


def start(name: str, argv: Sequence[str], env: dict[str, str], tmp: Path, port: int) -> Proc:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    return Proc(name, proc, log, port)


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


def find_litellm() -> str | None:
    explicit = os.environ.get("LLMGW_BENCH_LITELLM")
    if explicit:
        return explicit
    sibling = Path(sys.executable).parent / "litellm"
    if sibling.exists():
        return str(sibling)
    return shutil.which("litellm")


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
    cpu: float = 0.0
    rss: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def us_per_event(self) -> float:
        """The process's on-CPU microseconds per SSE event the clients got."""
        return self.cpu / self.events * 1e6 if self.events else float("nan")


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
            level.events += events
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
    before = sum(tree_cpu(p) for p in pids)
    while True:
        time.sleep(0.25)
        after = sum(tree_cpu(p) for p in pids)
        if after - before < 0.05 * 0.25:
            return ""
        if time.monotonic() > deadline:
            return f"the processes under test were still busy {timeout:g} s after the point ended"
        before = after


def measure(
    port: int, request: bytes, concurrency: int, warmup: float, seconds: float, pid: int | None
) -> Level:
    cpu0 = tree_cpu(pid) if pid else 0.0
    level = trio.run(drive, port, request, concurrency, warmup, seconds)
    if pid:
        level.cpu = tree_cpu(pid) - cpu0
        level.rss = tree_rss(pid)
    return level


# ---------------------------------------------------------------------------------------------
# Report


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def start_litellm(tmp: Path, engine_port: int, key: str) -> tuple[Proc | None, str]:
    """LiteLLM's proxy, offline, on the same engine; (None, why) when it cannot run."""
    exe = find_litellm()
    if exe is None:
        return None, f"LiteLLM NOT RUN: no litellm executable ({LITELLM_INSTALL}, or set LLMGW_BENCH_LITELLM)"
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
    proc = start("litellm", argv, env, tmp, port)
    try:
        wait_http(proc, "/health/liveliness", 240)
        probe = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        if probe.status_code != 200:
            raise RuntimeError(f"a probe request answered {probe.status_code}: {probe.text[:300]}")
    except (RuntimeError, httpx.HTTPError) as exc:
        proc.stop()
        return None, f"LiteLLM NOT RUN: it did not start and answer offline: {str(exc)[:800]}"
    return proc, ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["relay"]:
        relay(int(argv[1]), int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench.router", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--concurrency", default="1,32,256", help="comma list (default 1,32,256)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=60,
        help="lengthen a point until the engine could complete this many requests (default 60): at "
        "concurrency 1, 4 s is a dozen requests, too few for a p50, let alone a p99",
    )
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--ttft-ms", type=float, default=10.0)
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM")
    parser.add_argument(
        "--no-python-pump", action="store_true", help="skip the router run with its Python relay pump"
    )
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    def window(c: int) -> float:
        """Measured seconds at concurrency ``c``: enough for ``--min-requests`` at the engine's pace."""
        ideal_rps = c / (args.ttft_ms / 1000 + TOKENS * args.itl_ms / 1000)
        least: float = args.min_requests / ideal_rps
        return max(float(args.seconds), least)

    cpus = os.cpu_count() or 1

    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-router-"))
    procs: list[Proc] = []
    try:
        engine_port, router_port, relay_port, router_py_port = (
            free_port(),
            free_port(),
            free_port(),
            free_port(),
        )
        env = {
            **os.environ,
            "LLMGW_SIM_LOAD_SECONDS": "0",
            "LLMGW_SIM_TTFT_MS": str(args.ttft_ms),
            "LLMGW_SIM_ITL_MS": str(args.itl_ms),
        }
        py = sys.executable
        engine = start(
            "engine",
            [py, "-m", "agent.engines.sim", "serve", "org/bench", "--served-model-name", MODEL,
             "--host", "127.0.0.1", "--port", str(engine_port)],
            env, tmp, engine_port,
        )  # fmt: skip
        procs.append(engine)
        router = start(
            "router",
            [py, "-m", "router", "--static", f"{MODEL}=http://127.0.0.1:{engine_port}",
             "--host", "127.0.0.1", "--port", str(router_port)],
            dict(os.environ), tmp, router_port,
        )  # fmt: skip
        procs.append(router)
        router_py = None
        if not args.no_python_pump:
            router_py = start(
                "router-py",
                [py, "-m", "router", "--static", f"{MODEL}=http://127.0.0.1:{engine_port}",
                 "--host", "127.0.0.1", "--port", str(router_py_port)],
                {**os.environ, "LLMGW_RELAY": "python"}, tmp, router_py_port,
            )  # fmt: skip
            procs.append(router_py)
        floor = start(
            "relay",
            [py, "-m", "bench.router", "relay", str(relay_port), str(engine_port)],
            dict(os.environ),
            tmp,
            relay_port,
        )
        procs.append(floor)
        wait_http(engine, "/health", 30)
        wait_http(router, "/health", 30)
        wait_http(floor, "/health", 30)
        if router_py is not None:
            wait_http(router_py, "/health", 30)
        pump = next(
            (line for line in router.log.read_text().splitlines() if "relay pump" in line),
            "relay pump unknown",
        )

        key = "sk-" + secrets.token_hex(32)
        litellm, litellm_note = (
            (None, "LiteLLM skipped (--no-litellm)")
            if args.no_litellm
            else start_litellm(tmp, engine_port, key)
        )
        if litellm is not None:
            procs.append(litellm)

        path = "/v1/chat/completions"
        targets: list[tuple[str, int, bytes, int]] = [
            ("direct", engine_port, request_bytes(engine_port, path, None), engine.proc.pid),
            ("relay", relay_port, request_bytes(relay_port, path, None), floor.proc.pid),
            ("router", router_port, request_bytes(router_port, path, None), router.proc.pid),
        ]
        if router_py is not None:
            targets.append(
                ("router-py", router_py_port, request_bytes(router_py_port, path, None), router_py.proc.pid)
            )
        if litellm is not None:
            targets.append(
                ("litellm", litellm.port, request_bytes(litellm.port, path, key), litellm.proc.pid)
            )

        longer = ", ".join(
            f"{window(c):.0f} s at concurrency {c}" for c in levels if window(c) > args.seconds
        )
        print(
            f"router bench: one sim engine, {TOKENS} tokens per streamed chat request, ITL {args.itl_ms:g} ms, "
            f"TTFT {args.ttft_ms:g} ms; {args.seconds:g} s per point ({longer or 'none longer'}) "
            f"after {args.warmup:g} s of warm-up; "
            f"{cpus} CPUs shared by the engine, the proxies and this load generator"
        )
        print(
            "targets: direct = the engine itself (the physical limit); relay = a bare TCP relay, no HTTP (the floor "
            "any proxy process pays here); router = python -m router; router-py = the same with its "
            "Python relay pump (LLMGW_RELAY=python); litellm = LiteLLM's proxy"
        )
        print(f"router: {pump.split('(', 1)[-1].rstrip(')')}")
        if litellm_note:
            print(litellm_note)
        print(
            "times in ms; ttfb = to the first SSE event; gap = between SSE events as received; +x = added over "
            "direct at the same concurrency; cpu = the process's on-CPU time per SSE event the clients got "
            "(for direct: the engine's own cost per event)"
        )
        cols = (
            "conc",
            "target",
            "req/s",
            "ttfb p50",
            "p99",
            "+p50",
            "+p99",
            "gap p50",
            "p99",
            "+gap",
            "cpu us/ev",
            "rss MiB",
            "err",
        )
        widths = (5, 9, 8, 9, 8, 8, 8, 8, 8, 7, 9, 8, 4)
        print(
            " ".join(
                c.rjust(w) if i != 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(cols, widths, strict=True))
            )
        )
        results: dict[tuple[str, int], Level] = {}
        notes: list[str] = []
        for c in levels:
            for name, port, req, pid in targets:
                busy = settle([t[3] for t in targets])
                if busy:
                    notes.append(f"before {name} at concurrency {c}: {busy}")
                level = measure(port, req, c, args.warmup, window(c), pid)
                results[name, c] = level
                d = results["direct", c]
                proxied = name != "direct"
                row = (
                    str(c),
                    name,
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
                print(
                    " ".join(
                        v.rjust(w) if i != 1 else v.ljust(w)
                        for i, (v, w) in enumerate(zip(row, widths, strict=True))
                    ),
                    flush=True,
                )
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
        report(results, levels, litellm is not None)
    finally:
        for p in reversed(procs):
            p.stop()
    return 0


def report(results: dict[tuple[str, int], Level], levels: list[int], with_litellm: bool) -> None:
    def added(name: str, c: int, q: float) -> float:
        return pct(results[name, c].ttfb, q) - pct(results["direct", c].ttfb, q)

    def per_event(name: str) -> float:
        events = sum(results[name, c].events for c in levels)
        return sum(results[name, c].cpu for c in levels) / events * 1e6 if events else float("nan")

    print("ratios and targets:")
    if 1 in levels:
        a = added("router", 1, 0.5)
        print(
            f"  added TTFB p50 at concurrency 1: router {a * 1000:.2f} ms (target < 1 ms: {'met' if a < 0.001 else 'MISSED'}); "
            f"bare relay {added('relay', 1, 0.5) * 1000:.2f} ms"
            + (f"; LiteLLM {added('litellm', 1, 0.5) * 1000:.2f} ms" if with_litellm else "")
        )
    r, floor, engine = per_event("router"), per_event("relay"), per_event("direct")
    print(
        f"  CPU per relayed event, all levels: router {r:.1f} us (target < 30 us: {'met' if r < 30 else 'MISSED'}); "
        f"bare relay {floor:.1f} us (router/relay {r / floor:.2f}x); the engine's own cost per event {engine:.1f} us"
        + (
            f"; LiteLLM {per_event('litellm'):.1f} us ({per_event('litellm') / r:.1f}x the router)"
            if with_litellm
            else ""
        )
    )
    print(
        "  CPU per relayed event by level (router / bare relay): "
        + "; ".join(
            f"concurrency {c}: {results['router', c].us_per_event:.1f} / "
            f"{results['relay', c].us_per_event:.1f} us"
            for c in levels
            if results["router", c].events and results["relay", c].events
        )
    )
    if ("router-py", levels[0]) in results:
        py = per_event("router-py")
        print(
            f"  CPU per relayed event with the Python relay pump, all levels: {py:.1f} us "
            f"({py / r:.2f}x the router as built)"
        )
    if not with_litellm:
        print("  LiteLLM ratios: not measured (see above)")
        return
    for c in levels:
        rr, ll = results["router", c], results["litellm", c]
        if ll.rps:
            print(
                f"  concurrency {c}: router/LiteLLM req/s {rr.rps / ll.rps:.2f}x; added TTFB p99: router "
                f"{added('router', c, 0.99) * 1000:.2f} ms, LiteLLM {added('litellm', c, 0.99) * 1000:.2f} ms"
            )
        else:
            print(
                f"  concurrency {c}: LiteLLM completed no request inside the {ll.seconds:g} s window "
                f"({ll.errors} errors); the router completed {rr.rps:.1f} req/s"
            )
    # At equal added p99: LiteLLM's best throughput, against the router's best throughput among the
    # points where its added p99 is no worse than LiteLLM's there.
    best = max(levels, key=lambda c: results["litellm", c].rps)
    ll = results["litellm", best]
    ll_p99 = added("litellm", best, 0.99)
    within = [results["router", c] for c in levels if added("router", c, 0.99) <= ll_p99]
    if within and ll.rps:
        top = max(within, key=lambda level: level.rps)
        ratio = top.rps / ll.rps
        print(
            f"  at equal added p99 (LiteLLM's best: {ll.rps:.1f} req/s at concurrency {best}, +{ll_p99 * 1000:.1f} ms): "
            f"router {top.rps:.1f} req/s, {ratio:.2f}x (target >= 3x: {'met' if ratio >= 3 else 'MISSED'})"
        )
    else:
        print(
            f"  at equal added p99: the router never had an added p99 as high as LiteLLM's best point (+{ll_p99 * 1000:.1f} ms)"
        )


if __name__ == "__main__":
    sys.exit(main())
