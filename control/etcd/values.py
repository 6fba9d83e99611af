"""The etcd client's values: what it is asked (requests for a txn, comparisons) and what it answers
(key-values, events, results), as frozen attrs classes.

Keys and values are ``bytes`` (etcd's are); revisions, versions and lease ids are ``int`` (the
gateway's int64 strings are converted at the edge, ``control.etcd.wire``).
"""

from __future__ import annotations

from typing import Literal

import attrs

#: A comparison's operator, as written in code (``Compare.value(key, "==", b"me")``).
CompareOp = Literal["==", "!=", "<", ">"]
#: What a comparison looks at: the value, the version (0: the key does not exist), the revision that
#: created it or last modified it, or its lease.
CompareTarget = Literal["value", "version", "create_revision", "mod_revision", "lease"]


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``: the prefix with
    its last byte below 0xff incremented and what follows dropped (etcd's own rule, clientv3's
    ``GetPrefixRangeEnd``); ``b"\\0"`` (every key from ``prefix`` on) when there is no such byte."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"


@attrs.frozen
class ResponseHeader:
    """Which cluster and member answered, at which store revision and raft term."""

    cluster_id: int
    member_id: int
    revision: int
    raft_term: int


@attrs.frozen
class KeyValue:
    """One key as etcd stores it. ``version`` counts puts since the key was created (it restarts at 1
    after a delete); ``lease`` is 0 when the key has none."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


# -- requests (also the operations of a txn) -------------------------------------------------------------


@attrs.frozen
class Range:
    """Read ``key``, or every key from ``key`` up to ``range_end`` (exclusive; ``Range.prefix`` makes
    it a prefix), at ``revision`` (0: the latest). ``limit`` 0 is no limit."""

    key: bytes
    range_end: bytes = b""
    revision: int = 0
    limit: int = 0
    keys_only: bool = False
    count_only: bool = False

    @classmethod
    def prefix(cls, prefix: bytes, *, revision: int = 0, limit: int = 0) -> Range:
        return cls(prefix, prefix_end(prefix), revision=revision, limit=limit)


@attrs.frozen
class Put:
    """Write ``value`` at ``key``, attached to ``lease`` (0: none, the key stays until deleted)."""

    key: bytes
    value: bytes
    lease: int = 0
    prev_kv: bool = False


@attrs.frozen
class Delete:
    """Delete ``key``, or every key from ``key`` up to ``range_end`` (``Delete.prefix``)."""

    key: bytes
    range_end: bytes = b""
    prev_kv: bool = False

    @classmethod
    def prefix(cls, prefix: bytes, *, prev_kv: bool = False) -> Delete:
        return cls(prefix, prefix_end(prefix), prev_kv=prev_kv)


@attrs.frozen
class Compare:
    """One condition of a txn: ``target`` of ``key`` ``op`` ``operand``. Made with the class methods,
    e.g. "the leader key is still mine": ``Compare.value(b"/llmgw/leader", "==", my_id)``, "the key does
    not exist yet": ``Compare.version(key, "==", 0)``."""

    key: bytes
    target: CompareTarget
    op: CompareOp
    operand: bytes | int

    @classmethod
    def value(cls, key: bytes, op: CompareOp, value: bytes) -> Compare:
        return cls(key, "value", op, value)

    @classmethod
    def version(cls, key: bytes, op: CompareOp, version: int) -> Compare:
        return cls(key, "version", op, version)

    @classmethod
    def create_revision(cls, key: bytes, op: CompareOp, revision: int) -> Compare:
        return cls(key, "create_revision", op, revision)

    @classmethod
    def mod_revision(cls, key: bytes, op: CompareOp, revision: int) -> Compare:
        return cls(key, "mod_revision", op, revision)

    @classmethod
    def lease(cls, key: bytes, op: CompareOp, lease: int) -> Compare:
        return cls(key, "lease", op, lease)


@attrs.frozen
class Txn:
    """If every comparison holds, run ``success``, else ``failure`` (each a sequence of operations,
    applied atomically at one revision)."""

    compare: tuple[Compare, ...] = ()
    success: tuple[Range | Put | Delete | Txn, ...] = ()
    failure: tuple[Range | Put | Delete | Txn, ...] = ()


Operation = Range | Put | Delete | Txn

# -- results ---------------------------------------------------------------------------------------------


@attrs.frozen
class RangeResult:
    """The keys found (at most ``limit``), how many matched in all, and whether more than were
    returned."""

    header: ResponseHeader
    kvs: tuple[KeyValue, ...]
    count: int
    more: bool


@attrs.frozen
class PutResult:
    header: ResponseHeader
    prev_kv: KeyValue | None


@attrs.frozen
class DeleteResult:
    header: ResponseHeader
    deleted: int
    prev_kvs: tuple[KeyValue, ...]


@attrs.frozen
class TxnResult:
    """Whether the comparisons held, and one result per operation of the branch that ran."""

    header: ResponseHeader
    succeeded: bool
    responses: tuple[RangeResult | PutResult | DeleteResult | TxnResult, ...]


Result = RangeResult | PutResult | DeleteResult | TxnResult


@attrs.frozen
class Lease:
    """A granted lease: its id and the TTL (seconds) etcd gave it."""

    id: int
    ttl: int


@attrs.frozen
class Event:
    """One change seen by a watch: a put (``kv`` is the new key-value) or a delete (``kv`` holds the key
    and the deleting revision as ``mod_revision``)."""

    type: Literal["put", "delete"]
    kv: KeyValue


@attrs.frozen
class WatchBatch:
    """The events of one watch response, in revision order; the events of one txn are never split
    across batches. ``revision`` is the last event's revision."""

    revision: int
    events: tuple[Event, ...]


@attrs.frozen
class Status:
    """One member's view (``/v3/maintenance/status``): its version, database size, the member it
    follows as leader (``leader``, 0 when it has none) and its raft position."""

    endpoint: str
    header: ResponseHeader
    version: str
    db_size: int
    leader: int
    raft_index: int
    raft_term: int
