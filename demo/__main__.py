"""``python -m demo``: the wire end to end on loopback, over every carrier.

A control-plane stream server (``control.transport``) and three node agents' streams
(``agent.transport``): one over gRPC, one over the Connect protocol, one over WebSocket. Each node
registers with an 8x H100 inventory and heartbeats; the server answers each Register with an Ack and
sends one StartShard down each stream while the agent keeps sending, and each agent acknowledges it.
The whole exchange is printed, then everything shuts down gracefully (GOAWAY, then drain).

Until the control plane and the router land, this is what the system can show; later issues replace it
with replicas placed on agents and a chat completion streamed through the router.
"""

from __future__ import annotations

import argparse
import sys

import trio

import schema
from agent.transport import StreamOptions, open_stream
from control.transport import ServerStream, StreamServer

CARRIERS = (("gpu01", "http", "grpc"), ("gpu02", "http", "connect"), ("gpu03", "ws", "grpc"))


def say(who: str, text: str) -> None:
    print(f"{who:>13} | {text}", flush=True)


def h100_node(node_id: str) -> schema.Register:
    gpus = [
        schema.Gpu(
            index=i,
            uuid=f"GPU-{node_id}-{i}",
            name="NVIDIA H100 80GB HBM3",
            compute_capability="9.0",
            memory_total_mib=81559,
            nvlink_peers=[j for j in range(8) if j != i],
        )
        for i in range(8)
    ]
    return schema.Register(
        node_id=node_id,
        hostname=node_id,
        mgmt_addr="127.0.0.1",
        agent_version="demo",
        gpus=gpus,
        fabrics=[schema.FabricAttachment(fabric="ib-a", hca="mlx5_0", port=1)],
        engine_ports=schema.PortRange(first=8000, last=8099),
    )


async def control_plane(stream: ServerStream) -> None:
    """What the control plane's stream handler does, in miniature."""
    first = await stream.receive()
    if first is None or first.register is None:
        return
    reg = first.register
    say(
        "control plane",
        f"{reg.node_id} registered over {stream.protocol}: {len(reg.gpus)}x {reg.gpus[0].name}",
    )
    await stream.send(
        schema.ControlMessage(message_id=1, ack=schema.Ack(message_id=first.message_id, ok=True))
    )
    start = schema.StartShard(
        shard_id=f"llama-70b-r0-{reg.node_id}",
        replica_id="llama-70b-r0",
        profile=schema.EngineProfile(
            engine="vllm", model="meta-llama/Llama-3.1-70B-Instruct", tensor_parallel_size=8
        ),
        gpu_indices=list(range(8)),
        http_port=8000,
    )
    await stream.send(schema.ControlMessage(message_id=2, start=start))
    async for msg in stream:
        if msg.heartbeat is not None:
            say("control plane", f"{reg.node_id} heartbeat #{msg.message_id}")
        elif msg.ack is not None:
            say("control plane", f"{reg.node_id} acknowledged command {msg.ack.message_id}: ok={msg.ack.ok}")


async def agent(node_id: str, url: str, protocol: str, heartbeats: int) -> None:
    """What the agent's session does, in miniature: register, then heartbeat and answer commands."""
    async with open_stream(url, StreamOptions(protocol=protocol)) as stream:  # type: ignore[arg-type]
        await stream.send(schema.AgentMessage(message_id=1, register=h100_node(node_id)))
        reply = await stream.receive()
        assert reply is not None and reply.ack is not None
        carrier = "websocket" if url.startswith("ws") else f"HTTP/2, {protocol} protocol"
        say(node_id, f"registered over {carrier}")
        command = await stream.receive()
        assert command is not None and command.start is not None
        say(node_id, f"StartShard {command.start.shard_id} on GPUs {list(command.start.gpu_indices)}")
        await stream.send(
            schema.AgentMessage(message_id=2, ack=schema.Ack(message_id=command.message_id, ok=True))
        )
        for i in range(heartbeats):
            await stream.send(
                schema.AgentMessage(message_id=3 + i, heartbeat=schema.Heartbeat(node_id=node_id))
            )
        await stream.close_send()
        assert await stream.receive() is None
        say(node_id, "stream closed cleanly")


async def main(heartbeats: int, serve: bool) -> None:
    server = StreamServer(control_plane)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        say("control plane", f"serving AgentService/Connect on 127.0.0.1:{port} (gRPC, Connect, WebSocket)")
        with trio.fail_after(30):
            async with trio.open_nursery() as agents:
                for node_id, scheme, protocol in CARRIERS:
                    agents.start_soon(agent, node_id, f"{scheme}://127.0.0.1:{port}", protocol, heartbeats)
        if serve:
            say("control plane", f"still serving on 127.0.0.1:{port}; Ctrl-C to stop")
            await trio.sleep_forever()
        await server.shutdown(grace=2)
        nursery.cancel_scope.cancel()
    say("demo", "done: three carriers, one wire contract")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="llmgw wire demo on loopback")
    parser.add_argument("--heartbeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="keep the server running afterwards")
    args = parser.parse_args()
    try:
        trio.run(main, args.heartbeats, args.serve)
    except KeyboardInterrupt:
        sys.exit(130)
