"""The real ``python -m agent`` refuses a start-up mistake with status 2 and one line on stderr.

Each case is a mistake an operator makes on a first try. Before these checks an unknown engine name
was ignored and the agent ran on, and a server URL with no host or a bad port passed the config and
then failed every reconnect with a traceback, forever; a URL without a scheme exited with a heading
and the problem on two lines.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: A refused start reads the config and exits before the event loop: seconds even on a busy host.
#: An agent that runs on instead is killed at this bound and the test fails.
EXIT_WITHIN_S = 30.0


def run_agent(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``python -m agent`` with ``args`` and a state directory in ``tmp_path``; its exit status,
    stderr and how long it took. ``subprocess.run`` kills the agent if it outlives the bound."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_AGENT_")}
    environ.update(env or {})
    argv = [sys.executable, "-m", "agent", "--state-dir", str(tmp_path / "state"), *args]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_WITHIN_S, env=environ)
    return proc.returncode, proc.stderr, time.monotonic() - started


def assert_one_line(code: int, stderr: str, *expected: str) -> None:
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert "Traceback" not in stderr
    for text in expected:
        assert text in stderr, stderr


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ("127.0.0.1:7070", "is not a URL; write SCHEME://HOST:PORT"),
        ("http://cp:99999", "port 99999 is out of range; use 1-65535"),
        ("http://cp:port", "the port 'port' is not a number; give 1-65535"),
        ("http://:7070", "has no host; name the control plane"),
        ("ftp://cp:7070", "the scheme 'ftp' is not one the agent speaks"),
    ],
)
def test_bad_server_url_is_one_line_naming_the_flag(tmp_path: Path, server: str, problem: str) -> None:
    code, stderr, took = run_agent(tmp_path, "--node-id", "gpu07", "--server", server)
    assert_one_line(code, stderr, f"llmgw-agent: server {server!r}", problem, "(server from --server)")
    assert took < EXIT_WITHIN_S


def test_bad_server_url_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    code, stderr, _ = run_agent(tmp_path, "--node-id", "gpu07", env={"LLMGW_AGENT_SERVER": "http://:7070"})
    assert_one_line(code, stderr, "server 'http://:7070' has no host", "(server from LLMGW_AGENT_SERVER)")


def test_unknown_engine_flag_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    code, stderr, _ = run_agent(
        tmp_path, "--node-id", "gpu07", "--server", "http://127.0.0.1:9", "--engines", "vlm=/bin/true"
    )
    assert_one_line(
        code,
        stderr,
        "llmgw-agent: engines: unknown engine 'vlm'; did you mean 'vllm'?",
        "known engines: vllm, sglang, llamacpp, trtllm, sim; name one of them or remove the entry",
        "(engines from --engines)",
    )


def test_unknown_engine_in_the_file_names_its_own_line(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'node_id = "gpu07"\nserver = "http://127.0.0.1:9"\n\n[engines]\n'
        'sim = "python3 -m agent.engines.sim"\nsglan = "python3 -m sglang.launch_server"\n'
    )
    code, stderr, _ = run_agent(tmp_path, "--config", str(config))
    assert_one_line(
        code, stderr, "unknown engine 'sglan'; did you mean 'sglang'?", f"(engines from {config} line 6)"
    )


def test_unknown_flag_is_one_line(tmp_path: Path) -> None:
    code, stderr, _ = run_agent(tmp_path, "--node-id", "gpu07", "--sever", "http://cp:7070")
    assert_one_line(code, stderr, "unrecognized arguments: --sever", "see python -m agent --help")


def test_version_is_the_installed_package_version(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "--version"], capture_output=True, text=True, timeout=EXIT_WITHIN_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"llmgw-agent {importlib.metadata.version('llmgw')}\n"


def test_help_names_each_flag_with_its_variable(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "--help"], capture_output=True, text=True, timeout=EXIT_WITHIN_S
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--heartbeat-interval HEARTBEAT_INTERVAL seconds between heartbeats (env " in text
    assert "LLMGW_AGENT_HEARTBEAT_INTERVAL; default 5)" in text
    assert "--metrics-listen METRICS_LISTEN" in text and "--log-format" in text


def test_bad_log_level_from_the_environment_is_one_line(tmp_path: Path) -> None:
    code, stderr, _ = run_agent(
        tmp_path, "--node-id", "gpu07", "--server", "http://127.0.0.1:9", env={"LLMGW_LOG_LEVEL": "loud"}
    )
    assert_one_line(code, stderr, "llmgw-agent: LLMGW_LOG_LEVEL 'loud' is not a log level; use one of debug")


def test_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    """A port another process holds stops the agent at start, before discovery or any engine."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr, _ = run_agent(
            tmp_path, "--node-id", "gpu07", "--server", "http://127.0.0.1:9", "--metrics-listen", str(port)
        )
    assert_one_line(
        code, stderr, f"llmgw-agent: metrics_listen '{port}': cannot listen (", "pick a free port"
    )
