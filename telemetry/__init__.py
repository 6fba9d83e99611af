"""What every llmgw process shares for being operated: log setup, Prometheus helpers, traces.

The agent, the control plane and the router each take ``--log-format text|json`` and
``--log-level`` the same way (:mod:`telemetry.logs`) and expose metrics through ``prometheus_client``
the same way (:mod:`telemetry.metrics`), so an operator's log shipper and scrape config work for all
three; traces go to an OpenTelemetry collector (:mod:`telemetry.tracing`, imported by the processes
that trace, not from here). This package imports nothing of llmgw's: any room may use it.
"""

from telemetry.logs import (
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    JsonFormatter,
    LogSettings,
    LogSettingsError,
    add_log_arguments,
    log_settings,
    setup_logging,
)
from telemetry.metrics import exposition, new_registry

__all__ = [
    "LOG_FORMAT_ENV",
    "LOG_LEVEL_ENV",
    "JsonFormatter",
    "LogSettings",
    "LogSettingsError",
    "add_log_arguments",
    "exposition",
    "log_settings",
    "new_registry",
    "setup_logging",
]
