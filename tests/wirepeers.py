"""Shared pieces of the wire tests: an echo handler for our server, and grpcio peers.

The handler's behaviour is chosen by what the agent sends, so one server serves every scenario:
- Heartbeat(node_id="echo"): answered with an Ack naming the message id;
- Register(node_id="refuse", hostname=TEXT): the stream ends with PERMISSION_DENIED and TEXT;
- Register(node_id="big", cpu_count=N): answered with an Ack whose error is N bytes long;
- Register(node_id="push", cpu_count=N): N Acks are sent at once, while the client keeps sending;
- Register(node_id="end"): the server ends the stream with OK at once (client may keep sending).
"""

from __future__ import annotations

import trio

import schema
from schema.rpc import Code, RpcError
from transport import ServerStream


def ack(message_id: int, error: str = "") -> schema.ControlMessage:
    return schema.ControlMessage(
        message_id=message_id, ack=schema.Ack(message_id=message_id, ok=not error, error=error)
    )


async def echo_handler(stream: ServerStream) -> None:
    async for msg in stream:
        if msg.register is not None:
            reg = msg.register
            if reg.node_id == "refuse":
                raise RpcError(Code.PERMISSION_DENIED, reg.hostname)
            if reg.node_id == "big":
                await stream.send(ack(msg.message_id, "x" * reg.cpu_count))
            elif reg.node_id == "push":
                for i in range(reg.cpu_count):
                    await stream.send(ack(i))
            elif reg.node_id == "end":
                return
            elif reg.node_id == "whoami":
                await stream.send(ack(msg.message_id, ",".join(stream.peer.names()) or "-"))
            else:
                await stream.send(ack(msg.message_id))
        else:
            await stream.send(ack(msg.message_id))
        await trio.lowlevel.checkpoint()


def heartbeat(i: int) -> schema.AgentMessage:
    return schema.AgentMessage(message_id=i, heartbeat=schema.Heartbeat(node_id="echo"))


def register(
    node_id: str, *, hostname: str = "", cpu_count: int = 0, message_id: int = 1
) -> schema.AgentMessage:
    return schema.AgentMessage(
        message_id=message_id,
        register=schema.Register(node_id=node_id, hostname=hostname, cpu_count=cpu_count),
    )


async def nursery_handler(stream: ServerStream) -> None:
    """Shaped like the control plane's agent service: Register is acked, then a sender task and a
    receiver loop share a nursery, so a lost connection surfaces as an ExceptionGroup holding the
    receiver's TransportError and the sender's Cancelled."""
    first = await stream.receive()
    if first is None:
        return
    await stream.send(ack(first.message_id))
    send, receive = trio.open_memory_channel[schema.ControlMessage](16)

    async def sender() -> None:
        async for message in receive:
            await stream.send(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        async for msg in stream:
            await send.send(ack(msg.message_id))
        nursery.cancel_scope.cancel()
