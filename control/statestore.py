"""Where the control plane's state lives: one interface (``StateStore``), two backends.

``FileStore`` is ``state_dir/control-state.json`` (``control.state``), the embedded default: the
whole document is written, atomically and fsynced, when anything in it changed. ``EtcdStore`` keeps
the same document in etcd under ``[state] prefix``, one key per object (docs/etcd.md's layout), so a
write costs what changed: it diffs the new document's keys against the ones it last wrote (or read)
and sends only those that differ, in one txn per batch of ``TXN_OPS``, each fenced by ``fence`` (the
leader's key, ``control.leader``): a deposed leader's write changes nothing and raises ``NotLeader``.

The per-key values are the file's own per-entry shapes (JSON, a Register as base64 text), so a
migration between backends (``python -m control migrate-state``) is ``doc_keys`` one way and
``keys_doc`` the other, and ``parse_state`` checks both. The join token and the node credential
digests (``control.joins``) live beside them: ``join-token`` and ``credentials/<node id>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from control.etcd import Compare, Delete, EtcdClient, EtcdConfig, Put
from control.state import SavedState, StateFileError, parse_state, read_state, write_state

if TYPE_CHECKING:
    from control.config import StateConfig

#: The most operations one txn carries (etcd's default ``--max-txn-ops`` is 128).
TXN_OPS = 100
#: The key that says a state is there at all, and what the document held (``catalog`` or not).
FORMAT_KEY = "format"
#: Groups of keys in the prefix that belong to the state document (each ``<group>/<id>``).
GROUPS = ("nodes", "placements", "cordons", "catalog", "lost")
JOIN_TOKEN_KEY = "join-token"
#: The cluster secret shard keys are derived from (``control.plane.load_shard_key_secret``): every
#: control plane on the prefix must derive the same keys, or a new leader's router is refused.
SHARD_KEY_SECRET_KEY = "shard-key-secret"
CREDENTIALS = "credentials/"


def etcd_config(state: StateConfig, environ: Mapping[str, str]) -> EtcdConfig:
    """``[state]``'s etcd client settings, the password from ``environ`` first (for the control
    plane and ``migrate-state`` alike); ``ValueError`` saying why when the password may not be
    sent (it would cross the network in clear)."""
    if problem := state.password_problem(environ):
        raise ValueError(problem)
    password = state.password_from(environ)
    return EtcdConfig(
        endpoints=state.endpoints,
        ca=state.ca,
        cert=state.cert,
        key=state.key,
        user=state.user or None,
        password=password or None,
    )


class NotLeader(Exception):
    """A fenced write failed: another control plane leads now; this one must stop acting."""


class StateStore(Protocol):
    """The state backend the control plane saves to and starts from."""

    #: Where the state is, for people (a path, or etcd's endpoints and the prefix).
    where: str

    async def load(self) -> SavedState | None:
        """The saved state, or None on a first start; ``StateFileError`` naming the entry when it
        cannot be used."""
        ...

    async def write(self, doc: Mapping[str, Any]) -> None:
        """Make the stored state ``doc`` (``control.state.state_doc``'s shape), durably, before
        returning; ``NotLeader`` when this control plane no longer leads."""
        ...


class FileStore:
    """The state file (``control.state``), read and written in worker threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    async def load(self) -> SavedState | None:
        return await trio.to_thread.run_sync(read_state, self.path)

    async def write(self, doc: Mapping[str, Any]) -> None:
        await trio.to_thread.run_sync(write_state, self.path, doc)


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def doc_keys(doc: Mapping[str, Any]) -> dict[str, bytes]:
    """The state document as etcd keys (relative to the prefix) and values: one per object."""
    keys: dict[str, bytes] = {FORMAT_KEY: _json({"version": 1, "catalog": "catalog" in doc})}
    for node_id, text in doc.get("nodes", {}).items():
        keys[f"nodes/{node_id}"] = str(text).encode()
    for p in doc.get("placements", []):
        keys[f"placements/{p['model']}/{p['replica_id']}"] = _json(p)
    for node_id, mark in doc.get("cordons", {}).items():
        keys[f"cordons/{node_id}"] = str(mark).encode()
    for entry in doc.get("catalog") or []:
        keys[f"catalog/{entry['name']}"] = _json(entry)
    for node_id, item in doc.get("lost", {}).items():
        keys[f"lost/{node_id}"] = _json(item)
    return keys


def keys_doc(keys: Mapping[str, bytes], where: str) -> dict[str, Any] | None:
    """``doc_keys``'s inverse: the document, or None when there is no state (no ``format`` key).
    A value that is not what its key holds raises ``StateFileError`` naming ``where`` and the key."""
    if FORMAT_KEY not in keys:
        return None

    def load(key: str, raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StateFileError(f"{where}{key}: not JSON ({exc})") from exc

    fmt = load(FORMAT_KEY, keys[FORMAT_KEY])
    if not isinstance(fmt, dict) or fmt.get("version") != 1:
        raise StateFileError(f"{where}{FORMAT_KEY}: expected {{'version': 1, ...}}, got {fmt!r}")
    doc: dict[str, Any] = {"nodes": {}, "placements": [], "cordons": {}, "lost": {}}
    catalog: list[Any] = []
    for key in sorted(keys):
        group, _, rest = key.partition("/")
        raw = keys[key]
        if group == "nodes":
            doc["nodes"][rest] = raw.decode(errors="replace")
        elif group == "cordons":
            doc["cordons"][rest] = raw.decode(errors="replace")
        elif group == "placements":
            doc["placements"].append(load(key, raw))
        elif group == "catalog":
            catalog.append(load(key, raw))
        elif group == "lost":
            doc["lost"][rest] = load(key, raw)
    if fmt.get("catalog"):
        doc["catalog"] = catalog
    return doc


class EtcdStore:
    """The state in etcd under ``prefix``, one key per object, written as diffs (module doc)."""

    def __init__(
        self, client: EtcdClient, prefix: str, fence: Callable[[], Sequence[Compare]] = lambda: ()
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.where = f"etcd {','.join(client.config.endpoints)} {prefix}"
        #: The comparisons every write carries (the leader's key at our epoch); () before leading.
        self.fence = fence
        #: What the state keys in etcd hold, as far as this store knows: read by ``load``, then
        #: kept up to date by each write.
        self._written: dict[str, bytes] = {}
        #: Puts and deletes sent, for the tests' and the log's sake.
        self.ops_sent = 0

    def _key(self, rel: str) -> bytes:
        return (self.prefix + rel).encode()

    async def read_keys(self) -> dict[str, bytes]:
        """Every state key under the prefix (relative), as etcd has it now."""
        result = await self.client.get_prefix(self.prefix.encode())
        keys = {}
        for kv in result.kvs:
            rel = kv.key[len(self.prefix) :].decode(errors="replace")
            if rel == FORMAT_KEY or rel.partition("/")[0] in GROUPS:
                keys[rel] = kv.value
        return keys

    async def load(self) -> SavedState | None:
        self._written = await self.read_keys()
        doc = keys_doc(self._written, self.prefix)
        return None if doc is None else parse_state(json.dumps(doc), self.prefix)

    async def write(self, doc: Mapping[str, Any]) -> None:
        await self.write_keys(doc_keys(doc))

    async def write_keys(self, new: Mapping[str, bytes]) -> None:
        """Make the state keys ``new``: put what differs from what is there, delete what is gone."""
        ops: list[tuple[str, bytes | None]] = [(k, v) for k, v in new.items() if self._written.get(k) != v]
        ops += [(k, None) for k in self._written if k not in new]
        # The format key last: a state interrupted between batches is still recognisably there.
        ops.sort(key=lambda op: op[0] == FORMAT_KEY)
        for start in range(0, len(ops), TXN_OPS):
            batch = ops[start : start + TXN_OPS]
            await self.txn_fenced(
                [Put(self._key(k), v) if v is not None else Delete(self._key(k)) for k, v in batch]
            )
            self.ops_sent += len(batch)
            for k, v in batch:
                if v is None:
                    self._written.pop(k, None)
                else:
                    self._written[k] = v

    async def txn_fenced(self, ops: Sequence[Put | Delete]) -> None:
        """``ops`` in one txn, if we still lead (``fence``); ``NotLeader`` when not."""
        fence = list(self.fence())
        result = await self.client.txn(fence, list(ops))
        if not result.succeeded:
            raise NotLeader(f"{self.where}: a write was refused: another control plane leads now")

    # -- the join token and node credentials (control.joins) ---------------------------------------

    async def get_or_create(self, rel: str, new: bytes) -> tuple[bytes, bool]:
        """The value at ``rel``, put as ``new`` first if absent (a txn on its create revision, so two
        control planes starting at once agree on one value); and whether this call created it."""
        key = self._key(rel)
        result = await self.client.txn([Compare.create_revision(key, "==", 0)], [Put(key, new)])
        kv = await self.client.get(key)
        return (new if kv is None else kv.value), result.succeeded

    async def load_joins(self, new_token: str) -> tuple[str, dict[str, str], bool]:
        """(join token, node id -> credential digest, whether this call created the token)."""
        token, created = await self.get_or_create(JOIN_TOKEN_KEY, new_token.encode())
        creds = await self.client.get_prefix(self._key(CREDENTIALS))
        start = len(self._key(CREDENTIALS))
        bindings = {kv.key[start:].decode(): kv.value.decode() for kv in creds.kvs}
        return token.decode().strip(), bindings, created

    async def bind(self, node_id: str, digest: str | None) -> None:
        """Keep (or with None forget) one node's credential digest: one key, fenced."""
        key = self._key(CREDENTIALS + node_id)
        await self.txn_fenced([Put(key, digest.encode()) if digest is not None else Delete(key)])


async def prefix_is_empty(client: EtcdClient, prefix: str) -> bool:
    """Whether nothing at all is stored under ``prefix`` (``migrate-state`` refuses to overwrite)."""
    result = await client.get_prefix(prefix.encode(), limit=1)
    return not result.kvs


__all__ = [
    "FORMAT_KEY",
    "JOIN_TOKEN_KEY",
    "SHARD_KEY_SECRET_KEY",
    "TXN_OPS",
    "EtcdStore",
    "FileStore",
    "NotLeader",
    "StateStore",
    "doc_keys",
    "keys_doc",
    "prefix_is_empty",
]
