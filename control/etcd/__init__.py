"""A Trio-native etcd v3 client (httpx on etcd's JSON gateway), for the control plane's state and
leadership: KV, txn with comparisons, leases kept alive with a deadline, watches that resume without
losing a change, several endpoints with failover, TLS and user/password auth. See docs/etcd.md."""

from control.etcd.client import EtcdClient, EtcdConfig, connect
from control.etcd.errors import (
    EtcdAuthError,
    EtcdCompacted,
    EtcdError,
    EtcdLeaseLost,
    EtcdProtocolError,
    EtcdRequestError,
    EtcdUnavailable,
)
from control.etcd.lease import LeaseKeeper
from control.etcd.values import (
    Compare,
    Delete,
    DeleteResult,
    Event,
    KeyValue,
    Lease,
    Put,
    PutResult,
    Range,
    RangeResult,
    ResponseHeader,
    Status,
    Txn,
    TxnResult,
    WatchBatch,
    prefix_end,
)
from control.etcd.watch import Watch

__all__ = [
    "Compare",
    "Delete",
    "DeleteResult",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdConfig",
    "EtcdError",
    "EtcdLeaseLost",
    "EtcdProtocolError",
    "EtcdRequestError",
    "EtcdUnavailable",
    "Event",
    "KeyValue",
    "Lease",
    "LeaseKeeper",
    "Put",
    "PutResult",
    "Range",
    "RangeResult",
    "ResponseHeader",
    "Status",
    "Txn",
    "TxnResult",
    "Watch",
    "WatchBatch",
    "connect",
    "prefix_end",
]
