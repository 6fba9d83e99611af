"""A Trio-native etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client port), with httpx.

``connect(EtcdConfig(...))`` gives an ``EtcdClient`` for the life of an ``async with``. The client
sticks to one endpoint and moves to the next when a connection to it fails or the member answers
"unavailable", in rounds until ``retry_timeout`` (each attempt bounded by ``request_timeout``); it
authenticates with a user and password when given them and again when etcd says the token has
expired.

Failover never repeats a write whose outcome is unknown: a put or txn whose connection broke (or that
timed out) after it was sent may have been applied, and sending it again is not the same as sending it
once (a second put makes a second revision; a txn's comparison may now fail because the first one
won). Such a write raises ``EtcdUnavailable`` with ``outcome_unknown`` set; reads, lease renewals and
revocations are retried on the next endpoint.

Why the JSON gateway and not gRPC: see docs/etcd.md.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from control.etcd import wire
from control.etcd.errors import (
    NOT_FOUND,
    UNAUTHENTICATED,
    UNAVAILABLE,
    EtcdAuthError,
    EtcdError,
    EtcdLeaseLost,
    EtcdProtocolError,
    EtcdRequestError,
    EtcdUnavailable,
    refusal,
)
from control.etcd.lease import LeaseKeeper
from control.etcd.values import (
    Compare,
    Delete,
    DeleteResult,
    KeyValue,
    Lease,
    Operation,
    Put,
    PutResult,
    Range,
    RangeResult,
    Status,
    Txn,
    TxnResult,
    prefix_end,
)
from control.etcd.watch import Watch

#: The most bytes one answer (a range, a txn) may have: etcd's own default limit on a request is
#: 1.5 MiB, but a range over a large prefix answers with all of it.
MAX_ANSWER_BYTES = 256 * 1024 * 1024

_AUTH_PATH = "/v3/auth/authenticate"


def _check_endpoint(endpoint: str) -> str:
    if not endpoint.startswith(("http://", "https://")) or "/" in endpoint.split("://", 1)[1].rstrip("/"):
        raise ValueError(f"etcd endpoint {endpoint!r}: want http://HOST:PORT or https://HOST:PORT (no path)")
    return endpoint.rstrip("/")


def _check_endpoints(endpoints: Sequence[str]) -> tuple[str, ...]:
    if isinstance(endpoints, str):
        raise TypeError(f"etcd endpoints: want a list of URLs, got the string {endpoints!r}")
    checked = tuple(_check_endpoint(e) for e in endpoints)
    if not checked:
        raise ValueError("etcd endpoints: none given (want at least one http://HOST:PORT)")
    return checked


@attrs.frozen
class EtcdConfig:
    """Where etcd is and how to talk to it.

    ``ca`` verifies the servers' certificates (the system's trust store when not given); ``cert`` and
    ``key`` are the client certificate for a cluster that wants one (``--client-cert-auth``). ``user``
    and ``password`` authenticate when etcd has auth enabled."""

    endpoints: tuple[str, ...] = attrs.field(converter=_check_endpoints)
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    #: The longest one request (connect, send, answer) may take on one endpoint.
    request_timeout: float = 5.0
    #: The longest a connection to one endpoint may take before the next one is tried.
    connect_timeout: float = 2.0
    #: How long a request goes on trying every endpoint in turn while none answers (an election
    #: takes about a second; a member restarted, a few): the longest wait is this plus one
    #: ``request_timeout``.
    retry_timeout: float = 5.0

    def __attrs_post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd TLS: cert and key go together (one was given without the other)")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth: user and password go together (one was given without the other)")
        if (self.ca or self.cert) and not any(e.startswith("https://") for e in self.endpoints):
            raise ValueError("etcd TLS: ca, cert and key are given but no endpoint is https://")
        if self.request_timeout <= 0 or self.connect_timeout <= 0 or self.retry_timeout < 0:
            raise ValueError(
                "etcd request_timeout and connect_timeout must be positive, retry_timeout 0 or more"
            )


def _ssl_context(config: EtcdConfig) -> ssl.SSLContext:
    """Reads the CA and the client certificate (blocking: called in a worker thread)."""
    try:
        context = ssl.create_default_context(cafile=str(config.ca) if config.ca else None)
        if config.cert is not None and config.key is not None:
            context.load_cert_chain(str(config.cert), str(config.key))
    except (OSError, ssl.SSLError) as exc:
        raise EtcdError(
            f"etcd TLS: cannot load ca={config.ca} cert={config.cert} key={config.key}: {exc}"
        ) from exc
    return context


@asynccontextmanager
async def connect(config: EtcdConfig) -> AsyncIterator[EtcdClient]:
    """An ``EtcdClient`` for ``config``, authenticated if it has a user; its connections are closed at
    the end of the ``async with``. Nothing is sent before the first request (or authentication)."""
    # Made in a worker thread even for http:// endpoints: httpx would otherwise load its default
    # trust store on the trio thread.
    verify = await trio.to_thread.run_sync(_ssl_context, config)
    timeout = httpx.Timeout(config.request_timeout, connect=config.connect_timeout)
    async with httpx.AsyncClient(verify=verify, timeout=timeout, trust_env=False) as http:
        client = EtcdClient(config, http)
        if config.user is not None:
            await client.authenticate()
        yield client


class EtcdClient:
    """etcd's KV, lease, watch and maintenance calls. Made by ``connect``; safe to use from many tasks
    at once."""

    def __init__(self, config: EtcdConfig, http: httpx.AsyncClient) -> None:
        self.config = config
        self.http = http
        self._current = 0
        self._token: str | None = None
        self._auth_lock = trio.Lock()

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to first (the last one that answered)."""
        return self.config.endpoints[self._current]

    # -- the one request path -------------------------------------------------------------------------

    async def request(
        self, path: str, body: Mapping[str, Any], *, operation: str, key: bytes = b"", idempotent: bool
    ) -> dict[str, Any]:
        """POST ``body`` to ``path`` and return etcd's answer.

        Endpoints are tried in turn from the last that answered, in rounds with a growing pause,
        until ``retry_timeout``: while connections fail and while members answer "unavailable" (an
        election under way, a member without a leader). A request that may have been sent is tried
        again only when ``idempotent``; a write that is not raises ``EtcdUnavailable`` with
        ``outcome_unknown`` instead. Refusals raise ``EtcdRequestError`` (or a subclass)."""
        what = f"etcd {operation}" + (f" of {key!r}" if key else "")
        endpoints = self.config.endpoints
        deadline = trio.current_time() + self.config.retry_timeout
        pause = 0.05
        reauthenticated = False
        while True:
            failures: list[str] = []
            start = self._current
            for index in [(start + i) % len(endpoints) for i in range(len(endpoints))]:
                endpoint = endpoints[index]
                while True:
                    try:
                        with trio.fail_after(self.config.request_timeout):
                            status, raw = await self._post(endpoint, path, body)
                    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                        failures.append(f"{endpoint}: cannot connect ({exc or type(exc).__name__})")
                        break
                    except (trio.TooSlowError, httpx.TransportError) as exc:
                        why = (
                            f"no answer within {self.config.request_timeout:g} s"
                            if isinstance(exc, trio.TooSlowError)
                            else f"connection lost ({exc or type(exc).__name__})"
                        )
                        if not idempotent:
                            raise EtcdUnavailable(
                                f"{what}: {endpoint}: {why}; it may or may not have been applied (read it back)",
                                outcome_unknown=True,
                            ) from exc
                        failures.append(f"{endpoint}: {why}")
                        break
                    self._current = index
                    doc = wire.decode_document(raw, f"{what}: {endpoint}")
                    if status == 200 and "error" not in doc:
                        return doc
                    code, message = wire.error_of(doc, status)
                    if (
                        code == UNAUTHENTICATED
                        and path != _AUTH_PATH
                        and self.config.user is not None
                        and not reauthenticated
                    ):
                        # The token expired (simple tokens lapse after --auth-token-ttl unused): once
                        # more with a fresh one, on the same endpoint.
                        reauthenticated = True
                        await self.authenticate()
                        continue
                    if code != UNAVAILABLE:
                        raise refusal(what, endpoint, operation, code, message)
                    # "no leader" is said before anything is proposed; "leader changed" or "request
                    # timed out" after, when the write may yet be applied.
                    if not idempotent and "no leader" not in message:
                        raise EtcdUnavailable(
                            f"{what}: {endpoint}: {message}; it may or may not have been applied (read it back)",
                            outcome_unknown=True,
                        )
                    failures.append(f"{endpoint}: {message}")
                    break
            if trio.current_time() + pause > deadline:
                raise EtcdUnavailable(
                    f"{what}: no etcd endpoint answered within {self.config.retry_timeout:g} s: "
                    + "; ".join(failures)
                )
            await trio.sleep(pause)  # between rounds of every endpoint; the deadline above bounds it
            pause = min(pause * 2, 0.5)

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header with the current token (none before authentication)."""
        return {} if self._token is None else {"Authorization": self._token}

    def advance(self) -> None:
        """Send requests to the next endpoint from now on (a watch whose stream broke here)."""
        self._current = (self._current + 1) % len(self.config.endpoints)

    async def _post(self, endpoint: str, path: str, body: Mapping[str, Any]) -> tuple[int, bytes]:
        """One POST, its answer read up to ``MAX_ANSWER_BYTES``."""
        headers = {} if path == _AUTH_PATH else self.auth_headers()
        async with self.http.stream("POST", endpoint + path, json=body, headers=headers) as response:
            raw = bytearray()
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise EtcdProtocolError(f"{endpoint}{path} answered over {MAX_ANSWER_BYTES} bytes")
            return response.status_code, bytes(raw)

    async def authenticate(self) -> None:
        """Get a token for the configured user (coalesced: tasks that find the token expired at once
        authenticate once)."""
        if self.config.user is None or self.config.password is None:
            raise EtcdAuthError(
                "etcd: authentication needs a user and password (none configured)",
                code=UNAUTHENTICATED,
                endpoint=self.endpoint,
                operation="authenticate",
            )
        token = self._token
        async with self._auth_lock:
            if self._token is not token and self._token is not None:
                return  # another task got a fresh one while this one waited
            try:
                doc = await self.request(
                    _AUTH_PATH,
                    {"name": self.config.user, "password": self.config.password},
                    operation=f"authenticate as {self.config.user!r}",
                    idempotent=True,
                )
            except EtcdRequestError as exc:
                raise EtcdAuthError(
                    str(exc), code=exc.code, endpoint=exc.endpoint, operation=exc.operation
                ) from exc
            token = doc.get("token")
            if not isinstance(token, str) or not token:
                raise EtcdProtocolError(
                    f"etcd authenticate as {self.config.user!r}: {self.endpoint} gave no token"
                )
            self._token = token

    # -- KV ---------------------------------------------------------------------------------------------

    async def range(self, r: Range) -> RangeResult:
        """Read a key or a range (``Range``); a revision already compacted raises ``EtcdCompacted``."""
        doc = await self.request(
            "/v3/kv/range", wire.encode_range(r), operation="range", key=r.key, idempotent=True
        )
        return wire.decode_range(doc)

    async def get(self, key: bytes, *, revision: int = 0) -> KeyValue | None:
        """``key``'s key-value, or None when it does not exist."""
        result = await self.range(Range(key, revision=revision))
        return result.kvs[0] if result.kvs else None

    async def get_prefix(self, prefix: bytes, *, revision: int = 0, limit: int = 0) -> RangeResult:
        """Every key under ``prefix`` (in key order) at one revision, and that revision
        (``result.header.revision``): the place a watch of the prefix resumes from."""
        return await self.range(Range.prefix(prefix, revision=revision, limit=limit))

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> PutResult:
        doc = await self.request(
            "/v3/kv/put",
            wire.encode_put(Put(key, value, lease, prev_kv)),
            operation="put",
            key=key,
            idempotent=False,
        )
        return wire.decode_put(doc)

    async def delete(self, key: bytes, *, prev_kv: bool = False) -> DeleteResult:
        doc = await self.request(
            "/v3/kv/deleterange",
            wire.encode_delete(Delete(key, prev_kv=prev_kv)),
            operation="delete",
            key=key,
            idempotent=False,
        )
        return wire.decode_delete(doc)

    async def delete_prefix(self, prefix: bytes, *, prev_kv: bool = False) -> DeleteResult:
        doc = await self.request(
            "/v3/kv/deleterange",
            wire.encode_delete(Delete.prefix(prefix, prev_kv=prev_kv)),
            operation="delete prefix",
            key=prefix,
            idempotent=False,
        )
        return wire.decode_delete(doc)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Operation] = (), failure: Sequence[Operation] = ()
    ) -> TxnResult:
        """If every comparison holds, apply ``success``, else ``failure``, atomically; ``succeeded``
        says which ran. E.g. a write fenced by leadership::

            await client.txn([Compare.value(LEADER, "==", me)], [Put(key, value)])
        """
        t = Txn(tuple(compare), tuple(success), tuple(failure))
        key = (
            compare[0].key
            if compare
            else (success[0].key if success and not isinstance(success[0], Txn) else b"")
        )
        doc = await self.request("/v3/kv/txn", wire.encode_txn(t), operation="txn", key=key, idempotent=False)
        return wire.decode_txn(doc)

    async def compact(self, revision: int, *, physical: bool = False) -> None:
        """Drop the history before ``revision`` (watches and reads at older revisions then fail with
        ``EtcdCompacted``)."""
        await self.request(
            "/v3/kv/compaction",
            {"revision": str(revision), "physical": physical},
            operation=f"compact to {revision}",
            idempotent=True,
        )

    # -- leases ----------------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds (etcd may grant more: its minimum is its election timeout)."""
        if ttl <= 0:
            raise ValueError(f"etcd lease TTL must be a positive number of seconds, got {ttl}")
        doc = await self.request(
            "/v3/lease/grant", {"TTL": str(ttl)}, operation=f"lease grant (TTL {ttl} s)", idempotent=False
        )
        lease = wire.decode_lease(doc)
        if lease.ttl <= 0:
            raise EtcdProtocolError(
                f"etcd lease grant: {self.endpoint} granted lease {lease.id:x} with TTL {lease.ttl}"
            )
        return lease

    async def keepalive_once(self, lease_id: int) -> Lease:
        """Renew the lease once and return its new TTL; ``EtcdLeaseLost`` if it no longer exists."""
        doc = await self.request(
            "/v3/lease/keepalive",
            {"ID": str(lease_id)},
            operation=f"lease keepalive of {lease_id:x}",
            idempotent=True,
        )
        result = doc.get("result")
        if not isinstance(result, Mapping):
            raise EtcdProtocolError(
                f"etcd lease keepalive of {lease_id:x}: {self.endpoint} answered without a result: {doc!r}"
            )
        lease = wire.decode_lease(result, "lease keepalive")
        if lease.ttl <= 0:
            raise EtcdLeaseLost(
                f"etcd lease {lease_id:x} has expired or was revoked ({self.endpoint} does not know it)"
            )
        return lease

    async def revoke(self, lease_id: int) -> None:
        """End the lease now, deleting every key attached to it. Revoking a lease that has already
        gone is not an error (the keys are gone either way)."""
        try:
            await self.request(
                "/v3/lease/revoke",
                {"ID": str(lease_id)},
                operation=f"lease revoke of {lease_id:x}",
                idempotent=True,
            )
        except EtcdRequestError as exc:
            if exc.code != NOT_FOUND:
                raise

    async def keeper(self, ttl: int) -> LeaseKeeper:
        """Grant a lease of ``ttl`` seconds and return its keeper; run ``keeper.run`` in a nursery to
        keep it alive."""
        granted_at = trio.current_time()
        lease = await self.grant(ttl)
        return LeaseKeeper(self, lease, granted_at)

    # -- watch -----------------------------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        *,
        range_end: bytes = b"",
        start_revision: int = 0,
        idle_timeout: float = 30.0,
        reconnect_timeout: float = 60.0,
    ) -> Watch:
        """Watch ``key`` (or ``key`` to ``range_end``) from ``start_revision`` (0: changes after now).
        Use as ``async with client.watch(...) as w: async for batch in w``; the watch reconnects and
        resumes after a broken connection (see ``Watch``)."""
        return Watch(
            self,
            key,
            range_end,
            start_revision,
            idle_timeout=idle_timeout,
            reconnect_timeout=reconnect_timeout,
        )

    def watch_prefix(
        self,
        prefix: bytes,
        *,
        start_revision: int = 0,
        idle_timeout: float = 30.0,
        reconnect_timeout: float = 60.0,
    ) -> Watch:
        """Every change under ``prefix``: pass ``get_prefix``'s ``header.revision + 1`` as
        ``start_revision`` to see each change after that read, none missed and none twice."""
        return self.watch(
            prefix,
            range_end=prefix_end(prefix),
            start_revision=start_revision,
            idle_timeout=idle_timeout,
            reconnect_timeout=reconnect_timeout,
        )

    # -- maintenance -----------------------------------------------------------------------------------

    async def status(self) -> Status:
        """The status of the member requests go to (failing over like any read)."""
        doc = await self.request("/v3/maintenance/status", {}, operation="status", idempotent=True)
        return wire.decode_status(doc, self.endpoint)

    async def statuses(self) -> tuple[Status | str, ...]:
        """Each endpoint's status, or why it gave none, asked of each directly (for a health view):
        one per endpoint, in the configured order."""
        results: list[Status | str] = ["no answer"] * len(self.config.endpoints)

        async def ask(i: int, endpoint: str) -> None:
            try:
                with trio.fail_after(self.config.request_timeout):
                    status, raw = await self._post(endpoint, "/v3/maintenance/status", {})
                doc = wire.decode_document(raw, f"etcd status: {endpoint}")
                if status != 200 or "error" in doc:
                    results[i] = wire.error_of(doc, status)[1]
                else:
                    results[i] = wire.decode_status(doc, endpoint)
            except trio.TooSlowError:
                results[i] = f"no answer within {self.config.request_timeout:g} s"
            except (httpx.TransportError, EtcdProtocolError) as exc:
                results[i] = str(exc) or type(exc).__name__

        async with trio.open_nursery() as nursery:
            for i, endpoint in enumerate(self.config.endpoints):
                nursery.start_soon(ask, i, endpoint)
        return tuple(results)
