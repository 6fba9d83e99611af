"""llama.cpp: ``llama-server -m MODEL.gguf ...``, pinned to the llama.cpp that llama-cpp-python
0.3.36 vendors (``llama-server --version``: 0.5.0-dev, commit 0c1e570; ggml 0.25.3): the one ``nox -s engines`` builds and the
end-to-end test runs (``tests/test_e2e_llamacpp.py``). Every flag below was checked against that
binary's ``--help`` and its ``common/arg.cpp``; all of them are older and unchanged since 2024.

Flags:

- ``-m``/``--model FNAME``, ``-a``/``--alias STRING`` (the model name the REST API reports, and so
  the name the router routes by), ``--host``, ``--port``.
- ``-c``/``--ctx-size N``: the *total* context, shared by the slots; each of ``-np``/``--parallel N``
  slots gets N-th of it (an explicit ``-np`` also turns off the unified KV cache that an automatic
  slot count would pick). So ``-c`` is ``max_model_len x slots``, which gives every concurrent
  request the profile's context length (capped by the model's own trained context). ``SLOTS`` is
  fixed here; a profile that wants another count passes ``-np`` and ``-c`` in ``extra_args`` (the
  last occurrence wins). Without ``max_model_len`` the server's default applies: 0, the model's
  whole trained context (which ``--fit``, on by default, may shrink to fit memory).
- ``--metrics``: the Prometheus endpoint ``/metrics``, off by default. Drain needs it: its gauge
  ``llamacpp:requests_processing`` (busy slots; ``llamacpp:requests_deferred`` counts the queued
  ones) is how the supervisor knows in-flight requests have finished.
- GPUs: ``-ngl``/``--n-gpu-layers 999`` (offload every layer; ``all`` means the same to newer
  servers only), ``-sm``/``--split-mode {none,layer,row,tensor}`` (``row`` when the profile asks
  for tensor parallelism, else ``layer``), ``-ts``/``--tensor-split`` (proportions, here each GPU's
  memory; omitted when the sizes are unknown, and llama.cpp then splits by free memory),
  ``-mg``/``--main-gpu 0`` (the first of the shard's GPUs, as CUDA_VISIBLE_DEVICES numbers them).
- CPU-only: ``-ngl 0`` and an empty ``CUDA_VISIBLE_DEVICES``, so a CUDA build on a GPU node
  cannot wander onto GPUs another shard owns.
- ``--api-key-file FNAME``: the shard's secret (``StartShard.api_key``), in a 0600 file in the
  agent's key directory (``LaunchContext.key_dir``) that the supervisor writes before the spawn
  and removes when the engine exits, so ``ps`` does not show it as it would ``--api-key KEY``:
  ``/v1/*`` answers 401 without it, ``/health`` and ``/metrics`` stay open (the supervisor's
  probes and drain read them).

The whole command line, ``extra_args`` included, is checked against the flag set of the build the
node runs (``agent/engines/flags/llamacpp-<build>.json``, from that build's ``--help`` by
``python -m enginebuild.flags llamacpp BUILD``).

There is no dtype or quantization flag: the GGUF file fixes its weight types. ``quantization``
may name the file's GGUF type (``Q4_K_M``...; the list of ``tools/quantize``) for the memory
estimate, and ``dtype`` must be empty or ``auto``. ``gpu_memory_utilization`` has no llama.cpp
equivalent; it only scales the memory estimate.

Readiness: ``/health`` answers 503 (``{"error": {"code": 503, "message": "Loading model"}}``) while
the model loads and 200 after; the end-to-end test sees both. ``/v1/models`` alone is not a signal
(the server answers it during loading), so it is read only after ``/health`` passes, to check that
the id it lists (the ``--alias``) is the served name the control plane asked for.

Stop: llama-server does **not** drain in-flight requests on SIGTERM, and has no flag to. Its signal
handler stops the task loop at once: open streams get no more tokens and no end (no
``finish_reason``, no ``[DONE]``). Seen against the pinned binary, the process then sometimes exits
and sometimes hangs, streams open, until the clients hang up or the SIGKILL after the stop grace;
the end-to-end test checks the cut streams. So ``drains_in_flight`` is false and a drain is ours to do: the shard goes DRAINING (the
router stops sending it new requests), the supervisor polls ``/metrics`` until no request is in
flight, and only then sends SIGTERM.
"""

from __future__ import annotations

from collections.abc import Sequence

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines import base
from agent.engines.base import Command, Engine, LaunchContext, ProfileRefused, ShardSpec, StopBehaviour

NAME = "llamacpp"
DESCRIPTOR = enginedefs.BY_NAME[NAME]

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
    note=(
        "llama-server does not drain in-flight requests on SIGTERM (it cuts open streams); "
        "drain waits for its /metrics in-flight gauges to reach 0 before stopping it"
    )
)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """CPU-only nodes are fine (no GPUs given); otherwise every layer must fit the GPUs."""
    base.check_required(profile, NAME)
    base.check_env(profile)
    base.check_weights_fixed_by_checkpoint(
        profile,
        GGUF_TYPES,
        dtype_why="has no llama.cpp flag: a GGUF file fixes its own weight types; leave dtype empty "
        "(or 'auto') and name the GGUF type in quantization",
        quantization_of="a GGUF type llama.cpp loads",
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


#: ``-c`` is not the profile's context length (it is shared by the slots): set below.
SPELLING = base.Spelling(model="-m", served_name="--alias", after_port=("--metrics",))


def build_command(shard: ShardSpec, ctx: LaunchContext) -> Command:
    """The launch for the node's llama.cpp build; raises ProfileRefused for what it would refuse."""
    fs = base.flag_set(NAME, ctx)
    argv = base.profile_argv(fs, shard, ctx, SPELLING)
    if shard.profile.max_model_len:
        argv += ["-c", str(shard.profile.max_model_len * SLOTS)]
    argv += ["-np", str(SLOTS)]
    env: dict[str, str]
    if shard.spec.gpu_indices:
        argv += ["-ngl", "999", "--split-mode", "row" if shard.tp > 1 else "layer"]
        split = tensor_split(shard.spec, ctx.gpus)
        if split:
            argv += ["--tensor-split", split]
        argv += ["--main-gpu", "0"]
        env = base.gpu_env(shard.spec)
    else:
        argv += ["-ngl", "0"]
        env = {"CUDA_VISIBLE_DEVICES": ""}
    return base.assemble(DESCRIPTOR, fs, shard, ctx, argv=argv, env=env)


ENGINE = Engine(
    name=NAME, validate=validate, build_command=build_command, readiness=base.openai_readiness, stop=STOP
)
