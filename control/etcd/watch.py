"""A watch of a key or a prefix that survives broken connections without losing a change.

The watch remembers the revision it must see next (``next_revision``): the start revision asked for,
or, once etcd has created it, one past the revision it was created at; then one past each event
delivered, and one past each progress notification's revision. When the stream breaks (etcd killed,
a member gone, the connection cut, or nothing heard for ``idle_timeout``), it opens a new one from
``next_revision`` on the next endpoint that answers, so the caller sees every change exactly once, in
order. If etcd has compacted that revision away, the changes in between are gone: the watch raises
``EtcdCompacted`` and the caller must read the prefix again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import trio

from control.etcd import wire
from control.etcd.errors import (
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    EtcdAuthError,
    EtcdCompacted,
    EtcdProtocolError,
    EtcdRequestError,
    EtcdUnavailable,
    refusal,
)
from control.etcd.values import WatchBatch

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from control.etcd.client import EtcdClient

#: The longest closing a broken stream may take.
CLOSE_TIMEOUT = 5.0

#: The longest line (one watch response) the stream may carry.
MAX_LINE_BYTES = 128 * 1024 * 1024


class _Broken(Exception):
    """The stream ended or failed; the watch reopens it."""


class _TokenExpired(_Broken):
    """etcd refused the auth token (it expired): authenticate again, then reopen."""


class Watch:
    """``async with client.watch(...) as w: async for batch in w: ...`` (``WatchBatch`` values).

    ``reconnect_timeout`` bounds how long the watch tries to reopen a broken stream before raising
    ``EtcdUnavailable``; ``idle_timeout`` is how long a silent stream is trusted (etcd is asked for
    progress notifications, but only sends them every ten minutes by default, so a watch with no
    changes for ``idle_timeout`` is simply reopened from where it was)."""

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        range_end: bytes,
        start_revision: int,
        *,
        idle_timeout: float,
        reconnect_timeout: float,
    ) -> None:
        if start_revision < 0:
            raise ValueError(f"etcd watch of {key!r}: start_revision must be 0 or more, got {start_revision}")
        self.client = client
        self.key = key
        self.range_end = range_end
        self.next_revision = start_revision
        self.idle_timeout = idle_timeout
        self.reconnect_timeout = reconnect_timeout
        #: How many times the stream was reopened after it broke.
        self.reconnects = 0
        #: The endpoint the open stream is on ("" while none is open).
        self.endpoint = ""
        self._response: httpx.Response | None = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._buffer = bytearray()
        self._reauthenticated = False

    @property
    def what(self) -> str:
        return f"etcd watch of {self.key!r}" + (f" to {self.range_end!r}" if self.range_end else "")

    async def __aenter__(self) -> Watch:
        await self._open_with_retry()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Watch:
        return self

    async def aclose(self) -> None:
        chunks, response = self._chunks, self._response
        self._chunks = self._response = None
        self._buffer.clear()
        self.endpoint = ""
        # Shielded, so a cancelled watch still closes its connection; bounded, as every wait is
        # (closing a socket does not wait on the peer, so this is never reached in practice).
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            if chunks is not None:
                await chunks.aclose()  # type: ignore[attr-defined]
            if response is not None:
                await response.aclose()

    async def __anext__(self) -> WatchBatch:
        while True:
            if self._response is None:
                await self._open_with_retry()
            try:
                with trio.fail_after(self.idle_timeout):
                    doc = await self._next_doc()
                batch = self._handle(doc)
            except _TokenExpired:
                await self.aclose()
                await self.client.authenticate()
                self.reconnects += 1
                continue
            except (_Broken, trio.TooSlowError, httpx.TransportError):
                await self.aclose()
                self.reconnects += 1
                continue
            if batch is not None:
                return batch

    # -- the stream ------------------------------------------------------------------------------------

    async def _open_with_retry(self) -> None:
        """Open a stream from ``next_revision`` on the first endpoint that takes it, trying every
        endpoint in turn (with a short pause after each round) until ``reconnect_timeout``."""
        failures: list[str] = []
        pause = 0.05
        with trio.move_on_after(self.reconnect_timeout):
            while True:
                for _ in self.client.config.endpoints:
                    endpoint = self.client.endpoint
                    try:
                        await self._open(endpoint)
                        return
                    except _TokenExpired:
                        await self.aclose()
                        await self.client.authenticate()
                        continue
                    except (_Broken, trio.TooSlowError, httpx.TransportError) as exc:
                        failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                        await self.aclose()
                        self.client.advance()
                    except BaseException:
                        await self.aclose()  # a refusal, or cancelled: no stream left open
                        raise
                await trio.sleep(pause)  # between rounds of every endpoint; the deadline above bounds it
                pause = min(pause * 2, 1.0)
        last = "; ".join(failures[-len(self.client.config.endpoints) :])
        raise EtcdUnavailable(
            f"{self.what}: could not reopen from revision {self.next_revision} within {self.reconnect_timeout:g} s: {last}"
        )

    async def _open(self, endpoint: str) -> None:
        body = wire.encode_watch(self.key, self.range_end, self.next_revision)
        request = self.client.http.build_request(
            "POST",
            endpoint + "/v3/watch",
            json=body,
            headers=self.client.auth_headers(),
            timeout=httpx.Timeout(
                self.client.config.request_timeout, connect=self.client.config.connect_timeout, read=None
            ),
        )
        with trio.fail_after(self.client.config.request_timeout):
            self._response = await self.client.http.send(request, stream=True)
            self._chunks = self._response.aiter_raw()
            self.endpoint = endpoint
            if self._response.status_code != 200:
                raw = await self._response.aread()
                doc = json.loads(raw) if raw.startswith(b"{") else {}
                self._refused(doc, self._response.status_code)
            # The first response says the watch was created (or why not); read it here so that a
            # watch that etcd refuses at creation fails in __aenter__. A compacted start revision is
            # told after "created", so it is raised by the first __anext__.
            doc = await self._next_doc()
            result = doc.get("result")
            if "error" not in doc and not (
                isinstance(result, Mapping) and (result.get("created") or result.get("canceled"))
            ):
                raise EtcdProtocolError(
                    f"{self.what}: {endpoint}'s first response is not 'created': {dict(doc)!r}"
                )
            self._handle(doc)

    async def _next_doc(self) -> Mapping[str, Any]:
        assert self._chunks is not None
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                if not line.strip():
                    continue
                return wire.decode_document(line, f"{self.what}: {self.endpoint}", "a line")
            if len(self._buffer) > MAX_LINE_BYTES:
                raise EtcdProtocolError(
                    f"{self.what}: {self.endpoint} sent a response over {MAX_LINE_BYTES} bytes"
                )
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise _Broken(f"{self.endpoint} ended the stream") from None
            self._buffer += chunk

    def _refused(self, doc: Mapping[str, Any], status: int) -> None:
        code, message = wire.error_of(doc, status)
        if code == UNAUTHENTICATED and self.client.config.user is not None and not self._reauthenticated:
            self._reauthenticated = True
            raise _TokenExpired(f"token refused: {message}")
        if code == UNAVAILABLE or status in (502, 503, 504):
            raise _Broken(message)
        raise refusal(self.what, self.endpoint, "watch", code, message)

    def _handle(self, doc: Mapping[str, Any]) -> WatchBatch | None:
        """One response of the stream: a batch to deliver, or None (created, progress)."""
        if "error" in doc:
            self._refused(doc, 200)
        result = doc.get("result")
        if not isinstance(result, Mapping):
            raise EtcdProtocolError(
                f"{self.what}: {self.endpoint} sent a response without a result: {dict(doc)!r}"
            )
        header = wire.decode_header(result, self.what)
        if result.get("canceled"):
            compact = result.get("compact_revision")
            if compact:
                raise EtcdCompacted(
                    f"{self.what}: revision {self.next_revision} has been compacted (the oldest left is {compact}); read the prefix again and watch from there",
                    compact_revision=int(compact),
                )
            reason = str(result.get("cancel_reason") or "no reason given")
            if "code = Unauthenticated" in reason or "invalid auth token" in reason:
                # How etcd refuses a watch whose token has lapsed: the stream is opened, then the
                # watch cancelled with the gRPC error as its reason.
                self._refused({"code": UNAUTHENTICATED, "message": reason}, 200)
            if "permission denied" in reason:
                raise EtcdAuthError(
                    f"{self.what}: {self.endpoint} refused: {reason}",
                    code=PERMISSION_DENIED,
                    endpoint=self.endpoint,
                    operation="watch",
                )
            raise EtcdRequestError(
                f"{self.what}: {self.endpoint} cancelled the watch: {reason}",
                code=-1,
                endpoint=self.endpoint,
                operation="watch",
            )
        if result.get("created"):
            if self.next_revision == 0:
                self.next_revision = header.revision + 1
            self._reauthenticated = False
            return None
        events = wire.decode_events(result, self.what)
        if not events:  # a progress notification: every change up to header.revision has been sent
            self.next_revision = max(self.next_revision, header.revision + 1)
            return None
        self.next_revision = events[-1].kv.mod_revision + 1
        return wire.watch_batch(events)
