"""TensorRT-LLM: ``trtllm-serve serve MODEL ...``, pinned to **TensorRT-LLM 1.2**.

Flags, from ``tensorrt_llm/commands/serve.py`` (NVIDIA/TensorRT-LLM, the 1.2 line: ``serve`` has
``--custom_tokenizer`` and ``--config``, and the group has a ``grpc`` command); ``trtllm-serve`` is a
click ``DefaultGroup``, so the explicit ``serve`` is accepted by every version:

- ``MODEL`` (positional), ``--host`` (default localhost), ``--port``.
- ``--backend pytorch`` (the default since 1.0; stated so an old default cannot surprise us).
- ``--tp_size`` (alias ``--tensor_parallel_size``), ``--pp_size`` (alias
  ``--pipeline_parallel_size``), ``--max_seq_len``.
- ``--kv_cache_free_gpu_memory_fraction`` (alias ``--free_gpu_memory_fraction``, default 0.9): the
  fraction of the memory left *after* the weights that goes to the KV cache. It is not vLLM's
  ``gpu_memory_utilization``, but it is the knob that plays its part, so the profile's fraction
  maps onto it; the memory estimate therefore counts all of each GPU for the weights.

What trtllm-serve has no flag for, and so is refused rather than silently dropped: ``dtype``
(the checkpoint, or a ``--config`` YAML in ``extra_args``, sets it), a ``served_model_name``
different from the name the OpenAI server gives the model (its argument, or the base name of a
local checkpoint directory: ``tensorrt_llm/serve/openai_server.py`` uses ``Path(model).name``
when the path is a directory), and multi-node
shards (they need an MPI launcher, ``trtllm-llmapi-launch`` under mpirun or srun, which llmgw does
not drive). ``quantization`` is read from the checkpoint too; the profile may state it (a
``QuantAlgo`` name from ``tensorrt_llm/quantization/mode.py``) for the capability and memory
checks, and it is not passed on the command line.

trtllm-serve has no API-key option: the control plane sends no key for its shards, and a key sent
anyway is refused (``base.check_no_api_key_option``) rather than dropped, since an engine started
without it would answer anyone. The whole command line, ``extra_args`` included, is checked against
the flag set of the version the node runs (``agent/engines/flags/trtllm-<version>.json``, from the
click decorators of ``tensorrt_llm/commands/serve.py`` by ``python -m enginebuild.flags trtllm
VERSION``).

Readiness: ``/health``, then ``/v1/models`` must list the served name (which of the two names a
path gets depends on the node's filesystem, so only the running server can say). Stop: SIGTERM; no
drain flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, ProfileRefused, ShardSpec, StopBehaviour

NAME = "trtllm"
DESCRIPTOR = enginedefs.BY_NAME[NAME]
VERSION = "1.2"

#: ``QuantAlgo`` members, lower-cased (matched case-insensitively).
QUANT_ALGOS = (
    "w8a16",
    "w4a16",
    "w4a16_awq",
    "w4a8_awq",
    "w8a16_gptq",
    "w4a16_gptq",
    "w8a8_sq_per_channel",
    "w8a8_sq_per_tensor_plugin",
    "w8a8_sq_per_channel_per_token_plugin",
    "w8a8_sq_per_channel_per_tensor_plugin",
    "w8a8_sq_per_tensor_per_token_plugin",
    "w4a8_qserve_per_group",
    "w4a8_qserve_per_channel",
    "fp8",
    "fp8_per_channel_per_token",
    "fp8_block_scales",
    "int8",
    "mixed_precision",
    "nvfp4",
    "w4a8_nvfp4_fp8",
    "w4a8_mxfp4_fp8",
    "w4a8_mxfp4_mxfp8",
    "w4a16_mxfp4",
    "no_quant",
)

STOP = StopBehaviour(note="no drain flag at 1.2: SIGTERM aborts in-flight requests")


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    base.check_required(profile, NAME)
    base.check_env(profile)
    base.check_weights_fixed_by_checkpoint(
        profile,
        QUANT_ALGOS,
        dtype_why=f"has no trtllm-serve {VERSION} flag: the checkpoint sets it "
        "(or a --config YAML passed in extra_args); leave dtype empty",
        quantization_of=f"a TensorRT-LLM {VERSION} QuantAlgo",
    )
    names = enginedefs.model_names(profile.model)
    if profile.served_model_name not in names:
        served_as = " or ".join(repr(n) for n in names)
        raise ProfileRefused(
            "served-model-name",
            f"served_model_name {profile.served_model_name!r} cannot be honoured: trtllm-serve "
            f"{VERSION} has no flag for it and serves the model as {served_as}",
        )
    base.check_nnodes(
        nnodes,
        NAME,
        "multi-node TensorRT-LLM needs an MPI launcher (trtllm-llmapi-launch under mpirun or "
        "srun), which llmgw does not drive",
    )
    base.check_gpu_fit(
        profile,
        gpus,
        nnodes,
        NAME,
        default_fraction=1.0,
        fraction_name="weights share",
        use_profile_fraction=False,
    )


#: The words before the arguments a flag set describes (its ``program`` is ``trtllm-serve serve``).
SUBCOMMAND = "serve"

#: The profile's memory fraction maps onto the KV cache's share of what the weights leave.
SPELLING = base.Spelling(
    after_port=("--backend", "pytorch"),
    tp="--tp_size",
    pp="--pp_size",
    max_len="--max_seq_len",
    memory_fraction="--kv_cache_free_gpu_memory_fraction",
)


def build_command(shard: ShardSpec, ctx: LaunchContext) -> Command:
    """The launch for the node's TensorRT-LLM version; raises ProfileRefused for what it would refuse
    (a shard key among them: trtllm-serve has no key option, ``enginedefs``)."""
    fs = base.flag_set(NAME, ctx)
    argv = base.profile_argv(fs, shard, ctx, SPELLING)
    return base.assemble(
        DESCRIPTOR, fs, shard, ctx, argv=argv, env=base.gpu_env(shard.spec), subcommand=(SUBCOMMAND,)
    )


ENGINE = Engine(
    name=NAME, validate=validate, build_command=build_command, readiness=base.openai_readiness, stop=STOP
)
