"""``--log-format text|json`` and ``--log-level`` for every llmgw process.

Flags win over the environment (``LLMGW_LOG_FORMAT``, ``LLMGW_LOG_LEVEL``, shared by all three
processes so one unit file or container setting covers them), which wins over the defaults (text,
info). ``json`` writes one object per line, for log shippers that index fields rather than parse
prose: ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message``, ``trace_id`` and
``span_id`` (hex, as trace viewers show them, when the line was logged inside a trace span:
``telemetry.tracing``), ``exception`` (the traceback text, when there is one) and every
``extra=`` field the call passed. Escaping is
``json.dumps``'s, so a peer-supplied string holding a newline or a quote cannot forge a second
record or break the line.

A process's ready or listening line (what people, scripts and tests wait for) goes to stdout through
:func:`announce`: in text mode the plain line, as it always was; in json mode a record like every
other line of the process, so a log shipper reading both streams never meets a line it cannot parse.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal, TextIO, cast

import attrs
from opentelemetry.trace import get_current_span

LOG_FORMAT_ENV = "LLMGW_LOG_FORMAT"
LOG_LEVEL_ENV = "LLMGW_LOG_LEVEL"
LOG_FORMATS: tuple[str, ...] = ("text", "json")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class LogSettingsError(ValueError):
    """A log format or level that is not one of the choices; the message names where it came from."""


@attrs.frozen
class LogSettings:
    """How a process logs: the line format and the lowest level written."""

    format: Literal["text", "json"] = "text"
    level: str = "info"

    @property
    def level_number(self) -> int:
        return int(logging.getLevelName(self.level.upper()))


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-format`` and ``--log-level`` to ``parser``; both default to None (unset), so
    :func:`log_settings` can tell a flag from the environment and say which one was wrong."""
    parser.add_argument(
        "--log-format",
        default=None,
        metavar="|".join(LOG_FORMATS),
        help=f"log line format: text for people, json for one object per line "
        f"(env {LOG_FORMAT_ENV}; default text)",
    )
    parser.add_argument(
        "--log-level",
        default=None,
        metavar="LEVEL",
        help=f"lowest level logged: {', '.join(LOG_LEVELS)} (env {LOG_LEVEL_ENV}; default info)",
    )


def log_settings(
    log_format: str | None, log_level: str | None, environ: Mapping[str, str] | None = None
) -> LogSettings:
    """Flag values (None: not given) over the environment over the defaults.

    Raises :class:`LogSettingsError` naming the flag or variable whose value is not a choice."""
    environ = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    for key, flag, env, choices in (
        ("format", "--log-format", LOG_FORMAT_ENV, LOG_FORMATS),
        ("level", "--log-level", LOG_LEVEL_ENV, LOG_LEVELS),
    ):
        given = log_format if key == "format" else log_level
        source, value = (flag, given) if given is not None else (env, environ.get(env))
        if value is None or (source == env and not value.strip()):
            continue
        if value.strip().lower() not in choices:
            raise LogSettingsError(
                f"{source} {value[:40]!r} is not a log {key}; use one of {', '.join(choices)}"
            )
        chosen[key] = value.strip().lower()
    return LogSettings(
        format=cast(Literal["text", "json"], chosen.get("format", "text")), level=chosen.get("level", "info")
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line; see the module docstring for the fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # Inside a trace span (telemetry.tracing: a request the router traces), the ids a trace
        # viewer finds the span by; the record is formatted on the thread, and so in the context,
        # that logged it.
        span = get_current_span().get_span_context()
        if span.is_valid:
            doc["trace_id"] = format(span.trace_id, "032x")
            doc["span_id"] = format(span.span_id, "016x")
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc and not key.startswith("_"):
                doc[key] = value
        # default=str: an extra field holding a path or an enum is written as text, never dropped.
        # ASCII only: a lone surrogate (bytes a peer sent, decoded with surrogateescape) becomes
        # \udcxx instead of a line the stream cannot encode and logging drops.
        return json.dumps(doc, default=str)


#: Libraries that log every request at INFO; quiet below --log-level debug (setup_logging).
_CHATTY_LIBRARIES = ("httpx", "httpcore")


def setup_logging(settings: LogSettings, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) in ``settings``' format and level,
    replacing whatever handlers the root logger had."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=settings.level_number, handlers=[handler], force=True)
    # httpx writes one INFO line per request: every readiness probe, every engine /metrics scrape on
    # the heartbeat interval and every etcd lease keepalive would bury what an operator needs. Those
    # lines are kept for --log-level debug, where a person asked for everything.
    quiet = logging.WARNING if settings.level_number > logging.DEBUG else logging.NOTSET
    for name in _CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)


def announce(
    settings: LogSettings, logger: str, message: str, stream: TextIO | None = None, **fields: object
) -> None:
    """Write a process's ready or listening line to ``stream`` (stdout) at once.

    Text mode writes ``message`` as it is (scripts and tests match its words). JSON mode writes a
    record as :class:`JsonFormatter` does (``logger`` names it, level info), ``message`` the same
    words, and ``fields`` beside it (ports, pid), so that a reader need not parse the message."""
    if settings.format == "json":
        record = logging.LogRecord(logger, logging.INFO, "", 0, message, None, None)
        record.__dict__.update(fields)
        line = JsonFormatter().format(record)
    else:
        line = message
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()
