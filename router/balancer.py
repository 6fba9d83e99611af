"""Choosing a replica: least outstanding requests with prefix affinity, and outlier ejection.

Pure: the clock is passed in, nothing here does I/O, so the same rules run in every router process
and in unit tests. The prefix's hash is stable (blake2b, never Python's salted ``hash``), so that
several routers with the same routes send the same prompt prefix to the same engine (rendezvous
hashing). The rules are in ``router.server``'s docstring ("Choosing a replica", "Failures")."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from router.routes import Upstream


def affinity_key(doc: Mapping[str, Any], limit: int) -> str:
    """The first ``limit`` characters of what the engine will see first: the chat messages (role
    and text parts), or ``prompt``, or ``input``. Shared system prompts and few-shot preambles make
    this the part an engine's prefix cache can reuse."""
    parts: list[str] = []
    size = 0

    def add(text: str) -> bool:
        nonlocal size
        parts.append(text)
        size += len(text)
        return size >= limit

    messages = doc.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            if add(f"{message.get('role', '')}\x00"):
                break
            content = message.get("content")
            if isinstance(content, str):
                if add(content + "\x00"):
                    break
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str) and add(part["text"]):
                        break
                if size >= limit:
                    break
    else:
        prompt = doc.get("prompt", doc.get("input"))
        if isinstance(prompt, str):
            add(prompt)
        elif isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str):
                add(first)
            elif isinstance(first, int):  # token ids
                add(" ".join(str(t) for t in prompt[:limit] if isinstance(t, int)))
            elif isinstance(first, list):  # a batch of token id lists
                add(" ".join(str(t) for t in first[:limit] if isinstance(t, int)))
    return "".join(parts)[:limit]


def prefix_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def rendezvous_score(digest: bytes, url: str) -> int:
    """Rendezvous weight of ``url`` for a prefix: a stable hash (not Python's salted ``hash``), so
    that several router processes send the same prefix to the same engine."""
    return int.from_bytes(hashlib.blake2b(digest + url.encode(), digest_size=8).digest(), "big")


@attrs.define
class Health:
    """What the router knows about one engine URL."""

    replica_id: str
    outstanding: int = 0
    failures: int = 0  # consecutive failures since the last success or ejection
    ejections: int = 0  # consecutive ejections without a success in between
    ejected_until: float = 0.0
    last_error: str = ""


class Balancer:
    """Least outstanding with prefix affinity, and outlier ejection (rules in the module docstring).

    State is keyed by URL, not replica id: load and health belong to the engine process listening
    there, and one engine serving two model names must count its load once."""

    def __init__(
        self,
        *,
        affinity_slack: int = 4,
        eject_after: int = 3,
        eject_base: float = 10.0,
        eject_max: float = 300.0,
        rng: random.Random | None = None,
    ) -> None:
        self.affinity_slack = affinity_slack
        self.eject_after = eject_after
        self.eject_base = eject_base
        self.eject_max = eject_max
        self.health: dict[str, Health] = {}
        self._rng = rng or random.Random()

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

    def choose(
        self,
        upstreams: Sequence[Upstream],
        digest: bytes | None,
        now: float,
        exclude: Iterable[str] = (),
    ) -> Upstream | None:
        """The upstream for the next attempt, or None when every one is excluded (already tried)."""
        skip = set(exclude)
        candidates = [u for u in upstreams if u.url not in skip]
        if not candidates:
            return None
        healthy = [u for u in candidates if not self.is_ejected(u.url, now)]
        pool = healthy or candidates
        if len(pool) == 1:
            return pool[0]
        loads = [self.outstanding(u.url) for u in pool]
        low = min(loads)
        if digest is not None:
            ranked = sorted(
                zip(pool, loads, strict=True), key=lambda p: rendezvous_score(digest, p[0].url), reverse=True
            )
            for upstream, load in ranked:
                if load <= low + self.affinity_slack:
                    return upstream
        least = [u for u, load in zip(pool, loads, strict=True) if load == low]
        return least[0] if len(least) == 1 else self._rng.choice(least)

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
