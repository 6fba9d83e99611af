"""The simulator's configuration: vLLM's command line, plus the simulator's own knobs.

The simulator parses its command line as strictly as the vLLM version it imitates: the parser is
built from that version's flag file (``agent/engines/flags/vllm-*.json``, taken from vLLM's own
parser; the newest, or ``LLMGW_SIM_VLLM_VERSION``), and nothing else is accepted. An unknown flag,
a bad value or a bad choice exits 2 with vLLM's argparse message (``vllm serve: error:
unrecognized arguments: --bogus``); a deprecated quantization without
``--allow-deprecated-quantization`` exits 1, as vLLM's config check does. So the demo and every
fleet test run the real adapter's argv against a real flag set: a test double that accepted
anything would prove nothing. vLLM options it does not simulate are accepted and named on stderr.

Knobs come from ``--sim-*`` flags, else ``LLMGW_SIM_*`` environment variables, else defaults; see
the package docstring for the list.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import attrs

from agent.engines import flagsets

#: What LLMGW_SIM_HANG / --sim-hang may name.
HANG_POINTS = ("loading", "requests", "sigterm", "metrics")

#: vLLM's defaults on an 80 GB GPU for ``vllm serve`` (the OpenAI server's usage context).
DEFAULT_MAX_NUM_SEQS = 1024
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

#: The imitated setup's KV cache (docs/sim.md): Llama-3.1-8B in bf16 on one 80 GB H100 keeps
#: 128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes); what
#: --gpu-memory-utilization leaves after 16 GB of weights and about 2 GB of activations and
#: CUDA graphs holds the blocks.
GPU_MEMORY_BYTES = 80 * 2**30
NON_KV_BYTES = 18 * 2**30
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def kv_blocks(gpu_memory_utilization: float, block_size: int) -> int:
    """The number of KV blocks vLLM would find for the imitated setup (27,648 at 0.9 and 16)."""
    free = GPU_MEMORY_BYTES * gpu_memory_utilization - NON_KV_BYTES
    return max(int(free // (KV_BYTES_PER_TOKEN * block_size)), 1)


class SimUsageError(ValueError):
    """A command line or knob the simulator cannot run with; the message names the flag or
    variable and the value."""


@attrs.frozen
class SimConfig:
    model: str
    served_model_names: tuple[str, ...]
    host: str = ""
    port: int = 8000
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str = ""
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.9
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False
    #: vLLM --shutdown-timeout: how long SIGTERM waits for in-flight requests (0 aborts them).
    shutdown_timeout: float = 0.0
    load_seconds: float = 1.0
    #: The frontend's share of the time to first token (HTTP, tokenization), before the queue.
    ttft_ms: float = 40.0
    #: The base time of one engine step: the inter-token latency of a lone decoding sequence.
    itl_ms: float = 7.0
    #: Non-empty: print loading output, then this error, then exit 1 while loading.
    fail_loading: str = ""
    #: > 0: crash (exit with exit_code) this many seconds after start.
    exit_after: float = 0.0
    exit_code: int = 1
    hang: frozenset[str] = frozenset()
    #: Completion length when a request sets no max_tokens.
    default_max_tokens: int = 16
    #: vLLM arguments accepted but not simulated, for the note on stderr.
    ignored: tuple[str, ...] = ()
    #: vLLM's --api-key (or VLLM_API_KEY): /v1/* needs ``Authorization: Bearer`` one of them.
    api_keys: tuple[str, ...] = ()
    #: The vLLM version whose command line the simulator parsed (its flag file).
    vllm_version: str = ""
    # -- the capacity model (docs/sim.md): vLLM's own flags ----------------------------------
    block_size: int = 16
    #: --num-gpu-blocks-override, else derived from --gpu-memory-utilization (kv_blocks()).
    num_gpu_blocks: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    #: --kv-events-config as given (JSON text), "" when not given.
    kv_events_config: str = ""
    # -- the capacity model: the simulator's own knobs (milliseconds of the imitated GPU) -----
    prefill_ms_per_token: float = 0.03
    decode_ms_per_seq: float = 0.03
    context_ms_per_token: float = 0.00004
    #: Every modelled duration (step times, the frontend's TTFT share) is multiplied by this.
    time_scale: float = 1.0
    #: vLLM's --otlp-traces-endpoint: each request's span goes there (``sim.tracing``); none: off.
    otlp_traces_endpoint: str = ""

    @property
    def served_model_name(self) -> str:
        """The name responses carry (vLLM reports the first of several)."""
        return self.served_model_names[0]


class EngineUsageError(SimUsageError):
    """A command line vLLM itself would refuse, worded as vLLM (argparse) words it.

    ``exit_code`` is vLLM's: 2 for argparse's refusals (an unknown flag, a bad value or choice),
    1 for what vLLM refuses later while building its config (a deprecated quantization)."""

    def __init__(self, message: str, *, usage: str = "", exit_code: int = 2) -> None:
        super().__init__(message)
        self.usage = usage
        self.exit_code = exit_code


class _ParseError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors become values."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(message)


#: vLLM's usage line for ``vllm serve`` (printed above an argparse error, as vLLM does).
USAGE = "vllm serve [model_tag] [options]"

#: Destinations of the vLLM options the simulator acts on; any other vLLM option is accepted
#: (it is in the imitated version's flag file) and named on stderr as not simulated.
SIMULATED = frozenset(
    {
        "model_tag",
        "model",
        "served_model_name",
        "host",
        "port",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "dtype",
        "quantization",
        "allow_deprecated_quantization",
        "max_model_len",
        "gpu_memory_utilization",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "headless",
        "shutdown_timeout",
        "api_key",
        "block_size",
        "num_gpu_blocks_override",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "kv_events_config",
        "otlp_traces_endpoint",
    }
)

#: The simulator's own knobs, beside vLLM's options: (flag, type).
_KNOBS: tuple[tuple[str, type], ...] = (
    ("--sim-load-seconds", float),
    ("--sim-ttft-ms", float),
    ("--sim-itl-ms", float),
    ("--sim-fail-loading", str),
    ("--sim-exit-after", float),
    ("--sim-exit-code", int),
    ("--sim-hang", str),
    ("--sim-max-tokens", int),
    ("--sim-prefill-ms-per-token", float),
    ("--sim-decode-ms-per-seq", float),
    ("--sim-context-ms-per-token", float),
    ("--sim-time-scale", float),
)


def imitated(environ: Mapping[str, str]) -> flagsets.FlagSet:
    """The vLLM flag set the simulator imitates: ``LLMGW_SIM_VLLM_VERSION`` (the newest file not
    newer than it), else the newest vLLM file there is."""
    wanted = environ.get("LLMGW_SIM_VLLM_VERSION", "").strip()
    return flagsets.for_version("vllm", wanted or flagsets.available("vllm")[-1])


def _json_value(value: str) -> str:
    json.loads(value)
    return value


_json_value.__name__ = "json"
_CONVERTERS: Mapping[str, Any] = {"int": int, "float": float, "json": _json_value, "str": str}


def _parser(fs: flagsets.FlagSet) -> argparse.ArgumentParser:
    """vLLM's ``serve`` parser as the flag file records it, plus the ``--sim-*`` knobs.

    allow_abbrev=False: a prefix of a vLLM flag is not that flag here (stricter than argparse's
    default, never looser than vLLM)."""
    p = _QuietParser(prog=fs.program, usage=USAGE, allow_abbrev=False, add_help=False)
    for positional in fs.positionals:
        p.add_argument(positional.name, nargs=positional.nargs)
    for option in fs.options:
        if option.dest == "help":
            p.add_argument(*option.flags, action="help")
        elif not option.takes_value:
            # A switch's first flag turns it on; a second spelling that negates it is --no-X
            # (argparse's BooleanOptionalAction) or, in newer vLLM, --disable-X
            # (--enable-prefix-caching / --disable-prefix-caching): those store False.
            negative = [f for f in option.flags[1:] if f.startswith("--no-") or f.startswith("--disable-")]
            positive = [f for f in option.flags if f not in negative]
            p.add_argument(*positive, dest=option.dest, action="store_const", const=True)
            if negative:
                p.add_argument(*negative, dest=option.dest, action="store_const", const=False)
        else:
            p.add_argument(
                *option.flags,
                dest=option.dest,
                type=_CONVERTERS.get(option.type, str),
                nargs=option.nargs,
                choices=option.choices,
            )
    for flag, kind in _KNOBS:
        p.add_argument(flag, type=kind)
    return p


def _not_simulated(fs: flagsets.FlagSet, args: Sequence[str]) -> tuple[str, ...]:
    """The vLLM options in args (with their values) that the simulator does not act on."""
    out: list[str] = []
    taking = False
    for token in args:
        if token.startswith("-") and not token.lstrip("-").replace(".", "").isdigit():
            option = fs.option(token.partition("=")[0])
            taking = option is not None and option.dest not in SIMULATED
            if taking:
                out.append(token)
            taking = taking and option is not None and option.takes_value and "=" not in token
        elif taking:
            out.append(token)
    return tuple(out)


def _max_model_len(raw: str | None) -> int:
    """vLLM's human-readable --max-model-len (``4096``, ``32k``, ``1K``, ``auto``, ``-1``)."""
    if raw is None or raw in ("auto", "-1"):
        return 8192
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    if raw and raw[-1] in units:
        return int(float(raw[:-1]) * units[raw[-1]])
    return int(raw)


def _human_int(raw: str | None, flag: str, default: int) -> int:
    """vLLM's human-readable integers (``8192``, ``8k``, ``2K``) for flags typed that way."""
    if raw is None:
        return default
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if raw and raw[-1] in units:
            return int(float(raw[:-1]) * units[raw[-1]])
        return int(raw)
    except ValueError:
        raise SimUsageError(f"{flag} {raw!r} is not an integer") from None


def _api_keys(flag: str | list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """vLLM's keys: --api-key (one or several), else the VLLM_API_KEY variable, else none."""
    if flag:
        return [flag] if isinstance(flag, str) else [k for k in flag if k]
    key = environ.get("VLLM_API_KEY", "")
    return [key] if key else []


#: A knob's value type.
T = TypeVar("T", int, float)


def _knob(flag: T | None, environ: Mapping[str, str], name: str, default: T, kind: type[T]) -> T:
    """--sim-* flag, else the LLMGW_SIM_* variable (a ``kind``: int or float), else the default."""
    if flag is not None:
        return flag
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise SimUsageError(f"{name}={raw!r} is not {what}") from None


def _hang_points(raw: str, source: str) -> frozenset[str]:
    points: set[str] = set()
    for part in raw.replace(" ", "").split(","):
        if not part or part in ("0", "false", "no"):
            continue
        if part in ("1", "true", "yes"):
            part = "loading"
        if part not in HANG_POINTS:
            raise SimUsageError(
                f"{source}={raw!r}: {part!r} is not a hang point; choose from {', '.join(HANG_POINTS)}"
            )
        points.add(part)
    return frozenset(points)


def _fail_message(raw: str) -> str:
    raw = raw.strip()
    if raw in ("", "0", "false", "no"):
        return ""
    if raw in ("1", "true", "yes"):
        return "torch.OutOfMemoryError: CUDA out of memory (simulated by LLMGW_SIM_FAIL_LOADING)"
    return raw


def parse_command_line(argv: Sequence[str], environ: Mapping[str, str]) -> SimConfig:
    """Build a SimConfig from vLLM-style argv and the environment; pure, so it is tested directly."""
    args_list = list(argv)
    if args_list and args_list[0] == "serve":
        args_list = args_list[1:]
    fs = imitated(environ)
    args_list = fs.normalize(args_list)
    try:
        ns = _parser(fs).parse_args(args_list)
    except _ParseError as exc:
        raise EngineUsageError(f"{fs.program}: error: {exc}", usage=f"usage: {USAGE}") from None
    for option in fs.options:
        value = getattr(ns, option.dest, None)
        message = option.deprecated_choices.get(value) if isinstance(value, str) else None
        if message is None:
            continue
        enabling = [fs.option(flag) for flag in re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", message)]
        if not any(o is not None and getattr(ns, o.dest, None) for o in enabling):
            # vLLM refuses this while building its config, after argparse: exit 1, not 2.
            raise EngineUsageError(
                f"ValueError: {fs.label}: {option.flags[0]} {value} {message}", exit_code=1
            )

    # vLLM's serve takes the positional over --model when both are given.
    model = ns.model_tag or ns.model
    if not model:
        raise SimUsageError("no model given: pass `serve MODEL` or --model MODEL")
    names = tuple(ns.served_model_name or (model,))

    hang_raw = ns.sim_hang if ns.sim_hang is not None else environ.get("LLMGW_SIM_HANG", "")
    hang_source = "--sim-hang" if ns.sim_hang is not None else "LLMGW_SIM_HANG"
    fail_raw = (
        ns.sim_fail_loading if ns.sim_fail_loading is not None else environ.get("LLMGW_SIM_FAIL_LOADING", "")
    )

    config = SimConfig(
        model=model,
        served_model_names=names,
        host=ns.host or "",
        port=ns.port if ns.port is not None else 8000,
        tensor_parallel_size=ns.tensor_parallel_size or 1,
        pipeline_parallel_size=ns.pipeline_parallel_size or 1,
        dtype=ns.dtype or "auto",
        quantization=ns.quantization or "",
        max_model_len=_max_model_len(ns.max_model_len),
        gpu_memory_utilization=ns.gpu_memory_utilization or 0.9,
        nnodes=ns.nnodes or 1,
        node_rank=ns.node_rank or 0,
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=ns.master_port or 29501,
        headless=bool(ns.headless),
        shutdown_timeout=float(ns.shutdown_timeout or 0),
        api_keys=tuple(_api_keys(ns.api_key, environ)),
        vllm_version=fs.version,
        otlp_traces_endpoint=getattr(ns, "otlp_traces_endpoint", None) or "",
        load_seconds=_knob(ns.sim_load_seconds, environ, "LLMGW_SIM_LOAD_SECONDS", 1.0, float),
        ttft_ms=_knob(ns.sim_ttft_ms, environ, "LLMGW_SIM_TTFT_MS", 40.0, float),
        itl_ms=_knob(ns.sim_itl_ms, environ, "LLMGW_SIM_ITL_MS", 7.0, float),
        fail_loading=_fail_message(fail_raw),
        exit_after=_knob(ns.sim_exit_after, environ, "LLMGW_SIM_EXIT_AFTER", 0.0, float),
        exit_code=_knob(ns.sim_exit_code, environ, "LLMGW_SIM_EXIT_CODE", 1, int),
        hang=_hang_points(hang_raw, hang_source),
        default_max_tokens=_knob(ns.sim_max_tokens, environ, "LLMGW_SIM_MAX_TOKENS", 16, int),
        ignored=_not_simulated(fs, args_list),
        block_size=ns.block_size if ns.block_size is not None else 16,
        max_num_seqs=ns.max_num_seqs if ns.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens=_human_int(
            ns.max_num_batched_tokens, "--max-num-batched-tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS
        ),
        enable_prefix_caching=ns.enable_prefix_caching is not False,
        prefix_caching_hash_algo=ns.prefix_caching_hash_algo or "sha256",
        kv_events_config=ns.kv_events_config or "",
        prefill_ms_per_token=_knob(
            ns.sim_prefill_ms_per_token, environ, "LLMGW_SIM_PREFILL_MS_PER_TOKEN", 0.03, float
        ),
        decode_ms_per_seq=_knob(
            ns.sim_decode_ms_per_seq, environ, "LLMGW_SIM_DECODE_MS_PER_SEQ", 0.03, float
        ),
        context_ms_per_token=_knob(
            ns.sim_context_ms_per_token, environ, "LLMGW_SIM_CONTEXT_MS_PER_TOKEN", 0.00004, float
        ),
        time_scale=_knob(ns.sim_time_scale, environ, "LLMGW_SIM_TIME_SCALE", 1.0, float),
    )
    for field, value in (
        ("load seconds", config.load_seconds),
        ("TTFT ms", config.ttft_ms),
        ("ITL ms", config.itl_ms),
        ("exit-after seconds", config.exit_after),
        ("--shutdown-timeout", config.shutdown_timeout),
        ("prefill ms per token", config.prefill_ms_per_token),
        ("decode ms per sequence", config.decode_ms_per_seq),
        ("context ms per token", config.context_ms_per_token),
        ("time scale", config.time_scale),
    ):
        if value < 0:
            raise SimUsageError(f"{field} must be >= 0, got {value}")
    if config.default_max_tokens < 1:
        raise SimUsageError(f"default max tokens must be >= 1, got {config.default_max_tokens}")
    if not 0 <= config.port <= 65535:
        raise SimUsageError(f"--port {config.port} is not a TCP port")
    for flag, number in (
        ("--block-size", config.block_size),
        ("--max-num-seqs", config.max_num_seqs),
        ("--max-num-batched-tokens", config.max_num_batched_tokens),
    ):
        if number < 1:
            raise SimUsageError(f"{flag} must be >= 1, got {number}")
    override = ns.num_gpu_blocks_override
    if override is not None and override < 1:
        raise SimUsageError(f"--num-gpu-blocks-override must be >= 1, got {override}")
    blocks = override or kv_blocks(config.gpu_memory_utilization, config.block_size)
    if config.kv_events_config:
        kv_events_settings(config.kv_events_config)  # refuse a bad one before loading
    if config.prefix_caching_hash_algo.startswith("xxhash"):
        try:
            import xxhash  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            raise SimUsageError(
                f"--prefix-caching-hash-algo {config.prefix_caching_hash_algo} needs the xxhash "
                "package (pip install xxhash), as vLLM does"
            ) from None
    return attrs.evolve(config, num_gpu_blocks=blocks)


#: --kv-events-config's fields and defaults (vLLM's KVEventsConfig; the same in 0.18 and 0.33).
KV_EVENTS_DEFAULTS: Mapping[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}


def kv_events_settings(raw: str) -> dict[str, Any]:
    """--kv-events-config's JSON with vLLM's defaults filled in; an unknown field or a publisher
    other than null/zmq is refused, naming it, as vLLM's config class refuses it."""
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise SimUsageError(f"--kv-events-config must be a JSON object, got {raw!r}")
    unknown = sorted(set(doc) - set(KV_EVENTS_DEFAULTS))
    if unknown:
        raise SimUsageError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    settings = {**KV_EVENTS_DEFAULTS, **doc}
    if settings["publisher"] is None:
        settings["publisher"] = "zmq" if settings["enable_kv_cache_events"] else "null"
    if settings["publisher"] not in ("null", "zmq"):
        raise SimUsageError(
            f"--kv-events-config: publisher {settings['publisher']!r} is not one of null, zmq"
        )
    return settings
