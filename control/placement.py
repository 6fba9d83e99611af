"""Placement: which nodes, GPUs and ports each model replica runs on, and in words why one cannot.

`place(models, nodes, current)` is a pure function: no I/O, no clock, no randomness, and the same input
always gives the same plan. The reconciler calls it on every change to the catalog or the fleet and turns
the difference between the plan and what runs into start and stop commands; `ctl why` prints the reasons.

Rules where the choice is ours (each one is deterministic):

- **Stability first.** A placement in `current` is kept exactly as it is while its model still exists
  with that replica index, it still has the model's shape (shard count, GPUs per shard), every node it uses
  is known and not "lost", and its GPUs and ports still exist there. "unreachable" nodes keep their
  placements (their engines may still be serving). A multi-node placement is also dropped when one of its
  nodes no longer carries the placement's fabric, so a plan never holds a replica split across fabrics.
  Label, memory and capability requirements are not re-checked for kept placements: like Kubernetes'
  "IgnoredDuringExecution", a running replica is not evicted because a requirement changed. A multi-node
  placement given with no fabric (one rebuilt from what agents report: ShardStatus carries none) is
  kept with the first fabric name its nodes share; that field is the one thing `place` fills in. When two
  current placements claim the same GPU or port (bad input), the one with the lower (model, replica index)
  wins and the other is placed again.
- **Rollouts.** A model may name the replicas it wants (``ModelSpec.replica_ids``, chosen by
  ``control.rollout``) instead of a count, and keep replicas of an older template revision
  (``retained``): those are kept as placed whatever their shape, and never placed anew (the rollout
  replaces them). A replica placed here carries the model's ``revision``; a kept one keeps its own.
  Engines still running outside the placements (an old replica draining) hold their GPUs, so a
  surge replica goes on free GPUs only.
- **Order.** Kept placements claim their GPUs and ports first, then what engines outside every
  placement still hold (`NodeView.held_gpus`, `held_ports`). New replicas are then placed model by model
  in name order, replica index ascending, so scaling down always drops the highest indices and a replica
  with a low index is never starved by one with a higher index of the same model.
- **Single-node replicas.** Among the nodes that fit, prefer one that can give a GPU set fully connected
  over NVLink, then best fit (fewest GPUs left free on the node afterwards, which keeps whole nodes free
  for large shards and sends CPU-only engines to GPU-less nodes first), then the node with fewer replicas
  of the same model (spreads CPU-only replicas), then node_id. On the chosen node the GPU set is the
  lexicographically smallest NVLink clique of free qualifying GPUs, or the lowest indices when no clique
  exists. NVLink peers count when either GPU lists the other.
- **Multi-node replicas.** Every node of a replica must fit one shard on its own. Among the fabrics with
  enough fitting nodes, take the one with the fewest fitting nodes (best fit at the fabric level: keeps
  big fabrics for big jobs), then the fabric name. Within it, take the best nodes by the single-node order
  above. Ranks follow node_id, except that rank 0, the leader, is the lowest node_id among the chosen that
  has a second free port for the master; `master_addr` is its mgmt_addr.
- **Shard ids.** `{replica_id}-s{rank}-{6 hex}`, the hex a hash of the shard's node, GPUs and port, so
  each placement has an id of its own and the same placement always the same id (`shard_id`).
- **Engine versions.** A model whose profile sets ``engine_version`` (PEP 440 specifiers, ``">=0.18"``)
  is placed only on nodes whose agent reported a version of the model's engine that satisfies it
  (pre-releases and dev builds count by their place in the order: a node running ``0.19.0rc1`` has
  ``>=0.18``). A node whose engine is missing, whose version is unknown or not comparable, or whose
  agent reported no versions at all cannot show that it satisfies the constraint, so it takes none.
  llama.cpp's build tags compare by number (``b6432`` is 6432; the constraint may say ``>=b6000``).
  Without a constraint engines are not checked: ``ctl nodes`` shows a node's missing engines.
- **Cordoned and draining nodes** take nothing new; what they run is kept as long as the caller passes
  it in `current` (a drain leaves it out, so its replicas are placed elsewhere).
- **Ports.** Each shard takes the lowest free port in its node's inclusive range; the leader's master
  port is the lowest free port after that (engine and master ports share one pool per node). With
  `master_port_offset > 0` the master port must be exactly engine port + offset instead (for engines that
  derive their rendezvous port from the serving port); the leader then takes the lowest engine port for
  which both are free.
- **NVLink search bound.** The clique search is exact (a depth-first search in index order, pruned when
  too few common peers remain) when a node has at most 16 free qualifying GPUs, so it never visits more
  than the 2**16 subsets of those GPUs (in practice far fewer: about 1 ms for a 16-GPU graph built to have
  no 8-clique). Results are memoised by (topology, free set, size) within one call,
  so a homogeneous fleet searches each shape once. Above 16 free GPUs it is greedy (grow a set from each
  start GPU by lowest index), which may miss a clique but stays linear.
- **Reasons.** Every node gets a short reason with numbers. The summary groups nodes by reason category,
  largest group first, and shows one representative detail per group: for GPU shortages, the node closest
  to fitting; otherwise the lowest node_id. Once one replica of a model cannot be placed, the later ones
  of that model get the same explanation (nothing changed in between).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import attrs
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

#: Node states as the fleet reports them; only READY nodes take new placements.
READY = "ready"
UNREACHABLE = "unreachable"
LOST = "lost"

#: The longest shard id (``schema.ids.SHARD_ID``).
SHARD_ID_MAX = 128

#: Exact NVLink clique search up to this many free qualifying GPUs on a node; greedy above it.
EXACT_CLIQUE_LIMIT = 16

#: How many nodes the summary names in a "share no fabric" group before it says "+N more".
_SUMMARY_NODE_LIMIT = 4


def _int_frozenset(values: Iterable[int]) -> frozenset[int]:
    return frozenset(values)


def _str_frozenset(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


def _gpu_tuple(values: Iterable[GpuView]) -> tuple[GpuView, ...]:
    return tuple(values)


def _unique_gpu_indices(instance: NodeView, attribute: attrs.Attribute[object], value: object) -> None:
    indices = [g.index for g in instance.gpus]
    if len(set(indices)) != len(indices):
        raise ValueError(f"node {instance.node_id}: GPU indices repeat: {sorted(indices)}")


@attrs.frozen
class GpuView:
    """One GPU of a node, as its Register describes it."""

    index: int
    memory_total_mib: int
    #: (major, minor), e.g. (9, 0) for H100.
    compute_capability: tuple[int, int]
    #: Indices of the GPUs this one reaches over NVLink.
    nvlink_peers: frozenset[int] = attrs.field(default=frozenset(), converter=_int_frozenset)


@attrs.frozen
class EngineView:
    """One engine on a node, as its agent found it at start: the version, or why it is unknown."""

    version: str = ""
    error: str = ""


#: A llama.cpp build tag (``b6432``), compared by its number.
_BUILD_TAG = re.compile(r"(?<![\w.])b(\d+)\b")


def _comparable(text: str) -> str:
    """Version or specifier text as PEP 440 reads it: llama.cpp's ``b6432`` becomes ``6432``."""
    return _BUILD_TAG.sub(r"\1", text.strip())


@functools.lru_cache(maxsize=256)
def engine_constraint(text: str) -> SpecifierSet:
    """An ``engine_version`` constraint as a specifier set; ValueError, naming the text, when it is
    not one (``control.config`` checks every profile's at load, naming the line)."""
    try:
        return SpecifierSet(_comparable(text))
    except InvalidSpecifier as exc:
        raise ValueError(
            f"{text!r} is not a PEP 440 version specifier ({exc}); write e.g. '>=0.18' or '>=0.18,<0.34'"
        ) from None


def engine_version_problem(engine: str, constraint: str, engines: Mapping[str, EngineView]) -> str:
    """Why a node whose agent reported ``engines`` cannot run ``engine`` under ``constraint``, in
    words for ``ctl why`` ("vllm 0.17.1 does not satisfy >=0.18"); "" when it can."""
    if not constraint:
        return ""
    found = engines.get(engine)
    if found is None:
        if not engines:
            return f"reports no engine versions (its agent predates version detection); {constraint} cannot be checked"
        return f"reports no {engine} version; {constraint} cannot be checked"
    return _installed_problem(engine, constraint, found.version, found.error)


@functools.lru_cache(maxsize=4096)
def _installed_problem(engine: str, constraint: str, version_text: str, error: str) -> str:
    """:func:`engine_version_problem` for a reported engine; cached, since a fleet reports few
    distinct versions and a placement pass asks once per node."""
    found = EngineView(version_text, error)
    if not found.version:
        if "command not found" in found.error:
            return f"{engine} not installed ({found.error})"
        if found.error.startswith(f"{engine} not installed"):
            return found.error
        return (
            f"{engine} version unknown ({found.error or 'no reason given'}); {constraint} cannot be checked"
        )
    try:
        version = Version(_comparable(found.version))
        spec = engine_constraint(constraint)
    except (InvalidVersion, ValueError):
        return f"{engine} {found.version} is not a version {constraint} can be checked against"
    if spec.contains(version, prereleases=True):
        return ""
    return f"{engine} {found.version} does not satisfy {constraint}"


def _engines(values: Mapping[str, EngineView]) -> Mapping[str, EngineView]:
    return MappingProxyType(dict(values))


@attrs.frozen
class NodeView:
    """What placement needs to know about a node: its liveness, hardware, labels, fabrics and ports."""

    node_id: str
    #: "ready" | "unreachable" | "lost" (other values are treated as not ready).
    state: str
    gpus: tuple[GpuView, ...] = attrs.field(converter=_gpu_tuple, validator=_unique_gpu_indices)
    #: Excluded from the hash (a dict is unhashable) but still compared.
    labels: Mapping[str, str] = attrs.field(hash=False)
    #: Fabric names the node is attached to (configured on the node, not discovered).
    fabrics: frozenset[str] = attrs.field(converter=_str_frozenset)
    #: Where engines on this node are reached; the master address of replicas led from here.
    mgmt_addr: str
    #: Inclusive engine port range the node offers; first > last means no ports.
    port_range: tuple[int, int]
    #: Being drained (`ctl drain`): takes nothing new; the caller moves its replicas off.
    draining: bool = False
    #: Cordoned (`ctl cordon`): keeps what runs, takes nothing new.
    cordoned: bool = False
    #: GPUs and ports held by engines that run on the node outside any current placement (a copy
    #: left over from before the node was lost, or one waiting for its replacement): new placements
    #: keep off them until those engines stop, so no engine starts on a port or GPU still in use.
    held_gpus: frozenset[int] = attrs.field(default=frozenset(), converter=_int_frozenset)
    held_ports: frozenset[int] = attrs.field(default=frozenset(), converter=_int_frozenset)
    #: Engine name -> its version on the node, as the agent reported it in Register; empty when the
    #: agent reported none (an older agent). Excluded from the hash like ``labels``.
    engines: Mapping[str, EngineView] = attrs.field(factory=dict, converter=_engines, hash=False)


@attrs.frozen
class ModelSpec:
    """How many replicas of a model to run and what each one needs."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))
    replicas: int = attrs.field(validator=attrs.validators.ge(0))
    #: GPUs on each node of a replica; 0 for CPU-only engines (sim, llama.cpp on CPU).
    gpus_per_shard: int = attrs.field(validator=attrs.validators.ge(0))
    min_gpu_memory_mib: int = 0
    min_compute_capability: tuple[int, int] = (0, 0)
    #: Labels a node must carry, all of them, exact match.
    selector: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    #: More than 1: a multi-node replica, one shard per node, all on one fabric.
    nodes_per_replica: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: 0: the master port is any free port. >0: it must be the leader's engine port + this offset.
    master_port_offset: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: The profile's engine ("vllm", "sim"...), whose version ``engine_version`` constrains.
    engine: str = ""
    #: PEP 440 specifiers the node's installed engine must satisfy (``">=0.18"``); "": any.
    engine_version: str = ""
    #: The template revision new replicas are placed with (``control.rollout.revision``).
    revision: str = ""
    #: The replicas wanted, by id, when a rollout chooses them (``control.rollout.decide``); None:
    #: ``{name}-r{i}`` for every ``i < replicas``.
    replica_ids: tuple[str, ...] | None = None
    #: Replicas of an older revision that a rollout keeps serving: kept as they are placed whatever
    #: their shape (a change of GPU count is rolled out, not applied to them), never placed anew.
    retained: frozenset[str] = attrs.field(default=frozenset(), converter=_str_frozenset)

    def wanted_ids(self) -> tuple[str, ...]:
        """The replica ids placement places, in order."""
        if self.replica_ids is not None:
            return self.replica_ids
        return tuple(replica_id(self.name, i) for i in range(self.replicas))


@attrs.frozen
class ShardAssignment:
    """One shard of a replica on one node: the fields of StartShard that placement decides."""

    shard_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    port: int
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = ""
    master_port: int = 0


@attrs.frozen
class ReplicaPlacement:
    """Where one replica runs: one shard per node, in rank order."""

    model: str
    replica_id: str
    shards: tuple[ShardAssignment, ...]
    #: The fabric a multi-node replica's nodes share; "" for single-node replicas.
    fabric: str = ""
    #: The model's template revision it was placed with (``control.rollout``); "" when not known
    #: (a placement from an older state file, or adopted): the control plane recovers it.
    revision: str = ""

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.shards)


@attrs.frozen
class Unplaced:
    """A replica that could not be placed, and why, in the manner of Kubernetes' scheduler."""

    model: str
    replica_id: str
    #: One line, e.g. "0/3 nodes are available: 2 insufficient free GPUs (need 8, have 4 free), 1 lost."
    reason: str
    #: node_id -> why that node could not take it (every node of the fleet, in node_id order).
    per_node: Mapping[str, str] = attrs.field(hash=False)


@attrs.frozen
class Plan:
    """The desired placement of every replica: placed ones, and unplaced ones with their reasons."""

    replicas: tuple[ReplicaPlacement, ...]
    unplaced: tuple[Unplaced, ...]

    def for_model(self, name: str) -> tuple[ReplicaPlacement, ...]:
        """The placed replicas of one model, in replica index order."""
        return tuple(r for r in self.replicas if r.model == name)

    def unplaced_for(self, name: str) -> tuple[Unplaced, ...]:
        return tuple(u for u in self.unplaced if u.model == name)

    def replica(self, replica_id: str) -> ReplicaPlacement | None:
        return next((r for r in self.replicas if r.replica_id == replica_id), None)

    def why(self, replica_id: str) -> Unplaced | None:
        """Why a replica is not placed; None when it is (or does not exist)."""
        return next((u for u in self.unplaced if u.replica_id == replica_id), None)

    def on_node(self, node_id: str) -> tuple[tuple[ReplicaPlacement, ShardAssignment], ...]:
        """Every shard the plan puts on one node, with its replica."""
        return tuple((r, s) for r in self.replicas for s in r.shards if s.node_id == node_id)


def replica_id(model: str, index: int) -> str:
    return f"{model}-r{index}"


def model_name_of(replica_id: str) -> str:
    """``llama-70b-r1`` -> ``llama-70b``: the inverse of ``replica_id`` (ids are ``{model}-r{index}``)."""
    return replica_id.rsplit("-r", 1)[0]


def shard_id(replica: str, rank: int, node_id: str, gpu_indices: Sequence[int], port: int) -> str:
    """``{replica}-s{rank}-{6 hex}``: one id per placement, the same for the same placement.

    The hex digits hash where the shard runs (node, GPUs, port) with the replica and rank, so a
    replica placed anew (moved off a drained or lost node, or reshaped) gets an id of its own: the
    old engine's state and log stay reachable under the old id (``ctl logs``), and an agent that
    still runs the old copy can never confuse it with the new one. Ids obey ``schema.ids.SHARD_ID``
    (model names use its alphabet already); a replica id too long to fit 128 characters with the
    suffix is cut, and the hash, taken over the whole of it, keeps the ids of two long names apart.
    """
    where = f"{replica}\0{rank}\0{node_id}\0{','.join(map(str, gpu_indices))}\0{port}"
    digest = hashlib.sha256(where.encode()).hexdigest()[:6]
    suffix = f"-s{rank}-{digest}"
    return f"{replica[: SHARD_ID_MAX - len(suffix)]}{suffix}"


def place(
    models: Iterable[ModelSpec], nodes: Iterable[NodeView], current: Iterable[ReplicaPlacement] = ()
) -> Plan:
    """Place every replica of every model, keeping `current` placements that are still valid.

    Raises ValueError on duplicate model names or node ids: either would make replica ids or node
    resources ambiguous, and guessing which one was meant would lose something silently.
    """
    model_list = sorted(models, key=lambda m: m.name)
    node_list = sorted(nodes, key=lambda n: n.node_id)
    _reject_duplicates("model name", [m.name for m in model_list])
    _reject_duplicates("node id", [n.node_id for n in node_list])

    fleet = _Fleet(node_list)
    ledger = _Ledger(fleet.infos)
    kept = _keep(current, {m.name: m for m in model_list}, fleet.infos, ledger)
    for info in fleet.infos.values():
        ledger.hold(info)
    cliques = _CliqueFinder()
    offers: _OfferMemo = {}

    placed: list[ReplicaPlacement] = []
    unplaced: list[Unplaced] = []
    for model in model_list:
        wanted = model.wanted_ids()
        if all(rid in kept for rid in wanted):
            # The steady state: nothing new to place, so skip judging the fleet for this model.
            placed.extend(kept[rid] for rid in wanted)
            continue
        view = _ModelView(model, fleet)
        candidates = _Candidates(view, ledger, cliques, offers)
        failure: tuple[str, Mapping[str, str]] | None = None
        for rid in wanted:
            keep = kept.get(rid)
            if keep is not None:
                placed.append(keep)
                continue
            if rid in model.retained:
                continue  # an old revision's replica is replaced by the rollout, never placed anew
            if failure is None:
                new = candidates.place(rid)
                if new is not None:
                    placed.append(new)
                    continue
                failure = _explain(view, ledger)
            unplaced.append(Unplaced(model.name, rid, *failure))
    return Plan(tuple(placed), tuple(unplaced))


def _reject_duplicates(what: str, names: Sequence[str]) -> None:
    dupes = sorted({n for i, n in enumerate(names) if i and names[i - 1] == n})
    if dupes:
        raise ValueError(f"duplicate {what}: {', '.join(dupes)}")


class _NodeInfo:
    """A node plus what placement derives from it once per call (GPU lookup, NVLink graph, filters)."""

    __slots__ = (
        "_qualifying",
        "adjacency",
        "first_port",
        "gpus",
        "last_port",
        "node",
        "node_id",
        "port_count",
        "topology",
    )

    def __init__(
        self, node: NodeView, topologies: dict[tuple[tuple[int, tuple[int, ...]], ...], int]
    ) -> None:
        self.node = node
        self.node_id = node.node_id
        self.gpus = {g.index: g for g in node.gpus}
        self.first_port, self.last_port = node.port_range
        self.port_count = max(0, self.last_port - self.first_port + 1)
        linked: dict[int, set[int]] = {i: set() for i in self.gpus}
        for g in node.gpus:
            for peer in g.nvlink_peers:
                if peer in linked and peer != g.index:
                    linked[g.index].add(peer)
                    linked[peer].add(g.index)
        self.adjacency = {i: frozenset(p) for i, p in linked.items()}
        # Nodes with the same NVLink graph share one small id, and with it clique search results.
        shape = tuple(sorted((i, tuple(sorted(p))) for i, p in linked.items()))
        self.topology = topologies.setdefault(shape, len(topologies))
        self._qualifying: dict[tuple[int, tuple[int, int]], frozenset[int]] = {}

    def has_port(self, port: int) -> bool:
        return self.first_port <= port <= self.last_port

    def qualifying(self, min_memory_mib: int, min_capability: tuple[int, int]) -> frozenset[int]:
        """GPU indices that meet a model's minimums (cached: many models share the same minimums)."""
        key = (min_memory_mib, min_capability)
        found = self._qualifying.get(key)
        if found is None:
            found = frozenset(
                i
                for i, g in self.gpus.items()
                if g.memory_total_mib >= min_memory_mib and g.compute_capability >= min_capability
            )
            self._qualifying[key] = found
        return found


_EligibleKey = tuple[tuple[tuple[str, str], ...], int, tuple[int, int], str, str]


class _Fleet:
    """The nodes of one call, split once into those open to new placements and the others with why."""

    def __init__(self, nodes: Sequence[NodeView]) -> None:
        topologies: dict[tuple[tuple[int, tuple[int, ...]], ...], int] = {}
        self.infos = {n.node_id: _NodeInfo(n, topologies) for n in nodes}
        self.open: list[_NodeInfo] = []
        self.closed: dict[str, _Reason] = {}
        for info in self.infos.values():
            reason = _closed_reason(info.node)
            if reason is None:
                self.open.append(info)
            else:
                self.closed[info.node_id] = reason
        self._eligible: dict[_EligibleKey, list[tuple[_NodeInfo, frozenset[int]]]] = {}

    def eligible(self, model: ModelSpec) -> list[tuple[_NodeInfo, frozenset[int]]]:
        """Open nodes that carry the model's labels and satisfy its engine version constraint, with
        their GPUs that meet its minimums.

        Cached by (selector, minimums, engine constraint): catalogs repeat a few requirement sets
        across many models.
        """
        selector = tuple(sorted(model.selector.items()))
        constraint = model.engine_version
        key = (selector, model.min_gpu_memory_mib, model.min_compute_capability, model.engine, constraint)
        found = self._eligible.get(key)
        if found is None:
            found = [
                (info, info.qualifying(model.min_gpu_memory_mib, model.min_compute_capability))
                for info in self.open
                if all(info.node.labels.get(k) == v for k, v in selector)
                and not (constraint and engine_version_problem(model.engine, constraint, info.node.engines))
            ]
            self._eligible[key] = found
        return found

    def static_reasons(self, model: ModelSpec) -> dict[str, _Reason]:
        """Why each node that is closed, lacks the model's labels, or fails its engine version
        constraint, cannot take it."""
        reasons = dict(self.closed)
        if model.selector or model.engine_version:
            eligible = {info.node_id for info, _ in self.eligible(model)}
            memo: dict[tuple[str, ...], _Reason] = {}
            for info in self.open:
                if info.node_id not in eligible:
                    missing = _missing_labels(info.node, model.selector)
                    if not missing:
                        text = engine_version_problem(model.engine, model.engine_version, info.node.engines)
                        summary = f"do not have {model.engine} {model.engine_version}"
                        reasons[info.node_id] = _Reason("engine", text, summary)
                        continue
                    reason = memo.get(missing)
                    if reason is None:
                        reason = memo[missing] = _label_reason(missing)
                    reasons[info.node_id] = reason
        return reasons


class _Ledger:
    """GPUs and ports claimed so far in this call, per node; mutable, but lives only inside one call."""

    def __init__(self, infos: Mapping[str, _NodeInfo]) -> None:
        self.gpus: dict[str, set[int]] = {n: set() for n in infos}
        self.ports: dict[str, set[int]] = {n: set() for n in infos}
        #: model -> node -> replicas of that model with a shard on the node.
        self.replicas_of: dict[str, dict[str, int]] = {}
        #: node -> how many placements have claimed something there; lets fit results be memoised.
        self.version: dict[str, int] = dict.fromkeys(infos, 0)

    def hold(self, info: _NodeInfo) -> None:
        """Claim what engines outside every placement still use there (after the kept placements,
        which keep theirs whatever else runs)."""
        node = info.node
        gpus = {g for g in node.held_gpus if g in info.gpus}
        ports = {p for p in node.held_ports if info.has_port(p)}
        if gpus or ports:
            self.gpus[info.node_id] |= gpus
            self.ports[info.node_id] |= ports
            self.version[info.node_id] += 1

    def free_ports(self, info: _NodeInfo) -> int:
        # Every claimed port lies within the node's range: kept ones are checked, new ones drawn from it.
        return info.port_count - len(self.ports[info.node_id])

    def lowest_port(self, info: _NodeInfo, exclude: int | None = None) -> int | None:
        used = self.ports[info.node_id]
        port = info.first_port
        while port <= info.last_port:
            if port not in used and port != exclude:
                return port
            port += 1
        return None

    def leader_ports(self, info: _NodeInfo, offset: int) -> tuple[int, int] | None:
        """(engine port, master port) for a replica's leader, or None when the node cannot lead."""
        if offset == 0:
            engine = self.lowest_port(info)
            master = None if engine is None else self.lowest_port(info, exclude=engine)
            return None if engine is None or master is None else (engine, master)
        used = self.ports[info.node_id]
        port = info.first_port
        # Each rejected port has itself or its partner in `used`, so this loop is bounded by 2 * len(used).
        while port + offset <= info.last_port:
            if port not in used and port + offset not in used:
                return port, port + offset
            port += 1
        return None

    def claims(self, placement: ReplicaPlacement) -> list[tuple[str, str, int]] | None:
        """Every (node, "gpu" | "port", number) the placement uses; None when it repeats one itself."""
        out: list[tuple[str, str, int]] = []
        for shard in placement.shards:
            out.extend((shard.node_id, "gpu", g) for g in shard.gpu_indices)
            out.append((shard.node_id, "port", shard.port))
            if shard.nnodes > 1 and shard.node_rank == 0:
                out.append((shard.node_id, "port", shard.master_port))
        return out if len(set(out)) == len(out) else None

    def is_free(self, claims: Iterable[tuple[str, str, int]]) -> bool:
        return not any(number in self._pool(kind)[node] for node, kind, number in claims)

    def claim(self, placement: ReplicaPlacement) -> None:
        for node, kind, number in self.claims(placement) or ():
            self._pool(kind)[node].add(number)
        counts = self.replicas_of.setdefault(placement.model, {})
        for node in placement.node_ids:
            counts[node] = counts.get(node, 0) + 1
            self.version[node] += 1

    def _pool(self, kind: str) -> dict[str, set[int]]:
        return self.gpus if kind == "gpu" else self.ports


def _replica_index(model: ModelSpec, rid: str) -> int | None:
    """The index in `rid` when it names a replica of `model` that the catalog still wants (with
    explicit ids: its position among them)."""
    if model.replica_ids is not None:
        return model.replica_ids.index(rid) if rid in model.replica_ids else None
    prefix = f"{model.name}-r"
    digits = rid[len(prefix) :]
    if not rid.startswith(prefix) or not digits.isdigit() or str(int(digits)) != digits:
        return None
    index = int(digits)
    return index if index < model.replicas else None


def _keep(
    current: Iterable[ReplicaPlacement],
    models: Mapping[str, ModelSpec],
    infos: Mapping[str, _NodeInfo],
    ledger: _Ledger,
) -> dict[str, ReplicaPlacement]:
    """The current placements that stay, already claimed in `ledger`, by replica id."""
    candidates: list[tuple[str, int, ReplicaPlacement]] = []
    for placement in current:
        model = models.get(placement.model)
        index = None if model is None else _replica_index(model, placement.replica_id)
        if model is not None and model.nodes_per_replica > 1 and not placement.fabric:
            placement = _with_fabric(placement, infos)
        retained = model is not None and placement.replica_id in model.retained
        if model is not None and index is not None and _still_valid(placement, model, infos, retained):
            candidates.append((placement.model, index, placement))
    kept: dict[str, ReplicaPlacement] = {}
    # Sorted so that, between conflicting placements, the lower (model, index) wins whatever the input
    # order; the sort is stable, so for a repeated replica id the first one given wins.
    for _, _, placement in sorted(candidates, key=lambda c: (c[0], c[1])):
        claims = ledger.claims(placement)
        if placement.replica_id in kept or claims is None or not ledger.is_free(claims):
            continue
        ledger.claim(placement)
        kept[placement.replica_id] = placement
    return kept


def _with_fabric(placement: ReplicaPlacement, infos: Mapping[str, _NodeInfo]) -> ReplicaPlacement:
    """A multi-node placement rebuilt from what agents report (ShardStatus carries no fabric) gets the
    first fabric name all its nodes share, so it can be adopted; with none shared it stays invalid."""
    shared: frozenset[str] | None = None
    for shard in placement.shards:
        info = infos.get(shard.node_id)
        fabrics = info.node.fabrics if info is not None else frozenset()
        shared = fabrics if shared is None else shared & fabrics
    return attrs.evolve(placement, fabric=min(shared)) if shared else placement


def _still_valid(
    placement: ReplicaPlacement, model: ModelSpec, infos: Mapping[str, _NodeInfo], retained: bool = False
) -> bool:
    """Whether a current placement can stay: same shape (unless ``retained``: an old revision's
    replica keeps its own), live nodes, GPUs and ports that still exist."""
    shards = placement.shards
    n = len(shards) if retained else model.nodes_per_replica
    if n < 1 or len(shards) != n or len({s.node_id for s in shards}) != n:
        return False
    if n > 1 and sorted(s.node_rank for s in shards) != list(range(n)):
        return False
    for shard in shards:
        info = infos.get(shard.node_id)
        # A node missing from the fleet is as good as lost: nothing can be known to run there.
        if info is None or info.node.state == LOST:
            return False
        if (len(shard.gpu_indices) != model.gpus_per_shard and not retained) or not all(
            g in info.gpus for g in shard.gpu_indices
        ):
            return False
        if not info.has_port(shard.port) or shard.nnodes != n:
            return False
        if n > 1:
            if not placement.fabric or placement.fabric not in info.node.fabrics:
                return False
            if shard.node_rank == 0 and not info.has_port(shard.master_port):
                return False
    return True


class _ModelView:
    """One model against the fleet: the open nodes that carry its labels, with their qualifying GPUs.

    Liveness, draining, labels and GPU minimums do not change while one call places the model's
    replicas, so they are judged once per model, not once per replica.
    """

    def __init__(self, model: ModelSpec, fleet: _Fleet) -> None:
        self.model = model
        self.fleet = fleet
        self.eligible = fleet.eligible(model)


@attrs.frozen
class _Reason:
    """Why one node cannot take a replica: a grouping category, the node's line, the summary's words."""

    category: str
    text: str
    summary: str
    #: Smaller is closer to fitting; the group's representative is the closest node.
    closeness: tuple[int, ...] = ()


# Tie-break between groups of equal size in the summary: resource shortages first, then policy.
_CATEGORY_ORDER = (
    "gpus", "ports", "fabric", "master", "label", "engine", "cordoned", "draining", "unreachable", "state", "lost",
)  # fmt: skip


def _closed_reason(node: NodeView) -> _Reason | None:
    """Why a node takes no new placement whatever the model, or None when it is open."""
    if node.state == LOST:
        return _Reason("lost", "lost", "lost")
    if node.state == UNREACHABLE:
        return _Reason("unreachable", "not ready (unreachable)", "unreachable")
    if node.state != READY:
        text = f"not ready ({node.state})"
        return _Reason("state", text, text)
    if node.draining:
        return _Reason("draining", "draining", "draining")
    if node.cordoned:
        return _Reason("cordoned", "cordoned", "cordoned")
    return None


def _missing_labels(node: NodeView, selector: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in sorted(selector.items()) if node.labels.get(k) != v)


def _label_reason(missing: Sequence[str]) -> _Reason:
    text = f"missing label{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    return _Reason("label", text, text)


def _memory_text(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"


def _gpu_reason(model: ModelSpec, free: int, qualifying: int) -> _Reason:
    needs = []
    if model.min_gpu_memory_mib > 0:
        needs.append(f">= {_memory_text(model.min_gpu_memory_mib)}")
    if model.min_compute_capability > (0, 0):
        major, minor = model.min_compute_capability
        needs.append(f"compute capability >= {major}.{minor}")
    need = f"need {model.gpus_per_shard}" + (f" with {' and '.join(needs)}" if needs else "")
    have = f"have {free} free" + (f", {qualifying} qualifying" if needs else "")
    text = f"insufficient free GPUs ({need}, {have})"
    return _Reason("gpus", text, text, (-qualifying, -free))


def _resource_reason(
    model: ModelSpec,
    info: _NodeInfo,
    qualifying: frozenset[int],
    ledger: _Ledger,
    memo: dict[tuple[int, int], _Reason],
) -> _Reason | None:
    """Why a node that passes the static checks cannot take one shard now; None when it can.

    `memo` shares one reason between nodes with the same numbers (a large fleet has few distinct ones).
    """
    used = ledger.gpus[info.node_id]
    k = model.gpus_per_shard
    if k:
        free_qualifying = len(qualifying - used)
        if free_qualifying < k:
            key = (len(info.gpus) - len(used), free_qualifying)
            reason = memo.get(key)
            if reason is None:
                reason = memo[key] = _gpu_reason(model, *key)
            return reason
    if not info.port_count:
        # The node's range and the control plane's do not overlap: no port will ever free up there.
        text = "no engine ports: the agent's --engine-ports and llmgw.toml's [engines] ports do not overlap"
        return _Reason("ports", text, text)
    if ledger.free_ports(info) < 1:
        text = f"no free port in {info.first_port}-{info.last_port}"
        return _Reason("ports", text, text)
    return None


class _CliqueFinder:
    """Chooses a shard's GPUs on a node: the first NVLink clique in index order, else the lowest indices.

    Memoised within one `place` call by (NVLink graph, free qualifying GPUs, size), so a fleet of identical
    nodes pays for each search once.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[int, tuple[int, ...], int], tuple[tuple[int, ...], bool]] = {}

    def choose(self, info: _NodeInfo, free: tuple[int, ...], k: int) -> tuple[tuple[int, ...], bool]:
        """(GPU indices, whether they are fully NVLink-connected); `free` is sorted ascending."""
        if k <= 1:
            return free[:k], True
        key = (info.topology, free, k)
        found = self._memo.get(key)
        if found is None:
            if len(free) <= EXACT_CLIQUE_LIMIT:
                clique = _first_clique(free, info.adjacency, k)
            else:
                clique = _greedy_clique(free, info.adjacency, k)
            found = (clique, True) if clique is not None else (free[:k], False)
            self._memo[key] = found
        return found


def _first_clique(
    free: tuple[int, ...], adjacency: Mapping[int, frozenset[int]], k: int
) -> tuple[int, ...] | None:
    """The lexicographically smallest k-clique among `free`, by depth-first search in index order."""

    def extend(chosen: tuple[int, ...], pool: tuple[int, ...]) -> tuple[int, ...] | None:
        if len(chosen) == k:
            return chosen
        need = k - len(chosen)
        for pos, gpu in enumerate(pool):
            if len(pool) - pos < need:
                return None
            peers = adjacency[gpu]
            found = extend((*chosen, gpu), tuple(g for g in pool[pos + 1 :] if g in peers))
            if found is not None:
                return found
        return None

    return extend((), free)


def _greedy_clique(
    free: tuple[int, ...], adjacency: Mapping[int, frozenset[int]], k: int
) -> tuple[int, ...] | None:
    """A k-clique grown greedily from each start GPU in turn, lowest index first; None if none is found."""
    for start in free:
        chosen = [start]
        for gpu in free:
            if gpu > start and all(gpu in adjacency[c] for c in chosen):
                chosen.append(gpu)
                if len(chosen) == k:
                    return tuple(chosen)
    return None


#: What one node offers one shard of k GPUs from a set of qualifying GPUs, at one ledger version:
#: (GPUs free on the node, the GPUs it would give, whether they are NVLink-connected), or None.
_Offer = tuple[int, tuple[int, ...], bool] | None
_OfferMemo = dict[tuple[str, int, frozenset[int]], tuple[int, _Offer]]


#: A node that can take one more shard: (no NVLink clique, GPUs left free after, replicas of this model
#: there, node_id, the GPUs it would give). Plain tuples, so min() and sort() compare them in C; node_id
#: is unique, so comparison never reaches the GPUs.
_Entry = tuple[bool, int, int, str, tuple[int, ...]]


class _Candidates:
    """The nodes that can take one more shard of one model, in preference order, kept current as its
    replicas are placed.

    Between two replicas of the same model only the nodes the first one took change, so each node is
    judged once per model and again only when a placement uses it: O(nodes) per model, not per replica.
    """

    def __init__(self, view: _ModelView, ledger: _Ledger, cliques: _CliqueFinder, offers: _OfferMemo) -> None:
        self.view = view
        self.ledger = ledger
        self.cliques = cliques
        self.offers = offers
        self.entries: dict[str, _Entry] = {}
        # The one pass over the fleet per model, so it is written for speed: models with the same GPU
        # needs see the same offer from a node until something claims there, and the memo turns most of
        # this loop into one dict lookup per node.
        k = view.model.gpus_per_shard
        same = ledger.replicas_of.get(view.model.name, {})
        version = ledger.version
        for info, qualifying in view.eligible:
            node_id = info.node_id
            key = (node_id, k, qualifying)
            memo = offers.get(key)
            if memo is None or memo[0] != version[node_id]:
                memo = (version[node_id], self._offer(info, qualifying, k))
                offers[key] = memo
            offer = memo[1]
            if offer is not None:
                self.entries[node_id] = (not offer[2], offer[0] - k, same.get(node_id, 0), node_id, offer[1])

    def _refresh(self, info: _NodeInfo, qualifying: frozenset[int]) -> None:
        """Judge a node again after a placement of this model claimed something on it."""
        k = self.view.model.gpus_per_shard
        offer = self._offer(info, qualifying, k)
        if offer is None:
            self.entries.pop(info.node_id, None)
            return
        free_count, gpus, nvlinked = offer
        same = self.ledger.replicas_of.get(self.view.model.name, {}).get(info.node_id, 0)
        self.entries[info.node_id] = (not nvlinked, free_count - k, same, info.node_id, gpus)

    def _offer(self, info: _NodeInfo, qualifying: frozenset[int], k: int) -> _Offer:
        used = self.ledger.gpus[info.node_id]
        free_count = len(info.gpus) - len(used)
        if free_count < k or self.ledger.free_ports(info) < 1:
            return None
        ordered: tuple[int, ...] = ()
        if k:
            free = qualifying - used if used else qualifying
            if len(free) < k:
                return None
            ordered = tuple(sorted(free))
        gpus, nvlinked = self.cliques.choose(info, ordered, k)
        return free_count, gpus, nvlinked

    def place(self, rid: str) -> ReplicaPlacement | None:
        """Place one replica and claim what it uses, or return None when it does not fit now."""
        if self.view.model.nodes_per_replica == 1:
            new = self._single(rid)
        else:
            new = self._multi(rid)
        if new is not None:
            self.ledger.claim(new)
            for node_id in new.node_ids:
                info = self.view.fleet.infos[node_id]
                model = self.view.model
                self._refresh(info, info.qualifying(model.min_gpu_memory_mib, model.min_compute_capability))
        return new

    def _single(self, rid: str) -> ReplicaPlacement | None:
        best = min(self.entries.values(), default=None)
        if best is None:
            return None
        info = self.view.fleet.infos[best[3]]
        port = self.ledger.lowest_port(info)
        assert port is not None  # entries hold only nodes with a free port
        shard = ShardAssignment(shard_id(rid, 0, info.node_id, best[4], port), info.node_id, best[4], port)
        return ReplicaPlacement(self.view.model.name, rid, (shard,), revision=self.view.model.revision)

    def _multi(self, rid: str) -> ReplicaPlacement | None:
        model = self.view.model
        n = model.nodes_per_replica
        infos = self.view.fleet.infos
        groups: dict[str, list[_Entry]] = {}
        for entry in self.entries.values():
            for fabric in infos[entry[3]].node.fabrics:
                groups.setdefault(fabric, []).append(entry)
        options = []
        for fabric, members in groups.items():
            if len(members) >= n:
                chosen = self._choose_members(sorted(members), n)
                if chosen is not None:
                    options.append((len(members), fabric, chosen))
        if not options:
            return None
        _, fabric, chosen = min(options, key=lambda o: (o[0], o[1]))
        by_id = sorted(chosen, key=lambda e: e[3])
        leader, engine_port, master_port = next(
            (e, *ports)
            for e in by_id
            if (ports := self.ledger.leader_ports(infos[e[3]], model.master_port_offset)) is not None
        )
        master_addr = infos[leader[3]].node.mgmt_addr
        shards = []
        for rank, entry in enumerate([leader, *(e for e in by_id if e is not leader)]):
            port = engine_port if rank == 0 else self.ledger.lowest_port(infos[entry[3]])
            assert port is not None  # entries hold only nodes with a free port
            shards.append(
                ShardAssignment(
                    shard_id(rid, rank, entry[3], entry[4], port),
                    entry[3],
                    entry[4],
                    port,
                    node_rank=rank,
                    nnodes=n,
                    master_addr=master_addr,
                    master_port=master_port,
                )
            )
        return ReplicaPlacement(model.name, rid, tuple(shards), fabric=fabric, revision=model.revision)

    def _choose_members(self, members: Sequence[_Entry], n: int) -> list[_Entry] | None:
        """The best n members of one fabric, at least one of which can lead; None when none can."""
        offset = self.view.model.master_port_offset
        infos = self.view.fleet.infos

        def can_lead(entry: _Entry) -> bool:
            return self.ledger.leader_ports(infos[entry[3]], offset) is not None

        chosen = list(members[:n])
        if any(can_lead(e) for e in chosen):
            return chosen
        leader = next((e for e in members[n:] if can_lead(e)), None)
        return None if leader is None else [*chosen[:-1], leader]


def _explain(view: _ModelView, ledger: _Ledger) -> tuple[str, Mapping[str, str]]:
    """The summary line and per-node reasons for a replica that could not be placed just now."""
    model = view.model
    n = model.nodes_per_replica
    reasons = view.fleet.static_reasons(model)
    fitting: list[_NodeInfo] = []
    memo: dict[tuple[int, int], _Reason] = {}
    for info, qualifying in view.eligible:
        reason = _resource_reason(model, info, qualifying, ledger, memo)
        if reason is None:
            fitting.append(info)
        else:
            reasons[info.node_id] = reason
    if fitting:
        # Only a multi-node replica can fail with nodes that fit one shard each: they lack a shared
        # fabric with enough others, or no one of them has a second port for the master.
        counts: dict[str, int] = {}
        can_lead: dict[str, bool] = {}
        for info in fitting:
            leads = ledger.leader_ports(info, model.master_port_offset) is not None
            for fabric in info.node.fabrics:
                counts[fabric] = counts.get(fabric, 0) + 1
                can_lead[fabric] = can_lead.get(fabric, False) or leads
        for info in fitting:
            reasons[info.node_id] = _fabric_reason(info, counts, can_lead, n)
    node_ids = list(view.fleet.infos)
    # Read-only, so every unplaced replica of the model can share one mapping.
    per_node = MappingProxyType({node_id: reasons[node_id].text for node_id in node_ids})
    return _summary(node_ids, reasons, n), per_node


def _fabric_reason(
    info: _NodeInfo, counts: Mapping[str, int], can_lead: Mapping[str, bool], n: int
) -> _Reason:
    """Why a node that fits one shard is left out of a multi-node replica.

    For the "fabric" category the summary field holds this node's part of the group's listing
    ("gpu01: ib-a"), since that group names its nodes instead of showing one representative.
    """
    fabrics = sorted(info.node.fabrics)
    if not fabrics:
        return _Reason("fabric", "fits, but is attached to no fabric", f"{info.node_id}: no fabric")
    lacking_leader = [f for f in fabrics if counts[f] >= n and not can_lead[f]]
    if lacking_leader:
        names = ", ".join(lacking_leader)
        text = f"fits, but no fitting node on {names} has a second free port for the master"
        return _Reason("master", text, f"fit but none can lead: no second free port for the master ({names})")
    detail = ", ".join(f"{f}: {counts[f]} of {n}" for f in fabrics)
    text = f"fits, but shares no fabric with enough fitting nodes for a {n}-node replica ({detail})"
    return _Reason("fabric", text, f"{info.node_id}: {'+'.join(fabrics)}")


def _summary(node_ids: Sequence[str], reasons: Mapping[str, _Reason], n: int) -> str:
    """Kubernetes-style: "0/5 nodes are available: 3 <reason>, 2 <reason>." Largest group first."""
    groups: dict[str, list[str]] = {}
    for node_id in node_ids:
        groups.setdefault(reasons[node_id].category, []).append(node_id)

    def order(group: tuple[str, list[str]]) -> tuple[int, int, str]:
        category, members = group
        rank = _CATEGORY_ORDER.index(category) if category in _CATEGORY_ORDER else len(_CATEGORY_ORDER)
        return (-len(members), rank, category)

    parts = []
    for category, members in sorted(groups.items(), key=order):
        if category == "fabric":
            named = [reasons[m].summary for m in members[:_SUMMARY_NODE_LIMIT]]
            if len(members) > _SUMMARY_NODE_LIMIT:
                named.append(f"+{len(members) - _SUMMARY_NODE_LIMIT} more")
            words = f"fit but share no fabric ({', '.join(named)})"
        else:
            representative = min(members, key=lambda m: (reasons[m].closeness, m))
            words = reasons[representative].summary
        parts.append(f"{len(members)} {words}")
    head = f"0/{len(node_ids)} nodes are available" + (f" for a {n}-node replica" if n > 1 else "")
    return f"{head}: {', '.join(parts)}." if parts else f"{head}."
