"""Agent configuration: flags > environment (``LLMGW_AGENT_*``) > TOML file > defaults.

The frozen :class:`AgentConfig`, its rules, and :data:`SPEC` (each setting's help, how its flag's
text is read, its default in words); reading, merging and structuring the layers is the shared
loader's (``settings``), so a bad value fails at start with the key, its source
(``--heartbeat-interval``, ``LLMGW_AGENT_HEARTBEAT_INTERVAL``, or ``/etc/llmgw/agent.toml line 7``)
and what was expected, worded as every llmgw process words it. Unknown keys are errors, not ignored.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import os
import re
import shlex
import socket
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs

import enginedefs
import settings
from agent.discovery.model import FabricAttachment
from schema.ids import NODE_ID, NODE_ID_RULE
from settings import ConfigError, FieldProblem
from telemetry.http import parse_listen
from telemetry.logs import LogSettings, LogSettingsError, add_log_arguments, log_settings

__all__ = ["SPEC", "AgentConfig", "ConfigError", "FieldProblem", "Loaded", "load", "load_all"]

ENV_PREFIX = "LLMGW_AGENT_"
DEFAULT_CONFIG = Path("/etc/llmgw/agent.toml")


def _default_engines() -> dict[str, str]:
    """Engine command lines as a node usually has them (each descriptor's); override per engine in
    the config."""
    return {d.name: d.default_command() for d in enginedefs.DESCRIPTORS}


#: URL schemes the transport speaks (``transport.agentstream.open_stream``): HTTP/2 cleartext with
#: prior knowledge, HTTP/2 over TLS, and WebSocket without and with TLS.
SERVER_SCHEMES: tuple[str, ...] = ("http", "https", "ws", "wss")

#: A host name as resolvers take it (underscores included: some internal zones use them).
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")


def server_problem(url: str) -> str:
    """What is wrong with the control plane URL and what to write instead; "" when it is usable.

    Checked when the config is read: a URL the transport cannot open fails every reconnect the same
    way, forever, so it must stop the agent at start with one line rather than loop. Pure: nothing
    is resolved here (the name may well resolve only later)."""
    example = "'http://cp.example:7070'"
    if "://" not in url:
        hint = f"'http://{url}'" if url else example
        return (
            f"{url!r} is not a URL; write SCHEME://HOST:PORT with scheme "
            f"{', '.join(SERVER_SCHEMES)}, e.g. {hint}"
        )
    scheme_text, _, rest = url.partition("://")
    scheme = scheme_text.lower()  # as urlsplit reads it
    if scheme not in SERVER_SCHEMES:
        return (
            f"{url!r}: the scheme {scheme_text!r} is not one the agent speaks; use http (HTTP/2 "
            "cleartext), https (HTTP/2 over TLS), ws or wss (WebSocket, for proxies without HTTP/2)"
        )
    host_port = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
    if host_port.startswith("["):
        if "]" not in host_port:
            return f"{url!r}: the '[' of an IPv6 host is never closed; write e.g. 'http://[::1]:7070'"
        host, _, rest = host_port[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else None
        if rest and port is None:
            return f"{url!r}: expected ':PORT' after the bracketed IPv6 host, got {rest!r}"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{url!r}: {host!r} in brackets is not an IPv6 address"
    else:
        host, sep, port_text = host_port.rpartition(":")
        host, port = (host, port_text) if sep else (host_port, None)
        if not host:
            return f"{url!r} has no host; name the control plane, e.g. {example}"
        if not _HOST_NAME.fullmatch(host):
            return f"{url!r}: {host!r} is neither an IP address nor a host name"
    if port is not None:
        default = 443 if scheme in ("https", "wss") else 80
        if not port:
            return f"{url!r} ends its host with ':' but gives no port; add one (1-65535) or drop the ':'"
        if not port.isdigit():
            return (
                f"{url!r}: the port {port!r} is not a number; give 1-65535, or leave out ':' "
                f"for the scheme's default ({default})"
            )
        if not 1 <= int(port) <= 65535:
            return f"{url!r}: port {int(port)} is out of range; use 1-65535"
    try:
        urlsplit(url)  # what the transport parses it with; anything left that it refuses
    except ValueError as exc:
        return f"{url!r} is not a URL the agent can open: {exc}"
    return ""


def server_urls(value: str) -> tuple[str, ...]:
    """The control planes' URLs in ``--server`` (comma-separated: several control planes on one
    etcd prefix, tried in order; the one that leads accepts the stream)."""
    return tuple(part.strip() for part in value.split(","))


def _server_url(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    urls = server_urls(value)
    for i, url in enumerate(urls):
        problem = server_problem(url)
        if problem:
            where = f"{attribute.name} (URL {i + 1} of {len(urls)})" if len(urls) > 1 else attribute.name
            raise FieldProblem((attribute.name,), f"{where} {problem}")


def engine_problem(name: str) -> str:
    """Why ``name`` is no engine the agent can run, with the closest known name; "" when it is one.

    An ``[engines]`` entry under a misspelt name would otherwise be ignored without a word, and the
    engine it meant to configure would run the default command."""
    problem = enginedefs.unknown_engine(name)
    return f"{problem}; name one of them or remove the entry" if problem else ""


def _known_engines(_: object, attribute: attrs.Attribute[dict[str, str]], value: dict[str, str]) -> None:
    for name in value:
        problem = engine_problem(name)
        if problem:
            raise FieldProblem((attribute.name, name), f"{attribute.name}: {problem}")


def _listen_address(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise FieldProblem((attribute.name,), f"{attribute.name} {exc}") from None


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be greater than 0, got {value}")


def _at_least_one(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen
class PortRange:
    first: int = 8000
    last: int = 8999

    def __attrs_post_init__(self) -> None:
        if not (1 <= self.first <= self.last <= 65535):
            raise ValueError(f"port range {self.first}-{self.last} must satisfy 1 <= first <= last <= 65535")


@attrs.frozen(kw_only=True)
class AgentConfig:
    """Everything the agent runs with; see the module docstring for where values come from."""

    node_id: str
    #: The control plane's agent endpoint: ``http://``, ``https://``, ``ws://`` or ``wss://`` URL;
    #: several, comma-separated, for control planes sharing state in etcd (``servers``).
    server: str = attrs.field(validator=_server_url)
    hostname: str = attrs.field(factory=socket.gethostname)

    @property
    def servers(self) -> tuple[str, ...]:
        """Every control plane URL in ``server``, in the order they are tried."""
        return server_urls(self.server)

    #: Address the router and other nodes reach this node's engines on; empty: derived at start.
    mgmt_addr: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    #: NCCL and Gloo bootstrap over this interface for multi-node replicas.
    mgmt_interface: str = "eth0"
    fabrics: tuple[FabricAttachment, ...] = ()
    heartbeat_interval: float = attrs.field(default=5.0, validator=_positive)
    reconnect_base: float = attrs.field(default=1.0, validator=_positive)
    reconnect_max: float = attrs.field(default=30.0, validator=_positive)
    #: How long to wait for the server's HTTP/2 SETTINGS after our preface: nothing about this node
    #: is sent before the server has spoken HTTP/2 (a wrong or silent port learns nothing).
    settings_timeout: float = attrs.field(default=5.0, validator=_positive)
    protocol: Literal["grpc", "connect"] = "grpc"
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Per-node token for control planes without mutual TLS.
    token: str = ""
    state_dir: Path = Path("/var/lib/llmgw-agent")
    #: Engine log files; default ``state_dir/logs``.
    log_dir: Path | None = None
    #: Engine name -> command line (shell words), e.g. ``sglang = "python3 -m sglang.launch_server"``.
    engines: dict[str, str] = attrs.field(factory=_default_engines, validator=_known_engines)
    #: A static inventory file instead of NVML / nvidia-smi discovery.
    inventory: Path | None = None
    #: Seconds between SIGTERM and SIGKILL when stopping an engine.
    stop_grace: float = attrs.field(default=30.0, validator=_positive)
    engine_ports: PortRange = PortRange()
    #: Address engines bind to; empty (the default): the node's management address (``mgmt_addr``,
    #: or the one derived at start), so only the router and this agent can reach them, not every
    #: network the node is on. ``0.0.0.0`` (every interface) is still allowed, explicitly.
    engine_host: str = ""
    #: An engine's log (``log_dir/SHARD.log``) is rotated once it grows past this many bytes,
    #: keeping ``log_generations`` older files (``SHARD.log.1`` the newest); 0 keeps none.
    log_max_bytes: int = attrs.field(default=50 * 1024 * 1024, validator=_at_least_one)
    log_generations: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    #: kubelet's liveness probe, for each READY engine: a ``GET /health`` every ``liveness_period``
    #: seconds, each given ``liveness_timeout`` seconds (a wedged engine must not hold the probe),
    #: and ``liveness_failures`` misses in a row make the shard UNHEALTHY (a pass makes it READY).
    #: As in kubelet, a timeout longer than the period is allowed: probes never overlap, and the
    #: next one starts when the slow one ends.
    liveness_period: float = attrs.field(default=10.0, validator=_positive)
    liveness_timeout: float = attrs.field(default=5.0, validator=_positive)
    liveness_failures: int = attrs.field(default=3, validator=_at_least_one)
    #: Readiness trusts only the engine the agent started: the socket listening on the shard's port
    #: must belong to the engine's process group. Turn off only for engines launched through a
    #: container runtime (``docker run -p ...`` as the engine's command), whose published port is held
    #: by the runtime's proxy, not by a process the agent started.
    verify_listener: bool = True
    #: ``/healthz`` and ``/metrics`` (``agent.metrics``) on this address; empty (the default): off.
    #: A port alone listens on loopback: the admin port is local unless an interface is named.
    metrics_listen: str = attrs.field(default="", validator=_listen_address)

    def __attrs_post_init__(self) -> None:
        if not self.node_id.strip():
            raise ValueError("node_id must not be empty")
        if NODE_ID.fullmatch(self.node_id) is None:
            # The control plane refuses such a Register; say so at start, not at every reconnect.
            raise ValueError(f"node_id {self.node_id[:64]!r} is not valid: it must be {NODE_ID_RULE}")
        if self.reconnect_base > self.reconnect_max:
            raise ValueError(
                f"reconnect_base ({self.reconnect_base}) must not exceed reconnect_max ({self.reconnect_max})"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")

    @property
    def logs(self) -> Path:
        return self.log_dir or self.state_dir / "logs"

    def unwritable_dir(self, sources: Mapping[str, str]) -> str:
        """One line naming the first directory the agent cannot write (state, then logs), the
        setting that chose it and what to do; empty when both are writable. Blocks on the
        filesystem: called before the event loop starts.

        Writability is tried, not inferred from mode bits (root ignores them; a read-only mount
        does not show in them): the directory is created if missing and a file is made and removed.
        """
        state_from = _setting_source("state_dir", sources)
        log_from = (
            f"log_dir {_setting_source('log_dir', sources)}"
            if "log_dir" in sources
            else f"log_dir, unset: state_dir/logs with state_dir {state_from}"
        )
        for what, directory, chosen_by, setting in (
            ("state directory", self.state_dir, f"state_dir {state_from}", "state_dir"),
            ("log directory", self.logs, log_from, "log_dir"),
        ):
            problem = _write_problem(directory)
            if problem:
                return (
                    f"cannot write the {what} {directory} ({problem}); it was chosen by {chosen_by}: "
                    f"make it writable for this user, or set {SPEC.flag(setting)} "
                    f"(or {SPEC.variable(setting)}) to a directory that is"
                )
        return ""

    def engine_argv(self, engine: str) -> tuple[str, ...]:
        defaults = _default_engines()
        return tuple(shlex.split(self.engines.get(engine) or defaults.get(engine, engine)))


def _setting_source(key: str, sources: Mapping[str, str]) -> str:
    return f"from {sources[key]}" if key in sources else "by default"


def _write_problem(directory: Path) -> str:
    """Why a file cannot be created in ``directory`` (made if missing); empty when one can."""
    try:
        if directory.exists() and not directory.is_dir():
            return "it is a file, not a directory"
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".llmgw-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


# -- the layers ----------------------------------------------------------------------------------


def _parse_labels(text: str) -> dict[str, str]:
    """``zone=a,gpu=h100`` -> {"zone": "a", "gpu": "h100"}."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value pairs separated by commas, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _parse_fabrics(text: str) -> list[dict[str, Any]]:
    """``ib-a:mlx5_0:1,ib-a:mlx5_1`` -> fabric attachments (port defaults to 1)."""
    out: list[dict[str, Any]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"expected FABRIC:HCA[:PORT] entries separated by commas, got {item!r}")
        entry: dict[str, Any] = {"fabric": parts[0], "hca": parts[1]}
        if len(parts) == 3:
            entry["port"] = parts[2]
        out.append(entry)
    return out


def _parse_ports(text: str) -> dict[str, str]:
    first, sep, last = text.partition("-")
    if not sep:
        raise ValueError(f"expected FIRST-LAST, got {text!r}")
    return {"first": first.strip(), "last": last.strip()}


def _parse_engines(text: str) -> dict[str, str]:
    """``vllm=/opt/vllm/bin/vllm;sim=python3 -m agent.engines.sim`` (semicolons: commands hold spaces)."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected ENGINE=COMMAND entries separated by ';', got {item!r}")
        out[key.strip()] = value.strip()
    return out


#: Settings whose flag or variable is not a plain value, and how to read it from text.
_TEXT_PARSERS = {
    "verify_listener": settings.parse_bool,
    "labels": _parse_labels,
    "fabrics": _parse_fabrics,
    "engine_ports": _parse_ports,
    "engines": _parse_engines,
}


#: One line per setting for ``--help``; the flag, the variable and the default are added from the
#: field itself (``Spec.help``), so the text cannot name a variable or default that is not
#: the real one. A field without a line here fails ``build_parser``, and so the tests.
FIELD_HELP: dict[str, str] = {
    "node_id": "this node's name in the fleet: letters, digits, '.', '_', '-'",
    "server": "the control plane's agent endpoint: http://, https://, ws:// or wss:// URL (several, comma-separated: tried in turn)",
    "hostname": "the host name reported to the control plane",
    "mgmt_addr": "address the router and other nodes reach this node's engines on",
    "labels": "node labels for placement, KEY=VALUE,KEY=VALUE",
    "mgmt_interface": "network interface NCCL and Gloo bootstrap over for multi-node replicas",
    "fabrics": "GPU fabrics this node is attached to, FABRIC:HCA[:PORT],... (port 1 when left out)",
    "heartbeat_interval": "seconds between heartbeats",
    "reconnect_base": "first reconnect delay in seconds (doubled per failed attempt, jittered)",
    "reconnect_max": "longest reconnect delay in seconds",
    "settings_timeout": "seconds to wait for the server's HTTP/2 SETTINGS before giving up an attempt",
    "protocol": "wire protocol on http(s) URLs: grpc or connect",
    "tls_ca": "CA file that signs the control plane's certificate (https, wss)",
    "tls_cert": "client certificate for mutual TLS (with --tls-key)",
    "tls_key": "private key of --tls-cert",
    "token": "join token, for control planes without mutual TLS (keep it out of ps: use the variable)",
    "state_dir": "where shard records, the node credential and (by default) engine logs live",
    "log_dir": "engine log files",
    "engines": "engine command lines, ENGINE=COMMAND;ENGINE=COMMAND (semicolons: commands hold spaces)",
    "inventory": "a static GPU inventory file (TOML) instead of NVML / nvidia-smi discovery",
    "stop_grace": "seconds between SIGTERM and SIGKILL when stopping an engine",
    "engine_ports": "ports engines may listen on, FIRST-LAST",
    "engine_host": "address engines bind to (0.0.0.0: every interface)",
    "log_max_bytes": "an engine's log is rotated past this many bytes",
    "log_generations": "rotated engine logs kept (SHARD.log.1 the newest); 0 keeps none",
    "liveness_period": "seconds between liveness probes of a READY engine",
    "liveness_timeout": "seconds one liveness probe may take",
    "liveness_failures": "failed liveness probes in a row that make a shard UNHEALTHY",
    "verify_listener": "readiness counts only a port held by the engine's own processes (true/false; "
    "false for engines run through a container runtime)",
    "metrics_listen": "serve /healthz and /metrics on [HOST:]PORT (no host: loopback)",
}

#: Defaults that are computed, said in words rather than as one machine's value.
_DEFAULT_WORDS: dict[str, str] = {
    "node_id": "the host name",
    "server": "none: required",
    "hostname": "the host name",
    "mgmt_addr": "the local address that reaches the server",
    "log_dir": "STATE_DIR/logs",
    "engine_host": "the management address",
    "metrics_listen": "off",
    "log_max_bytes": "52428800 (50 MiB)",
    "engine_ports": f"{PortRange().first}-{PortRange().last}",
    # The sim's command names this interpreter: said as such, not as one machine's path.
    "engines": ";".join(f"{k}={v}" for k, v in _default_engines().items()).replace(
        shlex.quote(sys.executable), "THIS-PYTHON"
    ),
}


def _describe(path: settings.KeyPath, message: str, sources: Mapping[str, str]) -> str:
    """The agent's wording: ``server 'x' is not a URL; ... (server from --server)`` for a rule's
    words that name the key, ``heartbeat_interval: invalid value ... (from agent.toml line 4)``
    for a value of the wrong type; the source is the most precise there is (an ``[engines]``
    entry's own line when it has one)."""
    key = str(path[0])
    source = settings.source_of(path, sources)
    where = f"from {source}" if source else "default"
    if message.startswith((f"{key} ", f"{key}:")):
        return f"{message} ({key} {where})"
    return f"{settings.dotted(path)}: {message} ({where})"


def agent_version() -> str:
    """The installed package's version (what ``pip`` installed), else the source tree's."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        from agent import __version__

        return __version__


SPEC = settings.Spec(
    config=AgentConfig,
    settings={
        key: settings.Setting(
            help=FIELD_HELP.get(key, ""), parse=_TEXT_PARSERS.get(key), default=_DEFAULT_WORDS.get(key, "")
        )
        for key in attrs.fields_dict(AgentConfig)
    },
    env_prefix=ENV_PREFIX,
    default_file=DEFAULT_CONFIG,
    prog="python -m agent",
    description="llmgw node agent: registers this node with the control plane and supervises engines.",
    epilog="Precedence: flags, then the environment (LLMGW_AGENT_*), then the TOML file, then "
    "the defaults. Every setting's file key is its flag's name with '_' for '-'.",
    version=lambda: f"llmgw-agent {agent_version()}",
    describe=_describe,
    unset="default",
    what="the agent configuration",
    text=True,
)


def setting_help(key: str) -> str:
    """``--help``'s line for one setting: what it is, its variable and its default."""
    return SPEC.help(key)


def build_parser() -> argparse.ArgumentParser:
    """The agent's flags (one per setting, from :data:`SPEC`) and the log flags every process has."""
    parser = settings.build_parser(SPEC)
    add_log_arguments(parser)
    return parser


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Parse flags, read the environment and the TOML file, and structure the merged result."""
    return load_with_sources(argv, environ)[0]


def load_with_sources(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[AgentConfig, dict[str, str]]:
    """:func:`load`, and where each key set explicitly came from (``--state-dir``,
    ``LLMGW_AGENT_STATE_DIR``, ``/etc/llmgw/agent.toml line 7``); keys left at their default are
    absent. A start-up check that fails names the setting that chose the value with these."""
    loaded = load_all(argv, environ)
    return loaded.config, loaded.sources


@attrs.frozen
class Loaded:
    """What ``python -m agent`` starts with: the config, where its keys came from, and how to log
    (``--log-format``/``--log-level``, shared by every llmgw process: ``telemetry.logs``)."""

    config: AgentConfig
    sources: dict[str, str]
    logging: LogSettings


#: Where a node id taken from the host name is said to come from, in errors.
HOST_NAME_SOURCE = "the host name (no --node-id, LLMGW_AGENT_NODE_ID or node_id in the file)"


def default_node_id(hostname: str) -> str:
    """The node id of a node that names none: its host name, which must pass the node id rule.

    Raises ConfigError saying how to name the node otherwise; the control plane would refuse the
    Register of every reconnect, so the agent must not start."""
    if NODE_ID.fullmatch(hostname) is None:
        shown = hostname[:64] if hostname else "(empty)"
        raise ConfigError(
            f"node_id: not set, and the host name {shown!r} cannot stand in for it (a node id must be "
            f"{NODE_ID_RULE}); give --node-id, {SPEC.variable('node_id')} or node_id = ... in the file"
        )
    return hostname


def load_all(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    hostname: typing.Callable[[], str] = socket.gethostname,
) -> Loaded:
    """:func:`load_with_sources` and the log settings; ``hostname`` gives the default node id."""
    environ = os.environ if environ is None else environ
    ns = build_parser().parse_args(argv)
    try:
        logs = log_settings(ns.log_format, ns.log_level, environ)
    except LogSettingsError as exc:
        raise ConfigError(str(exc)) from None
    layered = settings.layers(SPEC, ns, environ)
    if isinstance(layered.values.get("metrics_listen"), int):
        # metrics_listen = 9101 in the file: a port alone, as the flag takes it.
        layered.values["metrics_listen"] = str(layered.values["metrics_listen"])
    if "node_id" not in layered.values:
        layered.values["node_id"] = default_node_id(hostname())
        layered.sources["node_id"] = HOST_NAME_SOURCE
    config: AgentConfig = settings.structure(SPEC, layered)
    return Loaded(config, dict(layered.sources), logs)
