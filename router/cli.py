"""``python -m router`` (and the ``llmgw-router`` script): the router as its own service.

The routes come from exactly one place: the control plane's route watch (``--control URL``), so
that the router keeps serving its last table while the control plane restarts, or a static list
(``--static MODEL=URL``) for a router with no control plane at all. Every other setting is in
``router.config.RouterConfig`` (flags > ``LLMGW_ROUTER_*`` > ``--config router.toml`` >
defaults). A configuration mistake is one line on stderr and exit status 2. Logs go to stderr
as ``--log-format`` (text or json, one object per line) and ``--log-level`` say (``telemetry.logs``).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

import trio

from router.config import ConfigError, RouterConfig, load
from router.routes import ModelRoutes, RoutesFn, static_routes
from router.server import Router
from telemetry import tracing as otel
from telemetry.logs import announce, setup_logging
from telemetry.tracing import Tracing, TracingSettingsError
from telemetry.version import version

log = logging.getLogger("llmgw.router")


async def run(
    config: RouterConfig,
    *,
    tracing: Tracing | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve with ``config`` until SIGTERM or SIGINT (or until cancelled); reports the bound port.
    With ``control`` the route watch runs in this nursery beside the server and the router reads
    its table per request.

    A signal stops the router as a service (``Router.shutdown``): the listener closes at once, so
    a load balancer's next connection goes elsewhere, and the responses in progress have
    ``shutdown_grace`` seconds to end before they are cut; then this returns and the process
    exits 0. A second signal during the grace ends the process at once: the handlers are back to
    their defaults by then."""
    async with trio.open_nursery() as nursery:
        routes: RoutesFn
        pending: Callable[[], str] | None = None
        if config.control:
            # Imported here: only a router that watches needs the transport's client side.
            from router.watch import WatchedRoutes

            watched = WatchedRoutes(config.control, token=config.control_token, ca=config.control_ca)
            await nursery.start(watched.run)
            routes = watched.routes
            where = config.control

            def pending() -> str:
                return "" if watched.tables else f"no route table from the control plane at {where} yet"
        else:
            routes = static_routes(config.static_routes())
        router = Router(routes, config, pending=pending, tracing=tracing)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            port = await nursery.start(
                lambda task_status: router.serve(
                    config.host, config.port, reuse_port=config.reuse_port, task_status=task_status
                )
            )
            source = (
                f"routes from {config.control}" if config.control else f"{len(config.static)} static routes"
            )
            announce(
                config.log_settings,
                "llmgw.router",
                f"llmgw router listening on {config.host}:{port} (pid {os.getpid()}, "
                f"{router.pump.kind} relay pump, {source})",
                host=config.host,
                port=port,
                pid=os.getpid(),
                relay_pump=router.pump.kind,
            )
            task_status.started(port)
            async for signum in signals:
                log.info(
                    "%s: stopping: the listener is closed; %d client connections have up to %g s to finish",
                    signal.Signals(signum).name,
                    router.connections,
                    config.shutdown_grace,
                )
                break
        cut = await router.shutdown(config.shutdown_grace)
        if cut:
            log.warning(
                "router stopped: %d client connections still open after the %g s shutdown grace were cut",
                cut,
                config.shutdown_grace,
            )
        else:
            log.info("router stopped: every response in progress ended")
        nursery.cancel_scope.cancel()


def static_table(table: Mapping[str, ModelRoutes]) -> RoutesFn:
    """A routes function over a table that never changes."""
    return lambda: table


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load(argv).config
        # Made once here so that what the router refuses (the relay pump asked for by
        # LLMGW_RELAY) is a start-up line too, not a traceback inside the event loop.
        Router(static_table({}), config)
        # The SDK's worker thread starts here, outside the event loop, and is stopped after it.
        tracing = otel.start(config.otlp_endpoint, "llmgw-router")
    except (ConfigError, TracingSettingsError) as exc:
        print(f"llmgw-router: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:
        print(f"llmgw-router: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_settings)
    log.info("llmgw router %s starting (pid %d)", version(), os.getpid())
    failed: list[OSError] = []
    try:
        try:
            trio.run(lambda: run(config, tracing=tracing))
        except* OSError as group:  # from inside the nursery: the port in use, a foreign address
            failed.extend(_leaves(group))
    except KeyboardInterrupt:
        pass
    finally:
        if tracing is not None:
            tracing.shutdown()  # sends what is queued, within a bound; the loop has ended
    for error in failed[:1]:
        if error.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            print(
                f"llmgw-router: cannot listen on {config.host}:{config.port}: {error.strerror} (another "
                "process holds the port, or the address is not this host's; routers share a port "
                "only when each has --reuse-port)",
                file=sys.stderr,
            )
        else:
            print(f"llmgw-router: {error}", file=sys.stderr)
        return 1
    return 0


def _leaves(group: BaseExceptionGroup[OSError]) -> list[OSError]:
    out: list[OSError] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


if __name__ == "__main__":
    sys.exit(main())
