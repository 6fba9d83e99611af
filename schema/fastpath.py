"""A fast decoder for the one message a control plane receives thousands of times a second: Heartbeat.

betterproto2 parses generically (reflection over dataclass fields, a BytesIO per nested message),
which is slow enough at fleet scale to matter (docs/router.md, 2026-12-04, has the figure).
``decode_agent_message`` reads the heartbeat's few fields directly (its GPU figures and engine
loads) and hands every other message (and any heartbeat carrying fields it does not know)
to betterproto2, so correctness never depends on this file: a test checks it agrees with betterproto2
on generated messages, and anything unexpected takes the generic path.
"""

from __future__ import annotations

import struct

import schema

_HEARTBEAT_FIELD = 11
_DOUBLE = struct.Struct("<d")


class _Unexpected(Exception):
    """Anything the fast path does not handle: fall back to the generic parser."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Unexpected
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _gpu_usage(buf: bytes) -> schema.GpuUsage:
    index = memory = util = 0
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        if key & 7 != 0:
            raise _Unexpected
        value, pos = _varint(buf, pos)
        field = key >> 3
        if field == 1:
            index = value
        elif field == 2:
            memory = value
        elif field == 3:
            util = value
        else:
            raise _Unexpected
    return schema.GpuUsage(index=index, memory_used_mib=memory, utilization_percent=util)


#: ShardLoad's fields by wire type: strings, optional uint32 counts, doubles, and the stale flag.
_LOAD_TEXT = {1: "shard_id", 2: "replica_id", 10: "error"}
_LOAD_COUNTS = {3: "requests_running", 4: "requests_waiting"}
_LOAD_DOUBLES = {
    5: "kv_cache_usage",
    6: "prefix_cache_hit_rate",
    7: "generation_tokens_per_second",
    8: "sample_age_seconds",
}
_STALE_FIELD = 9


def _shard_load(buf: bytes) -> schema.ShardLoad:
    load = schema.ShardLoad()
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2 and field in _LOAD_TEXT:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise _Unexpected
            setattr(load, _LOAD_TEXT[field], buf[pos : pos + length].decode("utf-8"))
            pos += length
        elif wire == 0 and (field in _LOAD_COUNTS or field == _STALE_FIELD):
            value, pos = _varint(buf, pos)
            if field == _STALE_FIELD:
                if value > 1:
                    raise _Unexpected
                load.stale = bool(value)
            else:
                if value >= 1 << 32:
                    raise _Unexpected
                setattr(load, _LOAD_COUNTS[field], value)
        elif wire == 1 and field in _LOAD_DOUBLES:
            if pos + 8 > len(buf):
                raise _Unexpected
            setattr(load, _LOAD_DOUBLES[field], _DOUBLE.unpack_from(buf, pos)[0])
            pos += 8
        else:
            raise _Unexpected
    return load


def _heartbeat(buf: bytes) -> schema.Heartbeat:
    node_id = ""
    gpus: list[schema.GpuUsage] = []
    loads: list[schema.ShardLoad] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        if key & 7 != 2:
            raise _Unexpected
        length, pos = _varint(buf, pos)
        end = pos + length
        if end > len(buf):
            raise _Unexpected
        field = key >> 3
        if field == 1:
            node_id = buf[pos:end].decode("utf-8")
        elif field == 2:
            gpus.append(_gpu_usage(buf[pos:end]))
        elif field == 3:
            loads.append(_shard_load(buf[pos:end]))
        else:
            raise _Unexpected
        pos = end
    return schema.Heartbeat(node_id=node_id, gpus=gpus, loads=loads)


def decode_agent_message(payload: bytes) -> schema.AgentMessage:
    """Parse an AgentMessage; heartbeats take the fast path, everything else betterproto2's."""
    try:
        message_id = 0
        heartbeat = None
        pos = 0
        while pos < len(payload):
            key, pos = _varint(payload, pos)
            field, wire = key >> 3, key & 7
            if field == 1 and wire == 0:
                message_id, pos = _varint(payload, pos)
            elif field == _HEARTBEAT_FIELD and wire == 2 and heartbeat is None:
                length, pos = _varint(payload, pos)
                if pos + length > len(payload):
                    raise _Unexpected
                heartbeat = _heartbeat(payload[pos : pos + length])
                pos += length
            else:
                raise _Unexpected
        if heartbeat is not None:
            return schema.AgentMessage(message_id=message_id, heartbeat=heartbeat)
    except (_Unexpected, UnicodeDecodeError):
        pass
    return schema.AgentMessage.parse(payload)
