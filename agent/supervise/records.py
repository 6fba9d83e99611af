"""What the supervisor writes down about each engine, so a restarted agent can find it again.

A record is the shard's spec, the engine's pid and the process start time read from
``/proc/PID/stat``. The pid alone is not enough: after a reboot or a long outage the kernel reuses
pids, and an agent that adopted "pid 4242" without checking its start time could end up signalling
somebody else's process.

The record is written twice per start: once *before* the spawn, as an intent (pid 0: "an engine for
this shard may exist"), and again once the pid is known. A ``kill -9`` of the agent between the two
leaves an intent, and the restarted agent looks for the engine by its marker in ``/proc``
(``procfs.find_engines``) instead of trusting the record. Writes are atomic and durable (write,
fsync, rename, fsync the directory), so a crash leaves the old record or the new one; a record
damaged anyway (a full disk, a person's editor) is reported and rebuilt from the engine's marker.

The record's file name *is* the shard id (``shards/ID.json``): ids are checked against
``schema.ids.SHARD_ID``, whose alphabet is safe for file names, so the map is one to one and no two
shards can share a file. Every method blocks on the filesystem: the supervisor calls them from a
worker thread.

**The shard's key.** The spec carries the shard's API key (``StartShard.api_key``), and the record
keeps it: an agent restarted while its engines run must probe them with it, and the control plane
is not asked again. Record files are therefore created mode 0600 in a directory made 0700: the key
is readable by the agent's own user only, who can read it from the engine's ``/proc/PID/environ``
(the marker) and command line anyway.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

import attrs

import schema
import statefile
from schema.ids import shard_id_problem


@attrs.frozen
class ShardRecord:
    shard_id: str
    engine: str
    #: 0 in an intent record: written before the spawn, when no pid exists yet.
    pid: int
    #: Field 22 of /proc/PID/stat (clock ticks since boot): with the pid, it names one process.
    start_time: int
    port: int
    log_path: str
    spec: schema.StartShard

    @property
    def intent(self) -> bool:
        """Written before the spawn; whether an engine exists only ``/proc`` can say."""
        return self.pid <= 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "shard_id": self.shard_id,
                "engine": self.engine,
                "pid": self.pid,
                "start_time": self.start_time,
                "port": self.port,
                "log_path": self.log_path,
                # The spec as protobuf bytes: the wire contract is the one schema we keep stable.
                "spec": base64.b64encode(bytes(self.spec)).decode(),
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> ShardRecord:
        """Raises ValueError (or KeyError, TypeError) for anything that is not a whole record."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        try:
            spec = schema.StartShard.parse(base64.b64decode(doc["spec"], validate=True))
        except binascii.Error as exc:
            raise ValueError(f"spec is not base64: {exc}") from exc
        return cls(
            shard_id=str(doc["shard_id"]),
            engine=str(doc["engine"]),
            pid=int(doc["pid"]),
            start_time=int(doc["start_time"]),
            port=int(doc["port"]),
            log_path=str(doc["log_path"]),
            spec=spec,
        )


@attrs.frozen
class LoadedRecord:
    """One file of the record directory: its shard id (the file name) and the record, or why it
    could not be read."""

    shard_id: str
    path: Path
    record: ShardRecord | None
    problem: str = ""


class RecordStore:
    """One JSON file per shard under ``state_dir/shards``, named after the shard id."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "shards"

    def create(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, shard_id: str) -> Path:
        problem = shard_id_problem(shard_id)
        if problem:
            raise ValueError(problem)
        return self.dir / f"{shard_id}.json"

    def save(self, record: ShardRecord) -> None:
        """Atomically and durably: once this returns, a crash at any instant leaves this record."""
        # 0600 (records hold the shard's key: see the module docstring).
        statefile.write_atomic(self.path(record.shard_id), record.to_json(), mode=0o600)

    def remove(self, shard_id: str) -> None:
        self.path(shard_id).unlink(missing_ok=True)

    def set_aside(self, loaded: LoadedRecord) -> Path:
        """Move an unreadable record out of the way (``ID.json.bad``, for a person to look at)."""
        bad = loaded.path.with_name(loaded.path.name + ".bad")
        os.replace(loaded.path, bad)
        return bad

    def load_all(self) -> list[LoadedRecord]:
        """Every ``*.json`` file, read or with the reason it could not be; leftover temporary files
        of a write a crash interrupted are removed (the record they were replacing still stands)."""
        loaded = []
        # pathlib's "*" matches the hidden ".ID.json.tmp" (and an older version's "ID.json.tmp").
        for tmp in self.dir.glob(f"*.json{statefile.TEMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*.json")):
            shard_id = path.name.removesuffix(".json")
            try:
                data = path.read_bytes()
            except OSError as exc:
                loaded.append(LoadedRecord(shard_id, path, None, f"cannot read it: {exc.strerror or exc}"))
                continue
            try:
                record = ShardRecord.from_json(data.decode())
            except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
                loaded.append(
                    LoadedRecord(
                        shard_id, path, None, f"damaged ({len(data)} bytes): {type(exc).__name__}: {exc}"
                    )
                )
                continue
            if record.shard_id != shard_id:
                loaded.append(
                    LoadedRecord(shard_id, path, None, f"names shard {record.shard_id!r}, not its file name")
                )
                continue
            loaded.append(LoadedRecord(shard_id, path, record))
        return loaded


__all__ = ["LoadedRecord", "RecordStore", "ShardRecord"]
