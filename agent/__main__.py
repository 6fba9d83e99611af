"""``python -m agent --node-id gpu07 --server https://cp:7443``: the node agent daemon.

SIGTERM and SIGINT stop the agent and leave the engines running: an agent upgrade or restart must not
cost a model reload, and the restarted agent re-adopts them from its state directory.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

import trio

from agent.config import AgentConfig, ConfigError, load_with_sources
from agent.discovery import InventoryFileError, discover
from agent.nursery import run_agent

log = logging.getLogger("llmgw.agent")


async def _main(config: AgentConfig) -> None:
    inventory = await trio.to_thread.run_sync(discover, config.inventory)
    if inventory.error:
        log.warning("GPU discovery found nothing usable: %s; registering with no GPUs", inventory.error)
    else:
        log.info("discovered %d GPU(s) via %s", len(inventory.gpus), inventory.source or "?")
    for warning in inventory.warnings:
        log.warning("discovery: %s", warning)
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(run_agent, config, inventory)
            async for signum in signals:
                log.info("received %s: stopping the agent; engines keep running", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, sources = load_with_sources(argv)
    except ConfigError as exc:
        print(f"llmgw-agent: {exc}", file=sys.stderr)
        return 2
    # Checked before the event loop starts (it blocks on the filesystem, which is fine here): an
    # agent that cannot record intents must not start engines, and one line says what to fix.
    unwritable = config.unwritable_dir(sources)
    if unwritable:
        print(f"llmgw-agent: {unwritable}", file=sys.stderr)
        return 2
    try:
        trio.run(_main, config)
    except InventoryFileError as exc:
        print(f"llmgw-agent: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
