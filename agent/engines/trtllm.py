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
from pathlib import PurePosixPath

import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, ProfileRefused, Readiness, StopBehaviour

NAME = "trtllm"
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


def model_names(model: str) -> tuple[str, ...]:
    """The names trtllm-serve may list ``model`` under: the argument itself, and for a filesystem
    path its base name too (used when the path is a local checkpoint directory)."""
    if model.startswith(("/", "./", "../", "~")):
        base_name = PurePosixPath(model.rstrip("/")).name
        if base_name and base_name != model:
            return (model, base_name)
    return (model,)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    base.check_required(profile, NAME)
    base.check_env(profile)
    if profile.dtype not in ("", "auto"):
        raise ProfileRefused(
            "dtype",
            f"dtype {profile.dtype!r} has no trtllm-serve {VERSION} flag: the checkpoint sets it "
            "(or a --config YAML passed in extra_args); leave dtype empty",
        )
    if profile.quantization and profile.quantization.lower() not in QUANT_ALGOS:
        raise ProfileRefused(
            "quantization",
            f"quantization {profile.quantization!r} is not a TensorRT-LLM {VERSION} QuantAlgo; "
            f"choices: {', '.join(QUANT_ALGOS)}",
        )
    names = model_names(profile.model)
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
    base.check_gpus_present(gpus, NAME)
    base.check_parallel_fit(profile, gpus, nnodes)
    base.check_capability(profile, gpus)
    base.check_memory_fit(
        profile,
        gpus,
        nnodes,
        default_fraction=1.0,
        fraction_name="weights share",
        use_profile_fraction=False,
    )


#: The words before the arguments a flag set describes (its ``program`` is ``trtllm-serve serve``).
SUBCOMMAND = "serve"


def build_command(spec: schema.StartShard, ctx: LaunchContext) -> Command:
    """The launch for the node's TensorRT-LLM version; raises ProfileRefused for what it would refuse."""
    profile = base.require_profile(spec)
    fs = base.flag_set(NAME, ctx)
    base.check_values(fs, spec)
    base.check_no_api_key_option(fs, spec)
    tp, pp = base.parallel_sizes(profile)
    argv = [
        profile.model,
        "--host",
        ctx.host,
        "--port",
        str(spec.http_port),
        "--backend",
        "pytorch",
        "--tp_size",
        str(tp),
        "--pp_size",
        str(pp),
    ]
    if profile.max_model_len:
        argv += ["--max_seq_len", str(profile.max_model_len)]
    if profile.gpu_memory_utilization:
        argv += [
            "--kv_cache_free_gpu_memory_fraction",
            base.fmt_number(profile.gpu_memory_utilization),
        ]
    argv += profile.extra_args
    base.check_command_line(fs, argv)
    return Command(
        argv=(*ctx.argv_prefix, SUBCOMMAND, *argv), env=base.merge_env(base.gpu_env(spec), profile)
    )


def readiness(spec: schema.StartShard) -> Readiness:
    return Readiness(
        health_path="/health",
        models_path="/v1/models",
        model_name=base.served_name(base.require_profile(spec)),
    )


ENGINE = Engine(name=NAME, validate=validate, build_command=build_command, readiness=readiness, stop=STOP)
