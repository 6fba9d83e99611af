"""One log format per process: with ``--log-format json`` (or ``LLMGW_LOG_FORMAT=json``) every line
a process writes, on stdout and stderr alike, is a JSON record, its ready or listening line included
(``telemetry.logs.announce``); in text mode that line stays the plain words scripts match."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_procs import Agent, ControlProcess, free_port, poll, terminate
from tests.test_cli import config_text

REPO = Path(__file__).resolve().parent.parent


def records(log: Path, ready: str) -> list[dict[str, Any]]:
    """Every line of ``log`` up to and including the first whose message holds ``ready``, each
    parsed as JSON (a line that is not one fails the test, naming it)."""
    out: list[dict[str, Any]] = []
    for line in log.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            raise AssertionError(f"{log.name}: a line that is not JSON: {line!r}") from None
        assert isinstance(doc, dict) and {"time", "level", "logger", "message"} <= set(doc), line
        out.append(doc)
        if ready in doc["message"]:
            return out
    raise AssertionError(f"{log.name}: no record saying {ready!r} yet")


def test_every_process_writes_only_json_lines_up_to_its_ready_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_LOG_FORMAT", "json")  # the control plane's and the agent's, inherited
    cp = ControlProcess(tmp_path / "cp", config_text(tmp_path / "state"))
    agent = None
    router_log = tmp_path / "router.log"
    router = None
    try:
        cp.start()  # finds its ready line inside the JSON record
        ready = records(cp.log, "llmgw control plane ready")[-1]
        assert ready["level"] == "info" and ready["logger"] == "llmgw.control"
        assert (ready["agents_port"], ready["api_port"], ready["router_port"]) == (
            cp.agent_port,
            cp.api_port,
            cp.router_port,
        )

        agent = Agent(
            tmp_path / "agents", "gpu01", f"http://127.0.0.1:{cp.agent_port}", "h100x4.toml",
            "ib-a:mlx5_0:1", "127.0.0.1",
        )  # fmt: skip
        agent.start()
        poll("the agent to register", lambda: "registered with the control plane" in agent.log.read_text())
        joined = records(agent.log, "registered with the control plane as gpu01")
        assert joined[-1]["logger"].startswith("llmgw.agent"), joined[-1]

        with router_log.open("wb") as out:
            router = subprocess.Popen(
                [sys.executable, "-m", "router", "--static", f"m=http://127.0.0.1:{free_port()}",
                 "--host", "127.0.0.1", "--port", "0", "--log-format", "json"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            )  # fmt: skip
        poll("the router to listen", lambda: "listening on" in router_log.read_text())
        listening = records(router_log, "llmgw router listening on")[-1]
        # The words scripts match are still in the message, and the port is a field besides.
        m = re.search(r"listening on [^ ]+:(\d+)", listening["message"])
        assert m is not None and int(m.group(1)) == listening["port"] > 0
        assert listening["pid"] == router.pid and listening["relay_pump"] in ("native", "python")
    finally:
        terminate(router)
        if agent is not None:
            terminate(agent.proc)
        cp.terminate()


def test_in_text_mode_the_ready_line_is_the_plain_words(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "router", "--static", f"m=http://127.0.0.1:{free_port()}",
             "--host", "127.0.0.1", "--port", "0"],
            stdout=out, stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
        )  # fmt: skip
    try:
        line = poll("the router to listen", lambda: log.read_text().strip())
        assert re.fullmatch(
            r"llmgw router listening on 127\.0\.0\.1:\d+ \(pid \d+, \w+ relay pump, 1 static routes\)", line
        )
    finally:
        terminate(router)


def test_request_per_line_libraries_are_quiet_unless_debug_is_asked_for() -> None:
    """httpx logs every request at INFO (probes, /metrics scrapes, etcd keepalives): only
    ``--log-level debug`` lets those lines through, and its own warnings always pass."""
    import io
    import logging

    import httpx

    from telemetry.logs import LogSettings, setup_logging

    def requests_logged(level: str) -> str:
        out = io.StringIO()
        setup_logging(LogSettings(level=level), out)
        transport = httpx.MockTransport(lambda request: httpx.Response(200))
        with httpx.Client(transport=transport) as client:
            client.get("http://127.0.0.1:9/metrics")
        logging.getLogger("httpx").warning("a warning of its own")
        return out.getvalue()

    try:
        info = requests_logged("info")
        assert "HTTP Request" not in info and "a warning of its own" in info, info
        assert "HTTP Request: GET http://127.0.0.1:9/metrics" in requests_logged("debug")
    finally:
        setup_logging(LogSettings())
