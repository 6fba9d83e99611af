"""Control plane benchmark: a simulated fleet against one control plane process.

``python -m bench.control --nodes 1000 5000`` (part of ``nox -s bench``) prints, per fleet size:

- the control plane's CPU (% of one core) and RSS while every node heartbeats every 5 s, next to
  grpcio's asyncio server holding the same streams under the same load (a bare transport floor: it
  keeps no fleet, places nothing and reconciles nothing);
- heartbeat handling latency under that load: a probe connection's h2 PING round trip, i.e. how long
  the control plane's event loop takes to get to a frame a node sent (p50, p99);
- the time for the whole fleet to register from cold, and to re-register after ``kill -9`` and a
  restart of the control plane (agents reconnect with the agent's own jittered backoff);
- placement time for 1,000 nodes and 200 models (the pure function, in this process).

The fleet runs in a separate load process (``python -m bench.control load``): light agent sessions
built from the agent's own transport and backoff, one connection each, 8 GPUs per node. Each joins
as a real agent does: the cluster's join token in its first Register, then the credential the
control plane issued it. The probe is a node too (it registers, then pings on its connection): a
connection that opens no stream is closed by the control plane after 10 s.
Targets (issue 4): 5,000 nodes with heartbeat handling p99 under 50 ms, re-registered within 60 s.

Every wait has a bound and says what it waited for (``bench.children``). ``--quick`` runs a fleet of
20 with a 1 s heartbeat (seconds; figures not comparable), so that CI notices a benchmark that no
longer runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import attrs
import h2.config
import h2.connection
import h2.events
import trio
import trio.lowlevel

import schema
from bench.children import Child, ChildExited
from bench.wire import ServerProcess, _raise_fd_limit, _rss_kib

TICKS = os.sysconf("SC_CLK_TCK")
#: The load process reads the cluster's join token here (not on its command line, which ``ps`` shows).
TOKEN_ENV = "LLMGW_BENCH_JOIN_TOKEN"


@attrs.frozen
class Size:
    """The fleets measured and the pace of the measurement."""

    nodes: tuple[int, ...] = (1000, 5000)
    heartbeat: float = float(os.environ.get("LLMGW_BENCH_HEARTBEAT", "5.0"))
    window: float = 20.0  # seconds of steady state measured
    placement_nodes: int = 1000
    placement_models: int = 200
    #: Bounds on the waits for the fleet: to register from cold (and again after the restart), and
    #: for the load process to notice the control plane's death.
    register_timeout: float = 600.0
    lost_timeout: float = 120.0


QUICK = Size(
    nodes=(20,), heartbeat=1.0, window=2.0, placement_nodes=100, placement_models=20,
    register_timeout=120.0, lost_timeout=60.0,
)  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# -- the load process ----------------------------------------------------------------------------


def _register(node_id: str, token: str, credential: str) -> schema.Register:
    return schema.Register(
        node_id=node_id,
        hostname=node_id,
        mgmt_addr="127.0.0.1",
        agent_version="bench",
        gpus=[
            schema.Gpu(index=i, uuid=f"GPU-{node_id}-{i}", name="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                       memory_total_mib=81559, nvlink_peers=[j for j in range(8) if j != i])
            for i in range(8)
        ],
        fabrics=[schema.FabricAttachment(fabric=f"ib-{hash(node_id) % 4}", hca="mlx5_0", port=1)],
        engine_ports=schema.PortRange(first=8000, last=8099),
        token=token,
        node_credential=credential,
    )  # fmt: skip


class _Encoded:
    """A message encoded once. The load process stands in for thousands of agents, each of which
    encodes its own messages on its own CPU; encoding them all here would measure the load process."""

    def __init__(self, message: schema.AgentMessage) -> None:
        self.data = bytes(message)

    def __bytes__(self) -> bytes:
        return self.data


def _register_message(node_id: str, token: str, credential: str) -> schema.AgentMessage:
    message = schema.AgentMessage(message_id=1, register=_register(node_id, token, credential))
    return cast(schema.AgentMessage, _Encoded(message))


async def _node(
    url: str, node_id: str, token: str, heartbeat: float, registered: set[str], changed: list[trio.Event]
) -> None:
    from agent.nursery import backoff_delay
    from transport import CallOptions, open_stream

    rng = random.Random(node_id)
    attempt = 0
    options = CallOptions(keepalive_interval=30, keepalive_timeout=20, connect_timeout=30)
    # As the agent does: the join token, and from the first answer on the credential it was issued.
    register = _register_message(node_id, token, "")
    beat = cast(
        schema.AgentMessage,
        _Encoded(
            schema.AgentMessage(
                message_id=2,
                heartbeat=schema.Heartbeat(
                    node_id=node_id, gpus=[schema.GpuUsage(index=g) for g in range(8)]
                ),
            )
        ),
    )
    while True:
        try:
            async with open_stream(url, options) as stream:
                await stream.send(register)
                with trio.fail_after(60):
                    reply = await stream.receive()
                if reply is None or reply.ack is None or not reply.ack.ok:
                    raise RuntimeError(f"{node_id}: register not acknowledged: {reply}")
                if reply.ack.node_credential:
                    register = _register_message(node_id, token, reply.ack.node_credential)
                attempt = 0
                registered.add(node_id)
                changed[0].set()
                async with trio.open_nursery() as nursery:

                    async def drain() -> None:
                        async for _ in stream:
                            pass
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(drain)
                    await trio.sleep(rng.random() * heartbeat)
                    while True:
                        await stream.send(beat)
                        await trio.sleep(heartbeat)
        except Exception:  # any failure of a session means: reconnect, as the agent does
            pass
        registered.discard(node_id)
        changed[0].set()
        await trio.sleep(backoff_delay(attempt, 1.0, 30.0, rng.random()))
        attempt += 1


async def _load(url: str, count: int, heartbeat: float, token: str) -> None:
    registered: set[str] = set()
    changed = [trio.Event()]
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(_node, url, f"sim{i:05d}", token, heartbeat, registered, changed)
            if i % 100 == 99:
                await trio.lowlevel.checkpoint()  # let earlier sessions get going
        full = False
        while True:
            await changed[0].wait()
            changed[0] = trio.Event()
            if len(registered) == count and not full:
                print(f"all {count} {time.monotonic():.3f}", flush=True)
                full = True
            elif len(registered) < count and full:
                print(f"lost {count - len(registered)} {time.monotonic():.3f}", flush=True)
                full = False


# -- the probe -------------------------------------------------------------------------------------


async def _ping_rtts(port: int, seconds: float, heartbeat: float, token: str) -> list[float]:
    """h2 PING round trips on a connection of its own, every 50 ms for ``seconds``.

    The probe is a node of the fleet: it opens the agent stream, joins with ``token`` and heartbeats
    (a connection that opens no stream is closed after 10 s, and a node that never registers after
    30 s), so the PINGs ride a connection the control plane treats like every other.
    """
    with trio.fail_after(seconds + 60):
        return await _ping_rtts_unbounded(port, seconds, heartbeat, token)


async def _ping_rtts_unbounded(port: int, seconds: float, heartbeat: float, token: str) -> list[float]:
    from transport.h2io import H2Stream, H2Transport

    sock = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    transport = H2Transport(sock, conn)
    await transport.flush()
    rtts: list[float] = []

    async def reader() -> None:
        while True:
            for event in await transport.receive_events():
                transport.handle_common(event)
            await transport.flush()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        stream_id = conn.get_next_available_stream_id()
        stream = H2Stream(transport, stream_id)
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", schema.CONNECT_PATH),
            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc+proto"),
            ("te", "trailers"),
        ]  # fmt: skip
        conn.send_headers(stream_id, [(k.encode(), v.encode()) for k, v in headers])
        register = schema.AgentMessage(message_id=1, register=_register("probe", token, ""))
        await stream.send_message(bytes(register))
        answer = await stream.receive_envelope()
        reply = schema.ControlMessage.parse(answer.payload) if answer is not None else None
        if reply is None or reply.ack is None or not reply.ack.ok:
            raise RuntimeError(f"the probe's Register was not acknowledged: {reply}")

        async def beat() -> None:
            message = schema.AgentMessage(message_id=2, heartbeat=schema.Heartbeat(node_id="probe"))
            while True:
                await stream.send_message(bytes(message))
                await trio.sleep(heartbeat)

        async def drain() -> None:
            while await stream.receive_envelope() is not None:
                pass

        nursery.start_soon(beat)
        nursery.start_soon(drain)
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            t0 = time.perf_counter()
            if await transport.ping(5.0):
                rtts.append(time.perf_counter() - t0)
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    await sock.aclose()
    return rtts


# -- orchestration ---------------------------------------------------------------------------------


def _catalog(state_dir: Path, port: int) -> str:
    # One model whose selector no simulated node carries: placement and reconcile run on every pass
    # over the whole fleet, as they would in production, without starting any engine.
    return f"""
state_dir = "{state_dir}"
[listen]
agents = "127.0.0.1:{port}"
api = "127.0.0.1:0"
router = ""
[liveness]
unreachable_after = 15
lost_after = 300
[[models]]
name = "bench"
replicas = 1
selector = {{ pool = "none" }}
[models.gpus]
count = 8
[models.profile]
engine = "vllm"
model = "m"
"""


class ControlProc:
    """The control plane under test, its output in ``control.log`` of the bench's directory."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.config = workdir / "llmgw.toml"
        self.state = workdir / "state"
        self.config.write_text(_catalog(self.state, port))
        self.log = workdir / "control.log"
        self.child: Child | None = None

    def start(self) -> float:
        t0 = time.monotonic()
        with open(self.log, "ab") as logf:
            self.child = Child(
                "the control plane",
                [sys.executable, "-m", "control", "--config", str(self.config)],
                stderr=logf,
            )
        return t0

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def join_token(self, timeout: float = 60) -> str:
        """The cluster join token, which the control plane writes at its first start (``ctl token``)."""
        from control.joins import JOIN_TOKEN_FILE

        assert self.child is not None
        path = self.state / JOIN_TOKEN_FILE
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text().strip():
            if self.child.proc.poll() is not None:
                raise ChildExited(
                    f"the control plane exited {self.child.proc.returncode} before writing {path}:\n"
                    + self.log.read_text()[-3000:]
                )
            if time.monotonic() > deadline:
                self.child.kill()
                raise TimeoutError(f"the control plane wrote no join token to {path} within {timeout:g} s")
            time.sleep(0.05)
        return path.read_text().strip()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_process(url: str, count: int, size: Size, token: str) -> Child:
    argv = [
        sys.executable,
        "-m",
        "bench.control",
        "load",
        url,
        str(count),
        "--heartbeat",
        f"{size.heartbeat:g}",
    ]
    return Child(f"the load process ({count} nodes)", argv, env={**os.environ, TOKEN_ENV: token})


def _wait_line(load: Child, prefix: str, what: str, timeout: float) -> float:
    """The time stamp on the load process's next line that starts with ``prefix``."""
    return float(load.line(what, timeout, prefix + " ").split()[-1])


def _measure(pid: int, port: int, size: Size, token: str) -> dict[str, float]:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    rtts = trio.run(_ping_rtts, port, size.window, size.heartbeat, token)
    if not rtts:
        raise RuntimeError(f"the probe had no PING answered in {size.window:g} s")
    cpu = 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    rtts.sort()
    return {
        "cpu_pct": cpu,
        "rss_mib": _rss_kib(pid) / 1024,
        "p50_ms": statistics.median(rtts) * 1000,
        "p99_ms": rtts[max(int(len(rtts) * 0.99) - 1, 0)] * 1000,
    }


def run_fleet(count: int, size: Size) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        cp = ControlProc(Path(tmp), port)
        t_start = cp.start()
        load: Child | None = None
        try:
            token = cp.join_token()
            load = _load_process(f"http://127.0.0.1:{port}", count, size, token)
            registered = f"all {count} nodes registered"
            t_all = _wait_line(load, "all", registered, size.register_timeout)
            out = {"cold_register_s": t_all - t_start}
            time.sleep(size.heartbeat)  # one full heartbeat period before measuring the steady state
            out |= _measure(cp.pid, port, size, token)
            cp.kill()
            _wait_line(load, "lost", "nodes lost after the control plane's kill -9", size.lost_timeout)
            t_restart = cp.start()
            t_back = _wait_line(load, "all", registered + " again", size.register_timeout)
            out["reregister_s"] = t_back - t_restart
            return out
        except (ChildExited, TimeoutError):
            print(f"bench.control: the control plane's log ({cp.log}):", file=sys.stderr)
            print(cp.log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            if load is not None:
                load.stop(30)
            cp.stop()


def run_peer(count: int, size: Size) -> dict[str, float]:
    peer = ServerProcess("grpcio")
    load = _load_process(f"http://127.0.0.1:{peer.port}", count, size, "")
    try:
        _wait_line(load, "all", f"all {count} nodes registered", size.register_timeout)
        time.sleep(size.heartbeat)
        c0, t0 = cpu_seconds(peer.proc.pid), time.monotonic()
        time.sleep(size.window)
        return {
            "cpu_pct": 100 * (cpu_seconds(peer.proc.pid) - c0) / (time.monotonic() - t0),
            "rss_mib": peer.rss_kib() / 1024,
        }
    finally:
        load.stop(30)
        peer.close()


def placement_time(node_count: int, model_count: int) -> float:
    from control.placement import GpuView, ModelSpec, NodeView, place

    gpus = tuple(GpuView(i, 81559, (9, 0), frozenset(j for j in range(8) if j != i)) for i in range(8))
    nodes = [
        NodeView(f"n{i:04d}", "ready", gpus, {"zone": "abcd"[i % 4]}, frozenset({f"ib-{i % 8}"}), f"10.0.{i // 250}.{i % 250}", (8000, 8099))
        for i in range(node_count)
    ]  # fmt: skip
    models = [
        ModelSpec(f"m{i:03d}", replicas=1 + i % 3, gpus_per_shard=(1, 2, 4, 8)[i % 4], nodes_per_replica=2 if i % 10 == 0 else 1)
        for i in range(model_count)
    ]  # fmt: skip
    t0 = time.perf_counter()
    plan = place(models, nodes, ())
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    place(models, nodes, plan.replicas)
    warm = time.perf_counter() - t0
    print(
        f"placement, {node_count:,} nodes x {model_count} models: {cold * 1000:.0f} ms from scratch, "
        f"{warm * 1000:.0f} ms with every placement kept"
    )
    return cold


def heartbeat_decode(rounds: int = 3000) -> None:
    """The CP's hottest parse: the fast path against betterproto2's generic parser, same input."""
    from schema.fastpath import decode_agent_message

    beat = bytes(
        schema.AgentMessage(
            message_id=9,
            heartbeat=schema.Heartbeat(
                node_id="gpu07", gpus=[schema.GpuUsage(index=i, memory_used_mib=70000) for i in range(8)]
            ),
        )
    )
    times = {}
    for name, fn in (("betterproto2", schema.AgentMessage.parse), ("fast path", decode_agent_message)):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn(beat)
        times[name] = (time.perf_counter() - t0) / rounds * 1e6
    print(
        f"heartbeat decode (8 GPUs): betterproto2 {times['betterproto2']:.0f} µs, fast path "
        f"{times['fast path']:.0f} µs ({times['betterproto2'] / times['fast path']:.1f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.control", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "load"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--nodes", type=int, nargs="+", default=None, help="fleet sizes (default 1000 5000)")
    parser.add_argument(
        "--heartbeat", type=float, default=None, help="seconds between heartbeats (default 5)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny size (seconds), to check that the benchmark runs"
    )
    args = parser.parse_args(argv)
    size = QUICK if args.quick else Size()
    if args.nodes is not None:
        size = attrs.evolve(size, nodes=tuple(args.nodes))
    if args.heartbeat is not None:
        size = attrs.evolve(size, heartbeat=args.heartbeat)
    _raise_fd_limit()
    if args.mode == "load":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        # Thousands of simulated agents in one process: full collections would pause all of them at
        # once, which no real fleet does (each agent is its own small process).
        gc.freeze()
        gc.set_threshold(100_000, 50, 1000)
        trio.run(_load, args.args[0], int(args.args[1]), size.heartbeat, os.environ.get(TOKEN_ENV, ""))
        return 0
    if args.quick:
        print("--quick: a tiny size, to check that the benchmark runs; its figures compare with nothing")
    placement_time(size.placement_nodes, size.placement_models)
    heartbeat_decode(300 if args.quick else 3000)
    heartbeat = size.heartbeat
    for count in size.nodes:
        ours = run_fleet(count, size)
        peer = run_peer(count, size)
        print(
            f"fleet of {count} nodes, heartbeat every {heartbeat:g} s ({count / heartbeat:.0f} heartbeats/s)"
        )
        print(f"  control plane   CPU {ours['cpu_pct']:5.1f}% of a core   RSS {ours['rss_mib']:6.1f} MiB")
        print(
            f"  grpcio floor    CPU {peer['cpu_pct']:5.1f}% of a core   RSS {peer['rss_mib']:6.1f} MiB   (holds streams, nothing else)"
        )
        print(
            f"  ratio           CPU {ours['cpu_pct'] / max(peer['cpu_pct'], 1e-9):5.2f}x             RSS {ours['rss_mib'] / peer['rss_mib']:6.2f}x"
        )
        print(
            f"  heartbeat handling latency (probe PING RTT): p50 {ours['p50_ms']:.1f} ms  p99 {ours['p99_ms']:.1f} ms   (target p99 < 50 ms)"
        )
        print(
            f"  fleet registered from cold in {ours['cold_register_s']:.1f} s; re-registered {ours['reregister_s']:.1f} s after a kill -9 and restart   (target < 60 s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
