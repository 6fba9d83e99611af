"""What a restarted agent does with each shard it finds: a pure decision over records and ``/proc``.

Inputs: the record files (read, or damaged), the engines carrying this agent's marker
(``procfs.find_engines``), and which recorded (pid, start time) pairs still run. Outputs, one per
shard id (and one per extra engine):

- :class:`Adopt`: an engine runs; watch it again (rewriting its record when the record is missing,
  an intent, damaged or names another pid). The engine is the truth, the record only a pointer to it.
- :class:`Gone`: a record whose engine no longer runs; reported FAILED with the reason, not restarted
  (the control plane decides).
- :class:`Drop`: a record with nothing behind it that was never known to run (an intent written just
  before a crash, or a damaged file): removed, or set aside when damaged. The control plane starts
  the shard again if it still wants it.
- :class:`Extra`: a second engine for one shard, or one that cannot be identified: stopped, so
  that every slot ends with exactly one engine.

The order of preference when a shard has more than one engine: the one its record names, else the
oldest (it has served longest; a newer one is the duplicate).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

import schema
from agent.supervise.procfs import MarkedEngine
from agent.supervise.records import LoadedRecord, ShardRecord
from schema.ids import shard_id_problem


@attrs.frozen
class Adopt:
    shard_id: str
    pid: int
    start_time: int
    spec: schema.StartShard
    #: Whether the record must be written again (missing, an intent, damaged, another pid).
    rewrite: bool
    #: Why the record is rewritten, for the log; empty when it is not.
    note: str = ""


@attrs.frozen
class Gone:
    record: ShardRecord


@attrs.frozen
class Drop:
    loaded: LoadedRecord
    why: str
    #: Damaged files are moved aside for a person; intents are simply removed.
    set_aside: bool


@attrs.frozen
class Extra:
    shard_id: str
    pid: int
    start_time: int
    why: str


Decision = Adopt | Gone | Drop | Extra


def plan_adoption(
    loaded: Sequence[LoadedRecord],
    engines: Sequence[MarkedEngine],
    recorded_running: Collection[str],
) -> list[Decision]:
    """Decide per shard id; ``recorded_running`` holds the ids whose recorded pid and start time
    name a running process (engines started before markers existed are found only that way)."""
    records = {r.shard_id: r for r in loaded}
    by_shard: dict[str, list[MarkedEngine]] = {}
    for engine in engines:
        by_shard.setdefault(engine.shard_id, []).append(engine)
    decisions: list[Decision] = []
    for shard_id in sorted(set(records) | set(by_shard)):
        found = by_shard.get(shard_id, [])
        loaded_record = records.get(shard_id)
        record = loaded_record.record if loaded_record else None
        problem = shard_id_problem(shard_id)
        if problem:
            for e in found:
                decisions.append(Extra(shard_id, e.pid, e.start_time, f"its marker's {problem}"))
            if loaded_record is not None:
                decisions.append(Drop(loaded_record, f"the file name's {problem}", set_aside=True))
            continue
        if found:
            decisions.extend(_adopt_one(shard_id, found, loaded_record))
            continue
        assert loaded_record is not None
        if record is None:
            decisions.append(
                Drop(
                    loaded_record,
                    f"{loaded_record.problem}, and no engine of this shard runs",
                    set_aside=True,
                )
            )
        elif record.intent:
            decisions.append(
                Drop(
                    loaded_record, "an intent to start (the agent stopped before the spawn)", set_aside=False
                )
            )
        elif shard_id in recorded_running:
            decisions.append(Adopt(shard_id, record.pid, record.start_time, record.spec, rewrite=False))
        else:
            decisions.append(Gone(record))
    return decisions


def _adopt_one(shard_id: str, found: list[MarkedEngine], loaded: LoadedRecord | None) -> list[Decision]:
    record = loaded.record if loaded else None
    named = [
        e for e in found if record is not None and (e.pid, e.start_time) == (record.pid, record.start_time)
    ]
    keeper = named[0] if named else min(found, key=lambda e: (e.start_time, e.pid))
    spec = record.spec if record is not None and not record.intent else keeper.spec
    out: list[Decision] = []
    if spec is None or spec.shard_id != shard_id:
        # Neither the record nor the marker says what this engine runs: it cannot be reported.
        for e in found:
            out.append(
                Extra(
                    shard_id, e.pid, e.start_time, "its spec is unreadable in both the record and the marker"
                )
            )
        if loaded is not None:
            out.append(Drop(loaded, "its engine cannot be identified", set_aside=True))
        return out
    if loaded is None:
        note = "no record (the agent stopped between the spawn and writing it, or it was deleted)"
    elif record is None:
        note = f"the record is {loaded.problem}"
    elif record.intent:
        note = "the record was an intent (the agent stopped between the spawn and recording the pid)"
    elif not named:
        note = f"the record names pid {record.pid}, which is not this shard's engine"
    else:
        note = ""
    out.append(Adopt(shard_id, keeper.pid, keeper.start_time, spec, rewrite=bool(note), note=note))
    for e in found:
        if e is not keeper:
            out.append(
                Extra(
                    shard_id,
                    e.pid,
                    e.start_time,
                    f"a second engine for shard {shard_id} (keeping pid {keeper.pid})",
                )
            )
    return out


__all__ = ["Adopt", "Decision", "Drop", "Extra", "Gone", "plan_adoption"]
