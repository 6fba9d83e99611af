"""What survives a control plane restart: ``state_dir/control-state.json``.

The file holds the nodes the control plane knew (each one's last Register, base64 protobuf, with no
secret in it), the placements, the operators' cordons and drains, and the model catalog
(``control.catalog``: each model's definition, where it came from, what the file last said of it)::

    {"catalog": [{"name": "m", "definition": {...}, "source": "api", "file_definition": null,
                  "generation": 3, "deleting": false}],
     "cordons": {"gpu07": "draining"},
     "nodes": {"gpu07": "<base64 Register>"},
     "placements": [{"model": "m", "replica_id": "m-r0", "fabric": "", "shards": [...]}],
     "lost": {"gpu05": {"register": "<base64 Register>", "last_seen": 1796428800.0}}}

A lost node is kept under ``lost`` with the shards it last reported and when it was last heard from,
so that a restart still lists what may run there (``ctl replicas``) until the node comes back or
``ctl node reset`` forgets it. A file without ``catalog`` (written before models were objects) loads: its models then come from
``llmgw.toml`` alone, as they did.

Pure functions convert between that document and a ``SavedState`` value (``state_doc``,
``parse_state``); a damaged file is refused with the file and the field that is wrong
(``StateFileError``). The one blocking edge is ``write_state`` (atomic and durable) and
``read_state``; ``StateSaver`` runs them in a worker thread and writes only when something a restart
needs has changed.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import cattrs
import trio
from cattrs.gen import make_dict_unstructure_fn, override

import schema
import statefile
from control.catalog import Catalog, Entry, Source
from control.config import model_from_dict, model_to_dict
from control.fleet import Cordon, Node, NodeState
from control.placement import ReplicaPlacement

#: The state file's name in ``state_dir``.
STATE_FILE = "control-state.json"

_converter = cattrs.Converter()
# A placement's template revision (control.rollout) is written once known: a file from before
# rollouts reads back as it was, and its placements get theirs from the engines' specs.
_converter.register_unstructure_hook(
    ReplicaPlacement,
    make_dict_unstructure_fn(ReplicaPlacement, _converter, revision=override(omit_if_default=True)),
)


class StateFileError(ValueError):
    """The state file cannot be used: the message names the file and the field."""


@attrs.frozen
class SavedState:
    """What a restarted control plane starts from."""

    #: Each known node's last Register, with no token, credential or shard key in it.
    registers: tuple[schema.Register, ...] = ()
    placements: tuple[ReplicaPlacement, ...] = ()
    #: (node id, mark), sorted by node id.
    cordons: tuple[tuple[str, Cordon], ...] = ()
    #: Entries that were skipped (an unknown cordon mark), one line each, naming the file.
    skipped: tuple[str, ...] = ()
    #: The model catalog; None from a file written before there was one (models: the file's).
    catalog: tuple[Entry, ...] | None = None
    #: Lost nodes: each one's last Register (the shards it last reported) and when it was last
    #: heard from (Unix time), so that they stay listed as lost after a restart.
    lost: tuple[tuple[schema.Register, float], ...] = ()


def keyless(register: schema.Register) -> schema.Register:
    """``register`` without any secret in it, for the state file: agents leave shard keys out of
    ShardStatus, and one that does not (an older agent) must not put them on disk here; the join
    token and node credential a Register carries are never written either."""
    if (
        not register.token
        and not register.node_credential
        and not any(st.spec is not None and st.spec.api_key for st in register.shards)
    ):
        return register
    copy = schema.Register.parse(bytes(register))
    copy.token = copy.node_credential = ""
    for st in copy.shards:
        if st.spec is not None:
            st.spec.api_key = ""
    return copy


def encode_register(register: schema.Register) -> str:
    """One node's entry in the file (~2 ms per Register with betterproto2: call it off the trio
    thread for many)."""
    return base64.b64encode(bytes(keyless(register))).decode()


def state_doc(
    nodes: Mapping[str, str],
    placements: Iterable[ReplicaPlacement],
    cordons: Iterable[tuple[str, Cordon]],
    catalog: Iterable[Entry] | None = None,
    lost: Mapping[str, tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """The file's document: ``nodes`` maps node id to ``encode_register``'s text, ``lost`` a lost
    node's id to that text and when it was last heard from (Unix time)."""
    doc: dict[str, Any] = {
        "nodes": dict(nodes),
        "placements": _converter.unstructure(list(placements)),
        # Operator decisions: a restart must not make a cordoned or draining node schedulable.
        "cordons": {nid: mark.value for nid, mark in sorted(cordons)},
    }
    if catalog is not None:
        doc["catalog"] = [catalog_entry_doc(e) for e in catalog]
    if lost:
        doc["lost"] = {
            nid: {"register": text, "last_seen": round(t, 3)} for nid, (text, t) in sorted(lost.items())
        }
    return doc


def catalog_entry_doc(entry: Entry) -> dict[str, Any]:
    """One catalog entry as the file keeps it."""
    return {
        "name": entry.name,
        "definition": model_to_dict(entry.config),
        "source": entry.source.value,
        "file_definition": None if entry.file_definition is None else model_to_dict(entry.file_definition),
        "generation": entry.generation,
        "deleting": entry.deleting,
    }


def _parse_catalog(raw: object, path: Path | str) -> tuple[Entry, ...]:
    if not isinstance(raw, list):
        raise StateFileError(f"{path}: catalog: expected a list of models, got {type(raw).__name__}")
    entries = []
    for i, item in enumerate(raw):
        where = f"{path}: catalog[{i}]"
        if not isinstance(item, dict):
            raise StateFileError(f"{where}: expected an object, got {type(item).__name__}")
        try:
            config = model_from_dict(item.get("definition"), f"{where}.definition")
            file_raw = item.get("file_definition")
            file_def = None if file_raw is None else model_from_dict(file_raw, f"{where}.file_definition")
            source = Source(str(item.get("source")))
        except ValueError as exc:
            raise StateFileError(str(exc) if str(exc).startswith(str(path)) else f"{where}: {exc}") from exc
        generation = item.get("generation", 1)
        deleting = item.get("deleting", False)
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
            raise StateFileError(f"{where}.generation: expected a whole number from 1, got {generation!r}")
        if not isinstance(deleting, bool):
            raise StateFileError(f"{where}.deleting: expected true or false, got {deleting!r}")
        if item.get("name", config.name) != config.name:
            raise StateFileError(f"{where}: name {item.get('name')!r} but the definition is {config.name!r}")
        entries.append(Entry(config, source, file_def, generation, deleting))
    return tuple(entries)


def parse_state(text: str, path: Path | str = STATE_FILE) -> SavedState:
    """The file's contents as a value; ``StateFileError`` naming ``path`` and the field when they are
    not a state file (not JSON, a node that is not a Register, a placement missing a field)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StateFileError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise StateFileError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    nodes = doc.get("nodes", {})
    if not isinstance(nodes, dict):
        raise StateFileError(
            f"{path}: nodes: expected an object of node id -> Register, got {type(nodes).__name__}"
        )
    registers = [
        _parse_register(node_id, text_value, f"{path}: nodes[{str(node_id)[:64]!r}]")
        for node_id, text_value in nodes.items()
    ]
    raw_lost = doc.get("lost", {})
    if not isinstance(raw_lost, dict):
        raise StateFileError(f"{path}: lost: expected an object of node id -> {{register, last_seen}}")
    lost = []
    for node_id, item in raw_lost.items():
        where = f"{path}: lost[{str(node_id)[:64]!r}]"
        if not isinstance(item, dict) or not isinstance(item.get("last_seen"), int | float):
            raise StateFileError(f'{where}: expected {{"register": base64 text, "last_seen": Unix time}}')
        lost.append(
            (_parse_register(node_id, item.get("register"), f"{where}.register"), float(item["last_seen"]))
        )
    try:
        placements = tuple(_converter.structure(doc.get("placements", []), list[ReplicaPlacement]))
    except Exception as exc:
        problems = cattrs.transform_error(exc, path="placements")
        raise StateFileError(f"{path}: {'; '.join(problems)}") from exc
    raw_cordons = doc.get("cordons", {})
    if not isinstance(raw_cordons, dict):
        raise StateFileError(f"{path}: cordons: expected an object of node id -> mark")
    cordons = []
    skipped = []
    for node_id, mark in raw_cordons.items():
        try:
            cordons.append((str(node_id), Cordon(mark)))
        except ValueError:
            skipped.append(f"{path}: cordons[{str(node_id)[:64]!r}]: unknown mark {mark!r}, ignored")
    catalog = _parse_catalog(doc["catalog"], path) if "catalog" in doc else None
    return SavedState(
        tuple(registers), placements, tuple(sorted(cordons)), tuple(skipped), catalog, tuple(lost)
    )


def _parse_register(node_id: object, text_value: object, where: str) -> schema.Register:
    if not isinstance(text_value, str):
        raise StateFileError(f"{where}: expected base64 text, got {type(text_value).__name__}")
    try:
        reg = schema.Register.parse(base64.b64decode(text_value, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise StateFileError(f"{where}: not a base64 Register ({exc})") from exc
    except Exception as exc:  # betterproto2 raises assorted errors on bytes that are not a message
        raise StateFileError(f"{where}: not a Register ({type(exc).__name__}: {exc})") from exc
    if reg.node_id != node_id:
        raise StateFileError(f"{where}: the Register is for node {reg.node_id[:64]!r}")
    # A file written before secrets were stripped from it: they are not kept in memory either,
    # and the next save leaves them out.
    return keyless(reg)


def read_state(path: Path) -> SavedState | None:
    """The saved state, or None when there is no file (a first start). Blocks on the filesystem."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise StateFileError(f"{path}: unreadable ({exc})") from exc
    return parse_state(text, path)


def set_aside(path: Path) -> Path:
    """Rename a damaged state file to ``NAME.damaged`` (replacing an older one), so that the next
    save does not overwrite what a person may want to read or repair. Blocks on the filesystem."""
    aside = path.with_name(path.name + ".damaged")
    os.replace(path, aside)
    return aside


def write_state(path: Path, doc: Mapping[str, Any]) -> None:
    """Replace the state file atomically and durably (blocking: run it in a worker thread).

    The new contents are fsynced before the rename and the directory after it: without the first a
    crash can leave the new name on an empty or partial file (ext4 and XFS reorder data and
    metadata), without the second the rename itself may not survive a power loss, and the control
    plane would come back with an older fleet, drains and cordons forgotten.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0600: the file holds node inventories and credential digests; an older file left 0644 is
    # replaced by one that is not.
    statefile.write_atomic(path, json.dumps(doc, sort_keys=True), mode=0o600)


class StateWriter(Protocol):
    """What ``StateSaver`` writes to (``control.statestore.StateStore`` is one)."""

    async def write(self, doc: Mapping[str, Any]) -> None: ...


class StateSaver:
    """Writes the state file when what a restart needs has changed, never on the trio thread.

    Encoded Registers are cached per node (a Register changes only when its node registers again),
    and new ones are encoded in a worker thread along with the file write: betterproto2 takes ~2 ms
    per Register, so a registration storm of thousands would otherwise hold the event loop, and with
    it every node's heartbeats, for seconds.
    """

    def __init__(self, target: Path | StateWriter) -> None:
        """``target``: the state file's path, or a backend (``control.statestore``) to write to."""
        self.target = target
        self._encoded: dict[str, tuple[schema.Register, str]] = {}
        self._saved_key: object = None
        self._saved_generation: object = None
        #: node id -> ((register, shards, last heard from), encoded Register) of each lost node.
        self._lost: dict[str, tuple[tuple[schema.Register, tuple[schema.ShardStatus, ...], float], str]] = {}
        # One writer at a time: the reconciler's pass, an admin request (a drain is saved before it
        # is answered) and the shutdown path all save, and all write the same temporary file.
        self._lock = trio.Lock()

    async def save(
        self,
        generation: int,
        nodes: Iterable[Node],
        placements: tuple[ReplicaPlacement, ...],
        cordons: Mapping[str, Cordon],
        catalog: Catalog | None = None,
        wall_of: Callable[[float], float] = lambda t: t,
    ) -> bool:
        """Write the nodes, the placements, the cordons and the catalog, unless nothing changed
        since the last write (``generation`` is the fleet's, the catalog's own ``revision`` tells
        its changes). Returns whether it wrote. A lost node is written with the shards it last
        reported and when it was last heard from: ``wall_of`` turns the fleet's monotonic time into
        Unix time."""
        async with self._lock:
            return await self._save(generation, nodes, placements, cordons, catalog, wall_of)

    async def _save(
        self,
        generation: int,
        nodes: Iterable[Node],
        placements: tuple[ReplicaPlacement, ...],
        cordons: Mapping[str, Cordon],
        catalog: Catalog | None = None,
        wall_of: Callable[[float], float] = lambda t: t,
    ) -> bool:
        # The catalog as it is now: its entries are frozen values, the catalog may change while
        # Registers are encoded below.
        entries = tuple(catalog.entries()) if catalog is not None else None
        stamp = (generation, placements, entries)
        if stamp == self._saved_generation:
            return False  # nothing a restart needs has changed since the last write
        nodes = tuple(nodes)
        live = [n for n in nodes if n.state is not NodeState.LOST]
        # A lost node's last word on each shard (its Register's list, then ShardStatus messages),
        # as a Register of its own; it changes only when the node is heard from, so the key holds it.
        lost = {
            n.node_id: (n.register, tuple(n.shards.values()), n.last_heartbeat)
            for n in nodes
            if n.state is NodeState.LOST
        }
        fresh_lost = {nid: item for nid, item in lost.items() if self._lost.get(nid, (None,))[0] != item}
        if fresh_lost:
            encoded_lost = await trio.to_thread.run_sync(
                lambda: {
                    nid: encode_register(dataclasses.replace(reg, shards=list(shards)))
                    for nid, (reg, shards, _) in fresh_lost.items()
                }
            )
            for nid, text in encoded_lost.items():
                self._lost[nid] = (fresh_lost[nid], text)
        for gone in set(self._lost) - set(lost):
            del self._lost[gone]
        fresh = [
            (n.node_id, n.register)
            for n in live
            if (cached := self._encoded.get(n.node_id)) is None or cached[0] is not n.register
        ]
        if fresh:
            encoded = await trio.to_thread.run_sync(
                lambda: [(nid, reg, encode_register(reg)) for nid, reg in fresh]
            )
            for nid, reg, text in encoded:
                self._encoded[nid] = (reg, text)
        for gone in set(self._encoded) - {n.node_id for n in live}:
            del self._encoded[gone]
        marks = tuple(sorted(cordons.items()))
        key = (
            tuple(sorted((nid, reg) for nid, (reg, _) in self._encoded.items())),
            placements,
            marks,
            entries,
            tuple(sorted((nid, reg, shards, seen) for nid, (reg, shards, seen) in lost.items())),
        )
        if key == self._saved_key:
            self._saved_generation = stamp
            return False
        doc = state_doc(
            {nid: text for nid, (_, text) in self._encoded.items()},
            placements,
            marks,
            entries,
            {nid: (text, wall_of(item[2])) for nid, (item, text) in self._lost.items()},
        )
        if isinstance(self.target, Path):
            await trio.to_thread.run_sync(write_state, self.target, doc)
        else:
            await self.target.write(doc)
        self._saved_key = key
        self._saved_generation = stamp
        return True


__all__ = [
    "STATE_FILE",
    "SavedState",
    "StateFileError",
    "StateSaver",
    "StateWriter",
    "catalog_entry_doc",
    "encode_register",
    "keyless",
    "parse_state",
    "read_state",
    "set_aside",
    "state_doc",
    "write_state",
]
