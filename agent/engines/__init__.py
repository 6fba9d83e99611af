"""Engine adapters, one module per engine, and the registry the supervisor looks them up in.

Each adapter is pure (see ``base``): ``validate(profile, gpus, nnodes=)`` refuses what the engine
would refuse, ``build_command(shard, ctx)`` is the argv, the environment we add and the key files,
``readiness(shard)`` says what to poll, and ``stop`` how to stop it. ``plan`` runs all of it for one
``StartShard`` on this node, which is what the supervisor calls before it spawns anything.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines.base import (
    Command,
    Engine,
    LaunchContext,
    ProfileRefused,
    Readiness,
    ShardSpec,
    StopBehaviour,
    format_indices,
)


def load_adapter(descriptor: enginedefs.EngineDescriptor) -> Engine:
    """The adapter a descriptor names (``module:attribute``), checked to be the engine it says."""
    module, _, attribute = descriptor.adapter.partition(":")
    engine = getattr(importlib.import_module(module), attribute)
    if not isinstance(engine, Engine) or engine.name != descriptor.name:
        raise TypeError(f"{descriptor.adapter} is not the {descriptor.name} adapter (got {engine!r})")
    return engine


#: Every engine's adapter, one per descriptor (``enginedefs.DESCRIPTORS``), in its order.
ENGINES: Mapping[str, Engine] = MappingProxyType({d.name: load_adapter(d) for d in enginedefs.DESCRIPTORS})


@attrs.frozen
class Launch:
    """Everything the supervisor needs to start and watch one shard."""

    engine: str
    command: Command
    readiness: Readiness
    stop: StopBehaviour


def engine_for(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise ProfileRefused(
            "engine", f"engine {name!r} is not one llmgw can run; known engines: {known}"
        ) from None


def select_gpus(node_gpus: Sequence[GpuInfo], indices: Sequence[int]) -> tuple[GpuInfo, ...]:
    """The shard's GPUs, in the order the spec names them; refuses an index the node lacks or
    names twice (CUDA_VISIBLE_DEVICES with a duplicate fails inside the engine, minutes later)."""
    by_index = {g.index: g for g in node_gpus}
    missing = [i for i in indices if i not in by_index]
    if missing:
        raise ProfileRefused(
            "gpu-indices",
            f"gpu_indices {format_indices(missing)} do not exist on this node "
            f"(it has {format_indices(by_index)})",
        )
    if len(set(indices)) != len(indices):
        raise ProfileRefused("gpu-indices", f"gpu_indices {list(indices)} name a GPU twice")
    return tuple(by_index[i] for i in indices)


def check_spec(spec: schema.StartShard) -> None:
    """The multi-node fields hang together: a rank within the replica, and rank 0's address."""
    if spec.http_port == 0 and not (spec.nnodes > 1 and spec.node_rank > 0):
        raise ProfileRefused("http-port", "http_port is required (the port the engine serves on)")
    if spec.nnodes > 1:
        if spec.node_rank >= spec.nnodes:
            raise ProfileRefused("multi-node", f"node_rank {spec.node_rank} is outside nnodes {spec.nnodes}")
        if not spec.master_addr or not spec.master_port:
            raise ProfileRefused(
                "multi-node",
                f"a {spec.nnodes}-node shard needs master_addr and master_port "
                f"(got {spec.master_addr or 'no address'}:{spec.master_port or 'no port'})",
            )


def plan(spec: schema.StartShard, node_gpus: Sequence[GpuInfo], ctx: LaunchContext) -> Launch:
    """Validate one StartShard against this node and build its launch; raises ProfileRefused.
    The StartShard is converted here, once (``ShardSpec.of``); the adapter takes the result."""
    shard = ShardSpec.of(spec)
    engine = engine_for(shard.profile.engine)
    check_spec(spec)
    gpus = select_gpus(node_gpus, spec.gpu_indices)
    engine.validate(shard.profile, gpus, nnodes=max(spec.nnodes, 1))
    command = engine.build_command(shard, ctx)
    stop = engine.stop
    if stop.drains_in_flight and stop.graceful_flag and stop.graceful_flag not in command.argv:
        # The engine drains on SIGTERM only with its graceful flag, which this version (or a stop
        # grace too short for a margin) did not get: SIGTERM aborts, so a drain must wait itself.
        stop = attrs.evolve(stop, drains_in_flight=False)
    return Launch(engine=engine.name, command=command, readiness=engine.readiness(shard), stop=stop)


__all__ = [
    "ENGINES",
    "Command",
    "Engine",
    "Launch",
    "LaunchContext",
    "ProfileRefused",
    "Readiness",
    "ShardSpec",
    "StopBehaviour",
    "check_spec",
    "engine_for",
    "plan",
    "select_gpus",
]
