"""The HTTP probes the supervisor runs against an engine, and the liveness transitions as a pure step.

- **Readiness** (while STARTING, and once for an adopted engine): ``/health`` 200, then the
  OpenAI ``/v1/models`` list names the served model. Its verdict is one of three: ready, not yet
  (keep polling until the ready timeout), or *wrong model*: the engine is up and lists other
  names, which no amount of waiting will change, so the start fails at once.
- **Liveness** (after READY), kubelet's liveness probe: ``GET /health`` every ``period`` seconds,
  each bounded by ``timeout`` (a SIGSTOPped or wedged engine accepts the connection and never
  answers, so an unbounded probe would hang with it), and ``failures`` misses in a row make the
  shard UNHEALTHY. One pass makes it READY again: every state has a way back.
- **In flight**: the engines' own Prometheus gauges, which a drain waits on.

``liveness_step`` is the transition alone (state and count in, state and count out), so the rule is
tested without clocks or sockets; the supervisor does the I/O and the timing.
"""

from __future__ import annotations

import enum
import re

import attrs
import httpx
import trio

import enginedefs
import schema
from agent.engines import Readiness
from agent.engines.base import listed_names

State = schema.ShardState

# Gauges of in-flight requests, every engine's (``enginedefs``: ``publishes.in_flight``): a drain
# waits for these to reach zero before stopping.
_GAUGES = sorted({g for d in enginedefs.DESCRIPTORS for g in d.publishes.in_flight})
IN_FLIGHT = re.compile(
    rb"^(" + b"|".join(re.escape(g.encode()) for g in _GAUGES) + rb")(\{[^}]*\})?\s+([0-9.eE+-]+)",
    re.MULTILINE,
)


def probe_address(engine_host: str) -> str:
    """Where the agent reaches an engine bound to ``engine_host``: that address, or loopback for a
    wildcard bind (every interface then includes loopback)."""
    if engine_host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if engine_host in ("::", "[::]"):
        return "::1"
    return engine_host


def base_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, with an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def auth_headers(api_key: str) -> dict[str, str]:
    """The header an engine started with ``--api-key`` wants on its API (vLLM, SGLang, llama.cpp
    and the sim check ``Authorization: Bearer``); none for an engine without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be greater than 0, got {value}")


@attrs.frozen
class LivenessProbe:
    """kubelet's liveness probe settings (``periodSeconds``, ``timeoutSeconds``,
    ``failureThreshold``), with its defaults."""

    period: float = attrs.field(default=10.0, validator=_positive)
    timeout: float = attrs.field(default=5.0, validator=_positive)
    failures: int = attrs.field(default=3, validator=attrs.validators.ge(1))


class Verdict(enum.Enum):
    READY = "ready"
    NOT_YET = "not yet"
    #: Up and answering, but its model list lacks the served name: the start has failed.
    WRONG_MODEL = "wrong model"


@attrs.frozen
class ReadyCheck:
    verdict: Verdict
    #: What the check saw, for the log and the error ("GET /health -> 503").
    detail: str


async def check_ready(client: httpx.AsyncClient, ready: Readiness) -> ReadyCheck:
    """One readiness check: ``/health``, then the model list (see the module docstring)."""
    try:
        health = await client.get(ready.health_path)
        if health.status_code != 200:
            return ReadyCheck(Verdict.NOT_YET, f"GET {ready.health_path} -> {health.status_code}")
        if ready.models_path:
            models = await client.get(ready.models_path)
            if models.status_code != 200:
                return ReadyCheck(Verdict.NOT_YET, f"GET {ready.models_path} -> {models.status_code}")
            names = listed_names(models.content)
            if names is None:
                return ReadyCheck(Verdict.NOT_YET, f"GET {ready.models_path}: not an OpenAI model list yet")
            if ready.model_name not in names:
                serves = ", ".join(repr(n) for n in names[:5]) or "no model"
                return ReadyCheck(
                    Verdict.WRONG_MODEL, f"engine serves {serves}, StartShard asked for {ready.model_name!r}"
                )
        return ReadyCheck(Verdict.READY, "ready")
    except httpx.HTTPError as exc:
        return ReadyCheck(Verdict.NOT_YET, f"GET {ready.health_path}: {type(exc).__name__}")


async def check_live(client: httpx.AsyncClient, path: str, timeout: float) -> str:
    """One liveness probe: empty when it passed, else what failed, in words.

    Passing is kubelet's rule: a status from 200 to 399 within ``timeout``. The whole request is
    bounded (connect, send, the head, the body), not each phase alone.
    """
    with trio.move_on_after(timeout):
        try:
            resp = await client.get(path, timeout=timeout)
        except httpx.TimeoutException:
            return f"GET {path} timed out after {timeout:g} s"
        except httpx.HTTPError as exc:
            detail = str(exc)
            return f"GET {path}: {type(exc).__name__}" + (f": {detail}" if detail else "")
        if 200 <= resp.status_code < 400:
            return ""
        return f"GET {path} -> {resp.status_code}"
    return f"GET {path} timed out after {timeout:g} s"


@attrs.frozen
class LivenessStep:
    state: schema.ShardState
    #: Failures in a row so far (0 after a pass).
    failures: int


def liveness_step(state: schema.ShardState, failures: int, passed: bool, threshold: int) -> LivenessStep:
    """The next state of a READY or UNHEALTHY shard after one probe; other states are left alone."""
    if state not in (State.READY, State.UNHEALTHY):
        return LivenessStep(state, failures)
    if passed:
        return LivenessStep(State.READY, 0)
    failures += 1
    return LivenessStep(State.UNHEALTHY if failures >= threshold else state, failures)


async def in_flight(client: httpx.AsyncClient, url: str) -> float | None:
    """Requests the engine is still running, from its Prometheus gauges; ``None`` when unknown."""
    try:
        resp = await client.get(url)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    values = [float(m.group(3)) for m in IN_FLIGHT.finditer(resp.content)]
    return sum(values) if values else None


__all__ = [
    "IN_FLIGHT",
    "LivenessProbe",
    "LivenessStep",
    "ReadyCheck",
    "Verdict",
    "auth_headers",
    "base_url",
    "check_live",
    "check_ready",
    "in_flight",
    "liveness_step",
    "probe_address",
]
