"""What the supervisor writes down about each engine, so a restarted agent can find it again.

A record is the shard's spec, the engine's pid and the process start time read from
``/proc/PID/stat``. The pid alone is not enough: after a reboot or a long outage the kernel reuses
pids, and an agent that adopted "pid 4242" without checking its start time could end up signalling
somebody else's process. Records are written atomically (write, fsync, rename) so a ``kill -9`` in
the middle never leaves a half-written file.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import attrs

import schema


@attrs.frozen
class ShardRecord:
    shard_id: str
    engine: str
    pid: int
    #: Field 22 of /proc/PID/stat (clock ticks since boot): with the pid, it names one process.
    start_time: int
    port: int
    log_path: str
    spec: schema.StartShard

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
        doc = json.loads(text)
        return cls(
            shard_id=str(doc["shard_id"]),
            engine=str(doc["engine"]),
            pid=int(doc["pid"]),
            start_time=int(doc["start_time"]),
            port=int(doc["port"]),
            log_path=str(doc["log_path"]),
            spec=schema.StartShard.parse(base64.b64decode(doc["spec"])),
        )


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or ``None`` when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); field 22 is fields[19].
    if fields[0] in ("Z", "X"):
        return None  # a zombie is not a running engine
    return int(fields[19])


def is_same_process(record: ShardRecord) -> bool:
    return process_start_time(record.pid) == record.start_time


class RecordStore:
    """One JSON file per shard under ``state_dir/shards``."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, shard_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in shard_id)
        return self.dir / f"{safe}.json"

    def save(self, record: ShardRecord) -> None:
        path = self._path(record.shard_id)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            f.write(record.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def remove(self, shard_id: str) -> None:
        self._path(shard_id).unlink(missing_ok=True)

    def load_all(self) -> tuple[list[ShardRecord], list[str]]:
        """Every readable record, and a note for each file that could not be read (kept for a person)."""
        records, problems = [], []
        for path in sorted(self.dir.glob("*.json")):
            try:
                records.append(ShardRecord.from_json(path.read_text()))
            except (OSError, ValueError, KeyError) as exc:
                problems.append(f"{path}: unreadable shard record ({exc}); left in place")
        return records, problems
