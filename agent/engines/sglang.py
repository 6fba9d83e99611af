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
- ``--api-key KEY``: the shard's secret (``StartShard.api_key``). SGLang reads no variable for it
  (``ServerArgs.api_key`` comes from the arguments only), but ``--config FILE.yaml``
  (``sglang/srt/server_args_config_parser.py``, in every version with a flag file) turns a YAML
  file's keys into arguments inside the process: the key goes there (``api-key: KEY``, a 0600
  file in the agent's key directory), out of sight of ``ps``. SGLang takes one ``--config``: a
  profile that passes its own in ``extra_args`` gets the key on the command line.

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

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, ShardSpec, StopBehaviour

NAME = "sglang"
DESCRIPTOR = enginedefs.BY_NAME[NAME]

DEFAULT_MEM_FRACTION_STATIC = 0.85

STOP = StopBehaviour(note="no drain flag: SIGTERM aborts in-flight requests")


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """The rules that hold for every version; the version's choices are checked in
    ``build_command``, where the node's version is known."""
    base.check_required(profile, NAME)
    base.check_env(profile)
    base.check_gpu_fit(
        profile,
        gpus,
        nnodes,
        NAME,
        default_fraction=DEFAULT_MEM_FRACTION_STATIC,
        fraction_name="mem_fraction_static",
    )


SPELLING = base.Spelling(
    model="--model-path",
    served_name="--served-model-name",
    tp="--tp-size",
    pp="--pp-size",
    dtype="--dtype",
    quantization="--quantization",
    max_len="--context-length",
    memory_fraction="--mem-fraction-static",
)


def build_command(shard: ShardSpec, ctx: LaunchContext) -> Command:
    """The launch for the node's SGLang version; raises ProfileRefused for what it would refuse."""
    fs = base.flag_set(NAME, ctx)
    argv = base.profile_argv(fs, shard, ctx, SPELLING)
    env = base.gpu_env(shard.spec)
    if shard.multinode:
        spec = shard.spec
        argv += [
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--dist-init-addr",
            base.host_port(spec.master_addr, spec.master_port),
        ]
        env.update(base.multinode_env(ctx))
    return base.assemble(DESCRIPTOR, fs, shard, ctx, argv=argv, env=env)


ENGINE = Engine(
    name=NAME, validate=validate, build_command=build_command, readiness=base.openai_readiness, stop=STOP
)
