"""The simulator's configuration: vLLM's command line, plus the simulator's own knobs.

The simulator accepts the argv the vLLM adapter builds (``serve MODEL --served-model-name ...``),
so pointing a vLLM profile's binary at ``python -m agent.engines.sim`` exercises the real launch
path end to end. vLLM flags it does not simulate are accepted and named on stderr, never fatal:
a profile's ``extra_args`` must not stop a demo.

Knobs come from ``--sim-*`` flags, else ``LLMGW_SIM_*`` environment variables, else defaults; see
the package docstring for the list.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import NoReturn

import attrs

#: What LLMGW_SIM_HANG / --sim-hang may name.
HANG_POINTS = ("loading", "requests", "sigterm")


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
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
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

    @property
    def served_model_name(self) -> str:
        """The name responses carry (vLLM reports the first of several)."""
        return self.served_model_names[0]


class _ParseError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors become values."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(message)


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown vLLM flag must never be taken for an abbreviation of ours.
    p = _QuietParser(
        prog="python -m agent.engines.sim",
        description="llmgw engine simulator: an OpenAI-compatible server on vLLM's command line.",
        allow_abbrev=False,
    )
    p.add_argument("model_tag", nargs="?", help="the model (vLLM's positional MODEL)")
    p.add_argument("--model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--tensor-parallel-size", "-tp", type=int)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int)
    p.add_argument("--dtype")
    p.add_argument("--quantization", "-q")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--nnodes", "-n", type=int)
    p.add_argument("--node-rank", "-r", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--shutdown-timeout", type=float)
    p.add_argument("--sim-load-seconds", type=float)
    p.add_argument("--sim-ttft-ms", type=float)
    p.add_argument("--sim-itl-ms", type=float)
    p.add_argument("--sim-fail-loading")
    p.add_argument("--sim-exit-after", type=float)
    p.add_argument("--sim-exit-code", type=int)
    p.add_argument("--sim-hang")
    p.add_argument("--sim-max-tokens", type=int)
    return p


def _float_knob(flag: float | None, environ: Mapping[str, str], name: str, default: float) -> float:
    """--sim-* flag, else the LLMGW_SIM_* variable, else the default."""
    if flag is not None:
        return flag
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SimUsageError(f"{name}={raw!r} is not a number") from None


def _int_knob(flag: int | None, environ: Mapping[str, str], name: str, default: int) -> int:
    if flag is not None:
        return flag
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SimUsageError(f"{name}={raw!r} is not an integer") from None


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
    try:
        ns, unknown = _parser().parse_known_args(args_list)
    except _ParseError as exc:
        raise SimUsageError(str(exc)) from None

    # vLLM gives the positional precedence; when an ignored flag's value landed there instead
    # (``--model X --some-flag 3``), --model is the one the caller meant.
    model = ns.model or ns.model_tag
    if ns.model and ns.model_tag and ns.model_tag != ns.model:
        unknown.append(ns.model_tag)
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
        max_model_len=ns.max_model_len or 8192,
        gpu_memory_utilization=ns.gpu_memory_utilization or 0.9,
        nnodes=ns.nnodes or 1,
        node_rank=ns.node_rank or 0,
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=ns.master_port or 29501,
        headless=bool(ns.headless),
        shutdown_timeout=ns.shutdown_timeout or 0.0,
        load_seconds=_float_knob(ns.sim_load_seconds, environ, "LLMGW_SIM_LOAD_SECONDS", 1.0),
        ttft_ms=_float_knob(ns.sim_ttft_ms, environ, "LLMGW_SIM_TTFT_MS", 50.0),
        itl_ms=_float_knob(ns.sim_itl_ms, environ, "LLMGW_SIM_ITL_MS", 10.0),
        fail_loading=_fail_message(fail_raw),
        exit_after=_float_knob(ns.sim_exit_after, environ, "LLMGW_SIM_EXIT_AFTER", 0.0),
        exit_code=_int_knob(ns.sim_exit_code, environ, "LLMGW_SIM_EXIT_CODE", 1),
        hang=_hang_points(hang_raw, hang_source),
        default_max_tokens=_int_knob(ns.sim_max_tokens, environ, "LLMGW_SIM_MAX_TOKENS", 16),
        ignored=tuple(unknown),
    )
    for field, value in (
        ("load seconds", config.load_seconds),
        ("TTFT ms", config.ttft_ms),
        ("ITL ms", config.itl_ms),
        ("exit-after seconds", config.exit_after),
        ("--shutdown-timeout", config.shutdown_timeout),
    ):
        if value < 0:
            raise SimUsageError(f"{field} must be >= 0, got {value}")
    if config.default_max_tokens < 1:
        raise SimUsageError(f"default max tokens must be >= 1, got {config.default_max_tokens}")
    if not 0 <= config.port <= 65535:
        raise SimUsageError(f"--port {config.port} is not a TCP port")
    return config
