"""Prefix affinity over least loaded: the router's default policy.

The prompt's prefix (``PolicyRequest.prompt``) is hashed, the candidates are ranked by rendezvous
hashing of that digest with each URL, and the request goes to the highest-ranked candidate whose
load is at most the lowest load among them plus ``slack``. Requests sharing a prefix therefore
land on the engine that already holds that prefix's KV cache while it is not overloaded, and
spill to the least loaded one when it is; rendezvous ranking moves only the prefixes of a replica
that comes or goes. A request with no prompt goes to the least loaded candidate (ties at random).

The hash is stable (blake2b, never Python's salted ``hash``), so several routers with the same
routes send the same prefix to the same engine without talking to each other.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from router.policies import Candidate, Choice, PolicyRequest


def prefix_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def rendezvous_score(digest: bytes, url: str) -> int:
    """Rendezvous weight of ``url`` for a prefix: a stable hash (not Python's salted ``hash``), so
    that several router processes send the same prefix to the same engine."""
    return int.from_bytes(hashlib.blake2b(digest + url.encode(), digest_size=8).digest(), "big")


class PrefixHash:
    """Prefix affinity by rendezvous hashing, with ``slack`` over the least loaded candidate."""

    name = "prefix_hash"

    def __init__(self, slack: int = 4, rng: random.Random | None = None) -> None:
        self.slack = slack
        self._rng = rng or random.Random()

    def choose(self, request: PolicyRequest, candidates: Sequence[Candidate]) -> Choice:
        if len(candidates) == 1:
            return Choice(candidates[0].upstream, self.name, "only")
        low = min([c.load for c in candidates])
        if request.prompt:
            digest = prefix_digest(request.prompt)
            ranked = sorted(candidates, key=lambda c: rendezvous_score(digest, c.upstream.url), reverse=True)
            for rank, (upstream, load) in enumerate(ranked, 1):
                if load <= low + self.slack:
                    inputs = (("rank", rank), ("load", load), ("least", low), ("slack", self.slack))
                    return Choice(upstream, self.name, "prefix", inputs)
        least = [c for c in candidates if c.load == low]
        pick = least[0] if len(least) == 1 else self._rng.choice(least)
        return Choice(pick.upstream, self.name, "least_loaded", (("load", low), ("tied", len(least))))
