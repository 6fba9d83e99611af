"""The agent's admin port (``/healthz``, ``/metrics``) and JSON logs, from a real agent process.

A real control plane and one agent (``fleet_procs.one_node``) whose vLLM is the sim engine; the
agent's port is scraped with httpx and parsed with ``prometheus_client``'s own parser, so a series
that is malformed, missing or never moving fails here. Before these, the agent had no admin port
and logged only text.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import schema
from agent.engines import LaunchContext, ProfileRefused
from agent.metrics import AgentMetrics
from agent.supervise import LivenessProbe, Supervisor, procfs
from telemetry.http import Listen, Response, parse_listen, serve
from telemetry.logs import JsonFormatter, LogSettings, LogSettingsError, log_settings, setup_logging
from tests.fleet_procs import free_port, one_node, poll

# Polled (``apoll``) rather than woken by ``any_change``: the values are set by the metrics watcher,
# another task woken by the same event, which may not have run yet when this one wakes.
from tests.support import apoll as until


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the agent's /metrics, by name and labels."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def healthz(port: int) -> tuple[int, dict[str, object]]:
    response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
    return response.status_code, response.json()


def session_is(port: int, state: str) -> tuple[int, dict[str, object]] | None:
    """/healthz once its session is ``state``; None before (or while the port is not bound yet)."""
    try:
        status, body = healthz(port)
    except httpx.TransportError:
        return None
    return (status, body) if body.get("session") == state else None


def test_a_real_agent_serves_health_and_metrics_that_move(tmp_path: Path) -> None:
    model = f"m{os.getpid()}"
    models = (
        f'[[models]]\nname = "{model}"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
        'env = { LLMGW_SIM_LOAD_SECONDS = "0.2" }\n'
    )
    port = free_port()
    # A port alone: the agent listens on loopback (reached below at 127.0.0.1).
    extra = ("--metrics-listen", str(port), "--log-format", "json")
    with one_node(tmp_path, models, "24600-24699", agent_extra=extra) as (cp, agent):
        status, body = poll(
            "the agent's /healthz says connected",
            lambda: session_is(port, "connected"),
            timeout=60,
        )
        assert status == 200 and body["status"] == "ok" and body["node_id"] == "gpu07", body

        def ready_engine() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            samples = scrape(port)
            return samples if samples[("llmgw_agent_engines", (("state", "ready"),))] == 1 else None

        first = poll("an engine READY in the agent's metrics", ready_engine, timeout=60)
        assert first[("llmgw_agent_session", (("llmgw_agent_session", "connected"),))] == 1
        assert first[("llmgw_agent_session", (("llmgw_agent_session", "reconnecting"),))] == 0
        assert first[("llmgw_agent_engine_spawns_total", ())] == 1
        assert first[("llmgw_agent_engines_adopted_total", ())] == 0
        assert first[("llmgw_agent_probe_failures_total", ())] == 0
        assert first[("process_resident_memory_bytes", ())] > 0
        beats = first[("llmgw_agent_heartbeats_sent_total", ())]
        assert beats >= 1
        # Heartbeats keep going out (every 0.3 s in fleet_procs' agents) and the counter follows.
        poll(
            "the heartbeat counter grows",
            lambda: scrape(port)[("llmgw_agent_heartbeats_sent_total", ())] >= beats + 3,
            timeout=30,
        )
        _, body = healthz(port)
        assert body["engines"] == {"ready": 1}, body

        # The control plane goes away: a session state, not the agent's health.
        cp.terminate()
        status, body = poll(
            "the agent's session reconnecting",
            lambda: session_is(port, "reconnecting"),
            timeout=30,
        )
        assert status == 200 and body["status"] == "ok", body
        samples = scrape(port)
        assert samples[("llmgw_agent_session", (("llmgw_agent_session", "reconnecting"),))] == 1
        assert (
            samples[("llmgw_agent_session_since_seconds", ())]
            > first[("llmgw_agent_session_since_seconds", ())]
        )
        # The next attempt starts after a jittered backoff: it is counted when it starts.
        poll(
            "a second connection attempt counted",
            lambda: scrape(port)[("llmgw_agent_session_attempts_total", ())] >= 2,
            timeout=30,
        )
        assert samples[("llmgw_agent_engines", (("state", "ready"),))] == 1  # engines keep serving

        # Not a route: 404 naming the two that are.
        missing = httpx.get(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert missing.status_code == 404 and "/healthz" in missing.text and "/metrics" in missing.text

    # --log-format json: every line the agent logged is one JSON object with the fields.
    lines = [line for line in agent.log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records), lines[:3]
    assert any(r["message"] == "registered with the control plane as gpu07" for r in records)
    assert all(r["time"].endswith("Z") for r in records)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9100", Listen("127.0.0.1", 9100)),
        (":9100", Listen("127.0.0.1", 9100)),
        ("0.0.0.0:9100", Listen("0.0.0.0", 9100)),
        ("[::1]:9100", Listen("::1", 9100)),
        ("0", Listen("127.0.0.1", 0)),
    ],
)
def test_listen_addresses(text: str, expected: Listen) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("99999", "the port '99999' is not 0-65535"),
        ("host:port", "the port 'port' is not 0-65535"),
        ("::1:9100", "put an IPv6 address in brackets"),
        ("[nothost]:9100", "'nothost' in brackets is not an IPv6 address"),
    ],
)
def test_bad_listen_addresses_say_what_to_write(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_listen(text)
    assert problem in str(info.value)


def test_json_lines_escape_what_they_carry_and_keep_extra_fields() -> None:
    """A message holding a newline and a quote stays one line that parses back to itself; an
    exception's traceback and ``extra=`` fields are fields of the object."""
    out = io.StringIO()
    setup_logging(LogSettings(format="json", level="debug"), out)
    try:
        log = logging.getLogger("llmgw.test")
        log.info('peer said "hi"\nforged line\udcff', extra={"shard_id": "r1-s0", "path": Path("/x")})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
        log.debug("debug shows at debug")
    finally:
        setup_logging(LogSettings())
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    # ASCII only: a stream that encodes to UTF-8 (stderr) cannot choke on the lone surrogate.
    assert all(line.isascii() for line in lines)
    first, second, third = (json.loads(line) for line in lines)
    assert first["message"] == 'peer said "hi"\nforged line\udcff' and first["shard_id"] == "r1-s0"
    assert first["path"] == "/x" and first["level"] == "info" and first["logger"] == "llmgw.test"
    assert second["level"] == "error" and "RuntimeError: boom" in second["exception"]
    assert third["level"] == "debug"


def test_json_formatter_time_is_rfc3339_utc() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", None, None)
    record.created = 0.5
    assert json.loads(JsonFormatter().format(record))["time"] == "1970-01-01T00:00:00.500Z"


def test_log_settings_flags_over_environment_over_defaults() -> None:
    assert log_settings(None, None, {}) == LogSettings("text", "info")
    env = {"LLMGW_LOG_FORMAT": "json", "LLMGW_LOG_LEVEL": "WARNING"}
    assert log_settings(None, None, env) == LogSettings("json", "warning")
    assert log_settings("text", "debug", env) == LogSettings("text", "debug")
    with pytest.raises(
        LogSettingsError, match=r"LLMGW_LOG_LEVEL 'loud' is not a log level; use one of debug"
    ):
        log_settings(None, None, {"LLMGW_LOG_LEVEL": "loud"})
    with pytest.raises(
        LogSettingsError, match=r"--log-format 'xml' is not a log format; use one of text, json"
    ):
        log_settings("xml", None, {})


# ---------------------------------------------------------------------------------------------
# The supervisor's series, from a real supervisor with sim engines in this process


SIM = (sys.executable, "-m", "agent.engines.sim")


def make_supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(
        node_id="cpu01",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        gpus=(),
        launch_context=lambda _: LaunchContext(argv_prefix=SIM, host="127.0.0.1"),
        stop_grace=3,
        poll_interval=0.05,
        liveness=LivenessProbe(period=0.2, timeout=0.2, failures=2),
    )


def sim_spec(shard_id: str, port: int, **profile: object) -> schema.StartShard:
    fields: dict[str, object] = {
        "engine": "sim",
        "model": "org/tiny",
        "served_model_name": "tiny",
        "env": {"LLMGW_SIM_LOAD_SECONDS": "0.2"},
        **profile,
    }
    return schema.StartShard(
        shard_id=shard_id,
        replica_id="r0",
        profile=schema.EngineProfile(**fields),  # type: ignore[arg-type]
        http_port=port,
        ready_timeout_seconds=30,
    )


def value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    assert found is not None, name
    return found


def end_engines(supervisor: Supervisor) -> None:
    for engine in procfs.find_engines(supervisor.owner):
        os.killpg(engine.pid, signal.SIGKILL)


async def test_engine_series_follow_a_real_supervisor(tmp_path: Path) -> None:
    """Spawned, READY, a SIGSTOPped engine's liveness failure (UNHEALTHY, then READY again after
    SIGCONT), a start refused before launch (FAILED), and, in a second supervisor on the same state
    directory (an agent restart), the engine adopted rather than spawned."""
    first = make_supervisor(tmp_path)
    metrics = AgentMetrics("cpu01", "test")
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        nursery.start_soon(metrics.watch, first)
        try:
            shard = await first.start(sim_spec("m-s0", free_port()))
            await until("READY", lambda: value(metrics, "llmgw_agent_engines", state="ready") == 1)
            assert value(metrics, "llmgw_agent_engine_spawns_total") == 1
            assert value(metrics, "llmgw_agent_probe_failures_total") == 0
            os.kill(shard.pid, signal.SIGSTOP)
            await until("a probe failure", lambda: value(metrics, "llmgw_agent_probe_failures_total") == 1)
            assert value(metrics, "llmgw_agent_engines", state="unhealthy") == 1
            os.kill(shard.pid, signal.SIGCONT)
            await until("READY again", lambda: value(metrics, "llmgw_agent_engines", state="ready") == 1)

            with pytest.raises(ProfileRefused):
                await first.start(sim_spec("bad-s0", free_port(), dtype="float7"))
            await until("a FAILED shard", lambda: value(metrics, "llmgw_agent_engine_failures_total") == 1)
            assert value(metrics, "llmgw_agent_engines", state="failed") == 1
            assert value(metrics, "llmgw_agent_engine_spawns_total") == 1  # the refusal spawned nothing
            assert metrics.health()[1]["engines"] == {"ready": 1, "failed": 1}
            nursery.cancel_scope.cancel()  # the agent stops; the engine keeps serving
        except BaseException:
            end_engines(first)
            raise
    second = make_supervisor(tmp_path)
    again = AgentMetrics("cpu01", "test")
    assert again.health()[0] == 503  # no supervisor yet: starting
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        nursery.start_soon(again.watch, second)
        try:
            await until(
                "the adoption counted", lambda: value(again, "llmgw_agent_engines_adopted_total") == 1
            )
            assert value(again, "llmgw_agent_engine_spawns_total") == 0
            assert value(again, "llmgw_agent_engines", state="ready") == 1
            assert again.health()[0] == 200
        finally:
            end_engines(second)
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# The admin port's HTTP server survives peers that misbehave


async def test_admin_port_survives_garbage_oversized_and_silent_peers() -> None:
    async def hello(accept: str) -> Response:
        return Response(200, "text/plain", f"hello {accept or '-'}\n".encode())

    async def raw(port: int, data: bytes) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            out = b""
            with trio.fail_after(15), contextlib.suppress(trio.BrokenResourceError):
                # A reset (the server closed with our excess bytes unread) ends the answer too.
                while chunk := await stream.receive_some(65536):
                    out += chunk
            return out

    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve, Listen("127.0.0.1", 0), {"/hello": hello})
        port = bound.port
        assert port != 0
        silent = await trio.open_tcp_stream("127.0.0.1", port)  # says nothing; holds no one up
        garbage = await raw(port, b"\x16\x03\x01garbage\r\n\r\n")  # a TLS hello, say
        assert garbage == b"" or garbage.startswith(b"HTTP/1.1 400 "), garbage
        huge = b"GET /hello HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 40_000 + b"\r\n\r\n"
        refused = await raw(port, huge)
        assert refused == b"" or refused.startswith(b"HTTP/1.1 431 "), refused  # never served
        post = await raw(port, b"POST /hello HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert post.startswith(b"HTTP/1.1 405 ")
        ok = await raw(port, b"GET /hello?x=1 HTTP/1.1\r\nhost: x\r\naccept: text/plain\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"hello text/plain\n")
        head = await raw(port, b"HEAD /hello HTTP/1.1\r\nhost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        await silent.aclose()
        nursery.cancel_scope.cancel()
