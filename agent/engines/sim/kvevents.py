"""KV events as vLLM publishes them with ``--kv-events-config``: the bytes, and the ZMQ sockets.

The wire (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): a PUB socket sends one
multipart message per engine step that changed the cache, ``[topic, seq, payload]`` (``seq`` an
8-byte big-endian counter from 0, ``payload`` msgpack of a ``KVEventBatch``); a ROUTER socket on
``replay_endpoint`` answers a request ``[identity, b"", start_seq (8 bytes)]`` with every buffered
``[identity, b"", topic, seq, payload]`` whose seq >= start_seq (the last ``buffer_steps`` batches),
then ``[identity, b"", b"", seq -1, b""]`` as the end marker. The endpoint is bound when it has a
``*`` or ``::`` or is ipc/inproc, else connected to, as vLLM decides.

The payload, encoded by msgspec in vLLM and by msgpack here, imitating the version parsed
(``SimConfig.vllm_version``): the batch is always a positional array ``[ts, events,
data_parallel_rank]``. Each event is tagged with its class name; vLLM up to 0.18 declares the
events ``array_like`` (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys]``), later versions encode them as maps with the tag under
``"type"`` (and add ``group_idx``). Fields at their default are omitted (``omit_defaults``), as
msgspec omits them. tests/fixtures/vllm_kv_events/ holds vLLM's own class definitions, taken from
the pinned wheels by ``python -m enginebuild.kvevents``, and a test decodes a real simulator's
bytes with them.

Nothing here blocks the trio thread: sends are non-blocking (a PUB socket at its high-water
mark drops, as vLLM's does), and the replay socket is read when trio reports its descriptor
readable.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack
import trio
import zmq

from agent.engines.sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

#: vLLM's ``MEDIUM_GPU``.
MEDIUM_GPU = "GPU"
#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def array_like(vllm_version: str) -> bool:
    """Whether the imitated vLLM encodes events as positional arrays (0.18 and older) rather
    than tagged maps (newer)."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in vllm_version.split(".")[:2]]
    return tuple(parts) <= (0, 18)


def _event(event: KVEvent, arrays: bool) -> Any:
    if isinstance(event, BlockStored):
        extra: list[None] = [None] * len(event.block_hashes)
        fields: list[tuple[str, Any]] = [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", None),
            ("medium", MEDIUM_GPU),
            ("lora_name", None),
            ("extra_keys", extra),
        ]
        if not arrays:
            fields.append(("group_idx", 0))
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", MEDIUM_GPU)]
        if not arrays:
            fields.append(("group_idx", 0))
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields = []
        tag = "AllBlocksCleared"
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"not a KV event: {event!r}")
    if arrays:
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _array_header(n: int) -> bytes:
    """msgpack's shortest array header, as msgspec writes it for a list."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(ts: float, events: Sequence[KVEvent], vllm_version: str, dp_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload as the imitated vLLM version's msgspec encoder writes it, byte
    for byte (tests/test_sim_load.py compares with vLLM's own classes): msgspec sizes a struct's
    map header by the fields the struct declares, not by those it writes, so a struct with 16 or
    more possible keys (0.33's ``BlockStored``: 15 fields and the tag) gets a map16 header even
    when ``omit_defaults`` leaves fewer keys."""
    arrays = array_like(vllm_version)
    out = [_array_header(3), _pack(ts), _array_header(len(events))]
    for event in events:
        body = _event(event, arrays)
        if isinstance(body, dict) and body["type"] == "BlockStored":
            out.append(b"\xde" + len(body).to_bytes(2, "big"))
            out += [_pack(k) + _pack(v) for k, v in body.items()]
        else:
            out.append(_pack(body))
    out.append(_pack(dp_rank))
    return b"".join(out)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """vLLM's ``ZmqEventPublisher``, with the replay socket served from trio."""

    def __init__(
        self,
        settings: dict[str, Any],
        vllm_version: str,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.version = vllm_version
        self.topic = str(settings["topic"]).encode()
        self._clock = clock
        self._log = log
        self._seq = 0
        buffer_steps = int(settings["buffer_steps"])
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.set_hwm(int(settings["hwm"]))
        self.pub.setsockopt(zmq.LINGER, 0)
        endpoint = str(settings["endpoint"])
        self.replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint = ""
        try:
            if _binds(endpoint):
                self.pub.bind(endpoint)
                endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.pub.connect(endpoint)
            if settings["replay_endpoint"]:
                self.replay = self._ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(str(settings["replay_endpoint"]))
                self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            where = f"{settings['endpoint']} / replay {settings['replay_endpoint']}"
            raise OSError(f"--kv-events-config: cannot open {where}: {exc}") from None
        self.endpoint = endpoint
        self.dropped = 0

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send one step's events as the next batch (non-blocking; a full queue drops it)."""
        payload = encode_batch(self._clock(), events, self.version)
        seq = self._seq
        self._seq += 1
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        self._buffer.append((seq, payload))

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        sock = self.replay
        if sock is None:
            return
        fd = cast(int, sock.getsockopt(zmq.FD))
        while True:
            # The descriptor is edge-triggered: drain every pending request before waiting again.
            while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                self._answer(sock, frames)
            await trio.lowlevel.wait_readable(fd)

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._log(f"kv events: invalid replay request of {len(frames)} frame(s), ignored")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        try:
            for seq, payload in self._buffer:
                if seq >= first:
                    sock.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                    )
            sock.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._log("kv events: a replay client is not reading; its replay was cut short")

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self._ctx.destroy(linger=0)
