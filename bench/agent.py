"""Agent benchmark: idle cost with heartbeats, and how fast shard events reach the control plane.

``python -m bench.agent`` (part of ``nox -s bench``) prints:

1. the agent's idle CPU (% of one core) and RSS while heartbeating every second, next to a peer
   doing the same job with grpcio (a minimal heartbeat-only client, no supervisor, no discovery);
2. StartShard sent -> ShardStatus(STARTING, pid) received: the time to spawn an engine;
3. engine ``kill -9`` -> ShardStatus(FAILED) received: the time to notice and report an exit.

Targets (issue 3): idle under 1% of a core and under 80 MiB; engine exit to ShardStatus under 1 s.
The control plane here is our stream server in this process, recording arrival times.
``--quick`` runs it at a tiny size (seconds; figures not comparable), so that CI notices a
benchmark that no longer runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

import schema
from bench.children import Child
from transport import ServerStream, StreamServer

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "tests" / "fixtures" / "inventory" / "h100x8.toml"
TICKS = os.sysconf("SC_CLK_TCK")


@attrs.frozen
class Size:
    """How long the idle window is and how many engines are started and killed."""

    idle_seconds: float = 20.0
    rounds: int = 5
    settle_seconds: float = 2.0  # start-up work that must be over before the idle window


QUICK = Size(idle_seconds=2.0, rounds=2, settle_seconds=0.5)

PEER = r"""
import sys, time, grpc, schema
channel = grpc.insecure_channel(sys.argv[1])
call = channel.stream_stream(schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse)
def beats():
    yield schema.AgentMessage(message_id=1, register=schema.Register(node_id="peer"))
    i = 1
    while True:
        i += 1
        yield schema.AgentMessage(message_id=i, heartbeat=schema.Heartbeat(node_id="peer", gpus=[schema.GpuUsage(index=g) for g in range(8)]))
        time.sleep(1.0)
for _ in call(beats()):
    pass
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RecordingControlPlane:
    def __init__(self) -> None:
        self.streams: dict[str, ServerStream] = {}
        self.statuses: list[tuple[float, schema.ShardStatus]] = []
        self.changed = trio.Event()

    async def handle(self, stream: ServerStream) -> None:
        async for msg in stream:
            if msg.register is not None:
                self.streams[msg.register.node_id] = stream
                await stream.send(
                    schema.ControlMessage(message_id=1, ack=schema.Ack(message_id=msg.message_id, ok=True))
                )
            elif msg.shard is not None:
                self.statuses.append((time.monotonic(), msg.shard))
            self.changed.set()
            self.changed = trio.Event()

    async def wait_status(
        self, shard_id: str, state: schema.ShardState, after: float
    ) -> tuple[float, schema.ShardStatus]:
        with trio.fail_after(60):
            while True:
                for t, s in self.statuses:
                    if t >= after and s.shard_id == shard_id and s.state == state:
                        return t, s
                await self.changed.wait()


async def measure_idle(pid: int, seconds: float) -> tuple[float, float]:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await trio.sleep(seconds)
    return 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0), rss_mib(pid)


async def bench(size: Size) -> None:
    cp = RecordingControlPlane()
    server = StreamServer(cp.handle)
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            # The benchmark ends these itself, at a point it chooses, and never waits on them
            # without a bound (bench.children).
            agent = Child(
                "the agent",
                [
                    sys.executable, "-m", "agent", "--node-id", "bench01",
                    "--server", f"http://127.0.0.1:{port}", "--inventory", str(INVENTORY),
                    "--state-dir", tmp, "--heartbeat-interval", "1", "--mgmt-addr", "127.0.0.1",
                    "--engines", f"vllm={sys.executable} -m agent.engines.sim",
                ],
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            peer = Child("the grpcio peer", [sys.executable, "-c", PEER, f"127.0.0.1:{port}"], cwd=ROOT)
            try:
                with trio.fail_after(30):
                    while "bench01" not in cp.streams or "peer" not in cp.streams:
                        await cp.changed.wait()
                await trio.sleep(size.settle_seconds)  # let start-up work settle before the idle window
                (agent_cpu, agent_rss), (peer_cpu, peer_rss) = await _both(
                    agent.pid, peer.pid, size.idle_seconds
                )

                spawn, report = [], []
                stream = cp.streams["bench01"]
                for i in range(size.rounds):
                    shard_id = f"bench-r{i}-s0"
                    spec = schema.StartShard(
                        shard_id=shard_id,
                        replica_id=f"bench-r{i}",
                        profile=schema.EngineProfile(
                            engine="vllm",
                            model="m",
                            served_model_name="m",
                            env={"LLMGW_SIM_LOAD_SECONDS": "0"},
                        ),
                        gpu_indices=[0],
                        http_port=free_port(),
                        ready_timeout_seconds=30,
                    )
                    t0 = time.monotonic()
                    await stream.send(schema.ControlMessage(message_id=100 + i, start=spec))
                    t1, starting = await cp.wait_status(shard_id, schema.ShardState.STARTING, t0)
                    spawn.append(t1 - t0)
                    await cp.wait_status(shard_id, schema.ShardState.READY, t0)
                    t2 = time.monotonic()
                    os.killpg(starting.pid, signal.SIGKILL)
                    t3, _ = await cp.wait_status(shard_id, schema.ShardState.FAILED, t2)
                    report.append(t3 - t2)
            finally:
                agent.signal(signal.SIGTERM)
                peer.signal(signal.SIGTERM)
                agent.stop()
                peer.stop()
                nursery.cancel_scope.cancel()

    print(f"agent idle with heartbeats every 1 s, {size.idle_seconds:g} s window")
    print(
        f"  llmgw agent      CPU {agent_cpu:5.2f}% of a core   RSS {agent_rss:6.1f} MiB   (targets: < 1%, < 80 MiB)"
    )
    print(f"  grpcio peer      CPU {peer_cpu:5.2f}% of a core   RSS {peer_rss:6.1f} MiB   (heartbeats only)")
    print(
        f"  ratio            CPU {agent_cpu / max(peer_cpu, 1e-9):5.2f}x             RSS {agent_rss / peer_rss:6.2f}x"
    )
    print(f"StartShard -> STARTING(pid) at the control plane, {size.rounds} rounds:")
    print(f"  median {statistics.median(spawn) * 1000:7.1f} ms   max {max(spawn) * 1000:7.1f} ms")
    print(f"engine kill -9 -> FAILED at the control plane, {size.rounds} rounds (target < 1 s):")
    print(f"  median {statistics.median(report) * 1000:7.1f} ms   max {max(report) * 1000:7.1f} ms")


async def _both(a: int, b: int, seconds: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """Idle figures of two processes over the same window."""
    results: dict[int, tuple[float, float]] = {}

    async def run(pid: int) -> None:
        results[pid] = await measure_idle(pid, seconds)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, a)
        nursery.start_soon(run, b)
    return results[a], results[b]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny size (seconds), to check that the benchmark runs"
    )
    args = parser.parse_args(argv)
    if args.quick:
        print("--quick: a tiny size, to check that the benchmark runs; its figures compare with nothing")
    trio.run(bench, QUICK if args.quick else Size())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
