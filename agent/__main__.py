"""``python -m agent --node-id gpu07 --server https://cp:7443``: the node agent daemon.

SIGTERM and SIGINT stop the agent and leave the engines running: an agent upgrade or restart must not
cost a model reload, and the restarted agent re-adopts them from its state directory.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from agent.config import AgentConfig, ConfigError, agent_version, load_all
from agent.discovery import InventoryFileError, discover
from agent.metrics import AgentMetrics
from agent.nursery import run_agent
from telemetry.http import parse_listen
from telemetry.logs import setup_logging

log = logging.getLogger("llmgw.agent")


class MetricsPortError(Exception):
    """The admin port (``metrics_listen``) cannot be bound; the message says which and why."""


async def _main(config: AgentConfig) -> None:
    metrics = AgentMetrics(config.node_id, agent_version())
    async with trio.open_nursery() as admin:
        if config.metrics_listen:
            # First, so that /healthz answers 503 "starting" through discovery and adoption, and a
            # port that cannot be bound stops the agent before it touches any engine.
            try:
                bound = await admin.start(metrics.serve, parse_listen(config.metrics_listen))
            except OSError as exc:
                raise MetricsPortError(
                    f"metrics_listen {config.metrics_listen!r}: cannot listen ({exc.strerror or exc}); "
                    "pick a free port or leave metrics_listen unset"
                ) from None
            log.info("admin port: http://%s/healthz and /metrics", bound)
        await _run(config, metrics)
        admin.cancel_scope.cancel()


async def _run(config: AgentConfig, metrics: AgentMetrics) -> None:
    inventory = await trio.to_thread.run_sync(discover, config.inventory)
    if inventory.error:
        log.warning("GPU discovery found nothing usable: %s; registering with no GPUs", inventory.error)
    else:
        log.info("discovered %d GPU(s) via %s", len(inventory.gpus), inventory.source or "?")
    for warning in inventory.warnings:
        log.warning("discovery: %s", warning)
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(functools.partial(run_agent, config, inventory, metrics=metrics))
            async for signum in signals:
                log.info("received %s: stopping the agent; engines keep running", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    try:
        loaded = load_all(argv)
    except ConfigError as exc:
        print(f"llmgw-agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(loaded.logging)
    config, sources = loaded.config, loaded.sources
    # Checked before the event loop starts (it blocks on the filesystem, which is fine here): an
    # agent that cannot record intents must not start engines, and one line says what to fix.
    unwritable = config.unwritable_dir(sources)
    if unwritable:
        print(f"llmgw-agent: {unwritable}", file=sys.stderr)
        return 2
    code = 0
    try:
        trio.run(_main, config)
    except* (InventoryFileError, MetricsPortError) as group:
        # A start-up mistake, raised inside the admin nursery: one line each, status 2.
        for problem in group.exceptions:
            print(f"llmgw-agent: {problem}", file=sys.stderr)
        code = 2
    return code


if __name__ == "__main__":
    sys.exit(main())
