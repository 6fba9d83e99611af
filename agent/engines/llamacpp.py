"""llama.cpp: ``llama-server -m MODEL.gguf ...``, pinned to the ``common/arg.cpp`` of late-2025
llama.cpp (ggml-org/llama.cpp, the version with ``-fit``/``--fit``); every flag used here is older
and unchanged since 2024.

Flags, from ``common/arg.cpp``:

- ``-m``/``--model FNAME``, ``-a``/``--alias STRING`` (the model name the REST API reports),
  ``--host``, ``--port``.
- ``-c``/``--ctx-size N``: the *total* context, shared by the slots; each of ``-np``/``--parallel N``
  slots gets N-th of it. So ``-c`` is ``max_model_len x slots``, which gives every concurrent
  request the profile's context length. ``SLOTS`` is fixed here; a profile that wants another
  count passes ``-np`` and ``-c`` in ``extra_args`` (the last occurrence wins).
- GPUs: ``-ngl``/``--n-gpu-layers 999`` (offload every layer), ``-sm``/``--split-mode
  {none,layer,row}`` (``row`` when the profile asks for tensor parallelism, else ``layer``),
  ``-ts``/``--tensor-split`` (proportions, here each GPU's memory; omitted when the sizes are
  unknown, and llama.cpp then splits by free memory), ``-mg``/``--main-gpu 0``.
- CPU-only: ``-ngl 0`` and an empty ``CUDA_VISIBLE_DEVICES``, so a CUDA build on a GPU node
  cannot wander onto GPUs another shard owns.

There is no dtype or quantization flag: the GGUF file fixes its weight types. ``quantization``
may name the file's GGUF type (``Q4_K_M``...; the list of ``tools/quantize``) for the memory
estimate, and ``dtype`` must be empty or ``auto``. ``gpu_memory_utilization`` has no llama.cpp
equivalent; it only scales the memory estimate.

Readiness: ``/health`` answers 503 (``ERROR_TYPE_UNAVAILABLE``, "Loading model") while the model
loads and 200 after. ``/v1/models`` is not a signal: newer servers answer it during loading.

Stop: llama-server does **not** drain in-flight requests on SIGTERM: it stops the HTTP server and
exits, cutting open streams. Drain at the router before stopping it.
"""

from __future__ import annotations

from collections.abc import Sequence

import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, ProfileRefused, Readiness, StopBehaviour

NAME = "llamacpp"

#: Concurrent sequences (``-np``). Four is llama-server's own automatic choice.
SLOTS = 4

#: GGUF file types llama.cpp's quantizer writes (``tools/quantize``), matched case-insensitively;
#: "gguf" names the format without the type.
GGUF_TYPES = (
    "gguf",
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q2_K_S",
    "Q3_K_S",
    "Q3_K_M",
    "Q3_K_L",
    "Q4_K_S",
    "Q4_K_M",
    "Q5_K_S",
    "Q5_K_M",
    "Q6_K",
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ2_M",
    "IQ3_XXS",
    "IQ3_XS",
    "IQ3_S",
    "IQ3_M",
    "IQ4_NL",
    "IQ4_XS",
    "TQ1_0",
    "TQ2_0",
    "MXFP4_MOE",
)

STOP = StopBehaviour(
    note="llama-server does not drain in-flight requests on SIGTERM; drain at the router first"
)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """CPU-only nodes are fine (no GPUs given); otherwise every layer must fit the GPUs."""
    base.check_required(profile, NAME)
    base.check_env(profile)
    if profile.dtype not in ("", "auto"):
        raise ProfileRefused(
            "dtype",
            f"dtype {profile.dtype!r} has no llama.cpp flag: a GGUF file fixes its own weight "
            "types; leave dtype empty (or 'auto') and name the GGUF type in quantization",
        )
    if profile.quantization and profile.quantization.lower() not in {t.lower() for t in GGUF_TYPES}:
        raise ProfileRefused(
            "quantization",
            f"quantization {profile.quantization!r} is not a GGUF type llama.cpp loads; "
            f"choices: {', '.join(GGUF_TYPES)}",
        )
    base.check_nnodes(
        nnodes, NAME, "llama-server has no multi-node launcher (its RPC backend is not driven by llmgw)"
    )
    tp, pp = base.parallel_sizes(profile)
    world = tp * pp
    if world > 1 and world != len(gpus):
        raise ProfileRefused(
            "parallel-fit",
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs {world} GPUs, "
            f"{len(gpus)} given (indices {base.format_indices(g.index for g in gpus)}); "
            "llama.cpp splits one model over every GPU it is given, so leave both at 1 "
            "or match the GPU count",
        )
    base.check_memory_fit(profile, gpus, nnodes, default_fraction=1.0)


def tensor_split(spec: schema.StartShard, known: Sequence[GpuInfo]) -> str:
    """``--tensor-split`` proportions from each GPU's memory, in CUDA_VISIBLE_DEVICES order;
    empty when a GPU's size is unknown."""
    sizes = {g.index: g.memory_total_mib for g in known}
    if len(spec.gpu_indices) < 2 or any(i not in sizes for i in spec.gpu_indices):
        return ""
    total = sum(sizes[i] for i in spec.gpu_indices)
    return ",".join(f"{sizes[i] / total:.4g}" for i in spec.gpu_indices)


def build_command(spec: schema.StartShard, ctx: LaunchContext) -> Command:
    profile = base.require_profile(spec)
    tp, _ = base.parallel_sizes(profile)
    argv = [
        *ctx.argv_prefix,
        "-m",
        profile.model,
        "--alias",
        base.served_name(profile),
        "--host",
        ctx.host,
        "--port",
        str(spec.http_port),
    ]
    if profile.max_model_len:
        argv += ["-c", str(profile.max_model_len * SLOTS)]
    argv += ["-np", str(SLOTS)]
    env: dict[str, str]
    if spec.gpu_indices:
        argv += ["-ngl", "999", "--split-mode", "row" if tp > 1 else "layer"]
        split = tensor_split(spec, ctx.gpus)
        if split:
            argv += ["--tensor-split", split]
        argv += ["--main-gpu", "0"]
        env = base.gpu_env(spec)
    else:
        argv += ["-ngl", "0"]
        env = {"CUDA_VISIBLE_DEVICES": ""}
    argv += profile.extra_args
    return Command(argv=tuple(argv), env=base.merge_env(env, profile))


def readiness(spec: schema.StartShard) -> Readiness:
    return Readiness(health_path="/health", loading_statuses=(503,))


ENGINE = Engine(name=NAME, validate=validate, build_command=build_command, readiness=readiness, stop=STOP)
