"""Control plane configuration (``llmgw.toml``), structured with cattrs; errors name key and line.

::

    state_dir = "/var/lib/llmgw-control"

    api_keys = ["sk-..."]          # optional: bearer keys the router accepts
    router_coalesce_us = 500       # streamed tokens arriving within this share a relay wake-up
    router_response_timeout = 300.0     # an engine's first response byte, or 504 and it is ejected
    router_stream_idle_timeout = 60.0   # an engine's longest silence mid-response, or an error event

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

    metrics_key = "..."            # optional: the router's /metrics wants Authorization: Bearer KEY
                                   # (without it, /metrics answers loopback clients only)
    router_header_timeout = 10.0   # a client's request head must arrive within this (slowloris)
    router_client_idle_timeout = 75.0   # an idle keep-alive client connection is closed after it
    router_max_connections = 10000 # client connections over it get a 503 and are closed

    [api]                          # the admin API (`ctl`); without tokens it answers loopback only
    read_tokens = ["..."]          # bearer tokens that may read: nodes, replicas, why, logs
    admin_tokens = ["..."]         # bearer tokens that may also write: cordon, drain, uncordon
                                   # (tokens and metrics_key: 16+ characters, `openssl rand -hex 16`)
    hosts = ["cp.example.internal"]     # Host names it answers to besides its listen address
    [api.tls]                      # optional: HTTPS, and with client_ca + require_client_cert mTLS
    cert = "api.pem"
    key = "api.key"
    client_ca = "operators-ca.pem"
    require_client_cert = true

    [liveness]
    unreachable_after = 15.0       # 3 missed heartbeats at the agents' default 5 s
    lost_after = 300.0
    startup_grace = 300.0          # default: lost_after

    [tokens]                       # optional per-node tokens, for control planes without mutual TLS
    gpu07 = "s3cret"
    # Agents join with the join token (state_dir/join-token, `ctl token`) and are then bound to a
    # credential of their own. `insecure = true` (top level) accepts agents with no authentication
    # at all: for a lab only, and said at start and in `ctl nodes`.

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
    min_memory_gib = 79            # an "80GB" H100 reports 81559 MiB: 79.6 GiB
    min_compute_capability = "8.0"
    [models.profile]
    engine = "vllm"
    engine_version = ">=0.18"     # optional: only nodes whose vllm satisfies it (PEP 440 specifiers)
    model = "meta-llama/Llama-3.1-70B-Instruct"
    tensor_parallel_size = 4
    dtype = "bfloat16"
    [models.rollout]               # a change of profile, gpus, selector or nodes_per_replica
    max_surge = 1                  # new replicas beyond `replicas` while it rolls out
    max_unavailable = 0            # ready replicas it may go below `replicas` (0: new ready first)

Unknown keys are errors, never silently ignored: a misspelt ``replica = 2`` that quietly became the
default 1 is how a fleet ends up half the size its operator thinks it is.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs

import enginedefs
import schema
import settings
from control.placement import engine_constraint
from router.config import RouterConfig
from settings import ConfigError, FieldProblem, KeyPath, dotted, line_of
from transport.tls import ServerTLS

__all__ = [
    "ConfigError",
    "ControlConfig",
    "FieldProblem",
    "ModelConfig",
    "StateConfig",
    "dotted",
    "line_of",
    "load",
    "parse",
]


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise FieldProblem(attribute.name, f"{attribute.name} must be greater than 0, got {value}")


def _at_least_one(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise FieldProblem(attribute.name, f"{attribute.name} must be at least 1, got {value}")


def engine_problem(name: str) -> str:
    """Why ``name`` is no engine an agent can run (``enginedefs.NAMES``), with the closest known
    name; "" when it is one.

    Caught here, a typo fails at start-up with the right line instead of as a StartShard refusal on
    every node, one reconcile pass after another."""
    return enginedefs.unknown_engine(name)


def _known_engine(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    problem = engine_problem(value)
    if problem:
        raise FieldProblem(attribute.name, problem)


_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def listen_problem(address: str, *, example: str, may_be_empty: bool = False, fixed_port: str = "") -> str:
    """What is wrong with a ``[listen]`` address, and what to write instead; "" when it is fine.

    HOST:PORT with PORT 1-65535, IPv6 hosts in brackets (``[::1]:7070``). ``may_be_empty``: "" means
    "no such listener". Port 0 (the kernel picks a free one, which the ready line reports) is
    allowed unless ``fixed_port`` says why the port must be known in advance. Pure: nothing is
    resolved or bound here."""
    if address == "":
        return "" if may_be_empty else f"is empty; write HOST:PORT, e.g. {example!r}"
    if "://" in address:
        netloc = address.split("://", 1)[1].split("/", 1)[0]
        return f"{address!r} is a URL; write HOST:PORT only, e.g. {netloc or example!r}"
    bracketed = re.fullmatch(r"\[([^\]]*)\](?::(.*))?", address)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
        if not _is_ipv6(host):
            return f"{address!r}: {host!r} in brackets is not an IPv6 address"
        if port is None:
            return f"{address!r} has no port; write HOST:PORT, e.g. '[{host}]:{example.rpartition(':')[2]}'"
    elif ":" not in address:
        if address.isdigit():
            return (
                f"{address!r} has no host; write HOST:PORT, e.g. '0.0.0.0:{address}' (every interface) "
                f"or '127.0.0.1:{address}' (this machine only)"
            )
        return f"{address!r} has no port; write HOST:PORT, e.g. '{address}:{example.rpartition(':')[2]}'"
    else:
        host, _, port = address.rpartition(":")
        if _is_ipv6(address):
            example = f"'[{host}]:{port}'" if _is_ipv6(host) else f"'[{address}]:PORT'"
            return f"{address!r}: an IPv6 address goes in brackets, as in {example}"
        if _is_ipv6(host):
            return f"{address!r}: an IPv6 address goes in brackets: '[{host}]:{port}'"
        if not host:
            return (
                f"{address!r} has no host; write HOST:PORT, e.g. '0.0.0.0:{port}' (every interface) "
                f"or '127.0.0.1:{port}' (this machine only)"
            )
        if not (_HOSTNAME.fullmatch(host) or _is_ipv4(host)):
            return f"{address!r}: {host!r} is neither an IP address nor a host name"
    ports = "1-65535" if fixed_port else "0-65535 (0: any free port)"
    if not port.isdigit():
        return f"{address!r}: the port {port!r} is not a number; use {ports}"
    if fixed_port and int(port) == 0:
        return f"{address!r}: port 0 (any free port) does not suit this listener: {fixed_port}; use {ports}"
    if not int(port) <= 65535:
        return f"{address!r}: port {int(port)} is out of range; use {ports}"
    return ""


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def _listen_address(
    *, may_be_empty: bool = False, fixed_port: str = ""
) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        problem = listen_problem(
            value, example=str(attribute.default), may_be_empty=may_be_empty, fixed_port=fixed_port
        )
        if problem:
            raise FieldProblem(attribute.name, problem)

    return check


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
    """Where each listener binds, checked when the file is read (a bad address found at bind time
    would surface as a traceback from inside the running server).

    Port 0 (any free port, reported on the ready line) suits the API and the router; agents dial
    a port fixed in their ``--server`` URL, so theirs must be set."""

    agents: str = attrs.field(
        default="0.0.0.0:7070",
        validator=_listen_address(fixed_port="agents dial the port in their --server URL"),
    )
    api: str = attrs.field(default="127.0.0.1:7080", validator=_listen_address())
    #: The OpenAI-compatible router; empty: no router in this process.
    router: str = attrs.field(default="0.0.0.0:8080", validator=_listen_address(may_be_empty=True))

    def __attrs_post_init__(self) -> None:
        named = [("agents", self.agents), ("api", self.api), ("router", self.router)]
        for i, (key, address) in enumerate(named):
            for other, other_address in named[:i]:
                if address and other_address and _same_socket(address, other_address):
                    raise FieldProblem(
                        key,
                        f"{address!r} takes the port of listen.{other} ({other_address!r}); "
                        "each listener needs a port of its own",
                    )

    @staticmethod
    def split(address: str) -> tuple[str, int]:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address must be HOST:PORT, got {address!r}")
        return host.strip("[]"), int(port)


def _same_socket(a: str, b: str) -> bool:
    """Whether two valid listen addresses would bind the same port: the same host, or one is its
    family's wildcard. Port 0 never collides (each listener gets its own free port)."""
    host_a, port_a = Listen.split(a)
    host_b, port_b = Listen.split(b)
    if port_a != port_b or port_a == 0:
        return False
    if host_a == host_b:
        return True
    wildcards = {"0.0.0.0": False, "::": True}
    for wild, other in ((host_a, host_b), (host_b, host_a)):
        if wild in wildcards and (":" in other) == wildcards[wild]:
            return True
    return False


#: The shortest admin API token accepted: 16 characters (``openssl rand -hex 16`` gives 32), so a
#: token cannot be guessed by trying, which the API does not rate-limit.
MIN_TOKEN_CHARS = 16


def _tokens(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for i, token in enumerate(value):
        if len(token) < MIN_TOKEN_CHARS or token != token.strip():
            raise FieldProblem(
                (attribute.name, i),
                f"{attribute.name}[{i}] must be at least {MIN_TOKEN_CHARS} characters without blanks "
                f"around them (got {len(token)}); make one with `openssl rand -hex 16`",
            )


def _host_names(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for i, host in enumerate(value):
        if not (_HOSTNAME.fullmatch(host) or _is_ipv4(host) or _is_ipv6(host.strip("[]"))):
            raise FieldProblem(
                (attribute.name, i),
                f"{attribute.name}[{i}] {host!r} is not a host name; write the name clients put in "
                "the URL, without port or scheme, e.g. 'cp.example.internal'",
            )


@attrs.frozen
class AdminApi:
    """Who may use the admin API (``[api]``): bearer tokens in two roles, the Host names it answers
    to, and optional TLS. No token at all: it answers loopback clients only, with a start-up
    warning (control/api.py says why each check exists)."""

    #: May read: every GET (nodes, replicas, why, logs, drain progress).
    read_tokens: tuple[str, ...] = attrs.field(default=(), validator=_tokens)
    #: May read and write: cordon, drain, uncordon and every other POST.
    admin_tokens: tuple[str, ...] = attrs.field(default=(), validator=_tokens)
    #: Host header names the API answers to besides its listen address, localhost and IP literals
    #: (a name not listed is refused: that is what stops DNS rebinding).
    hosts: tuple[str, ...] = attrs.field(default=(), validator=_host_names)
    tls: ServerTLS | None = None

    def __attrs_post_init__(self) -> None:
        both = sorted(set(self.read_tokens) & set(self.admin_tokens))
        if both:
            raise FieldProblem(
                "read_tokens",
                f"read_tokens[{self.read_tokens.index(both[0])}] is also in admin_tokens; a token has one role",
            )

    @property
    def has_tokens(self) -> bool:
        return bool(self.read_tokens or self.admin_tokens)


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
            raise FieldProblem("count", f"count must be >= 0, got {self.count}")
        try:
            _parse_cc(self.min_compute_capability)
        except ValueError as exc:
            raise FieldProblem("min_compute_capability", str(exc)) from None

    @property
    def compute_capability(self) -> tuple[int, int]:
        return _parse_cc(self.min_compute_capability)


@attrs.frozen
class ProfileConfig:
    """An engine profile, as in StartShard."""

    engine: str = attrs.field(validator=_known_engine)
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
    #: PEP 440 specifiers the node's installed engine must satisfy (">=0.18"); "": any version.
    engine_version: str = ""

    def __attrs_post_init__(self) -> None:
        if self.engine_version:
            try:
                engine_constraint(self.engine_version)
            except ValueError as exc:
                raise FieldProblem("engine_version", f"engine_version {exc}") from None
        if not enginedefs.renames(self.engine) and self.served_model_name:
            names = self.model_names()
            if self.served_model_name not in names:
                raise FieldProblem(
                    "served_model_name",
                    f"served_model_name {self.served_model_name!r} cannot be honoured by {self.engine}: "
                    f"it has no flag to rename a model and serves this one as "
                    f"{' or '.join(repr(n) for n in names)}; leave served_model_name out or use that",
                )

    def model_names(self) -> tuple[str, ...]:
        """The names an engine that cannot rename its model serves it under
        (``enginedefs.model_names``)."""
        return enginedefs.model_names(self.model)

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
            engine_version=self.engine_version,
        )


@attrs.frozen
class RolloutConfig:
    """How a change of a model's replica template rolls out (``[models.rollout]``), as a
    Kubernetes Deployment's rolling update: ``max_surge`` replicas of the new revision beyond
    ``replicas`` while it runs, and ``max_unavailable`` fewer ready ones than ``replicas`` at any
    instant. The defaults (1 and 0) start a new replica and wait for it to be ready before an old
    one is drained; ``max_surge = 0`` needs ``max_unavailable >= 1`` (an old one goes first), for
    a fleet with no spare GPUs."""

    max_surge: int = 1
    max_unavailable: int = 0

    def __attrs_post_init__(self) -> None:
        for key in ("max_surge", "max_unavailable"):
            value = getattr(self, key)
            if value < 0:
                raise FieldProblem(key, f"{key} must be >= 0, got {value}")
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise FieldProblem(
                "max_surge",
                "max_surge and max_unavailable are both 0: a rollout could neither add a replica nor "
                "take one away; set max_surge = 1 (needs spare GPUs) or max_unavailable = 1",
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
    rollout: RolloutConfig = RolloutConfig()

    def __attrs_post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise FieldProblem(
                "name",
                f"model name {self.name!r} must be letters, digits, '.', '_' or '-', first a letter or digit",
            )
        if self.replicas < 0:
            raise FieldProblem("replicas", f"replicas must be >= 0, got {self.replicas}")
        if self.nodes_per_replica < 1:
            raise FieldProblem(
                "nodes_per_replica", f"nodes_per_replica must be >= 1, got {self.nodes_per_replica}"
            )

    @property
    def served_name(self) -> str:
        """The one name clients use, sent in every StartShard: ``served_model_name``, else the
        catalog name; for an engine that cannot rename its model (trtllm-serve), the model as it
        serves it (a local path's base name, a hub id as written)."""
        if self.profile.served_model_name:
            return self.profile.served_model_name
        if not enginedefs.renames(self.profile.engine):
            names = self.profile.model_names()
            return names[-1] if self.profile.model.startswith(("/", ".")) else names[0]
        return self.name


def _unique_names(models: Sequence[ModelConfig], hint: str) -> None:
    """Refuse a second ``[[models]]`` table of a name, naming both tables' places."""
    first: dict[str, int] = {}
    for i, m in enumerate(models):
        if m.name in first:
            raise FieldProblem(
                ("models", i, "name"),
                f"duplicate name {m.name!r} (models[{first[m.name]}] has it too); {hint}",
            )
        first[m.name] = i


@attrs.frozen
class EndpointConfig:
    """A static endpoint for router-only runs: traffic for ``model`` goes to ``url``."""

    model: str
    url: str


@attrs.frozen
class Engines:
    ports: str = "8000-8999"

    def __attrs_post_init__(self) -> None:
        try:
            _parse_range(self.ports, "ports")
        except ValueError as exc:
            raise FieldProblem("ports", str(exc)) from None

    @property
    def port_range(self) -> tuple[int, int]:
        return _parse_range(self.ports, "engines.ports")


#: llmgw.toml's keys of the embedded router and the ``RouterConfig`` field each one sets.
ROUTER_KEYS: dict[str, str] = {
    "router_coalesce_us": "relay_coalesce_us",
    "router_response_timeout": "response_timeout",
    "router_stream_idle_timeout": "stream_idle_timeout",
    "router_header_timeout": "header_timeout",
    "router_client_idle_timeout": "client_idle_timeout",
    "router_max_connections": "max_connections",
}


#: The environment variable the etcd password may come from instead of ``[state] password``
#: (a config file is often readable by more people than the process environment).
ETCD_PASSWORD_ENV = "LLMGW_ETCD_PASSWORD"


def _state_backend(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in ("file", "etcd"):
        raise FieldProblem(attribute.name, f"backend must be 'file' or 'etcd', got {value!r}")


def _etcd_endpoints(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for i, url in enumerate(value):
        rest = url.split("://", 1)[1] if "://" in url else ""
        if not url.startswith(("http://", "https://")) or not rest.rstrip("/") or "/" in rest.rstrip("/"):
            raise FieldProblem(
                (attribute.name, i),
                f"endpoints[{i}] {url!r} is not an etcd client URL; write http://HOST:PORT or "
                "https://HOST:PORT (no path), e.g. 'https://10.0.0.1:2379'",
            )


def _state_prefix(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value.startswith("/") or not value.endswith("/") or len(value) < 2:
        raise FieldProblem(
            attribute.name, f"prefix must begin and end with '/', e.g. '/llmgw/', got {value!r}"
        )


@attrs.frozen
class StateConfig:
    """Where the control plane keeps what survives it (``[state]``): the file in ``state_dir`` (the
    default, one host) or etcd (several control planes, one leader). Checked here so that a bad
    value names its key and line at start, not at the first write."""

    backend: str = attrs.field(default="file", validator=_state_backend)
    endpoints: tuple[str, ...] = attrs.field(default=(), validator=_etcd_endpoints)
    prefix: str = attrs.field(default="/llmgw/", validator=_state_prefix)
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str = ""
    #: Also from the environment (``LLMGW_ETCD_PASSWORD``), which wins over the file.
    password: str = attrs.field(default="", repr=False)
    #: The leader's lease: a leader that stops renewing is replaced within about this.
    lease_ttl: int = attrs.field(default=10)
    #: Send the password over plain http:// all the same (a lab only; said loudly at start).
    insecure_password: bool = False

    def __attrs_post_init__(self) -> None:
        if self.lease_ttl < 2:
            raise FieldProblem(
                "lease_ttl", f"lease_ttl must be a whole number of seconds from 2, got {self.lease_ttl}"
            )
        if self.backend == "file":
            given = [k for k in ("endpoints", "ca", "cert", "key", "user", "password") if getattr(self, k)]
            if given:
                raise FieldProblem(given[0], f"{given[0]} is for backend = 'etcd', but backend is 'file'")
            return
        if not self.endpoints:
            raise FieldProblem("endpoints", "endpoints is empty; backend = 'etcd' needs etcd's client URLs")
        if (self.cert is None) != (self.key is None):
            raise FieldProblem(
                "cert" if self.cert is None else "key", "cert and key go together (one is missing)"
            )
        if (self.ca or self.cert) and not any(e.startswith("https://") for e in self.endpoints):
            raise FieldProblem("ca" if self.ca else "cert", "TLS files are given but no endpoint is https://")
        if self.password and not self.user:
            raise FieldProblem("password", "password is given without a user")

    def password_from(self, environ: Mapping[str, str]) -> str:
        """The etcd password: ``LLMGW_ETCD_PASSWORD`` when set, else the file's."""
        return environ.get(ETCD_PASSWORD_ENV) or self.password

    def password_problem(self, environ: Mapping[str, str]) -> str:
        """Why the password may not be sent (it would cross the network in clear), or ""."""
        if not self.password_from(environ) or self.insecure_password:
            return ""
        clear = [e for e in self.endpoints if e.startswith("http://")]
        if not clear:
            return ""
        return (
            f"[state] password: would be sent in clear to {clear[0]}; use https:// endpoints (with ca), "
            "or set insecure_password = true for a lab"
        )


@attrs.frozen
class ControlConfig:
    state_dir: Path = Path("/var/lib/llmgw-control")
    #: Where the state lives: the file in ``state_dir`` or etcd (``StateConfig``).
    state: StateConfig = StateConfig()
    listen: Listen = Listen()
    tls: ServerTLS | None = None
    liveness: Liveness = Liveness()
    tokens: dict[str, str] = attrs.field(factory=dict)
    #: Accept agents with no authentication at all (no client certificate, join token or node
    #: token): explicit, since anything that reaches the agent port can then act as any node.
    insecure: bool = False
    engines: Engines = Engines()
    models: tuple[ModelConfig, ...] = ()
    endpoints: tuple[EndpointConfig, ...] = ()
    #: Bearer keys the router accepts; empty: no key needed.
    api_keys: tuple[str, ...] = ()
    #: The embedded router's settings, each the ``router.config.RouterConfig`` field that
    #: ``ROUTER_KEYS`` names; None (not in the file): the router's own default, with its own rule
    #: (checked here, so that a bad value names its key and line).
    router_coalesce_us: int | None = None
    router_response_timeout: float | None = None
    router_stream_idle_timeout: float | None = None
    router_header_timeout: float | None = None
    router_client_idle_timeout: float | None = None
    router_max_connections: int | None = None
    #: The key the router's /metrics wants (Authorization: Bearer KEY); "": loopback clients only.
    #: Checked by the router's own rule, as the router keys are (``router_config``).
    metrics_key: str = ""
    #: The admin API's tokens, Host names and TLS.
    api: AdminApi = AdminApi()
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
        _unique_names(self.models, "each model needs its own")
        try:
            self.router_config  # noqa: B018 -- made here for its checks
        except FieldProblem as exc:
            key = next((k for k, field in ROUTER_KEYS.items() if field == exc.key), exc.key)
            raise FieldProblem(key, f"{key} {exc}") from None
        if not self.runs_control_plane and not self.listen.router:
            raise FieldProblem(
                ("listen", "router"),
                "is empty, but a catalog without [[models]] is a router-only run: give the router an "
                "address, e.g. '0.0.0.0:8080'",
            )

    @property
    def router_config(self) -> RouterConfig:
        """The embedded router's settings, from this file's router keys (the listen address and
        the routes are the plane's own), as ``Router`` takes them; keys not in the file keep the
        router's defaults."""
        given = {field: getattr(self, key) for key, field in ROUTER_KEYS.items()}
        return RouterConfig(
            api_keys=tuple(self.api_keys),
            metrics_key=self.metrics_key,
            **{field: value for field, value in given.items() if value is not None},
        )

    @property
    def runs_control_plane(self) -> bool:
        """A catalog with any profile runs a control plane; static endpoints alone are router-only.
        A file with neither runs a control plane whose models come from ``ctl apply``."""
        return bool(self.models) or not self.endpoints


def _describe(path: KeyPath, message: str, source: str, lines: dict[KeyPath, int]) -> str:
    """One line: the key, what is wrong with it, the file and the key's own line. A message that
    begins with the key's name ("lost_after must be ...") reads on from the table's path."""
    leaf = path[-1] if path else None
    if isinstance(leaf, str) and message.startswith(f"{leaf} "):
        text = f"{dotted(path[:-1])}.{message}" if len(path) > 1 else message
    else:
        text = f"{dotted(path) or 'config'}: {message}"
    line = settings.nearest_line(lines, path)
    return f"{text} ({source}{f' line {line}' if line else ''})"


def _structure(data: object, cls: type[Any], text: str, source: str, what: str) -> Any:
    """``data`` (parsed from ``text``) as ``cls``; every problem names its key and the key's line
    in ``source``, in the order of the file."""
    try:
        return settings.converter().structure(data, cls)
    except (cattrs.BaseValidationError, ValueError) as exc:
        lines = settings.key_lines(text)
        found = sorted(settings.problems(exc), key=lambda p: settings.nearest_line(lines, p[0]) or 0)
        raise settings.config_error([_describe(path, m, source, lines) for path, m in found], what) from exc


def parse(text: str, source: str = "<config>") -> ControlConfig:
    """Structure TOML text into a ControlConfig; every problem names its key and the key's line."""
    config: ControlConfig = _structure(
        settings.parse(text, source), ControlConfig, text, source, "the control plane configuration"
    )
    return config


def read(path: Path) -> str:
    """The config file's text, or a ConfigError that names the file and why it cannot be read."""
    return settings.read_text(path)


def load(path: Path) -> ControlConfig:
    return parse(read(path), str(path))


@attrs.frozen
class ModelsFile:
    """What ``ctl apply -f`` sends: one or more ``[[models]]`` tables, nothing else."""

    models: tuple[ModelConfig, ...] = ()

    def __attrs_post_init__(self) -> None:
        _unique_names(self.models, "each model once")


def parse_models(text: str, source: str = "<models>") -> tuple[ModelConfig, ...]:
    """The ``[[models]]`` tables of TOML text (``ctl apply -f``), checked as ``llmgw.toml``'s are:
    every problem names its key and the key's line in ``source``. Any other top-level key is refused,
    naming it: server settings live in the control plane's own llmgw.toml, not in an apply."""
    data = settings.parse(text, source)
    lines = settings.key_lines(text)
    others = sorted(k for k in data if k != "models")
    if others:
        line = lines.get((others[0],))
        what = (
            "a server setting: it belongs in the control plane's llmgw.toml"
            if others[0] in attrs.fields_dict(ControlConfig)
            else "unknown key"
        )
        raise ConfigError(
            f"{dotted((others[0],))}: {what}, not in an apply, which takes [[models]] tables only "
            f"({source}{f' line {line}' if line else ''})"
        )
    if not data.get("models"):
        raise ConfigError(f"{source}: no [[models]] table; write one or more, as in llmgw.toml")
    models: ModelsFile = _structure(data, ModelsFile, text, source, source)
    return models.models


def model_from_dict(data: object, where: str) -> ModelConfig:
    """A model definition kept as a plain document (the control plane's state file), checked as
    the file's are; ``ValueError`` naming ``where`` and the key when it is not one."""
    try:
        model: ModelConfig = settings.converter().structure(data, ModelConfig)
        return model
    except (cattrs.BaseValidationError, ValueError) as exc:
        found = [f"{dotted(path) or 'model'}: {message}" for path, message in settings.problems(exc)]
        raise ValueError(f"{where}: {'; '.join(found)}") from exc


def model_to_dict(model: ModelConfig) -> dict[str, Any]:
    """``model`` as a plain JSON-able document (what ``model_from_dict`` reads back)."""
    doc: dict[str, Any] = cattrs.Converter().unstructure(model)
    return doc
