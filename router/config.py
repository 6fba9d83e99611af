"""The router's settings: flags > environment (``LLMGW_ROUTER_*``) > TOML file > defaults.

One frozen :class:`RouterConfig` holds every setting a router runs with, whether it runs alone
(``python -m router``, which loads it here) or inside the control plane (which builds it from
``llmgw.toml``'s router keys). This module holds the class, its rules and :data:`SPEC` (each
setting's flag, help and how its text is read); the layers are read, merged and structured by the
loader every llmgw process shares (``settings``), so a bad value stops the router at start with
one line naming the key, its source (``--response-timeout``, ``LLMGW_ROUTER_RESPONSE_TIMEOUT``, or
``router.toml line 7``) and what was expected. Unknown keys are errors, not ignored (with the
closest known key as a hint).
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

import settings
from router.limits import (
    DEFAULT_CLIENT_IDLE_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    ClientLimits,
)
from router.pumpconst import MAX_COALESCE_US
from router.relay import DEFAULT_COALESCE_US
from router.routes import parse_url
from router.stalls import DEFAULT_RESPONSE_TIMEOUT, DEFAULT_STREAM_IDLE_TIMEOUT
from settings import ConfigError, FieldProblem
from telemetry.logs import LOG_FORMAT_ENV, LOG_FORMATS, LOG_LEVEL_ENV, LOG_LEVELS, LogSettings
from telemetry.tracing import ENDPOINT_ENV, endpoint_problem
from telemetry.version import version

ENV_PREFIX = "LLMGW_ROUTER_"
#: Read when present and no ``--config`` / ``LLMGW_ROUTER_CONFIG`` names another file.
DEFAULT_CONFIG = Path("/etc/llmgw/router.toml")


__all__ = ["SPEC", "ConfigError", "FieldProblem", "Loaded", "RouterConfig", "load"]


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0 or math.isinf(value):  # also refuses NaN
        raise FieldProblem(attribute.name, f"must be a number of seconds more than 0, got {value:g}")


def _not_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0 or math.isinf(value):  # also refuses NaN
        raise FieldProblem(attribute.name, f"must be a number of seconds, 0 or more, got {value:g}")


def _at_least(low: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if value < low:
            raise FieldProblem(attribute.name, f"must be at least {low}, got {value}")

    return check


def _port(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= 65535:
        raise FieldProblem(attribute.name, f"must be a port, 0-65535 (0: the kernel picks), got {value}")


def _coalesce(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= MAX_COALESCE_US:
        raise FieldProblem(attribute.name, f"must be 0 to {MAX_COALESCE_US} microseconds, got {value}")


#: The shortest metrics key accepted, as the control plane's rule for its tokens and metrics_key:
#: 16 characters (``openssl rand -hex 16`` gives 32), so it cannot be guessed by trying.
MIN_KEY_CHARS = 16


def _optional_key(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value and (len(value) < MIN_KEY_CHARS or value != value.strip()):
        raise FieldProblem(
            attribute.name,
            f"must be empty or at least {MIN_KEY_CHARS} characters without blanks around them "
            f"(got {len(value)}); make one with `openssl rand -hex 16`",
        )


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            raise FieldProblem(
                attribute.name, f"{value[:40]!r} is not a {what}; use one of {', '.join(choices)}"
            )

    return check


def _lower(value: str) -> str:
    return value.strip().lower()


def parse_static(entry: str) -> tuple[str, str]:
    """``MODEL=URL`` -> (model, url); raises ValueError saying what to write instead."""
    model, sep, url = entry.partition("=")
    if not sep or not model or not url:
        raise ValueError(f"{entry!r}: expected MODEL=URL, e.g. llama=http://10.0.0.7:8000")
    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"{entry!r}: {exc}") from None
    return model, url


def _static_entries(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for entry in value:
        try:
            parse_static(entry)
        except ValueError as exc:
            raise FieldProblem(attribute.name, str(exc)) from None


def _otlp_endpoint(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    problem = endpoint_problem(value)
    if problem:
        raise FieldProblem(attribute.name, problem)


def _control_url(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        return
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest.strip("/"):
        raise FieldProblem(
            attribute.name,
            f"{value!r} is not the control plane's URL; write http://HOST:PORT or https://HOST:PORT "
            "(its agent endpoint, e.g. https://cp.example:7443)",
        )


@attrs.frozen(kw_only=True)
class RouterConfig:
    """Every setting of one router. The defaults are the ones the control plane's embedded router
    has always used; why each is what it is sits with its constant (``router.limits``,
    ``router.stalls``, ``router.relay``) and in ``Router``'s docstring."""

    #: The address clients reach the router on.
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080, validator=_port)
    #: SO_REUSEPORT on the listener: several router processes share one port on one host, and the
    #: kernel spreads connections over them.
    reuse_port: bool = False
    #: Bearer keys clients must send; none: the router checks none.
    api_keys: tuple[str, ...] = ()
    #: ``GET /metrics`` wants this key as a bearer token; none: it answers loopback clients only.
    metrics_key: str = attrs.field(default="", validator=_optional_key)
    #: Routes of a router-only run: ``MODEL=URL`` entries (one model may have several).
    static: tuple[str, ...] = attrs.field(default=(), validator=_static_entries)
    #: Routes watched from the control plane at this URL (its agent endpoint).
    control: str = attrs.field(default="", validator=_control_url)
    #: The bearer token of the watch (a token with the admin API's read role).
    control_token: str = ""
    #: CA file that signs the control plane's certificate (https).
    control_ca: Path | None = None
    affinity_chars: int = attrs.field(default=256, validator=_at_least(0))
    affinity_slack: int = attrs.field(default=4, validator=_at_least(0))
    max_attempts: int = attrs.field(default=3, validator=_at_least(1))
    eject_after: int = attrs.field(default=3, validator=_at_least(1))
    eject_base: float = attrs.field(default=10.0, validator=_positive)
    eject_max: float = attrs.field(default=300.0, validator=_positive)
    connect_timeout: float = attrs.field(default=5.0, validator=_positive)
    response_timeout: float = attrs.field(default=DEFAULT_RESPONSE_TIMEOUT, validator=_positive)
    stream_idle_timeout: float = attrs.field(default=DEFAULT_STREAM_IDLE_TIMEOUT, validator=_positive)
    pool_max_idle: int = attrs.field(default=1024, validator=_at_least(0))
    pool_idle_timeout: float = attrs.field(default=4.0, validator=_positive)
    header_timeout: float = attrs.field(default=DEFAULT_HEADER_TIMEOUT, validator=_positive)
    client_idle_timeout: float = attrs.field(default=DEFAULT_CLIENT_IDLE_TIMEOUT, validator=_positive)
    max_connections: int = attrs.field(default=DEFAULT_MAX_CONNECTIONS, validator=_at_least(1))
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_at_least(1))
    relay_coalesce_us: int = attrs.field(default=DEFAULT_COALESCE_US, validator=_coalesce)
    #: On SIGTERM or SIGINT, how long responses in progress may take to end before they are cut
    #: (``Router.shutdown``); long enough for a long generation, short of systemd's stop timeout.
    shutdown_grace: float = attrs.field(default=30.0, validator=_not_negative)
    #: Log lines: text for people, json for one object per line (``telemetry.logs``).
    log_format: str = attrs.field(
        default="text", converter=_lower, validator=_one_of(LOG_FORMATS, "log format")
    )
    log_level: str = attrs.field(default="info", converter=_lower, validator=_one_of(LOG_LEVELS, "log level"))
    #: Traces go to this OTLP/HTTP collector (``telemetry.tracing``); none: the standard
    #: ``OTEL_EXPORTER_OTLP_*`` variables decide, and without them tracing is off.
    otlp_endpoint: str = attrs.field(default="", validator=_otlp_endpoint)

    def __attrs_post_init__(self) -> None:
        if self.eject_base > self.eject_max:
            raise FieldProblem(
                "eject_base", f"({self.eject_base:g}) must not exceed eject_max ({self.eject_max:g})"
            )

    @property
    def client_limits(self) -> ClientLimits:
        return ClientLimits(
            header_timeout=self.header_timeout,
            idle_timeout=self.client_idle_timeout,
            max_connections=self.max_connections,
        )

    @property
    def log_settings(self) -> LogSettings:
        return LogSettings(
            format=typing.cast(typing.Literal["text", "json"], self.log_format), level=self.log_level
        )

    def static_routes(self) -> list[tuple[str, str]]:
        """The ``static`` entries as (model, url) pairs (checked when the config was made)."""
        return [parse_static(entry) for entry in self.static]


# -- the layers ----------------------------------------------------------------------------------

#: One line per setting for ``--help``; the flag, the variable and the default are added from the
#: field itself (``setting_help``), so the text cannot name a variable or default that is not the
#: real one. A field without a line here fails ``build_parser``, and so the tests.
FIELD_HELP: dict[str, str] = {
    "host": "address to listen on",
    "port": "port to listen on (0: the kernel picks)",
    "reuse_port": "SO_REUSEPORT on the listener, so several router processes share one port",
    "api_keys": "accepted bearer key; repeat (the variable, comma-separated, keeps keys out of ps)",
    "metrics_key": "GET /metrics wants Authorization: Bearer KEY (the variable keeps it out of ps); "
    "without one /metrics answers loopback clients only",
    "static": "a replica, MODEL=URL; repeat (the variable: comma-separated); a router-only run",
    "control": "watch routes from the control plane at this URL (its agent endpoint)",
    "control_token": "bearer token for the route watch (the admin API's read role; use the variable)",
    "control_ca": "CA file that signs the control plane's certificate",
    "affinity_chars": "prompt prefix characters hashed for prefix affinity (0: no affinity)",
    "affinity_slack": "outstanding requests the prefix's replica may have over the least loaded one",
    "max_attempts": "replicas tried per request before a 502",
    "eject_after": "consecutive failures that eject a replica",
    "eject_base": "seconds of a first ejection (doubling per consecutive one)",
    "eject_max": "longest ejection in seconds",
    "connect_timeout": "seconds to connect to an engine",
    "response_timeout": "the longest wait for an engine's first response byte, in seconds; past it "
    "the client gets a 504 and the replica is ejected",
    "stream_idle_timeout": "the longest silence of an engine once its response began, in seconds; "
    "past it the stream ends with an error event and the replica is ejected",
    "pool_max_idle": "idle keep-alive engine connections kept per engine",
    "pool_idle_timeout": "seconds an idle engine connection is kept (below the engines' keep-alive)",
    "header_timeout": "a request's head must arrive within this many seconds of its first byte "
    "(slowloris clients are closed)",
    "client_idle_timeout": "an idle keep-alive client connection is closed after this many seconds",
    "max_connections": "client connections over this get a 503 and are closed",
    "max_body_bytes": "the largest request body accepted",
    "relay_coalesce_us": f"the relay pump's pause after each wake-up, 0 to {MAX_COALESCE_US} "
    "microseconds (0: none): streamed tokens arriving together share a wake-up",
    "shutdown_grace": "on SIGTERM or SIGINT: stop accepting, then wait this many seconds for "
    "responses in progress to end before cutting them",
    "log_format": f"log line format: text for people, json for one object per line (also {LOG_FORMAT_ENV}, "
    "shared by every llmgw process, below this one)",
    "otlp_endpoint": "send traces to this OpenTelemetry collector's OTLP/HTTP endpoint, e.g. "
    f"http://127.0.0.1:4318 (also {ENDPOINT_ENV} and the other OTEL_* variables); none: no tracing",
    "log_level": f"lowest level logged: {', '.join(LOG_LEVELS)} (also {LOG_LEVEL_ENV}, shared by every "
    "llmgw process, below this one)",
}

#: Settings given as a list: repeated flags (named in the singular), comma-separated variables.
_LIST_KEYS = {"api_keys": "--api-key", "static": "--static"}
#: Settings whose flag is a switch rather than a value.
_SWITCH_KEYS = {"reuse_port"}
#: Settings never shown in ``--help`` defaults or error messages (secrets).
_SECRET_KEYS = {"api_keys", "metrics_key", "control_token"}


#: The placeholder ``--help`` shows for a setting's value.
_METAVARS = {
    "host": "HOST",
    "port": "PORT",
    "api_keys": "KEY",
    "metrics_key": "KEY",
    "static": "MODEL=URL",
    "control": "URL",
    "control_token": "TOKEN",
    "control_ca": "FILE",
    "max_body_bytes": "BYTES",
    "relay_coalesce_us": "US",
    "log_format": "|".join(LOG_FORMATS),
    "log_level": "LEVEL",
    "otlp_endpoint": "URL",
}


def _setting(key: str) -> settings.Setting:
    kind = str(attrs.fields_dict(RouterConfig)[key].type)  # as written: annotations are text here
    return settings.Setting(
        help=FIELD_HELP.get(key, ""),
        flag=_LIST_KEYS.get(key, ""),
        metavar=_METAVARS.get(key) or ("SECONDS" if kind == "float" else "N"),
        parse=settings.text_parser(kind),
        repeat=key in _LIST_KEYS,
        switch=key in _SWITCH_KEYS,
        secret=key in _SECRET_KEYS,
    )


SPEC = settings.Spec(
    config=RouterConfig,
    settings={key: _setting(key) for key in attrs.fields_dict(RouterConfig)},
    env_prefix=ENV_PREFIX,
    default_file=DEFAULT_CONFIG,
    prog="python -m router",
    description="llmgw's OpenAI-compatible router, as its own service: routes watched from the "
    "control plane (--control URL) or a static endpoint list (--static MODEL=URL).",
    epilog="Precedence: flags, then the environment (LLMGW_ROUTER_*), then the TOML file, then "
    "the defaults. Every setting's file key is its variable's name after LLMGW_ROUTER_, in "
    'lower case (api_keys = [...], static = ["MODEL=URL", ...]).',
    version=lambda: f"llmgw router {version()}",
    what="the router configuration",
    # LLMGW_LOG_FORMAT and LLMGW_LOG_LEVEL, which every llmgw process reads (one unit file or
    # container setting for all three); LLMGW_ROUTER_LOG_* and the flags win over them.
    shared_env={"log_format": LOG_FORMAT_ENV, "log_level": LOG_LEVEL_ENV},
)


def flag(key: str) -> str:
    return SPEC.flag(key)


def variable(key: str) -> str:
    return SPEC.variable(key)


def setting_help(key: str) -> str:
    """``--help``'s line for one setting: what it is, its variable and its default."""
    return SPEC.help(key)


def build_parser() -> argparse.ArgumentParser:
    return settings.build_parser(SPEC)


def _where(key: str, layered: settings.Layered) -> str:
    source = layered.sources.get(key)
    return f"from {source}" if source else "by default"


def structure(layered: settings.Layered) -> RouterConfig:
    """The config from merged values; a broken rule is a ConfigError naming the key and source."""
    config: RouterConfig = settings.structure(SPEC, layered)
    return config


@attrs.frozen
class Loaded:
    """A loaded config and where each key set explicitly came from (keys left at their default
    are absent), for start-up checks that must name the setting."""

    config: RouterConfig
    sources: dict[str, str]


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Loaded:
    """Parse flags, read the environment and the TOML file, and make the config of a router that
    runs alone: exactly one of ``control`` and ``static`` must be given."""
    environ = os.environ if environ is None else environ
    layered = settings.layers(SPEC, build_parser().parse_args(argv), environ)
    config = structure(layered)
    if bool(config.control) == bool(config.static):
        if config.control:
            raise ConfigError(
                f"control ({_where('control', layered)}) and static ({_where('static', layered)}) "
                "both give the routes; give exactly one of --control URL and --static MODEL=URL"
            )
        raise ConfigError(
            f"no routes: give --control URL ({variable('control')}; routes watched from the control "
            f"plane) or --static MODEL=URL ({variable('static')}; a router-only run)"
        )
    if config.control_ca is not None and not config.control_ca.is_file():
        raise ConfigError(
            f"control_ca ({_where('control_ca', layered)}): {config.control_ca} is not a readable file; "
            "name the PEM file of the CA that signs the control plane's certificate"
        )
    if not config.control:
        for key in ("control_token", "control_ca"):
            if key in layered.sources:
                raise ConfigError(
                    f"{key} ({_where(key, layered)}) applies to --control only, and none is given"
                )
    return Loaded(config, dict(layered.sources))
