"""SGLang: ``python -m sglang.launch_server --model-path MODEL ...``, for the SGLang version the
node runs (flag files for 0.5.4 and 0.5.10.post1).

Flags, all read from ``python/sglang/srt/server_args.py`` (sgl-project/sglang),
``ServerArgs.add_cli_args``; present in every version with a flag file:

- ``--model-path`` (alias ``--model``), ``--served-model-name``, ``--host``, ``--port``.
- ``--tp-size`` (alias ``--tensor-parallel-size``), ``--pp-size`` (alias
  ``--pipeline-parallel-size``).
- ``--dtype`` (choices auto, half, float16, bfloat16, float, float32), ``--quantization``
  (``QUANTIZATION_CHOICES``), ``--context-length``, ``--mem-fraction-static`` (the fraction of GPU
  memory for weights *and* the KV pool; unset, SGLang picks one from the GPU size, typically
  0.83-0.9, which is why the memory estimate assumes 0.85).
- Multi-node: ``--nnodes``, ``--node-rank``, ``--dist-init-addr HOST:PORT`` (alias
  ``--nccl-init-addr``); tp * pp GPUs are split evenly over the nodes.
- ``--api-key KEY``: the shard's secret (``StartShard.api_key``).

Choices are not typed here: ``--dtype`` and ``--quantization`` are checked against the flag set of
the version the node runs (``agent/engines/flags/sglang-<version>.json``, produced from SGLang's
own parser by ``python -m enginebuild.flags sglang VERSION``): 0.5.4 has no ``auto-round``, later
versions do. The whole command line, ``extra_args`` included, must parse as that version parses it.

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

DEFAULT_MEM_FRACTION_STATIC = 0.85

STOP = StopBehaviour(note="no drain flag: SIGTERM aborts in-flight requests")


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """The rules that hold for every version; the version's choices are checked in
    ``build_command``, where the node's version is known."""
    base.check_required(profile, NAME)
    base.check_env(profile)
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
    """The launch for the node's SGLang version; raises ProfileRefused for what it would refuse."""
    profile = base.require_profile(spec)
    fs = base.flag_set(NAME, ctx)
    base.check_values(fs, spec)
    base.check_flag_choice(fs, "--dtype", profile.dtype, "dtype", profile.extra_args)
    base.check_flag_choice(fs, "--quantization", profile.quantization, "quantization", profile.extra_args)
    tp, pp = base.parallel_sizes(profile)
    argv = [
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
    if spec.api_key:
        base.check_no_api_key_option(fs, spec)
        argv += ["--api-key", spec.api_key]
    argv += profile.extra_args
    base.check_command_line(fs, argv)
    return Command(argv=(*ctx.argv_prefix, *argv), env=base.merge_env(env, profile))


def readiness(spec: schema.StartShard) -> Readiness:
    if spec.nnodes > 1 and spec.node_rank > 0:
        return Readiness.rank0()
    return Readiness(
        health_path="/health",
        models_path="/v1/models",
        model_name=base.served_name(base.require_profile(spec)),
    )


ENGINE = Engine(name=NAME, validate=validate, build_command=build_command, readiness=readiness, stop=STOP)
