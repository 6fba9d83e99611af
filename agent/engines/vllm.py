"""vLLM: ``vllm serve MODEL ...``, for the vLLM version the node runs (0.18.x and 0.33.x files).

Flags, and where each was read (vllm-project/vllm):

- ``serve MODEL`` (positional ``model_tag``): ``vllm/entrypoints/cli/serve.py``.
- ``--host``, ``--port``: ``FrontendArgs`` in ``vllm/entrypoints/openai/cli_args.py``.
- ``--served-model-name``, ``--dtype``, ``--quantization``/``-q``, ``--max-model-len``,
  ``--tensor-parallel-size``/``-tp``, ``--pipeline-parallel-size``/``-pp``,
  ``--gpu-memory-utilization`` (default 0.9, ``CacheConfig``): ``vllm/engine/arg_utils.py``.
- ``--nnodes``/``-n``, ``--node-rank``/``-r``, ``--master-addr``, ``--master-port``: the
  ``ParallelConfig`` group of ``vllm/engine/arg_utils.py``; multi-node without Ray uses the
  multiprocessing executor with ``world_size = tp * pp`` split evenly over the nodes
  (``vllm/config/parallel.py``: ``local_world_size = world_size // nnodes``).
- ``--headless`` on ranks > 0: ``vllm/entrypoints/cli/serve.py`` (``run_headless`` starts the
  workers and no API server) and ``docs/serving/parallelism_scaling.md``.
- ``--shutdown-timeout SECONDS``: added by vllm-project/vllm#34730, first released in 0.18.0; 0,
  the default, aborts in-flight requests on SIGTERM, N drains them for up to N seconds. Emitted
  only when the node's version has it (older vLLM exits on the unknown flag; a node older than
  the oldest flag file gets none, ``base.older_than_its_file``), and set below the supervisor's
  SIGKILL deadline (``base.drain_seconds``).
- The shard's secret (``StartShard.api_key``) goes in ``VLLM_API_KEY``, not on the command line
  where ``ps`` shows it: ``vllm/entrypoints/openai/api_server.py`` takes ``args.api_key or
  envs.VLLM_API_KEY``. The version must still have ``--api-key`` (the same check). vLLM answers 401
  on ``/v1/*`` without it and leaves ``/health`` and ``/metrics`` open, which the supervisor's
  probes use.

Choices are not typed here: ``--dtype`` and ``--quantization`` are checked against the flag set of
the version the node runs (``agent/engines/flags/vllm-<version>.json``, produced from vLLM's own
code by ``python -m enginebuild.flags vllm VERSION``), deprecated quantizations included, and the
whole command line, ``extra_args`` too, must parse as that version parses it.

Readiness: ``/health`` answers 200 once the engine is up, and ``/v1/models`` lists the served
name. A headless rank serves no HTTP: it is ready when rank 0 is.
"""

from __future__ import annotations

from collections.abc import Sequence

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines import base, flagsets
from agent.engines.base import Command, Engine, LaunchContext, ShardSpec, StopBehaviour

NAME = "vllm"
DESCRIPTOR = enginedefs.BY_NAME[NAME]

#: The words before the arguments a flag set describes (its ``program`` is ``vllm serve``).
SUBCOMMAND = "serve"

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def _choices(flag: str) -> tuple[str, ...]:
    option = flagsets.for_version(NAME, "").option(flag)
    return tuple(str(c) for c in option.choices) if option is not None and option.choices else ()


#: The oldest vLLM file's choices, for callers that check a profile without a node's version
#: (the simulator's adapter); the adapter itself checks the node's version in ``build_command``.
VERSION = flagsets.for_version(NAME, "").version
DTYPES = _choices("--dtype")
QUANTIZATIONS = _choices("--quantization")

STOP = StopBehaviour(
    graceful_flag="--shutdown-timeout",
    drains_in_flight=True,
    note="drains in-flight requests only when started with --shutdown-timeout N > 0 (0.18.0+, set "
    "below the SIGKILL deadline); otherwise SIGTERM aborts them",
)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """Refuse, before launch, what vLLM would refuse after minutes of loading."""
    validate_as(NAME, profile, gpus, nnodes=nnodes)


def validate_as(
    engine: str, profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1
) -> None:
    """The vLLM rules under another adapter's name (the simulator speaks vLLM's command line).
    The version's choices are checked where the version is known, in ``build_command``."""
    base.check_required(profile, engine)
    base.check_env(profile)
    base.check_gpu_fit(profile, gpus, nnodes, engine, default_fraction=DEFAULT_GPU_MEMORY_UTILIZATION)


SPELLING = base.Spelling(
    served_name="--served-model-name",
    tp="--tensor-parallel-size",
    pp="--pipeline-parallel-size",
    dtype="--dtype",
    quantization="--quantization",
    max_len="--max-model-len",
    memory_fraction="--gpu-memory-utilization",
)


def build_as(
    descriptor: enginedefs.EngineDescriptor, shard: ShardSpec, ctx: LaunchContext, env: dict[str, str]
) -> Command:
    """``vllm serve`` for the node's vLLM version, as ``descriptor`` takes its key; shared with the
    simulator, which parses it with the same version's flag set. Raises ProfileRefused for what
    that version would refuse."""
    fs = base.flag_set(descriptor.flags, ctx)
    argv = base.profile_argv(fs, shard, ctx, SPELLING)
    drain = base.drain_seconds(ctx.shutdown_timeout_seconds)
    if drain > 0 and fs.option("--shutdown-timeout") is not None and not base.older_than_its_file(fs, ctx):
        argv += ["--shutdown-timeout", str(drain)]
    spec = shard.spec
    if shard.multinode:
        argv += [
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--master-addr",
            spec.master_addr,
            "--master-port",
            str(spec.master_port),
        ]
        if shard.follows_rank0:
            argv.append("--headless")
    return base.assemble(descriptor, fs, shard, ctx, argv=argv, env=env, subcommand=(SUBCOMMAND,))


def build_command(shard: ShardSpec, ctx: LaunchContext) -> Command:
    env = base.gpu_env(shard.spec)
    if shard.multinode:
        env.update(base.multinode_env(ctx))
    return build_as(DESCRIPTOR, shard, ctx, env)


ENGINE = Engine(
    name=NAME, validate=validate, build_command=build_command, readiness=base.openai_readiness, stop=STOP
)
