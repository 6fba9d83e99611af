"""Control plane configuration (``llmgw.toml``), structured with cattrs; errors name key and line.

::

    state_dir = "/var/lib/llmgw-control"

    api_keys = ["sk-..."]          # optional: bearer keys the router accepts
    router_coalesce_us = 500       # streamed tokens arriving within this share a relay wake-up

    [listen]
    agents = "0.0.0.0:7070"        # agent streams: gRPC, Connect and WebSocket on one port
    api = "127.0.0.1:7080"         # admin API and `ctl`
    router = "0.0.0.0:8080"        # OpenAI-compatible router ("" for none)

    [[endpoints]]                  # static endpoints; a catalog of only these is a router-only run
    model = "llama-3-8b"
    url = "http://10.0.0.5:8000"

    [tls]                          # optional; with client_ca + require_client_cert: mutual TLS
    cert = "server.pem"
    key = "server.key"
    client_ca = "nodes-ca.pem"
    require_client_cert = true

    [liveness]
    unreachable_after = 15.0       # 3 missed heartbeats at the agents' default 5 s
    lost_after = 300.0
    startup_grace = 300.0          # default: lost_after

    [tokens]                       # optional per-node tokens, for control planes without mutual TLS
    gpu07 = "s3cret"

    [engines]
    ports = "8000-8999"            # engine ports the control plane hands out (within each node's range)

    [[models]]
    name = "llama-70b"
    replicas = 2
    nodes_per_replica = 1
    ready_timeout = 900
    selector = { zone = "a" }
    [models.gpus]
    count = 4
    min_memory_gib = 80
    min_compute_capability = "8.0"
    [models.profile]
    engine = "vllm"
    model = "meta-llama/Llama-3.1-70B-Instruct"
    tensor_parallel_size = 4
    dtype = "bfloat16"

Unknown keys are errors, never silently ignored: a misspelt ``replica = 2`` that quietly became the
default 1 is how a fleet ends up half the size its operator thinks it is.
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.v import format_exception

import schema
from control.relay import DEFAULT_COALESCE_US, MAX_COALESCE_US


class ConfigError(Exception):
    """A configuration a person must fix; the message names the key, the file and the line."""


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be greater than 0, got {value}")


def _coalesce(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= MAX_COALESCE_US:
        raise ValueError(f"{attribute.name} must be 0 to {MAX_COALESCE_US} (microseconds), got {value}")


def _parse_range(text: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m or not (1 <= int(m.group(1)) <= int(m.group(2)) <= 65535):
        raise ValueError(f"{what} must be FIRST-LAST with 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _parse_cc(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if not m:
        raise ValueError(f"min_compute_capability must look like '8.0', got {text!r}")
    return int(m.group(1)), int(m.group(2))


@attrs.frozen
class Listen:
    agents: str = "0.0.0.0:7070"
    api: str = "127.0.0.1:7080"
    #: The OpenAI-compatible router; empty: no router in this process.
    router: str = "0.0.0.0:8080"

    @staticmethod
    def split(address: str) -> tuple[str, int]:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address must be HOST:PORT, got {address!r}")
        return host.strip("[]"), int(port)


@attrs.frozen
class TLSConfig:
    cert: Path
    key: Path
    client_ca: Path | None = None
    require_client_cert: bool = False


@attrs.frozen
class Liveness:
    unreachable_after: float = attrs.field(default=15.0, validator=_positive)
    lost_after: float = attrs.field(default=300.0, validator=_positive)
    #: After a control plane restart, how long known nodes get to re-register before they are lost.
    startup_grace: float | None = None

    @property
    def grace(self) -> float:
        return self.lost_after if self.startup_grace is None else self.startup_grace


@attrs.frozen
class GpuRequirements:
    """Per shard (per node, for a multi-node replica). ``count = 0``: a CPU-only engine."""

    count: int = 0
    min_memory_gib: float = 0.0
    min_compute_capability: str = "0.0"

    def __attrs_post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"gpus.count must be >= 0, got {self.count}")
        _parse_cc(self.min_compute_capability)

    @property
    def compute_capability(self) -> tuple[int, int]:
        return _parse_cc(self.min_compute_capability)


@attrs.frozen
class ProfileConfig:
    """An engine profile, as in StartShard."""

    engine: str
    model: str
    served_model_name: str = ""
    tensor_parallel_size: int = 0
    pipeline_parallel_size: int = 0
    dtype: str = ""
    quantization: str = ""
    max_model_len: int = 0
    gpu_memory_utilization: float = 0.0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)
    params_billions: float = 0.0

    def to_proto(self) -> schema.EngineProfile:
        return schema.EngineProfile(
            engine=self.engine,
            model=self.model,
            served_model_name=self.served_model_name,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            dtype=self.dtype,
            quantization=self.quantization,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            extra_args=list(self.extra_args),
            env=dict(self.env),
            params_billions=self.params_billions,
        )


@attrs.frozen
class ModelConfig:
    name: str
    profile: ProfileConfig
    replicas: int = 1
    gpus: GpuRequirements = GpuRequirements()
    selector: dict[str, str] = attrs.field(factory=dict)
    nodes_per_replica: int = 1
    ready_timeout: float = attrs.field(default=900.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"model name {self.name!r} must be letters, digits, '.', '_' or '-'")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.nodes_per_replica < 1:
            raise ValueError(f"nodes_per_replica must be >= 1, got {self.nodes_per_replica}")

    @property
    def served_name(self) -> str:
        return self.profile.served_model_name or self.name


@attrs.frozen
class EndpointConfig:
    """A static endpoint for router-only runs: traffic for ``model`` goes to ``url``."""

    model: str
    url: str


@attrs.frozen
class Engines:
    ports: str = "8000-8999"

    def __attrs_post_init__(self) -> None:
        _parse_range(self.ports, "engines.ports")

    @property
    def port_range(self) -> tuple[int, int]:
        return _parse_range(self.ports, "engines.ports")


@attrs.frozen
class ControlConfig:
    state_dir: Path = Path("/var/lib/llmgw-control")
    listen: Listen = Listen()
    tls: TLSConfig | None = None
    liveness: Liveness = Liveness()
    tokens: dict[str, str] = attrs.field(factory=dict)
    engines: Engines = Engines()
    models: tuple[ModelConfig, ...] = ()
    endpoints: tuple[EndpointConfig, ...] = ()
    #: Bearer keys the router accepts; empty: no key needed.
    api_keys: tuple[str, ...] = ()
    #: The router's relay pump pause after each wake-up, in microseconds (control/relay.py).
    router_coalesce_us: int = attrs.field(default=DEFAULT_COALESCE_US, validator=_coalesce)
    #: Seconds between SIGTERM and SIGKILL in StopShard; drain deadline for `ctl drain`.
    stop_grace: float = attrs.field(default=30.0, validator=_positive)
    drain_deadline: float = attrs.field(default=60.0, validator=_positive)
    #: How often the reconciler compares desired and observed state (it also runs on every change).
    reconcile_interval: float = attrs.field(default=2.0, validator=_positive)
    #: Crash-loop backoff: first delay, cap, and how long a shard must stay ready to reset it.
    backoff_initial: float = attrs.field(default=10.0, validator=_positive)
    backoff_max: float = attrs.field(default=300.0, validator=_positive)
    backoff_reset_after: float = attrs.field(default=600.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models: duplicate name(s) {', '.join(dupes)}")

    @property
    def runs_control_plane(self) -> bool:
        """A catalog with any profile runs a control plane; static endpoints alone are router-only."""
        return bool(self.models)


def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(kind: type, test: typing.Callable[[Any], bool], what: str) -> None:
        def hook(value: Any, _: type) -> Any:
            if not test(value):
                raise ValueError(f"expected {what}, got {value!r}")
            return kind(value)

        conv.register_structure_hook(kind, hook)

    strict(str, lambda v: isinstance(v, str), "a string")
    strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    strict(float, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number")
    strict(bool, lambda v: isinstance(v, bool), "true or false")
    strict(Path, lambda v: isinstance(v, str) and bool(v), "a file path")
    return conv


def _line_of(text: str, path: str) -> int | None:
    """Best-effort line of a cattrs path like ``models[1].gpus.count`` in the TOML text."""
    pos = 0
    line = None
    for name, index in re.findall(r"([A-Za-z_][\w-]*)(?:\[(\d+)\])?", path):
        pattern = re.compile(
            rf"^[ \t]*(\[\[?[ \t]*([\w-]+\.)*{re.escape(name)}[ \t]*\]\]?|{re.escape(name)}[ \t]*=)",
            re.MULTILINE,
        )
        matches = [m for m in pattern.finditer(text, pos)]
        k = int(index) if index else 0
        if len(matches) <= k:
            return line
        pos = matches[k].start()
        line = text.count("\n", 0, pos) + 1
        pos = matches[k].end()
    return line


def _explain(err: BaseException, type_: Any) -> str:
    if isinstance(err, ValueError) and str(err):
        return str(err)
    if typing.get_origin(type_) is Literal:
        return f"expected one of {', '.join(map(str, typing.get_args(type_)))}"
    return format_exception(err, type_)


def parse(text: str, source: str = "<config>") -> ControlConfig:
    """Structure TOML text into a ControlConfig; every problem names its key and line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    try:
        return _converter().structure(data, ControlConfig)
    except cattrs.BaseValidationError as exc:
        problems = []
        for message in cattrs.transform_error(exc, path="$", format_exception=_explain):
            what, _, where = message.rpartition(" @ ")
            key = where.removeprefix("$.").removeprefix("$")
            if what.startswith("extra fields found"):
                parent = f"{key}." if key else ""
                for extra in re.findall(r"[\w-]+", what.removeprefix("extra fields found")):
                    line = _line_of(text, f"{parent}{extra}")
                    problems.append(
                        f"{parent}{extra}: unknown key ({source}{f' line {line}' if line else ''})"
                    )
                continue
            line = _line_of(text, key) if key else None
            problems.append(f"{key or 'config'}: {what} ({source}{f' line {line}' if line else ''})")
        raise ConfigError("invalid control plane configuration:\n  " + "\n  ".join(problems)) from exc
    except ValueError as exc:
        raise ConfigError(f"invalid control plane configuration: {exc} ({source})") from exc


def load(path: Path) -> ControlConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from exc
    return parse(text, str(path))
