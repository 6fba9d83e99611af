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
- ``--api-key KEY``: the shard's secret (``StartShard.api_key``); vLLM answers 401 on ``/v1/*``
  without it and leaves ``/health`` and ``/metrics`` open, which the supervisor's probes use.

Choices are not typed here: ``--dtype`` and ``--quantization`` are checked against the flag set of
the version the node runs (``agent/engines/flags/vllm-<version>.json``, produced from vLLM's own
code by ``python -m enginebuild.flags vllm VERSION``), deprecated quantizations included, and the
whole command line, ``extra_args`` too, must parse as that version parses it.

Readiness: ``/health`` answers 200 once the engine is up, and ``/v1/models`` lists the served
name. A headless rank serves no HTTP: it is ready when rank 0 is.
"""

from __future__ import annotations

from collections.abc import Sequence

import schema
from agent.discovery.model import GpuInfo
from agent.engines import base, flagsets
from agent.engines.base import Command, Engine, LaunchContext, Readiness, StopBehaviour

NAME = "vllm"

#: The words before the arguments a flag set describes (its ``program`` is ``vllm serve``).
SUBCOMMAND = "serve"

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def _choices(flag: str) -> tuple[str, ...]:
    option = flagsets.for_version(NAME, "").option(flag)
    return tuple(str(c) for c in option.choices) if option is not None and option.choices else ()


#: The oldest vLLM file's choices, for callers that check a profile without a node's version
#: (the simulator's adapter); the adapter itself checks the node's version in ``build_argv``.
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
    The version's choices are checked where the version is known, in ``build_argv``."""
    base.check_required(profile, engine)
    base.check_env(profile)
    base.check_gpus_present(gpus, engine)
    base.check_parallel_fit(profile, gpus, nnodes)
    base.check_capability(profile, gpus)
    base.check_memory_fit(profile, gpus, nnodes, default_fraction=DEFAULT_GPU_MEMORY_UTILIZATION)


def build_argv(spec: schema.StartShard, ctx: LaunchContext) -> tuple[str, ...]:
    """``vllm serve`` argv for the node's vLLM version; shared with the simulator, which parses it
    with the same version's flag set. Raises ProfileRefused for what that version would refuse."""
    profile = base.require_profile(spec)
    fs = base.flag_set(NAME, ctx)
    base.check_values(fs, spec)
    base.check_flag_choice(fs, "--dtype", profile.dtype, "dtype", profile.extra_args)
    base.check_flag_choice(fs, "--quantization", profile.quantization, "quantization", profile.extra_args)
    tp, pp = base.parallel_sizes(profile)
    argv = [
        profile.model,
        "--served-model-name",
        base.served_name(profile),
        "--host",
        ctx.host,
        "--port",
        str(spec.http_port),
        "--tensor-parallel-size",
        str(tp),
        "--pipeline-parallel-size",
        str(pp),
    ]
    if profile.dtype:
        argv += ["--dtype", profile.dtype]
    if profile.quantization:
        argv += ["--quantization", profile.quantization]
    if profile.max_model_len:
        argv += ["--max-model-len", str(profile.max_model_len)]
    if profile.gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", base.fmt_number(profile.gpu_memory_utilization)]
    drain = base.drain_seconds(ctx.shutdown_timeout_seconds)
    if drain > 0 and fs.option("--shutdown-timeout") is not None and not base.older_than_its_file(fs, ctx):
        argv += ["--shutdown-timeout", str(drain)]
    if spec.api_key:
        base.check_no_api_key_option(fs, spec)
        argv += ["--api-key", spec.api_key]
    if spec.nnodes > 1:
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
        if spec.node_rank > 0:
            argv.append("--headless")
    argv += profile.extra_args
    base.check_command_line(fs, argv)
    return (*ctx.argv_prefix, SUBCOMMAND, *argv)


def build_env(spec: schema.StartShard, ctx: LaunchContext) -> dict[str, str]:
    profile = base.require_profile(spec)
    env = base.gpu_env(spec)
    if spec.nnodes > 1:
        env.update(base.multinode_env(ctx))
    return base.merge_env(env, profile)


def build_command(spec: schema.StartShard, ctx: LaunchContext) -> Command:
    return Command(argv=build_argv(spec, ctx), env=build_env(spec, ctx))


def readiness(spec: schema.StartShard) -> Readiness:
    if spec.nnodes > 1 and spec.node_rank > 0:
        return Readiness.rank0()
    return Readiness(
        health_path="/health",
        models_path="/v1/models",
        model_name=base.served_name(base.require_profile(spec)),
    )


ENGINE = Engine(name=NAME, validate=validate, build_command=build_command, readiness=readiness, stop=STOP)
