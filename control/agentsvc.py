"""The agent stream handler and the reconciler's dispatcher: it holds the open streams.

Only this room can deliver a command to a node, because only it holds the node's stream. It binds each
stream to a node identity before anything else: with mutual TLS the Register's node_id must be a name
in the client certificate, and a Register naming another node is refused and logged; without TLS an
optional per-node token does the same job. A second stream for the same node replaces the first: the
old one is ended and nothing it sends afterwards is believed.

Commands carry message ids. One that was not acknowledged before a disconnect is sent again after the
node reconnects; the agent's idempotency (a repeated StartShard for a live shard spawns nothing) makes
that safe, and losing a command silently would not be.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping

import attrs
import trio

import schema
from control.fleet import Fleet, Transition
from control.transport import ServerStream
from schema.ids import shard_id_problem
from schema.rpc import Code, RpcError

log = logging.getLogger("llmgw.control.agentsvc")

#: The first message (Register) must arrive within this long of the stream opening.
REGISTER_TIMEOUT = 30.0


@attrs.define(eq=False)
class NodeStream:
    """The current stream of one node, and the commands waiting on it."""

    node_id: str
    stream: ServerStream
    scope: trio.CancelScope
    outbox: trio.MemorySendChannel[schema.ControlMessage]
    replaced: bool = False


class AgentService:
    """See the module docstring. ``on_change`` is called after anything the reconciler cares about."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        tokens: Mapping[str, str] | None = None,
        clock: Callable[[], float] = trio.current_time,
        on_change: Callable[[], None] = lambda: None,
        on_transitions: Callable[[list[Transition]], None] = lambda _: None,
    ) -> None:
        self.fleet = fleet
        self.tokens = dict(tokens or {})
        self.clock = clock
        self.on_change = on_change
        self.on_transitions = on_transitions
        self.streams: dict[str, NodeStream] = {}
        #: Unacknowledged commands per node, re-sent after a reconnect (message_id -> message).
        self.pending: dict[str, dict[int, schema.ControlMessage]] = {}
        self._ids = itertools.count(1)
        self._log_waiters: dict[int, trio.MemorySendChannel[schema.LogsReply]] = {}

    # -- identity --------------------------------------------------------------------------------

    def _refusal(self, stream: ServerStream, reg: schema.Register) -> str:
        """Why this stream may not speak for ``reg.node_id``; empty when it may."""
        peer = stream.peer
        if peer.verified:
            if reg.node_id not in peer.names():
                return (
                    f"Register names node {reg.node_id!r} but the client certificate is for "
                    f"{', '.join(peer.names()) or 'no name'}"
                )
            return ""
        if self.tokens:
            expected = self.tokens.get(reg.node_id)
            if expected is None:
                return f"no token is configured for node {reg.node_id!r}"
            if reg.token != expected:
                return f"wrong token for node {reg.node_id!r}"
        return ""

    # -- the stream handler ----------------------------------------------------------------------

    async def handle(self, stream: ServerStream) -> None:
        with trio.move_on_after(REGISTER_TIMEOUT) as waited:
            first = await stream.receive()
        if waited.cancelled_caught:
            raise RpcError(
                Code.DEADLINE_EXCEEDED, f"no Register within {REGISTER_TIMEOUT:g} s of opening the stream"
            )
        if first is None:
            return
        if first.register is None:
            raise RpcError(Code.FAILED_PRECONDITION, "the first message on a stream must be Register")
        reg = first.register
        refusal = self._refusal(stream, reg)
        if refusal:
            log.warning("refused a stream from %s: %s", stream.peer.address, refusal)
            await stream.send(
                self._message(ack=schema.Ack(message_id=first.message_id, ok=False, error=refusal))
            )
            raise RpcError(Code.PERMISSION_DENIED, refusal)

        invalid = next((p for p in (shard_id_problem(s.shard_id) for s in reg.shards) if p), "")
        if invalid:
            problem = f"Register from node {reg.node_id!r} lists a shard whose {invalid}"
            log.warning("refused a stream from %s: %s", stream.peer.address, problem)
            await stream.send(
                self._message(ack=schema.Ack(message_id=first.message_id, ok=False, error=problem))
            )
            raise RpcError(Code.INVALID_ARGUMENT, problem)

        node_id = reg.node_id
        previous = self.streams.get(node_id)
        if previous is not None:
            log.info("%s: a new stream from %s replaces the previous one", node_id, stream.peer.address)
            previous.replaced = True
            previous.scope.cancel()
        send, receive = trio.open_memory_channel[schema.ControlMessage](1024)
        current = NodeStream(node_id, stream, trio.CancelScope(), send)
        # Everything from here is undone by the `finally`, the registration itself included: a
        # stream cancelled while its Ack is sent (the peer went away, or a newer stream replaced it)
        # must not stay in `streams` as a ghost that commands are queued to and the node looks ready by.
        try:
            with current.scope:
                self.streams[node_id] = current
                self.on_transitions(self.fleet.registered(reg, self.clock()))
                log.info(
                    "%s registered from %s over %s: %d GPU(s), %d shard(s) running",
                    node_id,
                    stream.peer.address,
                    stream.protocol,
                    len(reg.gpus),
                    len(reg.shards),
                )
                self.on_change()
                await stream.send(self._message(ack=schema.Ack(message_id=first.message_id, ok=True)))
                for message in sorted(self.pending.get(node_id, {}).values(), key=lambda m: m.message_id):
                    try:
                        send.send_nowait(message)  # unacknowledged before the disconnect: send again
                    except trio.WouldBlock:
                        break  # the rest stay pending for the next connection
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_loop, stream, receive)
                    await self._receive_loop(current)
                    nursery.cancel_scope.cancel()
        finally:
            if self.streams.get(node_id) is current:
                del self.streams[node_id]
                self.on_transitions(
                    self.fleet.disconnected(node_id, self.clock(), "the agent's stream ended")
                )
                self.on_change()
        if current.replaced:
            raise RpcError(Code.UNAVAILABLE, "replaced by a newer stream from the same node")

    async def _send_loop(
        self, stream: ServerStream, outbox: trio.MemoryReceiveChannel[schema.ControlMessage]
    ) -> None:
        async for message in outbox:
            await stream.send(message)

    async def _receive_loop(self, current: NodeStream) -> None:
        node_id = current.node_id
        async for msg in current.stream:
            if self.streams.get(node_id) is not current:
                return  # replaced: nothing this stream sends is believed any more
            now = self.clock()
            if msg.heartbeat is not None:
                self.on_transitions(self.fleet.heartbeat(node_id, msg.heartbeat, now))
            elif msg.shard is not None:
                problem = shard_id_problem(msg.shard.shard_id)
                if problem:
                    log.warning("%s: ignored a ShardStatus: %s", node_id, problem)
                    continue
                self.fleet.shard_status(node_id, msg.shard)
                self.on_change()
            elif msg.ack is not None:
                pending = self.pending.get(node_id, {})
                command = pending.pop(msg.ack.message_id, None)
                if not msg.ack.ok:
                    log.warning("%s refused command %d: %s", node_id, msg.ack.message_id, msg.ack.error)
                if command is not None and command.start is not None and not msg.ack.ok:
                    self.on_change()
            elif msg.logs is not None:
                waiter = self._log_waiters.pop(msg.logs.request_id, None)
                if waiter is not None:
                    waiter.send_nowait(msg.logs)
            elif msg.register is not None:
                raise RpcError(Code.FAILED_PRECONDITION, "Register may only be the first message of a stream")

    # -- the dispatcher --------------------------------------------------------------------------

    def _message(self, **fields: object) -> schema.ControlMessage:
        return schema.ControlMessage(message_id=next(self._ids), **fields)  # type: ignore[arg-type]

    def send(self, node_id: str, **fields: object) -> int:
        """Queue a command for ``node_id``; it is delivered now if connected, else on reconnect."""
        message = self._message(**fields)
        self.pending.setdefault(node_id, {})[message.message_id] = message
        current = self.streams.get(node_id)
        if current is not None:
            try:
                current.outbox.send_nowait(message)
            except trio.WouldBlock:
                log.warning(
                    "%s: command queue full; command %d waits for the next connection",
                    node_id,
                    message.message_id,
                )
        return message.message_id

    def connected(self, node_id: str) -> bool:
        return node_id in self.streams

    async def request_logs(
        self, node_id: str, shard_id: str, lines: int, timeout: float = 10.0
    ) -> schema.LogsReply:
        """Ask the agent for the tail of a shard's log; raises ``LookupError`` when it cannot answer."""
        current = self.streams.get(node_id)
        if current is None:
            raise LookupError(f"{node_id} is not connected")
        message = self._message(logs=schema.LogsRequest(shard_id=shard_id, lines=lines))
        send, receive = trio.open_memory_channel[schema.LogsReply](1)
        self._log_waiters[message.message_id] = send
        try:
            current.outbox.send_nowait(message)
            with trio.fail_after(timeout):
                return await receive.receive()
        except trio.TooSlowError:
            raise LookupError(f"{node_id} did not answer a logs request within {timeout:g} s") from None
        finally:
            self._log_waiters.pop(message.message_id, None)
