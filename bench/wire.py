"""Wire benchmark: our h2 stack against grpcio, measured side by side in one run.

``nox -s bench`` (or ``python -m bench.wire``) prints:

1. one stream's lock-step round-trip latency (p50, p99) and pipelined messages per second, for our
   client against our server and grpcio's client against grpcio's server (grpc.aio on both sides:
   the asyncio API is grpcio's fastest pure-Python path), with the ratio of the two;
2. how many concurrent idle streams one server process holds and the server's memory per stream, for
   our server and for grpc.aio's server, each in its own process, loaded by a separate client process.

Servers run in their own processes (``python -m bench.wire serve KIND``) so that the figures are the
server's own, not the load generator's. Targets (issue 2): our p50 at most 2x grpcio's; 5,000 streams
at no more than 50 KiB each. ``--quick`` runs it at a tiny size (seconds; figures not comparable),
so that CI notices a benchmark that no longer runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import AsyncIterator

import attrs
import trio

import schema
from bench.children import Child

#: The longest any one measurement may take before the benchmark gives up on it and says so.
STEP_TIMEOUT = 300.0


@attrs.frozen
class Size:
    """How much each part of the benchmark does."""

    latency_rounds: int = 3000
    pipeline_messages: int = 20000
    warmup: int = 300
    streams: int = 5000


QUICK = Size(latency_rounds=200, pipeline_messages=1000, warmup=20, streams=100)


def _raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _ack(message_id: int) -> schema.ControlMessage:
    return schema.ControlMessage(message_id=message_id, ack=schema.Ack(message_id=message_id, ok=True))


def _heartbeat(i: int) -> schema.AgentMessage:
    return schema.AgentMessage(message_id=i, heartbeat=schema.Heartbeat(node_id="bench"))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- servers (each runs in its own process) ------------------------------------------------------


async def _serve_ours() -> None:
    from transport import ServerLimits, ServerStream, StreamServer

    async def echo(stream: ServerStream) -> None:
        async for msg in stream:
            await stream.send(_ack(msg.message_id))

    server = StreamServer(echo, limits=ServerLimits(keepalive_interval=300, max_streams=50_000))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        print(port, flush=True)


async def _serve_grpcio() -> None:
    import grpc

    async def connect(
        requests: AsyncIterator[schema.AgentMessage], context: object
    ) -> AsyncIterator[schema.ControlMessage]:
        async for msg in requests:
            yield _ack(msg.message_id)

    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100)])
    handler = grpc.method_handlers_generic_handler(
        schema.SERVICE,
        {
            schema.METHOD: grpc.stream_stream_rpc_method_handler(
                connect, request_deserializer=schema.AgentMessage.parse, response_serializer=bytes
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


class ServerProcess:
    """A stream server (``python -m bench.wire serve KIND``) in a process of its own."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.child = Child(f"the {kind} server", [sys.executable, "-m", "bench.wire", "serve", kind])
        self.proc = self.child.proc
        self.port = int(self.child.line("its port", 60))

    def rss_kib(self) -> int:
        return _rss_kib(self.proc.pid)

    def close(self) -> None:
        self.child.stop()


# -- latency and throughput ---------------------------------------------------------------------


def _summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_us": statistics.median(samples) * 1e6,
        "p99_us": samples[int(len(samples) * 0.99) - 1] * 1e6,
    }


async def _latency_ours(port: int, size: Size) -> dict[str, float]:
    with trio.fail_after(STEP_TIMEOUT):
        return await _latency_ours_unbounded(port, size)


async def _latency_ours_unbounded(port: int, size: Size) -> dict[str, float]:
    from transport import CallOptions, open_stream

    async with open_stream(f"http://127.0.0.1:{port}", CallOptions(keepalive_interval=300)) as stream:
        samples = []
        for i in range(size.warmup + size.latency_rounds):
            t0 = time.perf_counter()
            await stream.send(_heartbeat(i))
            await stream.receive()
            if i >= size.warmup:
                samples.append(time.perf_counter() - t0)
        result = _summary(samples)
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:

            async def receive_all() -> None:
                for _ in range(size.pipeline_messages):
                    await stream.receive()

            nursery.start_soon(receive_all)
            for i in range(size.pipeline_messages):
                await stream.send(_heartbeat(i))
        result["msgs_per_s"] = size.pipeline_messages / (time.perf_counter() - t0)
        await stream.close_send()
    return result


async def _latency_grpcio(port: int, size: Size) -> dict[str, float]:
    return await asyncio.wait_for(_latency_grpcio_unbounded(port, size), STEP_TIMEOUT)


async def _latency_grpcio_unbounded(port: int, size: Size) -> dict[str, float]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.stream_stream(
            schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse
        )
        call = method()
        samples = []
        for i in range(size.warmup + size.latency_rounds):
            t0 = time.perf_counter()
            await call.write(_heartbeat(i))
            await call.read()
            if i >= size.warmup:
                samples.append(time.perf_counter() - t0)
        result = _summary(samples)
        t0 = time.perf_counter()

        async def receive_all() -> None:
            for _ in range(size.pipeline_messages):
                await call.read()

        reader = asyncio.ensure_future(receive_all())
        for i in range(size.pipeline_messages):
            await call.write(_heartbeat(i))
        await reader
        result["msgs_per_s"] = size.pipeline_messages / (time.perf_counter() - t0)
        await call.done_writing()
    return result


# -- idle streams ------------------------------------------------------------------------------


async def _hold_ours(port: int, count: int, ready: trio.Event, release: trio.Event) -> int:
    """Open ``count`` connections with one stream each, each answered once, then hold them."""
    from transport import CallOptions, open_stream

    opened = 0
    all_open = trio.Event()
    # At most 200 handshakes in flight: a fleet reconnects gradually, and the listen backlog is finite.
    handshakes = trio.Semaphore(200)

    async def one(i: int) -> None:
        nonlocal opened
        await handshakes.acquire()
        released = False
        try:
            async with open_stream(f"http://127.0.0.1:{port}", CallOptions(keepalive_interval=300)) as stream:
                await stream.send(_heartbeat(i))
                await stream.receive()
                handshakes.release()
                released = True
                opened += 1
                if opened == count:
                    all_open.set()
                await release.wait()
        finally:
            if not released:
                handshakes.release()

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
        with trio.fail_after(STEP_TIMEOUT):
            await all_open.wait()
        ready.set()
        await release.wait()
    return opened


def _hold_in_subprocess(kind: str, port: int, count: int) -> Child:
    load = Child(
        f"the load process for {kind}",
        [sys.executable, "-m", "bench.wire", "hold", kind, str(port), str(count)],
        stdin=True,
    )
    # Its own deadline to open them all is STEP_TIMEOUT; this one is the backstop.
    line = load.line(f"{count} streams open", STEP_TIMEOUT + 60)
    if line.strip() != "ready":
        load.stop()
        raise RuntimeError(f"load process for {kind} did not open {count} streams: {line!r}")
    return load


async def _hold_grpcio(port: int, count: int) -> None:
    import grpc

    channels = []
    calls = []
    sem = asyncio.Semaphore(200)

    async def one(i: int) -> None:
        async with sem:
            # One channel per stream: each node agent holds its own connection.
            channel = grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(channel)
            call = channel.stream_stream(
                schema.CONNECT_PATH,
                request_serializer=bytes,
                response_deserializer=schema.ControlMessage.parse,
            )()
            calls.append(call)
            await call.write(_heartbeat(i))
            await call.read()

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), STEP_TIMEOUT)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def _idle_streams(kind: str, count: int) -> dict[str, float]:
    server = ServerProcess(kind)
    try:
        time.sleep(0.5)  # let the fresh interpreter settle before the baseline reading
        before = server.rss_kib()
        load = _hold_in_subprocess(kind, server.port, count)
        try:
            after = server.rss_kib()
            load.write("\n")
            load.wait(f"closing its {count} streams", 120)
        finally:
            load.stop()
        return {
            "streams": count,
            "rss_before_mib": before / 1024,
            "rss_after_mib": after / 1024,
            "kib_per_stream": (after - before) / count,
        }
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    serve = sub.add_parser("serve")
    serve.add_argument("kind", choices=["ours", "grpcio"])
    hold = sub.add_parser("hold")
    hold.add_argument("kind", choices=["ours", "grpcio"])
    hold.add_argument("port", type=int)
    hold.add_argument("count", type=int)
    parser.add_argument("--streams", type=int, default=None, help="idle streams held (default 5000)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny size (seconds), to check that the benchmark runs"
    )
    args = parser.parse_args(argv)
    size = QUICK if args.quick else Size()
    if args.streams is not None:
        size = attrs.evolve(size, streams=args.streams)
    _raise_fd_limit()

    if args.cmd == "serve":
        if args.kind == "ours":
            trio.run(_serve_ours)
        else:
            asyncio.run(_serve_grpcio())
        return 0
    if args.cmd == "hold":
        if args.kind == "ours":

            async def hold_main() -> None:
                ready, release = trio.Event(), trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_hold_ours, args.port, args.count, ready, release)
                    await ready.wait()
                    print("ready", flush=True)
                    await trio.to_thread.run_sync(sys.stdin.readline)
                    release.set()

            trio.run(hold_main)
        else:
            asyncio.run(_hold_grpcio(args.port, args.count))
        return 0

    results: dict[str, object] = {}
    ours = ServerProcess("ours")
    try:
        results["latency_ours"] = trio.run(_latency_ours, ours.port, size)
    finally:
        ours.close()
    peer = ServerProcess("grpcio")
    try:
        results["latency_grpcio"] = asyncio.run(_latency_grpcio(peer.port, size))
    finally:
        peer.close()
    results["idle_ours"] = _idle_streams("ours", size.streams)
    results["idle_grpcio"] = _idle_streams("grpcio", size.streams)

    lo, lg = results["latency_ours"], results["latency_grpcio"]
    io, ig = results["idle_ours"], results["idle_grpcio"]
    assert isinstance(lo, dict) and isinstance(lg, dict) and isinstance(io, dict) and isinstance(ig, dict)
    if args.json:
        print(json.dumps(results, indent=2))
    if args.quick:
        print("--quick: a tiny size, to check that the benchmark runs; its figures compare with nothing")
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}")
    print("round trip, one stream, lock-step      p50 µs    p99 µs   pipelined msg/s")
    print(
        f"  llmgw (h2 on trio)                 {lo['p50_us']:8.0f}  {lo['p99_us']:8.0f}   {lo['msgs_per_s']:12.0f}"
    )
    print(
        f"  grpcio (grpc.aio, C core)          {lg['p50_us']:8.0f}  {lg['p99_us']:8.0f}   {lg['msgs_per_s']:12.0f}"
    )
    print(
        f"  ratio llmgw/grpcio                 {lo['p50_us'] / lg['p50_us']:8.2f}x {lo['p99_us'] / lg['p99_us']:8.2f}x "
        f"  {lo['msgs_per_s'] / lg['msgs_per_s']:11.2f}x   (target: p50 <= 2x)"
    )
    print(f"idle streams in one server process ({size.streams} connections, one stream each)")
    for name, r in (("llmgw", io), ("grpcio", ig)):
        print(
            f"  {name:<8} RSS {r['rss_before_mib']:6.1f} -> {r['rss_after_mib']:6.1f} MiB   "
            f"{r['kib_per_stream']:5.1f} KiB per stream"
        )
    print(
        f"  ratio llmgw/grpcio {io['kib_per_stream'] / ig['kib_per_stream']:.2f}x   (target: <= 50 KiB per stream)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
