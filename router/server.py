"""The router's server: an OpenAI-compatible HTTP API that sends traffic straight to the engines.

``Router(routes, config)`` listens, answers each client connection in one task (reading its
requests in order, authorizing them, answering /health, /metrics and /v1/models itself), and
proxies the completion and embedding requests to a replica of their model, watching every request
in flight for a silent engine (the stall watch) and stopping like a service (``shutdown``). It
runs as its own process (``router.cli``) or inside the control plane's, and talks only to engine
URLs, so engines keep serving while an agent or the control plane restarts.

Its parts have their own modules: the settings (``router.config``), the routes
(``router.routes``, ``router.watch``), the choice of a replica (``router.policies``), retries
and ejection (``router.retry``), the engine side (``router.upstream``, ``router.pool``,
``router.framing``), the client side (``router.http1``, ``router.limits``), the relay of a
response (``router.relay``), silent engines (``router.stalls``) and ``router.metrics``. Why it
is built this way, and what it measured: docs/router.md.

Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "code"}}``: 400 bad JSON or no model,
401 bad or missing bearer key (when keys are configured), 404 unknown model (naming the known ones),
503 no ready replica (with placement's reason), 502 every attempted upstream failed, 504 the
engine went silent (``_timed_out``). ``GET /health`` needs no key; ``GET /metrics`` wants
``metrics_key`` as a bearer token when one is set, and answers loopback clients only when none is
(``_authorize_metrics``). No global state: every counter, pool and table belongs to one ``Router``.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import NoReturn

import trio
from opentelemetry.trace import Tracer, use_span

from router import tracing as traced
from router.config import RouterConfig
from router.exchange import ClientLeft, Exchange, RouterError
from router.framing import ResponseHead, UpstreamBroken, UpstreamError
from router.http1 import (
    LAST_CHUNK,
    ClientConn,
    Request,
    RequestError,
    RequestReader,
    chunk,
    json_body,
    response_head,
)
from router.limits import connection_cap
from router.metrics import UNKNOWN_MODEL, Metrics, ended_with_done, monotonic_of
from router.policies import PolicyRequest, prompt_prefix
from router.policies.prefix_hash import PrefixHash
from router.pool import Pool
from router.pumpconst import RECEIVE_SIZE
from router.relay import EngineFailedEarly, NativeRelayPump, Relay, make_pump
from router.retry import AllFailed, Ejection, forward
from router.routes import ModelRoutes, RoutesFn, Upstream
from router.stalls import Watch, stall, tcp_progress, unread, writable
from router.upstream import UpstreamConn, classify, request_bytes
from telemetry.tracing import Tracing
from telemetry.version import version
from transport.addresses import is_loopback

log = logging.getLogger("llmgw.router")


CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"
EMBEDDINGS = b"/v1/embeddings"
MODELS = b"/v1/models"
PROXIED = frozenset({CHAT, COMPLETIONS, EMBEDDINGS})

#: What ``_forward`` raises when the client is gone (its connection at end of file): the
#: engine's relay or the client's socket broke, or an error answer has no one left to take it.
_HANG_UP_EFFECTS = (
    UpstreamBroken,
    RouterError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class Router:
    """The OpenAI-compatible proxy with the settings of ``config`` (``RouterConfig``: every
    tunable, its default and why, in one place). ``routes()`` is called once per request, so it
    must be cheap: a static table, the route watch, or the control plane's own table, which it
    rebuilds when replicas change. ``pending`` says why there is no table yet, if one may still
    come: a router whose routes are watched answers a model it does not know yet with a 503 to
    retry, not a 404. ``clock`` is trio's, or a test's."""

    def __init__(
        self,
        routes: RoutesFn,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = trio.current_time,
        pending: Callable[[], str] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.routes = routes
        self.config = config
        self.pending = pending
        self.api_keys = tuple(k.encode() for k in config.api_keys)
        self.affinity_chars = config.affinity_chars
        self.max_attempts = config.max_attempts
        self.response_timeout = config.response_timeout
        self.stream_idle_timeout = config.stream_idle_timeout
        # The stall watch's period: a tenth of the shorter timeout, so a timeout fires within
        # 10% of its length, and at most a second (a tick costs a getsockopt per request in flight).
        self.stall_tick = min(1.0, max(0.01, min(self.response_timeout, self.stream_idle_timeout) / 10))
        self._watches: set[Watch] = set()
        self.client_limits = config.client_limits
        #: Client connections open now (``_handle_connection``), against ``client_limits.max_connections``.
        self.connections = 0
        self.max_connections = self.client_limits.max_connections
        self.metrics_key = config.metrics_key.encode()
        self.max_body_bytes = config.max_body_bytes
        self.clock = clock
        self.policy = PrefixHash(config.affinity_slack)
        self.ejection = Ejection(
            eject_after=config.eject_after, eject_base=config.eject_base, eject_max=config.eject_max
        )
        self.pool = Pool(
            max_idle=config.pool_max_idle,
            idle_timeout=config.pool_idle_timeout,
            connect_timeout=config.connect_timeout,
        )
        self.metrics = Metrics(version())
        #: The process's tracer (``telemetry.tracing``), or None: tracing off, and no span, no
        #: tracer call, nothing but this check on a request's path.
        self.tracer: Tracer | None = tracing.tracer if tracing is not None else None
        if tracing is not None:
            self.metrics.process.register(tracing.collector())
        self.pump = make_pump(coalesce_us=config.relay_coalesce_us)
        self.relay = Relay(self.pump, self.metrics, self.ejection, clock)
        self.created = int(time.time())
        #: Open client connections, for ``shutdown`` to close the idle ones.
        self._clients: set[ClientConn] = set()
        #: ``shutdown`` was called: no new connections, none kept open for a next request.
        self.stopping = False
        self._accepting = trio.CancelScope()
        self._no_clients = trio.Event()

    # -- the service -----------------------------------------------------------------------------

    async def serve(
        self,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0: the kernel picks), report the bound port, serve until
        cancelled. ``reuse_port``: SO_REUSEPORT, so that several router processes on this host
        listen on the same port and the kernel spreads new connections over them (``listen``)."""
        self.max_connections = connection_cap(self.client_limits.max_connections)
        listeners = await listen(host, port, reuse_port=reuse_port)
        bound = int(listeners[0].socket.getsockname()[1])
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._housekeeping)
                nursery.start_soon(self._watch_stalls)
                await nursery.start(self.pump.run)
                # The connections' handlers live in a nursery of their own, apart from the
                # accepting task, so that ``shutdown`` can close the listeners and leave them be.
                async with trio.open_nursery() as handlers:
                    await handlers.start(self._accept, listeners, handlers)
                    task_status.started(bound)
        finally:
            self.pool.close_all()

    async def _accept(
        self,
        listeners: list[trio.SocketListener],
        handlers: trio.Nursery,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until ``shutdown`` cancels this, which closes the listeners (a
        load balancer's next connection is refused and goes to another router)."""
        with self._accepting:
            await trio.serve_listeners(
                self._handle_connection, listeners, handler_nursery=handlers, task_status=task_status
            )

    async def shutdown(self, grace: float) -> int:
        """Stop as a service: close the listeners, close client connections that wait for a next
        request (and every other one once its response has ended), and wait up to ``grace``
        seconds for the responses in progress to end. Returns how many client connections were
        still open then: cancelling ``serve`` cuts them (their streams end without their last
        bytes), as it cuts everything."""
        self.stopping = True
        self._accepting.cancel()
        for client in self._clients:
            client.closing = True
            if client.idle:
                client.scope.cancel()
        with trio.move_on_after(grace):
            if self.connections:
                await self._no_clients.wait()
        return self.connections

    async def _housekeeping(self) -> None:
        """Close pooled connections before the engines' idle timeouts do (a request sent on one
        the engine is closing would need a redo), and forget upstreams no longer routed to."""
        while True:
            await trio.sleep(1.0)
            try:
                live = {u.url for r in self.routes().values() for u in r.upstreams}
            except Exception:
                log.exception("router: routes() failed during housekeeping")
                continue
            now = self.clock()
            self.pool.sweep(now, live)
            self.ejection.prune(live, now)

    async def _watch_stalls(self) -> None:
        """Cut off engines that went silent: every ``stall_tick`` seconds, each request in flight
        to an engine is checked against the response and stream idle timeouts (``stall``), from
        its socket's counters (``tcp_progress``), and one past either has its attempt's scope
        cancelled (``_attempt`` then answers the client). A stalled engine needs no cooperation:
        a SIGSTOPped process or one that accepted and never answered looks the same."""
        while True:
            await trio.sleep(self.stall_tick)
            now = self.clock()
            for watch in list(self._watches):
                if watch.sock is None or watch.fired:
                    continue
                verdict = self._stalled(watch, now)
                if verdict:
                    watch.fired = verdict
                    watch.scope.cancel()

    def _stalled(self, watch: Watch, now: float) -> str:
        sock = watch.sock
        assert sock is not None
        progress = tcp_progress(sock)
        if progress is None:
            return ""
        received, quiet = progress
        if received != watch.baseline:
            watch.got_bytes = True
        waited = now - watch.since
        verdict = stall(
            waited=waited,
            got_bytes=watch.got_bytes,
            quiet=quiet,
            response_timeout=self.response_timeout,
            idle_timeout=self.stream_idle_timeout,
        )
        if verdict == "idle" and (unread(sock) or not writable(watch.client_fd)):
            return ""  # bytes wait for the router, or the client does not read: not the engine
        watch.waited = waited if verdict == "head" else quiet
        return verdict

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        if self.connections >= self.max_connections:
            await self._over_capacity(stream)
            return
        self.connections += 1
        reader = RequestReader(max_body=self.max_body_bytes)
        client: ClientConn | None = None
        limits = self.client_limits
        try:
            async with trio.open_nursery() as nursery:
                # The nursery's scope is the connection's: the watcher task cancels it when the
                # client hangs up, and next_request sets its deadline to the header or idle timeout.
                try:
                    client = ClientConn(
                        stream, reader, nursery.cancel_scope, limits.idle_timeout, limits.header_timeout
                    )
                except OSError as exc:  # no descriptor left for its hang-up watch
                    log.warning("router: refusing a client connection: %s", exc)
                    return
                client.closing = self.stopping
                self._clients.add(client)
                nursery.start_soon(client.watch)
                await self._serve_client(client)
                nursery.cancel_scope.cancel()
        finally:
            self.connections -= 1
            if self.stopping and not self.connections:
                self._no_clients.set()
            if client is not None:
                self._clients.discard(client)
                client.close()
                if client.timed_out:
                    self.metrics.client_closed(client.timed_out)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _over_capacity(self, stream: trio.SocketStream) -> None:
        """A connection over ``max_connections``: a 503 that says so, then closed (``ClientLimits``
        says why not queued). Counted in /metrics, not logged: a flood would be a flood of lines.
        The client's request is read and dropped for up to a second after the answer, so that
        closing does not reset the connection before the client has read the 503."""
        self.metrics.client_closed("over_capacity")
        body = RouterError(
            503,
            f"the router has {self.connections} client connections, its limit "
            "(router_max_connections); retry, or raise the limit",
            "server_error",
            "too_many_connections",
        ).body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ]
        try:
            with trio.move_on_after(1.0):
                await stream.send_all(response_head(503, headers, close=True) + body)
                await stream.send_eof()
                while await stream.receive_some(RECEIVE_SIZE):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _serve_client(self, client: ClientConn) -> None:
        """Answer the client's requests in order until the connection ends. Nothing escapes: the
        connection's watcher task shares the nursery and one connection's failure is its own."""
        try:
            while True:
                try:
                    request = await client.next_request()
                except RequestError as error:
                    await self._refuse(client, error)
                    return
                if request is None:  # closed or switched protocols (idle: the scope is cancelled)
                    return
                ex = Exchange(client, request, self.clock())
                await self._respond(ex)
                if not (ex.complete and request.keep_alive) or client.eof or self.stopping:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, ClientLeft, UpstreamBroken):
            return
        except Exception:
            # One connection's bug must not take the server down with it.
            log.exception("router: connection handler failed")

    async def _refuse(self, client: ClientConn, error: RequestError) -> None:
        """Answer a request that cannot be read to its end, and close."""
        self.metrics.request("", error.status)  # no model read: the label of requests naming none
        body = RouterError(error.status, error.message, "invalid_request_error").body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await client.stream.send_all(response_head(error.status, headers, close=True) + body)
        await client.linger()

    # -- one request ------------------------------------------------------------------------------

    async def _respond(self, ex: Exchange) -> None:
        head = ex.request
        path = head.target.split(b"?", 1)[0]
        try:
            if path == b"/metrics" or path == b"/health":
                self._method(head, b"GET")
                if path == b"/health":
                    await self._send(ex, 200, b'{"status":"ok"}\n')
                else:
                    self._authorize_metrics(ex)
                    self.metrics.client_connections = self.connections
                    accept = b", ".join(v for k, v in head.headers if k == b"accept").decode("latin-1")
                    data, content_type = await self.metrics.scrape(
                        self.ejection, self.pool, self.pump, self.clock(), accept
                    )
                    await self._send(ex, 200, data, content_type.encode())
                return
            if path != MODELS and path not in PROXIED:
                raise RouterError(
                    404,
                    f"no route {head.method.decode()} {path.decode(errors='replace')}",
                    "invalid_request_error",
                    "not_found",
                )
            self._method(head, b"GET" if path == MODELS else b"POST")
            self._authorize(head)
            if path == MODELS:
                await self._send(ex, 200, self._models_body())
                ex.status = 200
                return
            if self.tracer is None:
                await self._proxy(ex)
            else:
                await self._traced(ex, self.tracer, path)
        except RouterError as error:
            ex.status = error.status
            self.metrics.request(ex.model or "", error.status)
            await self._send(ex, error.status, error.body())
        except (ClientLeft, UpstreamBroken):
            raise
        except Exception as exc:
            log.exception("router: %s %r failed", head.method.decode(), head.target)
            if ex.head_sent:
                raise  # the response had begun: closing the connection is all that is left
            internal = RouterError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
            self.metrics.request(ex.model or "", 500)
            await self._send(ex, 500, internal.body())

    def _method(self, head: Request, allowed: bytes) -> None:
        if head.method != allowed and not (allowed == b"GET" and head.method == b"HEAD"):
            raise RouterError(
                405,
                f"{head.method.decode()} not allowed here; use {allowed.decode()}",
                "invalid_request_error",
                "method_not_allowed",
            )

    def _authorize(self, head: Request) -> None:
        if not self.api_keys:
            return
        given = b""
        for name, value in head.headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        # compare_digest against every key: the time taken says nothing about which key is close.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(key, given)
        if not given:
            raise RouterError(
                401,
                "missing API key: send Authorization: Bearer KEY",
                "invalid_request_error",
                "invalid_api_key",
            )
        if not ok:
            raise RouterError(401, "incorrect API key", "invalid_request_error", "invalid_api_key")

    def _authorize_metrics(self, ex: Exchange) -> None:
        """``/metrics`` names every replica's URL and the traffic per model: with ``metrics_key``
        it wants that key as a bearer token, and without one it answers loopback clients only (a
        scraper elsewhere needs the key configured; Prometheus sends it with ``authorization``)."""
        if self.metrics_key:
            given = b""
            for name, value in ex.request.headers:
                if name == b"authorization":
                    scheme, _, token = value.partition(b" ")
                    if scheme.lower() == b"bearer":
                        given = token.strip()
            if not hmac.compare_digest(self.metrics_key, given):
                raise RouterError(
                    401,
                    "/metrics wants the metrics key: send Authorization: Bearer KEY (metrics_key in llmgw.toml)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
            return
        try:
            peer = str(ex.client.stream.socket.getpeername()[0])
        except OSError:
            peer = ""
        if not is_loopback(peer):
            raise RouterError(
                403,
                "/metrics answers only this machine while no metrics_key is set; set metrics_key in "
                "llmgw.toml (--metrics-key for a router-only run) and scrape with Authorization: Bearer KEY",
                "permission_error",
                "forbidden",
            )

    def _models_body(self) -> bytes:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "llmgw"}
            for name, routes in sorted(self.routes().items())
            if routes.upstreams
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _send(
        self, ex: Exchange, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        data = response_head(status, headers, close=not ex.request.keep_alive)
        ex.head_sent = True
        await ex.client.stream.send_all(data if ex.request.method == b"HEAD" else data + body)
        ex.complete = True

    async def _proxy(self, ex: Exchange) -> None:
        try:
            doc = json_body(ex.request.body)
        except RequestError as exc:  # not JSON, or nested past MAX_JSON_DEPTH
            raise RouterError(exc.status, exc.message, "invalid_request_error") from None
        if not isinstance(doc, dict):
            raise RouterError(400, "the request body must be a JSON object", "invalid_request_error")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise RouterError(
                400, 'the request names no model ("model": "NAME")', "invalid_request_error", "model_required"
            )
        table = self.routes()
        routes = table.get(model)
        if routes is None:
            ex.model = UNKNOWN_MODEL  # the metrics' label: a client cannot grow the series
            waiting = self.pending() if self.pending is not None else ""
            if waiting:
                raise RouterError(
                    503, f"model `{model}`: {waiting}; retry shortly", "service_unavailable", "no_routes_yet"
                )
            known = ", ".join(sorted(table)) or "none"
            raise RouterError(
                404,
                f"The model `{model}` does not exist on this router; models: {known}",
                "invalid_request_error",
                "model_not_found",
            )
        ex.model = model
        ex.stream = doc.get("stream") is True
        options = doc.get("stream_options")
        ex.want_usage = not ex.stream or (isinstance(options, dict) and options.get("include_usage") is True)
        if ex.span is not None:
            traced.requested(ex.span, ex.request.target.split(b"?", 1)[0], model, ex.stream)
        if not routes.upstreams:
            why = routes.reason or "no replica is ready"
            raise RouterError(
                503, f"model `{model}` has no ready replica: {why}", "service_unavailable", "no_ready_replica"
            )
        request = PolicyRequest(model, prompt_prefix(doc, self.affinity_chars))

        # The client hanging up cancels the connection's scope (ClientConn.watch), and with it
        # this request: leaving _forward closes the engine connection, which cancels its work.
        # Only what a hang-up causes is a 499 (the cancellation, a failed write to the client,
        # or an answer there is no one left to take); anything else, a bug above all, goes on
        # as it is, to be logged (_respond, _serve_client), never counted as the client's doing.
        try:
            await self._forward(ex, routes, request)
        except trio.Cancelled:
            if ex.client.eof:
                self._client_left(ex)
            raise
        except ClientLeft:
            self._client_left(ex)
            raise
        except _HANG_UP_EFFECTS as exc:
            if not ex.client.eof:
                if isinstance(exc, UpstreamBroken):
                    self.metrics.request(model, ex.status)
                raise
            self._client_left(ex)
            raise ClientLeft() from None
        finally:
            if ex.facts is not None:  # once per response, however it ended
                since = monotonic_of(self.clock(), ex.started) if ex.stream else None
                self.metrics.body_ended(model, ex.facts, since, count_usage=ex.want_usage)
        self.metrics.request(model, ex.status)

    async def _traced(self, ex: Exchange, tracer: Tracer, path: bytes) -> None:
        """``_proxy`` inside the request's span (``router.tracing``): the span is current while the
        request is answered (log lines carry its ids), and ends with what the answer told."""
        span, ex.trace_context = traced.start(tracer, ex.request, path)
        ex.span = span
        try:
            with use_span(span, record_exception=False, set_status_on_exception=False):
                await self._proxy(ex)
        except RouterError as error:
            ex.status = error.status
            raise
        except (ClientLeft, trio.Cancelled) as exc:
            # As _client_left counts it: a client gone after the stream's last event was answered.
            left = isinstance(exc, ClientLeft) or ex.client.eof
            if left and not (ex.stream and ex.facts is not None and ended_with_done(ex.facts.tail)):
                ex.status = 499
            raise
        finally:
            ttft = None
            facts = ex.facts
            if ex.stream and facts is not None and facts.events:
                ttft = max(0.0, facts.first_at - monotonic_of(self.clock(), ex.started))
            traced.finish(span, ex, ttft)

    def _client_left(self, ex: Exchange) -> None:
        """Count a request whose client hung up before its response's end: a 499 and a
        disconnect, unless the stream's last event (``data: [DONE]``) had gone out, after which
        the ``openai`` client closes at once, answered whole (``ended_with_done``)."""
        if ex.stream and ex.facts is not None and ended_with_done(ex.facts.tail):
            self.metrics.request(ex.model, ex.status)
            return
        self.metrics.disconnects[ex.model] = self.metrics.disconnects.get(ex.model, 0) + 1
        self.metrics.request(ex.model, 499)

    async def _forward(self, ex: Exchange, routes: ModelRoutes, request: PolicyRequest) -> None:
        """Answer ``ex`` from one of ``routes``' replicas, moving to another after a failure before
        any response byte (``router.retry``); a 502 naming every failure when none answered."""

        def pick(tried: list[str]) -> Upstream | None:
            candidates = self.ejection.candidates(routes.upstreams, self.clock(), tried)
            if not candidates:
                return None
            choice = self.policy.choose(request, candidates)
            if ex.span is not None:
                traced.chose(ex.span, choice, candidates, len(tried) + 1)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "router: model %s to %s: %s", ex.model, choice.upstream.replica_id, choice.explain()
                )
            return choice.upstream

        def retried() -> None:
            self.metrics.retries[ex.model] = self.metrics.retries.get(ex.model, 0) + 1

        async def attempt(upstream: Upstream, last: bool) -> str | None:
            error = await self._attempt(ex, upstream, last=last)
            if error is not None and ex.span is not None:
                traced.failed(ex.span, upstream.replica_id, upstream.url, error)
            return error

        try:
            await forward(routes.upstreams, self.max_attempts, pick, attempt, retried)
        except AllFailed as failed:
            raise RouterError(
                502,
                f"every upstream of model `{ex.model}` failed before responding: {failed}",
                "upstream_error",
                "upstream_failed",
            ) from None

    async def _attempt(self, ex: Exchange, upstream: Upstream, *, last: bool) -> str | None:
        """Send the request to one upstream. Returns None once a response went to the client (its
        status may be anything the engine said), or the failure when nothing did and another
        replica may be tried. An engine that stays silent past the response or stream idle
        timeout is cut off by the stall watch (``_watch_stalls``), which cancels this scope;
        ``_timed_out`` then answers for it."""
        watch = Watch(ex.fd)
        with watch.scope:
            self._watches.add(watch)
            try:
                return await self._try_upstream(ex, upstream, watch, last=last)
            finally:
                self._watches.discard(watch)
        # Only the stall watch cancels this scope (the client leaving cancels an outer one, and
        # that cancellation goes on through this scope), so the engine was too slow.
        await self._timed_out(ex, upstream, watch)

    async def _try_upstream(
        self, ex: Exchange, upstream: Upstream, watch: Watch, *, last: bool
    ) -> str | None:
        ejection = self.ejection
        ejection.begin(upstream)
        conn: UpstreamConn | None = None
        try:
            try:
                target = self.pool.address(upstream.url)
            except ValueError as exc:
                return self._failed(upstream, UpstreamError("connect", str(exc)))
            request = request_bytes(
                ex.request,
                target,
                upstream.api_key,
                pass_authorization=not self.api_keys,
                trace_context=ex.trace_context,
            )
            # The native pump relays the usual streamed response from its head on (see
            # Relay.respond_whole); the timeouts apply to it from outside (the stall watch).
            whole = isinstance(self.pump, NativeRelayPump) and ex.request.http11
            head: ResponseHead | None = None
            buf = b""
            for fresh in (False, True):
                conn = None if fresh else self.pool.take_idle(upstream.url, self.clock())
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await self.pool.connect(upstream.url)
                    watch.arm(conn.sock, self.clock())
                    await conn.send_all(request)
                    if whole:
                        answer = await self.relay.respond_whole(ex, conn, upstream)
                        if answer.handed_back is None:
                            if answer.reusable:
                                self.pool.release(conn, self.clock())
                                conn = None
                            return None
                        buf = answer.handed_back
                    head, buf = await conn.read_head(buf)
                    break
                except (OSError, trio.TooSlowError, UpstreamError, EngineFailedEarly) as exc:
                    watch.sock = None
                    if conn is not None:
                        conn.close()
                        conn = None
                    error = classify(exc)
                    if reused and not fresh and not error.got_bytes:
                        continue  # a pooled connection the engine had closed: redo on a new one
                    return self._failed(upstream, error)
            assert conn is not None and head is not None
            if head.status == 503 and not last:
                conn.close()
                conn = None
                return self._failed(
                    upstream, UpstreamError("unavailable", "answered 503 (loading or draining)")
                )
            ejection.succeeded(upstream)
            if await self.relay.relay(ex, conn, head, buf, upstream):
                self.pool.release(conn, self.clock())
                conn = None
            return None
        finally:
            watch.sock = None
            if conn is not None:
                conn.close()  # never pooled mid-response: closing is what cancels the engine's work
            ejection.end(upstream)

    async def _timed_out(self, ex: Exchange, upstream: Upstream, watch: Watch) -> NoReturn:
        """Answer for an engine the stall watch cut off. The replica is ejected at once, not after
        ``eject_after`` failures: each request sent to a silent engine costs its client the whole
        timeout, where a refused connection costs a millisecond and a retry. The request is not
        tried elsewhere: its client has waited the whole timeout already, and the engine may
        still be generating it. Before the response began the client gets a 504. A stream that
        had begun ends with an SSE error event and a proper end of its chunked body, where its
        framing allows, and then the client's connection is closed (where it does not allow, the
        close alone tells the client its body broke off)."""
        where = f"replica {upstream.replica_id} ({upstream.url})"
        if watch.fired == "head":
            what = (
                f"{where} sent no response in {watch.waited:.1f} s "
                f"(router_response_timeout {self.response_timeout:g} s)"
            )
            code = "upstream_response_timeout"
        else:
            when = "mid-stream" if ex.head_sent else "mid response head"
            what = (
                f"{where} sent nothing for {watch.waited:.1f} s {when} "
                f"(router_stream_idle_timeout {self.stream_idle_timeout:g} s)"
            )
            code = "upstream_idle_timeout"
        self._failed(upstream, UpstreamError("timeout", what), at_once=True)
        what += "; the replica is ejected"
        if not ex.head_sent:
            raise RouterError(504, f"model `{ex.model}`: {what}", "timeout", code)
        if ex.stream and ex.at_chunk_end is not None and ex.at_chunk_end():
            doc = {"error": {"message": f"model `{ex.model}`: {what}", "type": "timeout", "code": code}}
            event = b"data: " + json.dumps(doc).encode() + b"\n\n"
            # The client's socket took bytes a moment ago (the watch checks); one that stops
            # reading now must not hold this task.
            with trio.move_on_after(self.stream_idle_timeout):
                await self.relay.write(ex, chunk(event) + LAST_CHUNK)
        raise UpstreamBroken(what)

    def _failed(self, upstream: Upstream, error: UpstreamError, *, at_once: bool = False) -> str:
        text = str(error)
        self.metrics.upstream_error(upstream, error.kind)
        ejected = self.ejection.failed(upstream, self.clock(), text, at_once=at_once)
        if ejected is not None:
            key = (upstream.replica_id, upstream.url)
            self.metrics.ejections[key] = self.metrics.ejections.get(key, 0) + 1
            log.warning(
                "router: ejected %s (%s) for %gs: %s", upstream.replica_id, upstream.url, ejected, text
            )
        return text


async def listen(host: str, port: int, *, reuse_port: bool = False) -> list[trio.SocketListener]:
    """TCP listeners on every address of ``host``. With ``reuse_port`` each socket has
    SO_REUSEPORT set before it binds, which lets N router processes (the same user's) bind one
    port: the kernel hashes each new connection to one of them, and one that exits leaves the
    others listening (its own accept queue goes with it). Without it, as trio opens them."""
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host)
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError(errno.ENOPROTOOPT, "SO_REUSEPORT is not available on this system (--reuse-port)")
    infos = await trio.socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[trio.SocketListener] = []
    try:
        for family, type_, proto, _, addr in infos:
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(addr)
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners
