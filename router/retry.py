"""Retries and ejection: what the router does when an engine fails before responding.

A failure before any response byte reached the client (connect refused or timed out, reset,
closed before a status line, or an HTTP 503 while another replica is left to try) moves the
request to another replica, at most ``max_attempts`` replicas (``forward``); when all fail the
client gets a 502 naming each failure. ``eject_after`` consecutive failures eject an upstream for
``eject_base`` seconds, doubling per consecutive ejection up to ``eject_max``; after an ejection
one more failure ejects it again, and one success clears the record (``Ejection``). When every
upstream of a model is ejected they are tried anyway: refusing outright would turn a blip into an
outage. An engine that went silent (``router.stalls``) is ejected at once and not retried.

Pure apart from ``forward``, which only sequences the caller's own attempts: the clock is passed
in, so the same rules run in every router process and in unit tests. State is keyed by URL, not
replica id: load and health belong to the engine process listening there, and one engine serving
two model names must count its load once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence

import attrs

from router.policies import Candidate
from router.routes import Upstream


@attrs.define
class Health:
    """What the router knows about one engine URL."""

    replica_id: str
    outstanding: int = 0
    failures: int = 0  # consecutive failures since the last success or ejection
    ejections: int = 0  # consecutive ejections without a success in between
    ejected_until: float = 0.0
    last_error: str = ""


class Ejection:
    """Each engine URL's outstanding requests and failure record, and the ejection rules (in the
    module docstring)."""

    def __init__(self, *, eject_after: int = 3, eject_base: float = 10.0, eject_max: float = 300.0) -> None:
        self.eject_after = eject_after
        self.eject_base = eject_base
        self.eject_max = eject_max
        self.health: dict[str, Health] = {}

    def _get(self, upstream: Upstream) -> Health:
        h = self.health.get(upstream.url)
        if h is None:
            h = self.health[upstream.url] = Health(upstream.replica_id)
        else:
            h.replica_id = upstream.replica_id
        return h

    def outstanding(self, url: str) -> int:
        h = self.health.get(url)
        return h.outstanding if h else 0

    def is_ejected(self, url: str, now: float) -> bool:
        h = self.health.get(url)
        return h is not None and h.ejected_until > now

    def candidates(
        self, upstreams: Sequence[Upstream], now: float, exclude: Collection[str] = ()
    ) -> list[Candidate]:
        """The upstreams a policy may choose from for the next attempt, with their loads: those
        not ``exclude``d (tried already) and not ejected, or every one not excluded when all of
        them are ejected. Empty when every upstream was tried. (One pass: this is on every
        request's path.)"""
        health = self.health
        left: list[Candidate] = []
        healthy: list[Candidate] = []
        for u in upstreams:
            if u.url in exclude:
                continue
            h = health.get(u.url)
            c = Candidate(u, h.outstanding if h is not None else 0)
            left.append(c)
            if h is None or h.ejected_until <= now:
                healthy.append(c)
        return healthy or left

    def begin(self, upstream: Upstream) -> None:
        self._get(upstream).outstanding += 1

    def end(self, upstream: Upstream) -> None:
        self._get(upstream).outstanding -= 1

    def succeeded(self, upstream: Upstream) -> None:
        h = self._get(upstream)
        h.failures = 0
        h.ejections = 0

    def failed(self, upstream: Upstream, now: float, error: str, *, at_once: bool = False) -> float | None:
        """Record a failure; returns the ejection's length in seconds when this one ejects it.
        ``at_once``: a failure that ejects without waiting for ``eject_after`` of them (a timeout:
        the next request sent there would wait as long).

        Failures of requests that were already in flight when the upstream was ejected do not
        count again: a burst against a dead engine is one ejection, not an escalating series."""
        h = self._get(upstream)
        h.last_error = error
        if h.ejected_until > now:
            return None
        h.failures += 1
        threshold = 1 if h.ejections or at_once else self.eject_after
        if h.failures < threshold:
            return None
        h.ejections += 1
        h.failures = 0
        seconds = min(self.eject_base * 2.0 ** (h.ejections - 1), self.eject_max)
        h.ejected_until = now + seconds
        return seconds

    def prune(self, live: set[str], now: float) -> None:
        """Forget URLs no model routes to any more, once nothing is in flight on them and no
        ejection is pending (a replica that comes back on the same URL inherits its ejection)."""
        for url in [u for u, h in self.health.items() if u not in live]:
            h = self.health[url]
            if h.outstanding == 0 and h.ejected_until <= now:
                del self.health[url]


class AllFailed(Exception):
    """Every replica tried failed before responding; ``failures`` names each one and why."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__("; ".join(failures))
        self.failures = failures


async def forward(
    upstreams: Sequence[Upstream],
    max_attempts: int,
    pick: Callable[[list[str]], Upstream | None],
    attempt: Callable[[Upstream, bool], Awaitable[str | None]],
    retried: Callable[[], None],
) -> None:
    """Try a request on up to ``max_attempts`` of ``upstreams``, one after another: ``pick(tried)``
    names the next (None: none left), ``attempt(upstream, last)`` returns None once a response
    went to the client, or why the upstream failed when nothing did; ``retried()`` is called for
    each attempt after the first. Raises ``AllFailed`` when no attempt answered."""
    tried: list[str] = []
    failures: list[str] = []
    attempts = min(max_attempts, len(upstreams))
    for n in range(attempts):
        upstream = pick(tried)
        if upstream is None:
            break
        tried.append(upstream.url)
        if n:
            retried()
        error = await attempt(upstream, n == attempts - 1)
        if error is None:
            return
        failures.append(f"{upstream.replica_id} ({upstream.url}): {error}")
    raise AllFailed(failures)
