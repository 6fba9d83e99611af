"""vLLM: ``vllm serve MODEL ...``, pinned to **vLLM 0.18.0**.

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
- ``--shutdown-timeout SECONDS``: added by vllm-project/vllm#34730, first released in 0.18.0 (the
  release this module pins); 0, the default, aborts in-flight requests on SIGTERM, N drains them
  for up to N seconds. Older vLLM rejects the flag, so it is only emitted when the launch context
  asks for a drain window.

Choices checked before launch: ``--dtype`` (``ModelDType``) and ``--quantization``
(``QuantizationMethods`` in ``vllm/model_executor/layers/quantization/__init__.py``, the list of
the 0.15-0.18 line).

Readiness: ``/health`` answers 200 once the engine is up, and ``/v1/models`` lists the served
name. A headless rank serves no HTTP: it is ready when rank 0 is.
"""

from __future__ import annotations

from collections.abc import Sequence

import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, Readiness, StopBehaviour

NAME = "vllm"
VERSION = "0.18.0"

DTYPES = base.TORCH_DTYPES
QUANTIZATIONS = (
    "awq",
    "fp8",
    "fbgemm_fp8",
    "fp_quant",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mixed",
    "gguf",
    "gptq_marlin",
    "awq_marlin",
    "gptq",
    "compressed-tensors",
    "bitsandbytes",
    "experts_int8",
    "quark",
    "moe_wna16",
    "torchao",
    "inc",
    "mxfp4",
    "petit_nvfp4",
    "cpu_awq",
)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

STOP = StopBehaviour(
    graceful_flag="--shutdown-timeout",
    drains_in_flight=True,
    note="drains in-flight requests only when started with --shutdown-timeout N > 0 (0.18.0+); "
    "otherwise SIGTERM aborts them",
)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """Refuse, before launch, what vLLM would refuse after minutes of loading."""
    validate_as(NAME, profile, gpus, nnodes=nnodes)


def validate_as(
    engine: str, profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1
) -> None:
    """The vLLM rules under another adapter's name (the simulator speaks vLLM's command line)."""
    base.check_required(profile, engine)
    base.check_env(profile)
    base.check_choice("dtype", profile.dtype, DTYPES, f"vLLM {VERSION}")
    base.check_choice("quantization", profile.quantization, QUANTIZATIONS, f"vLLM {VERSION}")
    base.check_gpus_present(gpus, engine)
    base.check_parallel_fit(profile, gpus, nnodes)
    base.check_capability(profile, gpus)
    base.check_memory_fit(profile, gpus, nnodes, default_fraction=DEFAULT_GPU_MEMORY_UTILIZATION)


def build_argv(spec: schema.StartShard, ctx: LaunchContext) -> tuple[str, ...]:
    """``vllm serve`` argv; shared with the simulator, which accepts exactly this command line."""
    profile = base.require_profile(spec)
    tp, pp = base.parallel_sizes(profile)
    argv = [
        *ctx.argv_prefix,
        "serve",
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
    if ctx.shutdown_timeout_seconds > 0:
        argv += ["--shutdown-timeout", str(round(ctx.shutdown_timeout_seconds))]
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
    return tuple(argv)


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
