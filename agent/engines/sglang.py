"""SGLang: ``python -m sglang.launch_server --model-path MODEL ...``, pinned to **SGLang 0.5.4**.

Flags, all read from ``python/sglang/srt/server_args.py`` (sgl-project/sglang, the 0.5.4 line: the
version with ``--grpc-mode`` and the NSA attention backends), ``ServerArgs.add_cli_args``:

- ``--model-path`` (alias ``--model``), ``--served-model-name``, ``--host``, ``--port``.
- ``--tp-size`` (alias ``--tensor-parallel-size``), ``--pp-size`` (alias
  ``--pipeline-parallel-size``).
- ``--dtype`` (choices auto, half, float16, bfloat16, float, float32), ``--quantization``
  (``QUANTIZATION_CHOICES``), ``--context-length``, ``--mem-fraction-static`` (the fraction of GPU
  memory for weights *and* the KV pool; unset, SGLang picks one from the GPU size, typically
  0.83-0.9, which is why the memory estimate assumes 0.85).
- Multi-node: ``--nnodes``, ``--node-rank``, ``--dist-init-addr HOST:PORT`` (alias
  ``--nccl-init-addr``); tp * pp GPUs are split evenly over the nodes.

Readiness: ``/health`` (``/health_generate`` runs a real generation and is too heavy to poll while
loading) and ``/v1/models``. Ranks > 0 of a multi-node replica run only schedulers; SGLang gives
them a *dummy* health server (``launch_dummy_health_check_server`` in ``sglang/srt/utils``) whose
``/health`` answers 200 unconditionally, so it says nothing about readiness: such a shard is ready
when rank 0 is (``Readiness.rank0()``).

Stop: SIGTERM. No drain flag was found in the pinned ``server_args.py``; in-flight requests are
aborted.
"""

from __future__ import annotations

from collections.abc import Sequence

import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, Readiness, StopBehaviour

NAME = "sglang"
VERSION = "0.5.4"

DTYPES = base.TORCH_DTYPES
QUANTIZATIONS = (
    "awq",
    "fp8",
    "gptq",
    "marlin",
    "gptq_marlin",
    "awq_marlin",
    "bitsandbytes",
    "gguf",
    "modelopt",
    "modelopt_fp8",
    "modelopt_fp4",
    "petit_nvfp4",
    "w8a8_int8",
    "w8a8_fp8",
    "moe_wna16",
    "qoq",
    "w4afp8",
    "mxfp4",
    "auto-round",
    "compressed-tensors",
)
DEFAULT_MEM_FRACTION_STATIC = 0.85

STOP = StopBehaviour(note="no drain flag at 0.5.4: SIGTERM aborts in-flight requests")


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    base.check_required(profile, NAME)
    base.check_env(profile)
    base.check_choice("dtype", profile.dtype, DTYPES, f"SGLang {VERSION}")
    base.check_choice("quantization", profile.quantization, QUANTIZATIONS, f"SGLang {VERSION}")
    base.check_gpus_present(gpus, NAME)
    base.check_parallel_fit(profile, gpus, nnodes)
    base.check_capability(profile, gpus)
    base.check_memory_fit(
        profile,
        gpus,
        nnodes,
        default_fraction=DEFAULT_MEM_FRACTION_STATIC,
        fraction_name="mem_fraction_static",
    )


def build_command(spec: schema.StartShard, ctx: LaunchContext) -> Command:
    profile = base.require_profile(spec)
    tp, pp = base.parallel_sizes(profile)
    argv = [
        *ctx.argv_prefix,
        "--model-path",
        profile.model,
        "--served-model-name",
        base.served_name(profile),
        "--host",
        ctx.host,
        "--port",
        str(spec.http_port),
        "--tp-size",
        str(tp),
        "--pp-size",
        str(pp),
    ]
    if profile.dtype:
        argv += ["--dtype", profile.dtype]
    if profile.quantization:
        argv += ["--quantization", profile.quantization]
    if profile.max_model_len:
        argv += ["--context-length", str(profile.max_model_len)]
    if profile.gpu_memory_utilization:
        argv += ["--mem-fraction-static", base.fmt_number(profile.gpu_memory_utilization)]
    env = base.gpu_env(spec)
    if spec.nnodes > 1:
        argv += [
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--dist-init-addr",
            base.host_port(spec.master_addr, spec.master_port),
        ]
        env.update(base.multinode_env(ctx))
    argv += profile.extra_args
    return Command(argv=tuple(argv), env=base.merge_env(env, profile))


def readiness(spec: schema.StartShard) -> Readiness:
    if spec.nnodes > 1 and spec.node_rank > 0:
        return Readiness.rank0()
    return Readiness(
        health_path="/health",
        models_path="/v1/models",
        model_name=base.served_name(base.require_profile(spec)),
    )


ENGINE = Engine(name=NAME, validate=validate, build_command=build_command, readiness=readiness, stop=STOP)
