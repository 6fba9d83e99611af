"""The route watch, server side: the latest route table, its revision, and the watchers it wakes.

Routers run apart from the control plane (several of them, restarted on their own schedule), so they
subscribe to ``llmgw.v1.RouteService/WatchRoutes`` on the agent port: the first message is the whole
table, and every change sends the whole table again with the next revision. The plane calls
:meth:`RouteWatch.publish` after each ``build_routes()``; a table equal to the last one is not a change.

A restarted control plane holds its table back until every node it restored from its state file has
registered again (or ``hold_limit`` seconds passed): until then it knows only the shards each node
had when it last registered, and a table built from that could tell routers that a serving replica
is gone. Routers keep their last table meanwhile, which is exactly right: the engines kept serving.

Why whole tables: a table is small (models times replicas), and a router that missed a message (one
the server coalesced, or a reconnect) is right again after the next one, with no delta to replay.

Bounded: each watcher holds nothing but the revision it last sent. The encoded table is shared, and a
watcher that reads slowly (its HTTP/2 window closed) is sent only the latest table once it catches up;
the revisions in between are skipped, never queued.

Authenticated like the admin API's read role: ``authorization: Bearer TOKEN`` compared in constant
time against every ``[api] read_tokens`` and ``admin_tokens`` entry (the engine keys are in the
table); with no token configured, loopback peers only. A refused call gets UNAUTHENTICATED or
PERMISSION_DENIED and nothing else.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping

import trio

import schema
from control.fleet import Node, NodeState
from router.routes import ModelRoutes
from schema.rpc import Code, RpcError
from transport import Handler, ServerStream
from transport.addresses import is_loopback
from transport.h2io import peer_text

log = logging.getLogger("llmgw.control.routewatch")

#: The request (a few bytes) must arrive within this long of the stream opening.
REQUEST_TIMEOUT = 10.0


def table_message(epoch: str, revision: int, table: Mapping[str, ModelRoutes]) -> schema.RouteTable:
    """The wire form of a route table (models sorted, so equal tables encode equally)."""
    return schema.RouteTable(
        epoch=epoch,
        revision=revision,
        models=[
            schema.ModelRoute(
                model=name,
                upstreams=[
                    schema.RouteUpstream(replica_id=u.replica_id, url=u.url, api_key=u.api_key)
                    for u in routes.upstreams
                ],
                reason=routes.reason,
            )
            for name, routes in sorted(table.items())
        ],
    )


class RouteWatch:
    """Holds the latest table and revision, and serves WatchRoutes; see the module docstring."""

    def __init__(
        self,
        tokens: Iterable[str] = (),
        *,
        hold_limit: float = 45.0,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._tokens = tuple(t.encode() for t in tokens)
        #: The longest a start holds the table back for nodes not heard from (an agent's reconnect
        #: backoff is capped at 30 s by default, so a live one is back within it).
        self.hold_limit = hold_limit
        self._clock = clock
        self._holding = True
        self._hold_began: float | None = None
        #: Set by :meth:`methods`: the agent port is about to serve, the fleet has been restored.
        self._open = False
        #: One control-plane run: a restarted control plane starts a new epoch at revision 1.
        self.epoch = secrets.token_hex(8)
        self.revision = 0
        self._table: dict[str, ModelRoutes] | None = None
        self._payload = bytes(table_message(self.epoch, 0, {}))
        self._changed = trio.Event()
        self.watchers = 0

    def methods(self) -> dict[str, Handler]:
        """The RPCs this serves, by HTTP/2 path, for ``StreamServer(methods=...)``.

        Called once the plane has restored its state and builds its server: tables published
        before that (the embedded router's first, built before the restore) neither go out nor end
        the hold, since the restored nodes are not in them yet."""
        self._open = True
        return {schema.WATCH_ROUTES_PATH: self.handle}

    def publish(self, table: Mapping[str, ModelRoutes], nodes: Iterable[Node] = ()) -> None:
        """Make ``table`` the current one; a new revision and a wake-up only when it changed.

        ``nodes`` is the fleet: while a node restored at start has not registered again (and is not
        lost), the table is held back, up to ``hold_limit`` seconds after the first publish.
        """
        if not self._open:
            return
        if self._holding:
            now = self._clock()
            if self._hold_began is None:
                self._hold_began = now
            waiting = sorted(n.node_id for n in nodes if not n.connected and n.state is not NodeState.LOST)
            if waiting and now - self._hold_began < self.hold_limit:
                return
            self._holding = False
            if waiting:
                log.warning(
                    "route watch: serving routes although %d node(s) restored at start did not register "
                    "again within %g s (%s); their shards count as last reported",
                    len(waiting),
                    self.hold_limit,
                    ", ".join(peer_text(n, 64) for n in waiting[:5]),
                )
            elif self._hold_began != now:
                log.info(
                    "route watch: every restored node registered again after %.1f s; serving routes",
                    now - self._hold_began,
                )
        current = dict(table)
        if current == self._table:
            return
        self._table = current
        self.revision += 1
        self._payload = bytes(table_message(self.epoch, self.revision, current))
        self._changed.set()
        self._changed = trio.Event()

    def authorize(self, st: ServerStream) -> None:
        """Raise the status a refused watcher gets (nothing is sent to it before this passes)."""
        if not self._tokens:
            if not is_loopback(st.peer.address.rsplit(":", 1)[0].strip("[]")):
                raise RpcError(
                    Code.PERMISSION_DENIED,
                    "the route watch answers only this machine while no tokens are configured; set "
                    "[api] read_tokens in llmgw.toml and give the router --control-token",
                )
            return
        scheme, _, token = st.metadata.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not given:
            raise RpcError(
                Code.UNAUTHENTICATED,
                "the route watch wants a token: authorization: Bearer TOKEN (router: --control-token), "
                "one of [api] read_tokens or admin_tokens",
            )
        # Every token is compared, whatever matched: the time taken says nothing about which is close.
        matched = False
        for known in self._tokens:
            matched |= hmac.compare_digest(given, known)
        if not matched:
            raise RpcError(
                Code.UNAUTHENTICATED,
                "route watch token not accepted (not in [api] read_tokens or admin_tokens)",
            )

    async def handle(self, st: ServerStream) -> None:
        """One watcher: authorize, read its request, send the table, then the latest after each change."""
        self.authorize(st)
        with trio.move_on_after(REQUEST_TIMEOUT) as scope:
            payload = await st.receive_payload()
        if scope.cancelled_caught:
            raise RpcError(Code.DEADLINE_EXCEEDED, f"no WatchRoutesRequest within {REQUEST_TIMEOUT:g} s")
        if payload is None:
            raise RpcError(Code.INVALID_ARGUMENT, "stream ended before its WatchRoutesRequest")
        try:
            request = schema.WatchRoutesRequest.parse(payload)
        except Exception as exc:
            raise RpcError(
                Code.INVALID_ARGUMENT, f"malformed WatchRoutesRequest ({len(payload)} bytes): {exc}"
            ) from exc
        resumed = f", resuming {peer_text(request.epoch, 32)}/{request.revision}" if request.epoch else ""
        log.info("route watcher at %s subscribed (revision %d%s)", st.peer.address, self.revision, resumed)
        self.watchers += 1
        try:
            sent = 0  # revision 0 is "no table yet" (a start still holding back): nothing to send
            while True:
                changed = self._changed
                if sent != self.revision:
                    sent = self.revision
                    # Waits for the watcher's window: while it does, changes only move the revision,
                    # and the loop then sends the latest table, never the ones in between.
                    await st.send_payload(self._payload)
                    continue
                await changed.wait()
        finally:
            self.watchers -= 1
