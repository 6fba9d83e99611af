"""The agent's own health and metrics: ``/healthz`` and ``/metrics`` on a local admin port.

Off unless ``metrics_listen`` is set (``--metrics-listen 9100`` listens on loopback; name a host to
listen elsewhere). Every series is a ``prometheus_client`` metric in the agent's own registry:

- ``llmgw_agent_session`` (connecting / connected / reconnecting) and
  ``llmgw_agent_session_since_seconds``: the stream to the control plane, and since when;
- ``llmgw_agent_heartbeats_sent_total``, ``llmgw_agent_session_attempts_total``;
- ``llmgw_agent_engines{state}``: the supervisor's shards by state;
- ``llmgw_agent_probe_failures_total``: READY engines the liveness probe turned UNHEALTHY;
- ``llmgw_agent_engines_adopted_total`` (engines found running at start and adopted, each an agent
  restart that cost no model reload), ``llmgw_agent_engine_spawns_total`` and
  ``llmgw_agent_engine_failures_total`` (shards that became FAILED);
- the process, platform and GC collectors (``process_resident_memory_bytes``, ...).

Values are updated on the trio thread (the session and the supervisor watcher below); a scrape
renders them in a worker thread, which ``prometheus_client``'s locked values allow.
"""

from __future__ import annotations

import datetime
import json
import time

import trio
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info

import schema
from agent.supervise import Shard, Supervisor
from telemetry.http import Listen, Response, serve
from telemetry.metrics import exposition, new_registry

SESSION_STATES = ("connecting", "connected", "reconnecting")
#: Every state a shard can be in (UNSPECIFIED is the wire's zero value, never a shard's).
ENGINE_STATES = tuple(s for s in schema.ShardState if s is not schema.ShardState.UNSPECIFIED)


class AgentMetrics:
    """The agent's series and the facts ``/healthz`` reports; one per agent process."""

    def __init__(self, node_id: str, version: str, registry: CollectorRegistry | None = None) -> None:
        self.node_id = node_id
        self.registry = registry or new_registry()
        r = self.registry
        Info("llmgw_agent", "The agent's version and node id.", registry=r).info(
            {"version": version, "node_id": node_id}
        )
        self.session = Enum(
            "llmgw_agent_session",
            "The stream to the control plane: connecting (first attempt), connected (registered), "
            "reconnecting (after a session ended).",
            states=list(SESSION_STATES),
            registry=r,
        )
        self.session_since = Gauge(
            "llmgw_agent_session_since_seconds",
            "Unix time the session entered its current state.",
            registry=r,
        )
        self.session_attempts = Counter(
            "llmgw_agent_session_attempts", "Connection attempts to the control plane.", registry=r
        )
        self.heartbeats = Counter(
            "llmgw_agent_heartbeats_sent", "Heartbeats written to the control plane stream.", registry=r
        )
        self.engines = Gauge("llmgw_agent_engines", "Shards by state.", ["state"], registry=r)
        for state in ENGINE_STATES:
            self.engines.labels(state=state.name.lower())
        self.probe_failures = Counter(
            "llmgw_agent_probe_failures",
            "READY engines the liveness probe made UNHEALTHY (liveness_failures misses in a row).",
            registry=r,
        )
        self.adopted = Counter(
            "llmgw_agent_engines_adopted",
            "Engines found running at start and adopted instead of started again (an agent restart "
            "that cost no model reload).",
            registry=r,
        )
        self.spawns = Counter("llmgw_agent_engine_spawns", "Engines this agent started.", registry=r)
        self.failures = Counter(
            "llmgw_agent_engine_failures",
            "Shards that became FAILED: refused before launch, not started, not ready in time, or "
            "exited on their own.",
            registry=r,
        )
        self.supervisor: Supervisor | None = None
        self.state = "connecting"
        self.since = time.time()
        self.session_since.set(self.since)
        self.session.state("connecting")

    # -- the session ---------------------------------------------------------------------------

    def _enter(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()
            self.session_since.set(self.since)
            self.session.state(state)

    def attempt(self) -> None:
        """A connection attempt begins (the state stays what it was until it registers or ends)."""
        self.session_attempts.inc()

    def connected(self) -> None:
        """The control plane acknowledged Register."""
        self._enter("connected")

    def disconnected(self) -> None:
        """A session ended; the reconnect loop waits its backoff and tries again."""
        self._enter("reconnecting")

    def heartbeat_sent(self) -> None:
        self.heartbeats.inc()

    # -- the supervisor ------------------------------------------------------------------------

    async def watch(self, supervisor: Supervisor) -> None:
        """Follow the supervisor's state changes until cancelled: shards by state, adoptions,
        spawns, failures and transitions into UNHEALTHY. It wakes on ``any_change``; two changes of
        one shard between wake-ups (READY to UNHEALTHY and back within one scheduling tick) count
        as none, which the liveness probe's period (seconds) makes moot. Shards are keyed by object
        (a restarted shard is a new object under the same id), and held while known, so an id()
        is never reused for another shard under our eyes."""
        self.supervisor = supervisor
        last: dict[int, tuple[Shard, schema.ShardState]] = {}
        while True:
            changed = supervisor.any_change
            seen: dict[int, tuple[Shard, schema.ShardState]] = {}
            counts = dict.fromkeys(ENGINE_STATES, 0)
            for shard in supervisor.shards.values():
                state = shard.state
                seen[id(shard)] = (shard, state)
                if state in counts:
                    counts[state] += 1
                before = last.get(id(shard))
                if before is None:
                    if shard.adopted:
                        self.adopted.inc()
                    elif shard.pid:
                        self.spawns.inc()
                previous = before[1] if before is not None else None
                if state is schema.ShardState.FAILED and previous is not schema.ShardState.FAILED:
                    self.failures.inc()
                if state is schema.ShardState.UNHEALTHY and previous is schema.ShardState.READY:
                    self.probe_failures.inc()
            for state, count in counts.items():
                self.engines.labels(state=state.name.lower()).set(count)
            last = seen
            await changed.wait()

    # -- the admin port ------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, object]]:
        """``/healthz``: 200 once the supervisor runs, 503 before (discovery, adoption).

        An unreachable control plane is *not* unhealthy: the agent is doing its job (the engines
        keep serving and it keeps redialing), and a service manager or orchestrator that restarted
        it on that account would cost nothing but a fresh adoption while fixing nothing. The
        session's state is in the body for whoever wants to alert on it."""
        since = datetime.datetime.fromtimestamp(self.since, datetime.UTC).isoformat(timespec="seconds")
        body: dict[str, object] = {
            "status": "ok" if self.supervisor is not None else "starting",
            "node_id": self.node_id,
            "session": self.state,
            "session_since": since.replace("+00:00", "Z"),
        }
        if self.supervisor is not None:
            engines: dict[str, int] = {}
            for shard in self.supervisor.shards.values():
                engines[shard.state.name.lower()] = engines.get(shard.state.name.lower(), 0) + 1
            body["engines"] = engines
        return (200 if self.supervisor is not None else 503), body

    async def _healthz(self, _accept: str) -> Response:
        status, body = self.health()
        return Response(status, "application/json", json.dumps(body).encode() + b"\n")

    async def _metrics(self, accept: str) -> Response:
        body, content_type = await exposition(self.registry, accept)
        return Response(200, content_type, body)

    async def serve(
        self, listen: Listen, *, task_status: trio.TaskStatus[Listen] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve ``/healthz`` and ``/metrics`` on ``listen`` until cancelled (``telemetry.http``)."""
        await serve(listen, {"/healthz": self._healthz, "/metrics": self._metrics}, task_status=task_status)
