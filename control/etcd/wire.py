"""etcd's JSON gateway, sans-IO: requests as the gateway reads them, its answers as ``values``.

The gateway (grpc-gateway over etcd's v3 protos) wants bytes fields in base64 and int64 fields as
decimal strings, and leaves out every field that holds its zero value (``false``, ``0``, an empty list,
the first enum member: ``PUT``, ``EQUAL``, ``VERSION``). Decoding therefore takes a missing field as its
zero and refuses a present one of the wrong type (``EtcdProtocolError``, naming the field), so that a
proxy or another server on the port is told apart from an empty answer.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from control.etcd.errors import EtcdProtocolError
from control.etcd.values import (
    Compare,
    Delete,
    DeleteResult,
    Event,
    KeyValue,
    Lease,
    Operation,
    Put,
    PutResult,
    Range,
    RangeResult,
    ResponseHeader,
    Result,
    Status,
    Txn,
    TxnResult,
    WatchBatch,
)

_OPS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_TARGETS = {
    "value": ("VALUE", "value"),
    "version": ("VERSION", "version"),
    "create_revision": ("CREATE", "create_revision"),
    "mod_revision": ("MOD", "mod_revision"),
    "lease": ("LEASE", "lease"),
}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# -- encoding --------------------------------------------------------------------------------------------


def encode_range(r: Range) -> dict[str, Any]:
    doc: dict[str, Any] = {"key": b64(r.key)}
    if r.range_end:
        doc["range_end"] = b64(r.range_end)
    if r.revision:
        doc["revision"] = str(r.revision)
    if r.limit:
        doc["limit"] = str(r.limit)
    if r.keys_only:
        doc["keys_only"] = True
    if r.count_only:
        doc["count_only"] = True
    return doc


def encode_put(p: Put) -> dict[str, Any]:
    doc: dict[str, Any] = {"key": b64(p.key), "value": b64(p.value)}
    if p.lease:
        doc["lease"] = str(p.lease)
    if p.prev_kv:
        doc["prev_kv"] = True
    return doc


def encode_delete(d: Delete) -> dict[str, Any]:
    doc: dict[str, Any] = {"key": b64(d.key)}
    if d.range_end:
        doc["range_end"] = b64(d.range_end)
    if d.prev_kv:
        doc["prev_kv"] = True
    return doc


def encode_compare(c: Compare) -> dict[str, Any]:
    target, field = _TARGETS[c.target]
    operand: str
    if c.target == "value":
        if not isinstance(c.operand, bytes):
            raise TypeError(f"compare on the value of {c.key!r} needs bytes, got {c.operand!r}")
        operand = b64(c.operand)
    else:
        if not isinstance(c.operand, int) or isinstance(c.operand, bool):
            raise TypeError(f"compare on the {c.target} of {c.key!r} needs an int, got {c.operand!r}")
        operand = str(c.operand)
    return {"key": b64(c.key), "result": _OPS[c.op], "target": target, field: operand}


def encode_txn(t: Txn) -> dict[str, Any]:
    return {
        "compare": [encode_compare(c) for c in t.compare],
        "success": [encode_request_op(op) for op in t.success],
        "failure": [encode_request_op(op) for op in t.failure],
    }


def encode_request_op(op: Operation) -> dict[str, Any]:
    """One operation of a txn branch (``RequestOp``: exactly one of its four fields)."""
    if isinstance(op, Range):
        return {"request_range": encode_range(op)}
    if isinstance(op, Put):
        return {"request_put": encode_put(op)}
    if isinstance(op, Delete):
        return {"request_delete_range": encode_delete(op)}
    return {"request_txn": encode_txn(op)}


def encode_watch(
    key: bytes, range_end: bytes, start_revision: int, *, prev_kv: bool = False
) -> dict[str, Any]:
    create: dict[str, Any] = {"key": b64(key), "progress_notify": True}
    if range_end:
        create["range_end"] = b64(range_end)
    if start_revision:
        create["start_revision"] = str(start_revision)
    if prev_kv:
        create["prev_kv"] = True
    return {"create_request": create}


# -- decoding --------------------------------------------------------------------------------------------


def decode_document(raw: bytes, sender: str, what: str = "something") -> dict[str, Any]:
    """One JSON object from the gateway (an answer, or a line of a watch's stream), or
    ``EtcdProtocolError`` naming ``sender`` ("etcd put: http://etcd1:2379") and what it sent
    instead, so that another server on the port is told apart from etcd."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise EtcdProtocolError(f"{sender} sent {what} that is not JSON: {raw[:200]!r}") from None
    if not isinstance(doc, dict):
        raise EtcdProtocolError(f"{sender} sent JSON that is not an object: {raw[:200]!r}")
    return doc


def _int(doc: Mapping[str, Any], field: str, where: str) -> int:
    raw = doc.get(field, 0)
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise EtcdProtocolError(f"{where}: {field} is not an integer: {raw!r}")
    try:
        return int(raw)
    except ValueError:
        raise EtcdProtocolError(f"{where}: {field} is not an integer: {raw!r}") from None


def _bool(doc: Mapping[str, Any], field: str, where: str) -> bool:
    raw = doc.get(field, False)
    if not isinstance(raw, bool):
        raise EtcdProtocolError(f"{where}: {field} is not a boolean: {raw!r}")
    return raw


def _bytes(doc: Mapping[str, Any], field: str, where: str) -> bytes:
    raw = doc.get(field, "")
    if not isinstance(raw, str):
        raise EtcdProtocolError(f"{where}: {field} is not a base64 string: {raw!r}")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise EtcdProtocolError(f"{where}: {field} is not base64: {raw[:80]!r}") from None


def _obj(doc: Mapping[str, Any], field: str, where: str) -> Mapping[str, Any]:
    raw = doc.get(field, {})
    if not isinstance(raw, Mapping):
        raise EtcdProtocolError(f"{where}: {field} is not an object: {raw!r}")
    return raw


def _list(doc: Mapping[str, Any], field: str, where: str) -> list[Mapping[str, Any]]:
    raw = doc.get(field, [])
    if not isinstance(raw, list) or not all(isinstance(item, Mapping) for item in raw):
        raise EtcdProtocolError(f"{where}: {field} is not a list of objects: {raw!r}")
    return raw


def error_of(doc: Mapping[str, Any], status: int) -> tuple[int, str]:
    """The gRPC code and message of an error answer (``{"error": "...", "code": 9, "message": "..."}``;
    nested under ``error`` inside a stream), or -1 and the HTTP status when it has neither."""
    error = doc.get("error")
    if isinstance(error, Mapping):
        doc = error
    code = doc.get("code")
    message = doc.get("message") or doc.get("error") or f"HTTP {status}"
    return (code if isinstance(code, int) and not isinstance(code, bool) else -1), str(message)


def decode_header(doc: Mapping[str, Any], where: str) -> ResponseHeader:
    h = _obj(doc, "header", where)
    where = f"{where} header"
    return ResponseHeader(
        cluster_id=_int(h, "cluster_id", where),
        member_id=_int(h, "member_id", where),
        revision=_int(h, "revision", where),
        raft_term=_int(h, "raft_term", where),
    )


def decode_kv(doc: Mapping[str, Any], where: str) -> KeyValue:
    return KeyValue(
        key=_bytes(doc, "key", where),
        value=_bytes(doc, "value", where),
        create_revision=_int(doc, "create_revision", where),
        mod_revision=_int(doc, "mod_revision", where),
        version=_int(doc, "version", where),
        lease=_int(doc, "lease", where),
    )


def decode_range(doc: Mapping[str, Any], where: str = "range") -> RangeResult:
    return RangeResult(
        header=decode_header(doc, where),
        kvs=tuple(decode_kv(kv, f"{where} kv") for kv in _list(doc, "kvs", where)),
        count=_int(doc, "count", where),
        more=_bool(doc, "more", where),
    )


def decode_put(doc: Mapping[str, Any], where: str = "put") -> PutResult:
    prev = doc.get("prev_kv")
    return PutResult(
        header=decode_header(doc, where),
        prev_kv=decode_kv(_obj(doc, "prev_kv", where), f"{where} prev_kv") if prev is not None else None,
    )


def decode_delete(doc: Mapping[str, Any], where: str = "delete") -> DeleteResult:
    return DeleteResult(
        header=decode_header(doc, where),
        deleted=_int(doc, "deleted", where),
        prev_kvs=tuple(decode_kv(kv, f"{where} prev_kv") for kv in _list(doc, "prev_kvs", where)),
    )


def decode_txn(doc: Mapping[str, Any], where: str = "txn") -> TxnResult:
    responses: list[Result] = []
    for item in _list(doc, "responses", where):
        if "response_range" in item:
            responses.append(decode_range(_obj(item, "response_range", where), f"{where} range"))
        elif "response_put" in item:
            responses.append(decode_put(_obj(item, "response_put", where), f"{where} put"))
        elif "response_delete_range" in item:
            responses.append(decode_delete(_obj(item, "response_delete_range", where), f"{where} delete"))
        elif "response_txn" in item:
            responses.append(decode_txn(_obj(item, "response_txn", where), f"{where} txn"))
        else:
            raise EtcdProtocolError(f"{where}: a response with none of the four kinds: {dict(item)!r}")
    return TxnResult(
        header=decode_header(doc, where), succeeded=_bool(doc, "succeeded", where), responses=tuple(responses)
    )


def decode_lease(doc: Mapping[str, Any], where: str = "lease grant") -> Lease:
    """A lease grant's answer, or a keepalive's ``result``: a TTL of 0 (left out) means the lease no
    longer exists."""
    return Lease(id=_int(doc, "ID", where), ttl=_int(doc, "TTL", where))


def decode_status(doc: Mapping[str, Any], endpoint: str) -> Status:
    where = f"status of {endpoint}"
    version = doc.get("version", "")
    if not isinstance(version, str):
        raise EtcdProtocolError(f"{where}: version is not a string: {version!r}")
    return Status(
        endpoint=endpoint,
        header=decode_header(doc, where),
        version=version,
        db_size=_int(doc, "dbSize", where),
        leader=_int(doc, "leader", where),
        raft_index=_int(doc, "raftIndex", where),
        raft_term=_int(doc, "raftTerm", where),
    )


def decode_events(doc: Mapping[str, Any], where: str = "watch") -> tuple[Event, ...]:
    events = []
    for item in _list(doc, "events", where):
        kind = item.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise EtcdProtocolError(f"{where}: an event of unknown type {kind!r}")
        events.append(
            Event("put" if kind == "PUT" else "delete", decode_kv(_obj(item, "kv", where), f"{where} event"))
        )
    return tuple(events)


def watch_batch(events: tuple[Event, ...]) -> WatchBatch:
    return WatchBatch(revision=events[-1].kv.mod_revision, events=events)
