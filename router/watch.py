"""The route watch, router side: routes from the control plane, kept while it is away.

A router run apart from the control plane (``python -m router --control URL``) subscribes to
``llmgw.v1.RouteService/WatchRoutes`` on the control plane's agent port and serves whatever table it
last received. A control plane that is down, restarting or unreachable is not an outage: the last
table stays in force (the router's own health view ejects engines that really fail), and the watch
resubscribes with jittered exponential backoff (capped at a few seconds, so a restarted control plane
is heard from soon, and routers do not come back in lockstep). One log line per loss and one per
recovery, not one per attempt.

:meth:`WatchedRoutes.run` reports readiness after the first table, or after a bounded first wait (a
router may start while the control plane is down: it serves 503 "no routes yet" until a table comes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import trio

import schema
from router.routes import ModelRoutes, Upstream, parse_url
from schema.rpc import Code, RpcError
from transport.client import CallOptions, server_stream
from transport.h2io import TransportError, peer_text
from transport.tls import ClientTLS

log = logging.getLogger("llmgw.router.watch")


def routes_of(table: schema.RouteTable) -> dict[str, ModelRoutes]:
    """The router's values for a received table; an upstream whose URL the router cannot use is
    left out with a warning (the rest of the table still applies)."""
    out: dict[str, ModelRoutes] = {}
    for model in table.models:
        ups: list[Upstream] = []
        for u in model.upstreams:
            try:
                parse_url(u.url)
            except ValueError as exc:
                log.warning(
                    "route watch: model %s: replica %s left out: %s",
                    peer_text(model.model, 64),
                    peer_text(u.replica_id, 64),
                    exc,
                )
                continue
            ups.append(Upstream(replica_id=u.replica_id, url=u.url.rstrip("/"), api_key=u.api_key))
        out[model.model] = ModelRoutes(upstreams=tuple(ups), reason=model.reason)
    return out


def _parse(payload: bytes) -> schema.RouteTable:
    try:
        return schema.RouteTable.parse(payload)
    except Exception as exc:  # betterproto raises several kinds for bytes that are not a RouteTable
        raise RpcError(Code.INTERNAL, f"malformed RouteTable ({len(payload)} bytes): {exc}") from exc


#: Where a router watches routes, for the errors of a connection that reached something else.
WATCH_PORT_HINT = "a router's --control is the control plane's [listen] agents address"


class WatchedRoutes:
    """Routes watched from the control plane at ``url``; see the module docstring.

    ``token`` is sent as ``authorization: Bearer`` (one of the control plane's ``[api] read_tokens``);
    ``ca`` verifies an ``https://`` control plane's certificate; ``protocol`` is ``grpc`` or ``connect``.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str = "",
        ca: Path | None = None,
        first_wait: float = 10.0,
        backoff_base: float = 0.25,
        backoff_cap: float = 3.0,
        protocol: str = "grpc",
    ) -> None:
        self.url = url
        self.first_wait = first_wait
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        metadata = {"authorization": f"Bearer {token}"} if token else {}
        # Shorter bounds than an agent's: a router without routes yet is waiting to serve.
        self._options = CallOptions(
            protocol=protocol,
            tls=ClientTLS(ca_file=ca) if ca else None,
            connect_timeout=5.0,
            settings_timeout=5.0,
            keepalive_interval=5.0,
            keepalive_timeout=5.0,
            metadata=metadata,
            user_agent="llmgw-router",
        )
        self._routes: Mapping[str, ModelRoutes] = MappingProxyType({})
        self.epoch = ""
        self.revision = 0
        #: Tables applied so far (a test and the metrics read it).
        self.tables = 0
        self._have_table = trio.Event()

    def routes(self) -> Mapping[str, ModelRoutes]:
        """The table in force: the last one received (empty before the first)."""
        return self._routes

    def _apply(self, table: schema.RouteTable) -> None:
        self._routes = MappingProxyType(routes_of(table))
        self.epoch, self.revision = table.epoch, table.revision
        self.tables += 1
        self._have_table.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; ``started()`` after the first table or ``first_wait`` seconds."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            with trio.move_on_after(self.first_wait):
                await self._have_table.wait()
            if not self._have_table.is_set():
                log.warning(
                    "no route table from %s within %g s; serving without routes (503) until one comes",
                    self.url,
                    self.first_wait,
                )
            task_status.started()

    async def _watch(self) -> None:
        failures = 0
        lost = False
        while True:
            reason = ""
            try:
                request = schema.WatchRoutesRequest(epoch=self.epoch, revision=self.revision)
                async with server_stream(
                    self.url,
                    schema.WATCH_ROUTES_PATH,
                    bytes(request),
                    self._options,
                    port_hint=WATCH_PORT_HINT,
                ) as call:
                    while (payload := await call.receive()) is not None:
                        self._apply(_parse(payload))
                        if lost or self.tables == 1:
                            log.info(
                                "route watch on %s %s: %d model(s), revision %s/%d",
                                self.url,
                                "recovered" if self.tables > 1 else "subscribed",
                                len(self._routes),
                                self.epoch,
                                self.revision,
                            )
                        lost, failures = False, 0
                reason = "the control plane ended the watch"
            except (RpcError, TransportError, OSError, ValueError) as exc:
                reason = str(exc)
            failures += 1
            if not lost and not self.tables:
                lost = True
                log.warning("route watch on %s: no table yet: %s; retrying", self.url, reason)
            elif not lost:
                lost = True
                log.warning(
                    "route watch on %s lost: %s; serving the last routes (%d model(s), revision %s/%d) "
                    "and resubscribing",
                    self.url,
                    reason,
                    len(self._routes),
                    self.epoch,
                    self.revision,
                )
            else:
                log.debug("route watch on %s: attempt %d failed: %s", self.url, failures, reason)
            ceiling = min(self.backoff_cap, self.backoff_base * 2 ** min(failures, 16))
            await trio.sleep(ceiling / 2 + random.random() * ceiling / 2)
