"""sim: llmgw's engine simulator, and its adapter.

``python -m agent.engines.sim`` is an OpenAI-compatible server for demos, CI and capacity tests:
it loads nothing and needs no GPU, but it speaks the HTTP an engine speaks, on the command line
vLLM takes. Pointing a vLLM profile's binary at it (``LaunchContext(argv_prefix=(sys.executable,
"-m", "agent.engines.sim"))``) runs the vLLM adapter's real argv end to end; the ``sim`` engine in
a profile does the same with the rules relaxed for nodes without GPUs.

Command line: exactly the vLLM version's it imitates (``vllm serve``'s parser rebuilt from
``agent/engines/flags/vllm-<version>.json``, which ``nox -s flags`` takes from vLLM's own code): the
newest flag file by default, ``LLMGW_SIM_VLLM_VERSION`` to choose (the newest file not newer than
it); ``--version`` prints it, as ``vllm --version`` does. An unknown flag, a bad value or choice
exits 2 with vLLM's argparse usage line and message (``vllm serve: error: unrecognized arguments:
--bogus``); a deprecated quantization without ``--allow-deprecated-quantization`` exits 1. It acts
on ``[serve] MODEL`` or ``--model MODEL``, ``--served-model-name NAME [NAME...]``, ``--host``,
``--port``, ``--tensor-parallel-size``/``-tp``, ``--pipeline-parallel-size``/``-pp``, ``--dtype``,
``--quantization``/``-q``, ``--max-model-len`` (default 8192), ``--gpu-memory-utilization``,
``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``, ``--headless`` (a worker rank: no
HTTP server, like vLLM's), ``--shutdown-timeout`` (drain window on SIGTERM, vLLM's semantics: 0
aborts in-flight requests) and ``--api-key KEY [KEY...]`` (or ``VLLM_API_KEY``: every ``/v1`` path
needs ``Authorization: Bearer KEY``, else 401 ``{"error": "Unauthorized"}``; ``/health`` and
``/metrics`` stay open, as in vLLM), and ``--otlp-traces-endpoint URL`` (vLLM's ``llm_request``
span per request, continuing its ``traceparent``, over OTLP/HTTP: ``sim.tracing``). Other vLLM
options are accepted and named on stderr.

Knobs, as ``--sim-*`` flags or ``LLMGW_SIM_*`` variables (a flag wins):

========================  ==========================  ==========================================
flag                      variable                    meaning (default)
========================  ==========================  ==========================================
--sim-load-seconds S      LLMGW_SIM_LOAD_SECONDS      /health is 503 for S seconds, then 200 (1)
--sim-ttft-ms MS          LLMGW_SIM_TTFT_MS           the frontend's share of the time to first
                                                      token, before the queue (40)
--sim-itl-ms MS           LLMGW_SIM_ITL_MS            an engine step's base time: the gap between
                                                      tokens of a lone sequence (7)
--sim-prefill-ms-per-...  LLMGW_SIM_PREFILL_MS_PER_   per uncached prompt token in a step (0.03)
  token MS                TOKEN
--sim-decode-ms-per-seq   LLMGW_SIM_DECODE_MS_PER_    per decoding sequence in a step (0.03)
  MS                      SEQ
--sim-context-ms-per-...  LLMGW_SIM_CONTEXT_MS_PER_   per token of context a decoding sequence
  token MS                TOKEN                       reads (0.00004)
--sim-time-scale F        LLMGW_SIM_TIME_SCALE        multiplies every modelled duration (1)
--sim-max-tokens N        LLMGW_SIM_MAX_TOKENS        length when a request sets no max_tokens (16)
--sim-fail-loading MSG    LLMGW_SIM_FAIL_LOADING      print loading output and MSG, exit 1 while
                                                      loading ("1" for a CUDA OOM message)
--sim-exit-after S        LLMGW_SIM_EXIT_AFTER        crash S seconds after start (off)
--sim-exit-code N         LLMGW_SIM_EXIT_CODE         exit code of that crash (1)
--sim-hang POINTS         LLMGW_SIM_HANG              comma list: ``loading`` (never ready; "1"
                                                      means this), ``requests`` (accept, never
                                                      answer), ``sigterm`` (ignore SIGTERM),
                                                      ``metrics`` (``/metrics`` never answers)
========================  ==========================  ==========================================

Endpoints: ``GET /health`` (503 while loading or draining), ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain JSON, or SSE with
``"stream": true`` and ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk),
``GET /metrics`` (Prometheus text: ``llmgw_sim_requests_total``, ``llmgw_sim_requests_running``,
``llmgw_sim_requests_cancelled_total``, ``llmgw_sim_tokens_generated_total``, and vLLM's
``vllm:num_requests_running`` family). Completions are deterministic: the same prompt gives the
same words. Every request and lifecycle event is a line on stdout.

Under load it behaves like vLLM (docs/sim.md): a paged KV cache with vLLM's block hashes, prefix
caching and LRU eviction (``--block-size``, ``--num-gpu-blocks-override``,
``--enable-prefix-caching``, ``--prefix-caching-hash-algo``), continuous batching with a waiting
queue, chunked prefill and preemption (``--max-num-seqs``, ``--max-num-batched-tokens``), step times
that grow with the work in the step, vLLM's scheduler metrics, and vLLM's KV events on ZMQ with
``--kv-events-config``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import enginedefs
import schema
from agent.discovery.model import GpuInfo
from agent.engines import base, vllm
from agent.engines.base import Command, Engine, LaunchContext, ShardSpec, StopBehaviour

NAME = "sim"
DESCRIPTOR = enginedefs.BY_NAME[NAME]

#: How the agent starts the simulator: this interpreter, this package.
ARGV_PREFIX = (sys.executable, "-m", "agent.engines.sim")

STOP = StopBehaviour(
    graceful_flag="--shutdown-timeout",
    drains_in_flight=True,
    note="like vLLM: drains for --shutdown-timeout seconds on SIGTERM, then exits 0",
)


def validate(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1) -> None:
    """The GPU rules only when GPUs are given, since the simulator runs on
    CPU-only nodes too (a demo fleet can be laptops)."""
    base.check_required(profile, NAME)
    base.check_env(profile)
    # dtype and quantization are checked by ``vllm.build_as`` against the flag file of the vLLM
    # version the simulator imitates on this node (it reports it as its own version).
    if gpus:
        vllm.validate_as(NAME, profile, gpus, nnodes=nnodes)


def build_command(shard: ShardSpec, ctx: LaunchContext) -> Command:
    """vLLM's argv exactly (the simulator parses it), its key in ``VLLM_API_KEY`` as vLLM takes it,
    with the GPU pinning only when GPUs are assigned: an empty CUDA_VISIBLE_DEVICES is meaningless
    to the simulator but confusing in logs."""
    env: dict[str, str] = base.gpu_env(shard.spec) if shard.spec.gpu_indices else {}
    if shard.multinode:
        env.update(base.multinode_env(ctx))
    return vllm.build_as(DESCRIPTOR, shard, ctx, env)


ENGINE = Engine(
    name=NAME, validate=validate, build_command=build_command, readiness=base.openai_readiness, stop=STOP
)
