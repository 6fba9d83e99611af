"""The models the control plane is asked to run: an object it owns, changed at run time.

The catalog holds each model's definition (a ``ModelConfig``) with where it last came from
(``source``: ``file`` for ``llmgw.toml``'s ``[[models]]``, ``api`` for ``ctl apply`` and ``ctl
scale``), the definition the *file* last gave it (``file_definition``), a ``generation`` that goes
up by one on every change of its definition or replica count (as kubectl's
``metadata.generation``), and whether it is being deleted. Every operation returns what it changed,
kubectl's way (``model/chat configured``), so ``ctl`` and the log can say it.

**The file rule** (a three-way merge, as ``kubectl apply`` keeps its last-applied configuration):
on start and on SIGHUP the control plane applies the file's ``[[models]]`` with ``apply_file``:

- a model new in the file is created;
- a model whose file definition changed since the file last applied it takes the file's new
  definition: the file changed, the file wins (over a ``ctl scale`` or ``ctl apply`` of it);
- a model whose file definition did not change keeps whatever ``ctl`` made of it, so a restart
  never reverts a ``ctl scale``;
- a model that came from the file and has left it is deleted;
- a model that exists only through ``ctl apply`` stays.

A model the file defines cannot be deleted with ``ctl delete`` (``CatalogConflict``): it would come
back at the next start; take it out of the file and send SIGHUP instead.

**Deleting** is not instant: a deleted model stays in ``models()`` with replicas 0 and
``deleting`` set, so its engines are drained and stopped like any replica no longer wanted, and it
leaves the catalog (``finish_deletes``) once no shard of it runs anywhere; until then it cannot be
scaled or applied (``CatalogConflict``).

Pure: no clock, no I/O, no trio. The control plane owns one and persists ``entries()`` through
``control.state``; ``revision`` goes up on every change, so a caller can tell cheaply whether to
place again or save.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

from control.config import ModelConfig
from control.notfound import unknown_model


class Source(enum.StrEnum):
    """Where a model's current definition came from."""

    FILE = "file"
    API = "api"


class Action(enum.StrEnum):
    """What an operation did to one model (kubectl's words, plus ``deleted`` when it is gone)."""

    CREATED = "created"
    CONFIGURED = "configured"
    UNCHANGED = "unchanged"
    SCALED = "scaled"
    DELETING = "deleting"
    DELETED = "deleted"


class CatalogConflict(Exception):
    """An operation the catalog's state forbids (scaling a model being deleted, deleting a model
    the file defines); the message says why and what to do instead."""


@attrs.frozen
class Entry:
    """One model in the catalog."""

    #: The definition in force (for a deleting model, the last one: its replicas say 0 in ``models()``).
    config: ModelConfig
    source: Source
    #: What ``llmgw.toml`` last said of it; None when the file does not define it.
    file_definition: ModelConfig | None = None
    #: +1 on every change of the definition or the replica count.
    generation: int = 1
    deleting: bool = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def desired(self) -> ModelConfig:
        """What placement and routes use: the definition, with replicas 0 while it is deleted."""
        return attrs.evolve(self.config, replicas=0) if self.deleting else self.config


@attrs.frozen
class Change:
    """What one operation did to one model; ``str()`` is kubectl's line, ``model/chat configured``."""

    name: str
    action: Action
    generation: int
    #: Who asked: ``file`` or ``api``.
    by: Source

    def __str__(self) -> str:
        return f"model/{self.name} {self.action.value}"


class Catalog:
    """The desired models (see the module docstring for the rules)."""

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._entries: dict[str, Entry] = {e.name: e for e in entries}
        #: +1 on every change of any entry: whoever places or saves compares it.
        self.revision = 0
        self._models: tuple[int, list[ModelConfig]] | None = None

    # -- reading --------------------------------------------------------------------------------

    def models(self) -> list[ModelConfig]:
        """Every model as placement and the routes see it, by name (a deleting one with replicas 0
        until its shards are gone). The same list object until the next change: do not modify it."""
        if self._models is None or self._models[0] != self.revision:
            self._models = (self.revision, [self._entries[n].desired for n in sorted(self._entries)])
        return self._models[1]

    def served(self) -> list[ModelConfig]:
        """The models the router offers clients: every one not being deleted. A deleted model's
        new requests are answered 404 at once (as a Service drops a terminating pod's endpoint)
        while its engines drain what they already have."""
        return [m for m in self.models() if not self._entries[m.name].deleting]

    def get(self, name: str) -> ModelConfig | None:
        """The model as placement sees it, or None."""
        entry = self._entries.get(name)
        return entry.desired if entry is not None else None

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def entries(self) -> list[Entry]:
        """Every entry, by name (what the state file keeps)."""
        return [self._entries[n] for n in sorted(self._entries)]

    def generation(self, name: str) -> int:
        """The model's generation; 0 for a model not in the catalog."""
        entry = self._entries.get(name)
        return entry.generation if entry is not None else 0

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _unknown(self, name: str) -> KeyError:
        return KeyError(unknown_model(name, self.names()))

    def _set(self, entry: Entry) -> None:
        self._entries[entry.name] = entry
        self.revision += 1

    # -- ctl: apply, scale, delete --------------------------------------------------------------

    def apply(self, models: Sequence[ModelConfig]) -> list[Change]:
        """``ctl apply``: create each model, or replace its definition (``unchanged`` when it is the
        same). All or nothing: ``CatalogConflict`` for a model being deleted, before anything changes."""
        names = [m.name for m in models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model {dupes[0]!r} is defined twice; each model once per apply")
        for m in models:
            entry = self._entries.get(m.name)
            if entry is not None and entry.deleting:
                raise CatalogConflict(
                    f"model {m.name!r} is being deleted (its engines drain and stop); apply it again "
                    f"once it is gone: `ctl delete {m.name} --wait` waits for that"
                )
        changes = []
        for m in models:
            entry = self._entries.get(m.name)
            if entry is None:
                self._set(Entry(m, Source.API))
                changes.append(Change(m.name, Action.CREATED, 1, Source.API))
            elif entry.config == m:
                changes.append(Change(m.name, Action.UNCHANGED, entry.generation, Source.API))
            else:
                new = attrs.evolve(entry, config=m, source=Source.API, generation=entry.generation + 1)
                self._set(new)
                changes.append(Change(m.name, Action.CONFIGURED, new.generation, Source.API))
        return changes

    def scale(self, name: str, replicas: int) -> Change:
        """``ctl scale``: set the replica count. ``KeyError`` naming the known models for an unknown
        one, ``CatalogConflict`` for one being deleted, ``ValueError`` for a negative count."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be a whole number, 0 or more, got {replicas!r}")
        entry = self._entries.get(name)
        if entry is None:
            raise self._unknown(name)
        if entry.deleting:
            raise CatalogConflict(f"model {name!r} is being deleted; it cannot be scaled")
        if entry.config.replicas == replicas:
            return Change(name, Action.UNCHANGED, entry.generation, Source.API)
        config = attrs.evolve(entry.config, replicas=replicas)
        new = attrs.evolve(entry, config=config, source=Source.API, generation=entry.generation + 1)
        self._set(new)
        return Change(name, Action.SCALED, new.generation, Source.API)

    def delete(self, name: str, *, by: Source = Source.API) -> Change:
        """``ctl delete`` (or the file dropping a model): mark it deleting, replicas 0. Deleting one
        already being deleted is ``unchanged``. From the API, a model the file defines is refused."""
        entry = self._entries.get(name)
        if entry is None:
            raise self._unknown(name)
        if entry.deleting:
            return Change(name, Action.UNCHANGED, entry.generation, by)
        if by is Source.API and entry.file_definition is not None:
            raise CatalogConflict(
                f"model {name!r} is defined in the control plane's llmgw.toml and would come back at "
                "its next start; remove its [[models]] table there and send the control plane SIGHUP "
                "(or restart it)"
            )
        new = attrs.evolve(entry, deleting=True, file_definition=None, generation=entry.generation + 1)
        self._set(new)
        return Change(name, Action.DELETING, new.generation, by)

    def finish_deletes(self, running: Iterable[str]) -> list[Change]:
        """Remove the deleting models that nothing runs any more (``running``: the names of models
        with a live shard or a placement somewhere)."""
        busy = set(running)
        gone = [e for e in self.entries() if e.deleting and e.name not in busy]
        for e in gone:
            del self._entries[e.name]
            self.revision += 1
        return [Change(e.name, Action.DELETED, e.generation, Source.API) for e in gone]

    # -- the file -------------------------------------------------------------------------------

    def apply_file(self, models: Sequence[ModelConfig]) -> list[Change]:
        """Apply ``llmgw.toml``'s ``[[models]]`` by the file rule (module docstring). Returns every
        change, ``unchanged`` ones included (one per file model, then one per model it dropped)."""
        changes = []
        in_file = {m.name for m in models}
        for m in models:
            entry = self._entries.get(m.name)
            if entry is None:
                self._set(Entry(m, Source.FILE, file_definition=m))
                changes.append(Change(m.name, Action.CREATED, 1, Source.FILE))
            elif entry.file_definition == m and not entry.deleting:
                changes.append(Change(m.name, Action.UNCHANGED, entry.generation, Source.FILE))
            elif entry.config == m and not entry.deleting:
                # The file now says what is already in force: remember it, change nothing running.
                self._set(attrs.evolve(entry, file_definition=m))
                changes.append(Change(m.name, Action.UNCHANGED, entry.generation, Source.FILE))
            else:
                new = attrs.evolve(
                    entry,
                    config=m,
                    source=Source.FILE,
                    file_definition=m,
                    generation=entry.generation + 1,
                    deleting=False,
                )
                self._set(new)
                changes.append(Change(m.name, Action.CONFIGURED, new.generation, Source.FILE))
        for entry in self.entries():
            if entry.file_definition is not None and entry.name not in in_file:
                changes.append(self.delete(entry.name, by=Source.FILE))
        return changes


__all__ = ["Action", "Catalog", "CatalogConflict", "Change", "Entry", "Source"]
