"""What llmgw knows about each engine, one descriptor per engine, for every process.

The agent runs engines and the control plane places and keys them; both need to know the same
facts about each engine (its name, whether it takes an API key and how, whether it can serve a
model under another name, how its version is found, what it publishes), and neither may import
the other. So the facts live here, as values, and every list of engines in the tree is derived
from :data:`DESCRIPTORS`: the agent's adapter registry (``agent.engines.ENGINES``, filled from each
descriptor's ``adapter`` import path, so this package imports nothing of the agent's), the
default command lines (``agent.config``), the version probes (``agent.engines.versions``), the
engines with flag files (``agent.engines.flagsets``) and their extractors
(``enginebuild.flags``), the names a profile may use and the engines that cannot rename a model
(``control.config``), the keyless engines (``control.plane``), the in-flight gauges a drain
reads (``agent.supervise.probes``), and the load series the agent sends in heartbeats
(``agent.engineload``).

A new engine is its adapter module (``agent/engines/<name>.py``), its descriptor below, and its
flag files (an extractor in ``enginebuild/flags/<name>.py`` and the JSON files it writes).
"""

from __future__ import annotations

import difflib
import shlex
import sys
from collections.abc import Mapping
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Literal

import attrs


@attrs.frozen
class VersionProbe:
    """How the agent finds the engine's installed version (``agent.engines.versions``).

    ``package``: the Python distribution whose metadata is the version when the engine runs from
    Python (``vllm``, ``tensorrt_llm``): read without importing torch. ``reads``: how the output of
    the engine's own ``--version`` is read otherwise: ``text`` (the first version-looking word) or
    ``llamacpp`` (its ``version: N (commit)`` line, reported as the build tag ``bN``)."""

    package: str = ""
    reads: Literal["text", "llamacpp"] = "text"


@attrs.frozen
class ApiKey:
    """How the engine takes the shard's API key, out of sight where it can.

    ``flag`` is the engine's own key option (``--api-key``): an engine version whose flag set lacks
    it cannot enforce a key, and a shard key for it is refused. At most one of the others says
    where the key goes instead of the command line, which any local user reads in ``ps``:

    - ``env``: a variable the engine reads (vLLM: ``VLLM_API_KEY``);
    - ``file_flag``: an option naming a file that holds the key (llama-server: ``--api-key-file``);
    - ``config_flag``: an option naming a YAML file of options, the key under ``config_key``
      (SGLang: ``--config``, merged into its arguments in-process).

    None of them: the key is passed as ``flag KEY``, on the command line.
    """

    flag: str = "--api-key"
    env: str = ""
    file_flag: str = ""
    config_flag: str = ""
    config_key: str = "api-key"

    def __attrs_post_init__(self) -> None:
        if sum(bool(x) for x in (self.env, self.file_flag, self.config_flag)) > 1:
            raise ValueError(f"ApiKey: at most one of env, file_flag, config_flag (got {self!r})")

    @property
    def on_command_line(self) -> bool:
        """Whether the engine can only take the key as an argument (visible in ``ps``)."""
        return not (self.env or self.file_flag or self.config_flag)


@attrs.frozen
class LoadSeries:
    """Which Prometheus samples at ``metrics_path`` give each figure of an engine's load (names as
    exposed: counters with ``_total``); the first name present wins, so a renamed series lists its
    new name first. The agent reads them every heartbeat interval (``agent.engineload``)."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    #: A 0..1 gauge of KV cache blocks (or tokens) in use.
    kv_usage: tuple[str, ...] = ()
    #: The engine's own hit-rate gauge (0..1), used where it has no hit and query counters.
    hit_rate: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    #: The counter of generated tokens, whose rate is tokens per second.
    generation_tokens: tuple[str, ...] = ()


#: vllm/v1/metrics/loggers.py (PrometheusStatLogger); the simulator publishes the same names.
VLLM_LOAD = LoadSeries(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    # kv_cache_usage_perc since 0.10 (a 0..1 fraction despite the name); gpu_cache_usage_perc before.
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # Counters of tokens queried and hit; the gpu_ names are the older v1 ones.
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    generation_tokens=("vllm:generation_tokens_total",),
)


@attrs.frozen
class Publishes:
    """What a running engine serves besides the OpenAI API.

    ``in_flight``: the Prometheus gauges at ``metrics_path`` that count requests in flight; a drain
    waits for their sum to reach 0 before stopping the engine. ``load``: the series that give its
    load for the heartbeat (None: it publishes none the agent reads). ``kv_events``: whether the
    engine can publish KV-cache events (``--kv-events-config``), which a KV-aware router
    subscribes to."""

    metrics_path: str = "/metrics"
    in_flight: tuple[str, ...] = ()
    load: LoadSeries | None = None
    kv_events: bool = False


@attrs.frozen
class EngineDescriptor:
    """One engine, as every process knows it."""

    #: The name a profile uses (``engine = "vllm"``).
    name: str
    #: How messages name it ("vLLM 0.18.0: ...").
    label: str
    #: The adapter, as ``module:attribute`` (an ``agent.engines.base.Engine``); only the agent
    #: imports it.
    adapter: str
    #: The command line a node runs it with unless its config says otherwise; ``{python}`` is the
    #: agent's own interpreter.
    command: str
    #: The engine whose flag files (``agent/engines/flags/<flags>-<version>.json``) check its
    #: command line: itself, or the engine it imitates (the simulator speaks vLLM's).
    flags: str
    #: The module that writes this engine's flag files from its released code
    #: (``python -m enginebuild.flags``); "" when its flags are another engine's.
    extractor: str
    version: VersionProbe
    #: How it takes the shard's key; None: it has no key option, and its shards get no key.
    key: ApiKey | None
    #: Whether it can serve a model under another name (a served-name option).
    renames: bool
    publishes: Publishes

    def default_command(self) -> str:
        return self.command.replace("{python}", shlex.quote(sys.executable))


DESCRIPTORS: tuple[EngineDescriptor, ...] = (
    EngineDescriptor(
        name="vllm",
        label="vLLM",
        adapter="agent.engines.vllm:ENGINE",
        command="vllm",
        flags="vllm",
        extractor="enginebuild.flags.vllm",
        # vllm/entrypoints/openai/api_server.py: the key is ``args.api_key or envs.VLLM_API_KEY``.
        version=VersionProbe(package="vllm"),
        key=ApiKey(env="VLLM_API_KEY"),
        renames=True,
        # Running and queued: a drain must wait for both (vllm/v1/metrics/loggers.py).
        publishes=Publishes(
            in_flight=("vllm:num_requests_running", "vllm:num_requests_waiting"),
            load=VLLM_LOAD,
            kv_events=True,
        ),
    ),
    EngineDescriptor(
        name="sglang",
        label="SGLang",
        adapter="agent.engines.sglang:ENGINE",
        command="python3 -m sglang.launch_server",
        flags="sglang",
        extractor="enginebuild.flags.sglang",
        version=VersionProbe(package="sglang"),
        # No variable: ServerArgs.api_key is read from the arguments only. ``--config FILE.yaml``
        # (sglang/srt/server_args_config_parser.py) turns the file's keys into arguments in-process.
        key=ApiKey(config_flag="--config"),
        renames=True,
        publishes=Publishes(
            in_flight=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
            # sglang/srt/metrics/collector.py (SchedulerMetricsCollector, TokenizerMetricsCollector).
            load=LoadSeries(
                running=("sglang:num_running_reqs",),
                waiting=("sglang:num_queue_reqs",),
                kv_usage=("sglang:token_usage",),
                hit_rate=("sglang:cache_hit_rate",),
                generation_tokens=("sglang:generation_tokens_total",),
            ),
            kv_events=True,
        ),
    ),
    EngineDescriptor(
        name="llamacpp",
        label="llama.cpp",
        adapter="agent.engines.llamacpp:ENGINE",
        command="llama-server",
        flags="llamacpp",
        extractor="enginebuild.flags.llamacpp",
        version=VersionProbe(reads="llamacpp"),
        key=ApiKey(file_flag="--api-key-file"),
        renames=True,
        publishes=Publishes(
            in_flight=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
            # tools/server (--metrics): busy slots and deferred requests.
            load=LoadSeries(
                running=("llamacpp:requests_processing",),
                waiting=("llamacpp:requests_deferred",),
                kv_usage=("llamacpp:kv_cache_usage_ratio",),
                generation_tokens=("llamacpp:tokens_predicted_total",),
            ),
        ),
    ),
    EngineDescriptor(
        name="trtllm",
        label="TensorRT-LLM",
        adapter="agent.engines.trtllm:ENGINE",
        command="trtllm-serve",
        flags="trtllm",
        extractor="enginebuild.flags.trtllm",
        version=VersionProbe(package="tensorrt_llm"),
        # trtllm-serve 1.2 has no key option and no served-name option.
        key=None,
        renames=False,
        publishes=Publishes(),
    ),
    EngineDescriptor(
        name="sim",
        label="sim",
        adapter="agent.engines.sim:ENGINE",
        command="{python} -m agent.engines.sim",
        flags="vllm",
        extractor="",
        # It prints the vLLM version it imitates.
        version=VersionProbe(),
        key=ApiKey(env="VLLM_API_KEY"),
        renames=True,
        # vLLM's gauges, and vLLM's KV events with --kv-events-config (docs/sim.md).
        publishes=Publishes(
            in_flight=("vllm:num_requests_running", "vllm:num_requests_waiting"),
            load=VLLM_LOAD,
            kv_events=True,
        ),
    ),
)

BY_NAME: Mapping[str, EngineDescriptor] = MappingProxyType({d.name: d for d in DESCRIPTORS})

#: Every engine name a profile may use, in the order above.
NAMES: tuple[str, ...] = tuple(BY_NAME)

#: Every engine with flag files of its own.
FLAG_ENGINES: tuple[str, ...] = tuple(d.name for d in DESCRIPTORS if d.flags == d.name)


def lookup(name: str) -> EngineDescriptor | None:
    return BY_NAME.get(name)


def label(name: str) -> str:
    """How messages name an engine: its label, or the name itself when it is unknown."""
    d = BY_NAME.get(name)
    return d.label if d is not None else name


def unknown_engine(name: str) -> str:
    """Why ``name`` is no engine llmgw can run, with the closest known name; "" when it is one."""
    if name in BY_NAME:
        return ""
    close = difflib.get_close_matches(name.lower(), NAMES, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown engine {name!r}; {hint}known engines: {', '.join(NAMES)}"


def takes_key(name: str) -> bool:
    """Whether shards of ``name`` get an API key (false for an engine without a key option)."""
    d = BY_NAME.get(name)
    return d is not None and d.key is not None


def renames(name: str) -> bool:
    """Whether ``name`` can serve a model under a name of llmgw's choosing."""
    d = BY_NAME.get(name)
    return d is None or d.renames


def model_names(model: str) -> tuple[str, ...]:
    """The names an engine that cannot rename its model may list ``model`` under: the argument
    itself, and for a filesystem path its base name too (trtllm-serve uses ``Path(model).name``
    when the path is a local checkpoint directory; which one applies depends on the node's disk,
    so both are accepted). A hub id (``org/name``) is served as written."""
    if model.startswith(("/", "./", "../", "~")):
        base = PurePosixPath(model.rstrip("/")).name
        if base and base != model:
            return (model, base)
    return (model,)


__all__ = [
    "BY_NAME",
    "DESCRIPTORS",
    "FLAG_ENGINES",
    "NAMES",
    "VLLM_LOAD",
    "ApiKey",
    "EngineDescriptor",
    "LoadSeries",
    "Publishes",
    "VersionProbe",
    "label",
    "lookup",
    "model_names",
    "renames",
    "takes_key",
    "unknown_engine",
]
