"""The agent stream handler and the reconciler's dispatcher: it holds the open streams.

Only this room can deliver a command to a node, because only it holds the node's stream. It binds each
stream to a node identity before anything else: with mutual TLS the Register's node_id must be a name
in the client certificate, and a Register naming another node is refused and logged; without TLS an
optional per-node token does the same job. A second stream for the same node replaces the first: the
old one is ended and nothing it sends afterwards is believed.

Without mutual TLS a node joins with the cluster's join token and is issued a credential of its own
(``control.joins``): from then on only that credential speaks for the node id, so a process that
holds the join token alone cannot take over a joined node. No authentication at all is an explicit
choice (``insecure = true`` in the config), never a default.

Everything in a Register is bounded before anything else is done with it (``register_problem``:
counts, string lengths, the node id's alphabet), since a peer that is not authenticated yet can
send anything; every peer-supplied string that reaches a log is escaped (``peer_text``).

Commands carry message ids. One that was not acknowledged before a disconnect is sent again after the
node reconnects; the agent's idempotency (a repeated StartShard for a live shard spawns nothing) makes
that safe, and losing a command silently would not be.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

import schema
from control.fleet import Fleet, Transition
from control.joins import JoinBook, same_secret
from schema.ids import NODE_ID, node_id_problem, shard_id_problem
from schema.rpc import Code, RpcError
from transport import ServerStream
from transport.h2io import peer_text

log = logging.getLogger("llmgw.control.agentsvc")

#: The first message (Register) must arrive within this long of the stream opening.
REGISTER_TIMEOUT = 30.0


#: Peer-data limits (see ``register_problem``). A real node has at most a few dozen GPUs, labels,
#: fabrics and engines; these leave room for that and keep one Register's decoded size (and so
#: the control plane's memory per node) to what a node can actually have.
MAX_GPUS = 64
MAX_LABELS = 64
MAX_FABRICS = 64
MAX_ENGINES = 32
MAX_SHARDS = 1024
#: Names, ids, addresses, versions, label keys and values.
MAX_NAME = 256
#: Errors, output lines, model paths, engine arguments and environment values.
MAX_TEXT = 16 * 1024
#: Output tail lines, engine arguments and environment entries of one shard.
MAX_LINES = 256

#: Value ranges (see ``register_problem``): each bound is far above any machine that exists, and
#: far below what would overflow a sum or mislead placement. A GPU index is below ``MAX_GPUS``, not
#: below the number of GPUs listed: discovery skips a GPU that NVML cannot read (``agent.discovery
#: .nvml``) and a static inventory may list a node's GPUs by their own indices, so gaps are real.
MAX_PORT = 65535
#: Per GPU: 16 TiB (the largest GPU today has 288 GB; 56 times that).
MAX_GPU_MEMORY_MIB = 16 << 20
#: Per node: 1 PiB of host memory (the largest single systems today have 32 TiB).
MAX_NODE_MEMORY_MIB = 1 << 30
#: CPUs per node (Linux builds for at most 8192).
MAX_CPUS = 1 << 16
#: An InfiniBand HCA port number is one byte.
MAX_HCA_PORT = 255
#: ``major.minor``, each one or two digits ("9.0", "12.1"; "0.0" or empty: unknown).
COMPUTE_CAPABILITY = re.compile(r"(?:[0-9]{1,2}\.[0-9]{1,2})?")


def _text_problem(field: str, value: str, limit: int) -> str:
    if len(value) > limit:
        return f"{field} is {len(value)} characters; at most {limit} are accepted"
    return ""


def _count_problem(field: str, count: int, limit: int) -> str:
    if count > limit:
        return f"{field} has {count} entries; at most {limit} are accepted"
    return ""


def _range_problem(field: str, value: int, low: int, high: int, unit: str = "") -> str:
    if not low <= value <= high:
        return f"{field} is {value}{unit}; expected {low}-{high}{unit}"
    return ""


def gpu_usage_problem(usage: Sequence[schema.GpuUsage], field: str) -> str:
    """Why GPU figures of a Heartbeat are out of range; empty when they are not."""
    checks = [_count_problem(field, len(usage), MAX_GPUS)]
    for i, u in enumerate(usage):
        checks += [
            _range_problem(f"{field}[{i}].index", u.index, 0, MAX_GPUS - 1),
            _range_problem(f"{field}[{i}].memory_used_mib", u.memory_used_mib, 0, MAX_GPU_MEMORY_MIB, " MiB"),
            _range_problem(f"{field}[{i}].utilization_percent", u.utilization_percent, 0, 100, "%"),
        ]
    return next((c for c in checks if c), "")


def _values_problem(reg: schema.Register) -> str:
    """Why a Register's numbers are out of range (see the bounds above); empty when they are not."""
    checks = [
        _range_problem("cpu_count", reg.cpu_count, 0, MAX_CPUS),
        _range_problem("memory_total_mib", reg.memory_total_mib, 0, MAX_NODE_MEMORY_MIB, " MiB"),
    ]
    ports = reg.engine_ports
    # Absent or all zero (proto3's default): the node states no range, the control plane's applies.
    if ports is not None and (ports.first or ports.last):
        checks += [
            _range_problem("engine_ports.first", ports.first, 1, MAX_PORT),
            _range_problem("engine_ports.last", ports.last, 1, MAX_PORT),
        ]
        if ports.first > ports.last:
            checks.append(f"engine_ports is {ports.first}-{ports.last}; the first port is above the last")
    seen: set[int] = set()
    for i, g in enumerate(reg.gpus):
        checks += [
            _range_problem(f"gpus[{i}].index", g.index, 0, MAX_GPUS - 1),
            _range_problem(f"gpus[{i}].memory_total_mib", g.memory_total_mib, 0, MAX_GPU_MEMORY_MIB, " MiB"),
            _range_problem(f"gpus[{i}].memory_used_mib", g.memory_used_mib, 0, MAX_GPU_MEMORY_MIB, " MiB"),
            _range_problem(f"gpus[{i}].utilization_percent", g.utilization_percent, 0, 100, "%"),
            *(
                _range_problem(f"gpus[{i}].nvlink_peers[{j}]", peer, 0, MAX_GPUS - 1)
                for j, peer in enumerate(g.nvlink_peers)
            ),
        ]
        if g.index in seen:
            checks.append(f"gpus[{i}].index is {g.index}, which an earlier GPU has; indices are unique")
        seen.add(g.index)
        if not COMPUTE_CAPABILITY.fullmatch(g.compute_capability):
            checks.append(
                f"gpus[{i}].compute_capability is {peer_text(g.compute_capability[:16])}; "
                "expected major.minor with at most two digits each, like 9.0"
            )
    checks += [
        _range_problem(f"fabrics[{i}].port", f.port, 0, MAX_HCA_PORT) for i, f in enumerate(reg.fabrics)
    ]
    return next((c for c in checks if c), "")


#: The longest a ShardLoad's sample may be said to be (a day; the agent marks it stale long before).
MAX_LOAD_AGE = 86_400.0


def _fraction_problem(field: str, value: float | None, high: float) -> str:
    if value is not None and not (math.isfinite(value) and 0 <= value <= high):
        return f"{field} is {value}; expected 0-{high:g}"
    return ""


def shard_load_problem(loads: Sequence[schema.ShardLoad], field: str) -> str:
    """Why a Heartbeat's engine loads are out of bounds; empty when they are not. Counts, fractions
    0..1, rates and ages must be finite and in range (the agent clamps and flags what an engine
    overstates, so anything beyond is a broken or hostile peer)."""
    checks = [_count_problem(field, len(loads), MAX_SHARDS)]
    for i, load in enumerate(loads):
        at = f"{field}[{i}]"
        problem = shard_id_problem(load.shard_id)
        if problem:
            return f"{at}.{problem}"
        checks += [
            _text_problem(f"{at}.replica_id", load.replica_id, MAX_NAME),
            _text_problem(f"{at}.error", load.error, MAX_NAME * 4),
            *(
                _range_problem(f"{at}.{name}", value, 0, schema.MAX_LOAD_REQUESTS)
                for name, value in (
                    ("requests_running", load.requests_running),
                    ("requests_waiting", load.requests_waiting),
                )
                if value is not None
            ),
            _fraction_problem(f"{at}.kv_cache_usage", load.kv_cache_usage, 1.0),
            _fraction_problem(f"{at}.prefix_cache_hit_rate", load.prefix_cache_hit_rate, 1.0),
            _fraction_problem(
                f"{at}.generation_tokens_per_second",
                load.generation_tokens_per_second,
                schema.MAX_LOAD_TOKENS_PER_SECOND,
            ),
            _fraction_problem(f"{at}.sample_age_seconds", load.sample_age_seconds, MAX_LOAD_AGE),
        ]
    return next((c for c in checks if c), "")


def shard_status_problem(st: schema.ShardStatus, field: str) -> str:
    """Why a ShardStatus (in a Register, or on its own) is out of bounds; empty when it is not."""
    problem = shard_id_problem(st.shard_id)
    if problem:
        return f"{field}.{problem}"
    checks = [
        _text_problem(f"{field}.node_id", st.node_id, MAX_NAME),
        _text_problem(f"{field}.replica_id", st.replica_id, MAX_NAME),
        _text_problem(f"{field}.error", st.error, MAX_TEXT),
        _range_problem(f"{field}.http_port", st.http_port, 0, MAX_PORT),
        _count_problem(f"{field}.output_tail", len(st.output_tail), MAX_LINES),
        *(_text_problem(f"{field}.output_tail[{i}]", t, MAX_TEXT) for i, t in enumerate(st.output_tail)),
    ]
    spec = st.spec
    if spec is not None:
        checks += [
            _text_problem(f"{field}.spec.shard_id", spec.shard_id, MAX_NAME),
            _text_problem(f"{field}.spec.replica_id", spec.replica_id, MAX_NAME),
            _text_problem(f"{field}.spec.master_addr", spec.master_addr, MAX_NAME),
            _text_problem(f"{field}.spec.api_key", spec.api_key, MAX_NAME),
            _count_problem(f"{field}.spec.gpu_indices", len(spec.gpu_indices), MAX_GPUS),
            *(
                _range_problem(f"{field}.spec.gpu_indices[{j}]", index, 0, MAX_GPUS - 1)
                for j, index in enumerate(spec.gpu_indices)
            ),
            _range_problem(f"{field}.spec.http_port", spec.http_port, 0, MAX_PORT),
            _range_problem(f"{field}.spec.master_port", spec.master_port, 0, MAX_PORT),
        ]
        profile = spec.profile
        if profile is not None:
            checks += [
                _text_problem(f"{field}.spec.profile.{name}", getattr(profile, name), MAX_TEXT)
                for name in (
                    "engine",
                    "model",
                    "served_model_name",
                    "dtype",
                    "quantization",
                    "engine_version",
                )
            ]
            checks += [
                _count_problem(f"{field}.spec.profile.extra_args", len(profile.extra_args), MAX_LINES),
                _count_problem(f"{field}.spec.profile.env", len(profile.env), MAX_LINES),
                *(_text_problem(f"{field}.spec.profile.extra_args", a, MAX_TEXT) for a in profile.extra_args),
                *(
                    _text_problem(f"{field}.spec.profile.env", k + v, MAX_TEXT)
                    for k, v in profile.env.items()
                ),
            ]
    return next((c for c in checks if c), "")


def register_problem(reg: schema.Register) -> str:
    """Why a Register is out of bounds, naming the field and the limit; empty when it is not.

    Checked before anything else is done with a Register (authentication included): whatever an
    unauthenticated peer sends must not grow the control plane beyond what a real node could.
    """
    problem = node_id_problem(reg.node_id)
    if problem:
        return problem
    counts = [
        _count_problem("gpus", len(reg.gpus), MAX_GPUS),
        _count_problem("labels", len(reg.labels), MAX_LABELS),
        _count_problem("fabrics", len(reg.fabrics), MAX_FABRICS),
        _count_problem("engines", len(reg.engines), MAX_ENGINES),
        _count_problem("shards", len(reg.shards), MAX_SHARDS),
    ]
    problem = next((c for c in counts if c), "")
    if problem:
        return problem
    checks = [
        _text_problem(name, getattr(reg, name), MAX_NAME)
        for name in (
            "hostname", "mgmt_addr", "agent_version", "mgmt_interface", "driver_version",
            "cuda_version", "token", "node_credential",
        )
    ]  # fmt: skip
    checks.append(_text_problem("discovery_error", reg.discovery_error, MAX_TEXT))
    for key, value in reg.labels.items():
        checks += [
            _text_problem("a label key", key, MAX_NAME),
            _text_problem(f"label {key[:64]!r}", value, MAX_NAME),
        ]
    for i, g in enumerate(reg.gpus):
        checks += [
            _text_problem(f"gpus[{i}].{name}", getattr(g, name), MAX_NAME)
            for name in ("uuid", "name", "compute_capability", "pci_bus_id")
        ]
        checks.append(_count_problem(f"gpus[{i}].nvlink_peers", len(g.nvlink_peers), MAX_GPUS))
    for i, f in enumerate(reg.fabrics):
        checks += [
            _text_problem(f"fabrics[{i}].fabric", f.fabric, MAX_NAME),
            _text_problem(f"fabrics[{i}].hca", f.hca, MAX_NAME),
        ]
    for i, e in enumerate(reg.engines):
        checks += [
            _text_problem(f"engines[{i}].engine", e.engine, MAX_NAME),
            _text_problem(f"engines[{i}].version", e.version, MAX_NAME),
            _text_problem(f"engines[{i}].error", e.error, MAX_TEXT),
        ]
    problem = next((c for c in checks if c), "") or _values_problem(reg)
    if problem:
        return problem
    return next(
        (p for p in (shard_status_problem(s, f"shards[{i}]") for i, s in enumerate(reg.shards)) if p), ""
    )


def _name_text(name: str) -> str:
    """A certificate name for a message: as it is when it is a plain node id, else escaped."""
    return name if NODE_ID.fullmatch(name) else peer_text(name)


@attrs.frozen
class Admission:
    """Whether a Register may speak for its node id, and how it proved it (``ctl nodes`` shows it)."""

    refusal: str = ""
    #: "mtls", "node token", "credential", "join token" or "insecure".
    method: str = ""
    #: A credential issued by this admission (first join), for the Ack.
    issued: str = ""


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
        joins: JoinBook | None = None,
        insecure: bool = False,
        clock: Callable[[], float] = trio.current_time,
        on_change: Callable[[], None] = lambda: None,
        on_transitions: Callable[[list[Transition]], None] = lambda _: None,
    ) -> None:
        self.fleet = fleet
        self.tokens = dict(tokens or {})
        #: The join token and node credentials; None: no join token (mTLS or [tokens] only).
        self.joins = joins
        #: Accept a node with no authentication at all (``insecure = true``; explicit and loud).
        self.insecure = insecure
        #: How each node's current stream was admitted (``Admission.method``).
        self.admitted_by: dict[str, str] = {}
        self.clock = clock
        self.on_change = on_change
        self.on_transitions = on_transitions
        self.streams: dict[str, NodeStream] = {}
        #: Unacknowledged commands per node, re-sent after a reconnect (message_id -> message).
        self.pending: dict[str, dict[int, schema.ControlMessage]] = {}
        self._ids = itertools.count(1)
        self._log_waiters: dict[int, trio.MemorySendChannel[schema.LogsReply]] = {}

    # -- identity --------------------------------------------------------------------------------

    async def admit(self, stream: ServerStream, reg: schema.Register) -> Admission:
        """Whether this stream may speak for ``reg.node_id``, and how it proved it.

        In order: a verified client certificate must name the node (and needs nothing else); a node
        with a per-node token in ``[tokens]`` must present it; a node that joined before must present
        its credential (the join token alone is refused: that is the takeover this prevents); a node
        new to this control plane may join with the join token and is issued a credential. Only with
        ``insecure`` is a node with none of these accepted.
        """
        node_id = reg.node_id
        peer = stream.peer
        if peer.verified:
            if node_id not in peer.names():
                return Admission(
                    f"Register names node {node_id!r} but the client certificate is for "
                    f"{', '.join(map(_name_text, peer.names())) or 'no name'}"
                )
            return Admission(method="mtls")
        expected = self.tokens.get(node_id)
        if expected is not None:
            if not same_secret(reg.token, expected):
                return Admission(f"wrong token for node {node_id!r}")
            return Admission(method="node token")
        joins = self.joins
        if joins is None:
            if self.insecure:
                return Admission(method="insecure")
            if self.tokens:
                return Admission(f"no token is configured for node {node_id!r}")
            return Admission(
                f"node {node_id!r} presents no client certificate, and this control plane has no join "
                "token or [tokens] to check it against"
            )
        async with joins.lock:
            if joins.bound(node_id):
                if joins.is_credential_of(node_id, reg.node_credential):
                    joins.confirm(node_id)  # presenting it shows it was kept
                    return Admission(method="credential")
                if joins.may_join_again(node_id) and joins.is_join_token(reg.token):
                    # Issued a moment ago and never shown to be kept (the Ack may have been lost).
                    return Admission(method="join token", issued=await joins.issue(node_id))
                if self.insecure:
                    return Admission(method="insecure")
                return Admission(
                    f"node {node_id!r} has already joined with a credential of its own, and this "
                    f"Register {'presents another' if reg.node_credential else 'does not present it'}; "
                    "the join token alone cannot take over a joined node. If the node was reinstalled "
                    f"on purpose, forget its credential with `ctl node reset {node_id}` and start its "
                    "agent with the join token"
                )
            if joins.is_join_token(reg.token):
                return Admission(method="join token", issued=await joins.issue(node_id))
            if self.insecure:
                return Admission(method="insecure")
            if reg.node_credential:
                return Admission(
                    f"node {node_id!r} presents a node credential this control plane does not know "
                    "(its binding was reset, or the control plane's state directory is new); start "
                    "the agent with the join token (`ctl token` prints it)"
                )
            if reg.token:
                return Admission(
                    f"wrong join token from node {node_id!r}; `ctl token` on the control plane prints it"
                )
            return Admission(
                f"node {node_id!r} presents no join token; start its agent with --token (or "
                "LLMGW_AGENT_TOKEN) set to what `ctl token` prints on the control plane"
            )

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
        first_id = first.message_id
        reg = first.register
        invalid = register_problem(reg)
        if invalid:
            named = f"node {reg.node_id!r}" if not node_id_problem(reg.node_id) else "a node"
            problem = f"Register from {named} refused: {invalid}"
            log.warning("refused a stream from %s: %s", stream.peer.address, problem)
            del first, reg  # a large refused Register is not kept while the refusal is sent
            await stream.send(self._message(ack=schema.Ack(message_id=first_id, ok=False, error=problem)))
            raise RpcError(Code.INVALID_ARGUMENT, problem)

        admission = await self.admit(stream, reg)
        if admission.refusal:
            refusal = admission.refusal
            log.warning("refused a stream from %s: %s", stream.peer.address, refusal)
            await stream.send(self._message(ack=schema.Ack(message_id=first_id, ok=False, error=refusal)))
            raise RpcError(Code.PERMISSION_DENIED, refusal)
        if admission.issued:
            log.info("%s joined with the join token and was issued a credential of its own", reg.node_id)
        # Secrets are not kept with the node's record (nor written into control-state.json).
        reg.token = ""
        reg.node_credential = ""

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
                self.admitted_by[node_id] = admission.method
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
                ack = schema.Ack(message_id=first_id, ok=True, node_credential=admission.issued)
                await stream.send(self._message(ack=ack))
                for message in sorted(self.pending.get(node_id, {}).values(), key=lambda m: m.message_id):
                    try:
                        send.send_nowait(message)  # unacknowledged before the disconnect: send again
                    except trio.WouldBlock:
                        break  # the rest stay pending for the next connection
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_loop, stream, receive)
                    await self._receive_loop(current, admission.issued)
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

    async def _receive_loop(self, current: NodeStream, issued: str = "") -> None:
        node_id = current.node_id
        async for msg in current.stream:
            if self.streams.get(node_id) is not current:
                return  # replaced: nothing this stream sends is believed any more
            if issued and self.joins is not None:
                # The agent sends nothing after the Register's Ack until it has kept its credential.
                self.joins.confirm(node_id)
                issued = ""
            now = self.clock()
            if msg.heartbeat is not None:
                problem = gpu_usage_problem(msg.heartbeat.gpus, "Heartbeat.gpus")
                if problem:
                    raise RpcError(Code.INVALID_ARGUMENT, f"{node_id}: {problem}")
                problem = shard_load_problem(msg.heartbeat.loads, "Heartbeat.loads")
                if problem:
                    # The heartbeat still proves the node alive; only its load figures are refused.
                    log.warning("%s: ignored a heartbeat's engine loads: %s", node_id, problem)
                    msg.heartbeat.loads = []
                self.on_transitions(self.fleet.heartbeat(node_id, msg.heartbeat, now))
            elif msg.shard is not None:
                problem = shard_status_problem(msg.shard, "ShardStatus")
                if problem:
                    log.warning("%s: ignored a ShardStatus: %s", node_id, problem)
                    continue
                self.fleet.shard_status(node_id, msg.shard)
                self.on_change()
            elif msg.ack is not None:
                pending = self.pending.get(node_id, {})
                command = pending.pop(msg.ack.message_id, None)
                if not msg.ack.ok:
                    log.warning(
                        "%s refused command %d: %s",
                        node_id,
                        msg.ack.message_id,
                        peer_text(msg.ack.error, 1024),
                    )
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
        self,
        node_id: str,
        shard_id: str,
        lines: int,
        timeout: float = 10.0,
        *,
        previous: bool = False,
        after: int | None = None,
    ) -> schema.LogsReply:
        """Ask the agent for the tail of a shard's log (or its run before the last restart, or the
        lines after a follower's offset); raises ``LookupError`` when it cannot answer."""
        current = self.streams.get(node_id)
        if current is None:
            raise LookupError(f"{node_id} is not connected")
        request = schema.LogsRequest(shard_id=shard_id, lines=lines, previous=previous, after=after)
        message = self._message(logs=request)
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
