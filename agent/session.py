"""One connection to the control plane: register, then receive / send / heartbeat / per-shard watchers.

The session's nursery is cancelled as a whole when the stream ends, so nothing it started can outlive
the connection. Engines are not in it: they belong to the supervisor, which outlives every session.

- **send** is the only writer on the stream (HTTP/2 and WebSocket streams are not safe for concurrent
  writes, and one writer keeps message order); everybody else puts messages on its channel.
- **receive** turns commands into supervisor calls. StartShard never blocks on loading: the
  supervisor spawns the engine (in a worker thread, in its own nursery, so a session cancelled
  mid-start cannot orphan it) and returns, so the stream keeps carrying heartbeats for the minutes
  a model takes to load. Shard ids are checked (``schema.ids``) before anything else.
- **heartbeat** sends per-GPU memory and utilization every ``heartbeat_interval``, and each engine's
  latest load sample (``agent.engineload``: scraped in the background, so never waited for); the
  transport's h2 PING underneath detects a dead peer within seconds.
- **a watcher per shard** forwards each supervisor state change as a ShardStatus.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

import schema
import statefile
from agent.discovery.model import GpuUsage
from agent.engineload import no_loads
from agent.engines import ProfileRefused
from agent.metrics import AgentMetrics
from agent.supervise import Shard, Supervisor
from transport import AgentStream, GoAwayReceived, RpcError, TransportError

log = logging.getLogger("llmgw.agent.session")

#: Register must be answered within this long, or the session is given up and retried.
REGISTER_TIMEOUT = 30.0


#: The credential the control plane issued this node when it joined, in the agent's state directory.
CREDENTIAL_FILE = "node-credential.json"


def read_credential(state_dir: Path, node_id: str) -> str:
    """The credential this node was issued, or "" (none yet, or one issued to another node id).

    Blocks (a file read): call it from a worker thread."""
    try:
        doc = json.loads((state_dir / CREDENTIAL_FILE).read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        log.warning(
            "%s: unreadable (%s); joining with the join token instead", state_dir / CREDENTIAL_FILE, exc
        )
        return ""
    if not isinstance(doc, dict) or doc.get("node_id") != node_id:
        return ""
    credential = doc.get("credential", "")
    return credential if isinstance(credential, str) else ""


def write_credential(state_dir: Path, node_id: str, credential: str) -> None:
    """Keep the credential issued to ``node_id`` (mode 0600 from the first byte, atomically, fsynced):
    losing it means the node can only join again after an operator's ``ctl node reset``.

    Blocks: call it from a worker thread."""
    state_dir.mkdir(parents=True, exist_ok=True)
    statefile.write_atomic(
        state_dir / CREDENTIAL_FILE, json.dumps({"node_id": node_id, "credential": credential}), mode=0o600
    )


class RegisterRefused(Exception):
    """The control plane answered Register with ok=false; its reason is the message."""


@attrs.define
class SessionResult:
    """How a session ended: whether it got as far as a registered stream, and why it stopped."""

    registered: bool = False
    reason: str = ""
    #: The control plane said goodbye (GOAWAY with NO_ERROR: it is shutting down or restarting), an
    #: expected end that is logged as information, not as a warning.
    graceful: bool = False


class Session:
    """The tasks of one connection; see the module docstring."""

    def __init__(
        self,
        stream: AgentStream,
        *,
        register: schema.Register,
        supervisor: Supervisor,
        heartbeat_interval: float,
        usage: Callable[[], Sequence[GpuUsage]],
        keep_credential: Callable[[str], Awaitable[None]] | None = None,
        metrics: AgentMetrics | None = None,
        loads: Callable[[], Sequence[schema.ShardLoad]] = no_loads,
    ) -> None:
        self.stream = stream
        #: The latest engine load samples (``agent.engineload.LoadScraper.loads``); never blocks.
        self.loads = loads
        #: Told when the session registers and each heartbeat it writes (``agent.metrics``).
        self.metrics = metrics
        #: Stores a credential the control plane issues in its answer to Register (before the
        #: session counts as registered: a credential not kept would lock the node out).
        self.keep_credential = keep_credential
        self.register = register
        self.node_id = register.node_id
        self.supervisor = supervisor
        self.heartbeat_interval = heartbeat_interval
        self.usage = usage
        self.result = SessionResult()
        self._ids = itertools.count(1)
        self._outbox_send, self._outbox = trio.open_memory_channel[schema.AgentMessage](1024)
        self._registered = trio.Event()
        self._register_id = 0
        self._watched: set[int] = set()

    def _message(self, **fields: object) -> schema.AgentMessage:
        return schema.AgentMessage(message_id=next(self._ids), **fields)  # type: ignore[arg-type]

    async def _post(self, **fields: object) -> None:
        await self._outbox_send.send(self._message(**fields))

    async def run(self) -> SessionResult:
        """Run until the stream ends; never raises for a stream that ended (the result says why)."""
        register = self._message(register=self.register)
        self._register_id = register.message_id
        # Shards already in Register are known to the control plane: watchers start from their version.
        # Keyed by the Shard object, not its id: a shard started again later in this session is a new
        # object under the same id whose versions start again at 0, and must be reported from there.
        seen = {s: s.version for s in self.supervisor.shards.values()}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._guard, self._send_loop, nursery)
            await self._outbox_send.send(register)
            nursery.start_soon(self._guard, self._receive_loop, nursery)
            with trio.move_on_after(REGISTER_TIMEOUT) as waiting:
                await self._registered.wait()
            if waiting.cancelled_caught:
                self.result.reason = f"no answer to Register within {REGISTER_TIMEOUT:g} s"
                nursery.cancel_scope.cancel()
                return self.result
            self.result.registered = True
            if self.metrics is not None:
                self.metrics.connected()
            self.supervisor.register_acknowledged(self.register.shards)
            log.info("registered with the control plane as %s", self.node_id)
            nursery.start_soon(self._guard, self._heartbeat_loop, nursery)
            nursery.start_soon(self._guard, functools.partial(self._watch_shards, seen), nursery)
        return self.result

    async def _guard(self, loop: Callable[[], Awaitable[object]], nursery: trio.Nursery) -> None:
        """Run one of the session's loops; the first to end (stream closed, refused) ends them all."""
        try:
            await loop()
            self.result.reason = self.result.reason or "the control plane ended the stream"
        except (TransportError, RpcError) as exc:
            if not self.result.reason:
                self.result.reason = f"{type(exc).__name__}: {exc}"
                self.result.graceful = isinstance(exc, GoAwayReceived) and exc.graceful
        except RegisterRefused as exc:
            self.result.reason = f"Register refused: {exc}"
        nursery.cancel_scope.cancel()

    # -- the tasks -------------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        async for message in self._outbox:
            await self.stream.send(message)
            if message.heartbeat is not None and self.metrics is not None:
                self.metrics.heartbeat_sent()

    async def _receive_loop(self) -> None:
        async for command in self.stream:
            await self._handle(command)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                gpus = await trio.to_thread.run_sync(self.usage)
            except Exception as exc:  # a failing NVML read must not end the session
                log.warning("GPU usage read failed: %s", exc)
                gpus = ()
            beat = schema.Heartbeat(
                node_id=self.node_id,
                gpus=[
                    schema.GpuUsage(
                        index=g.index,
                        memory_used_mib=g.memory_used_mib,
                        utilization_percent=g.utilization_percent,
                    )
                    for g in gpus
                ],
                loads=list(self.loads()),
            )
            await self._post(heartbeat=beat)
            await trio.sleep(self.heartbeat_interval)

    async def _watch_shards(self, seen: dict[Shard, int]) -> None:
        """Start a watcher for every shard the supervisor has, now and as new ones appear."""
        async with trio.open_nursery() as watchers:
            while True:
                changed = self.supervisor.any_change
                for shard in list(self.supervisor.shards.values()):
                    # Keyed by the Shard object: a restarted shard is a new object under the same id.
                    if id(shard) not in self._watched:
                        self._watched.add(id(shard))
                        # A shard born after Register has not been reported at all yet.
                        watchers.start_soon(self._watch_one, shard, seen.pop(shard, -1))
                await changed.wait()

    async def _watch_one(self, shard: Shard, seen_version: int) -> None:
        """Forward ``shard``'s changes until the supervisor replaces or forgets it."""
        while self.supervisor.shards.get(shard.shard_id) is shard:
            if shard.version > seen_version:
                seen_version = shard.version
                await self._post(shard=shard.status(self.node_id))
                continue
            # Any change wakes us, so a watcher whose shard was replaced notices and ends.
            await self.supervisor.any_change.wait()
        self._watched.discard(id(shard))

    # -- commands --------------------------------------------------------------------------------

    async def _ack(self, message_id: int, error: str = "") -> None:
        await self._post(ack=schema.Ack(message_id=message_id, ok=not error, error=error))

    async def _handle(self, command: schema.ControlMessage) -> None:
        mid = command.message_id
        if command.ack is not None:
            if command.ack.message_id == self._register_id:
                if not command.ack.ok:
                    raise RegisterRefused(command.ack.error or "no reason given")
                if command.ack.node_credential:
                    if self.keep_credential is None:
                        raise RegisterRefused(
                            "the control plane issued a node credential this agent cannot keep"
                        )
                    await self.keep_credential(command.ack.node_credential)
                    log.info(
                        "joined the cluster as %s; its credential is kept in the state directory",
                        self.node_id,
                    )
                self._registered.set()
            return
        if command.start is not None:
            spec = command.start
            try:
                # Returns once the engine process exists (milliseconds, in a worker thread), so
                # the STARTING status carries its pid; loading is watched in the background.
                shard = await self.supervisor.start(spec)
            except ProfileRefused as exc:
                # An invalid id is not repeated: the refusal names it, escaped.
                named = "" if exc.rule == "shard-id" else f" {spec.shard_id}"
                await self._ack(mid, f"{self.node_id}: StartShard{named} refused: {exc}")
                return
            await self._ack(mid)
            # A repeated start for a live shard changes nothing, so no watcher fires: report its state.
            await self._post(shard=shard.status(self.node_id))
        elif command.stop is not None:
            stopped = self.supervisor.stop(command.stop.shard_id, command.stop.grace_seconds)
            await self._ack(
                mid, "" if stopped else f"{self.node_id}: no shard {command.stop.shard_id!r} to stop"
            )
            if stopped is not None and not stopped.live:
                await self._post(shard=stopped.status(self.node_id))
        elif command.drain is not None:
            drained = self.supervisor.drain(command.drain.shard_id, command.drain.deadline_seconds)
            await self._ack(
                mid, "" if drained else f"{self.node_id}: no shard {command.drain.shard_id!r} to drain"
            )
        elif command.logs is not None:
            req = command.logs
            try:
                lines, offset = await self.supervisor.read_log(
                    req.shard_id,
                    min(req.lines or 100, schema.MAX_LOG_LINES),
                    previous=req.previous,
                    after=req.after,
                )
                reply = schema.LogsReply(request_id=mid, shard_id=req.shard_id, lines=lines, offset=offset)
            except KeyError as exc:
                reply = schema.LogsReply(
                    request_id=mid, shard_id=req.shard_id, error=f"{self.node_id}: {exc.args[0]}"
                )
            await self._post(logs=reply)
        else:
            await self._ack(
                mid,
                f"{self.node_id}: unknown command (message {mid}); is the agent older than the control plane?",
            )
