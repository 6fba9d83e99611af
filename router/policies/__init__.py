"""Balancing policies: which of a model's replicas gets the next attempt of a request.

One interface, ``Policy``, and one module per policy behind it. A policy is pure: it is handed
what it may base its choice on (the request's model and prompt text, and each candidate with its
load) and returns a ``Choice`` that names the replica, the policy, the rule that decided and the
inputs it used, so every routing decision can be explained. It does no I/O and reads no clock.
Which replicas are candidates at all (not tried yet for this request, not ejected) is decided
before it is asked (``router.retry.Ejection.candidates``).

Policies: ``router.policies.prefix_hash.PrefixHash`` (prefix affinity by rendezvous hashing, with
slack over the least loaded; the default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from router.routes import Upstream


class Candidate(NamedTuple):
    """A replica a policy may choose, with its load: the requests this router has outstanding on
    its engine (one engine serving two model names counts its load once). A named tuple, as the
    two classes below: they are made per request, and a tuple is the cheapest value to make."""

    upstream: Upstream
    load: int


class PolicyRequest(NamedTuple):
    """What a policy may read of a request: its model, and the start of its prompt as the engine
    will see it (``prompt_prefix``; chat messages with their roles, or ``prompt``, or ``input``),
    which is what an engine's prefix cache can reuse."""

    model: str
    prompt: str


class Choice(NamedTuple):
    """A policy's decision: the replica, the policy's name, the rule that decided (a word such
    as ``prefix`` or ``least_loaded``) and the inputs it used, as (name, value) pairs."""

    upstream: Upstream
    policy: str
    rule: str
    inputs: tuple[tuple[str, object], ...] = ()

    def explain(self) -> str:
        """One line for a log: ``prefix_hash: prefix (rank=1, load=2, least=0, slack=4)``."""
        used = ", ".join(f"{k}={v}" for k, v in self.inputs)
        return f"{self.policy}: {self.rule}" + (f" ({used})" if used else "")


class Policy(Protocol):
    """Chooses one of ``candidates`` (never empty) for ``request``."""

    @property
    def name(self) -> str: ...

    def choose(self, request: PolicyRequest, candidates: Sequence[Candidate]) -> Choice: ...


def prompt_prefix(doc: Mapping[str, Any], limit: int) -> str:
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
