"""deploy/systemd: the unit files pass ``systemd-analyze verify`` and keep the properties that matter.

The agent's unit must leave engines running when the agent stops (``KillMode=process``), restart
forever, and not hide the GPUs; the router's must stop it with SIGTERM and wait longer than its
shutdown grace; the example environment files must name only real settings, and an agent and a
router must start from them. ``systemd-analyze`` comes with Debian's ``systemd`` package, which
``.ci/run`` installs where it is missing; without it these tests fail rather than skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import attrs
import pytest

import router.config
from agent.config import AgentConfig, load_all
from router.config import RouterConfig

REPO = Path(__file__).parent.parent
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = ("llmgw-agent.service", "llmgw-control.service", "llmgw-router.service")
#: Where the units expect the package's console scripts.
INSTALLED_BIN = "/opt/llmgw/bin/"


def directives(unit: str) -> dict[str, list[str]]:
    """Key -> every value it is given (systemd allows a key several times)."""
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def systemd_analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed here (Debian: apt-get install systemd; .ci/run does)")
    return analyze


def verify(unit_text: str, name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on ``unit_text``. verify checks that ExecStart's command exists and
    is executable, so the commands the unit names under /opt/llmgw/bin are made in ``tmp_path``
    (each runs what pyproject.toml's console script of that name runs, with this interpreter) and
    the unit points there: no installed package is needed."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for script in re.findall(r"^ExecStart=" + re.escape(INSTALLED_BIN) + r"([\w-]+)", unit_text, re.M):
        module, function = scripts[script].split(":")
        code = f"import sys; from {module} import {function}; sys.exit({function}())"
        (bin_dir / script).write_text(f"#!/bin/sh\nexec {sys.executable} -c '{code}' \"$@\"\n")
        (bin_dir / script).chmod(0o755)
    path = tmp_path / name
    path.write_text(unit_text.replace(INSTALLED_BIN, f"{bin_dir}/"))
    return subprocess.run(
        [systemd_analyze(), "verify", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("unit", UNITS)
def test_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    text = (SYSTEMD / unit).read_text()
    assert INSTALLED_BIN + unit.removesuffix(".service") in text
    proc = verify(text, unit, tmp_path)
    # verify exits 0 on a key it ignores (a typo) and only says so on stderr: both must be clean.
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_verify_catches_a_mistyped_directive(tmp_path: Path) -> None:
    """The check above is not vacuous: a misspelt key and a bad value are reported."""
    text = (SYSTEMD / "llmgw-agent.service").read_text()
    bad = text.replace("KillMode=process", "KillMode=proces").replace("RestartSec=2", "RestartSecs=2")
    proc = verify(bad, "llmgw-agent.service", tmp_path)
    assert "kill mode" in proc.stderr and "RestartSecs" in proc.stderr, proc.stderr


def test_the_agent_unit_leaves_engines_running_and_gpus_visible() -> None:
    agent = directives("llmgw-agent.service")
    assert agent["KillMode"] == ["process"]  # engines are adopted by the next agent, not killed
    assert agent["Restart"] == ["always"] and agent["StartLimitIntervalSec"] == ["0"]
    assert agent["StateDirectory"] == ["llmgw-agent"]  # the agent's default state_dir
    assert str(AgentConfig(node_id="n", server="http://cp:1").state_dir) == "/var/lib/llmgw-agent"
    for hides_gpus in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "PrivateTmp", "ProtectProc"):
        assert hides_gpus not in agent, hides_gpus
    assert agent["LimitMEMLOCK"] == ["infinity"]
    control = directives("llmgw-control.service")
    assert control["Restart"] == ["always"] and control["StateDirectory"] == ["llmgw-control"]


def test_the_example_environment_names_real_settings_and_an_agent_starts_from_it() -> None:
    env: dict[str, str] = {}
    named: set[str] = set()
    for line in (SYSTEMD / "agent.env.example").read_text().splitlines():
        text = line.lstrip("#").strip()
        key, sep, value = text.partition("=")
        if sep and key.startswith("LLMGW_") and " " not in key:
            named.add(key)
            if not line.startswith("#"):
                env[key] = value
    settings = {f"LLMGW_AGENT_{f.name.upper()}" for f in attrs.fields(AgentConfig)}
    assert named - settings - {"LLMGW_LOG_FORMAT", "LLMGW_LOG_LEVEL"} == set()
    env["LLMGW_AGENT_TOKEN"] = "join-token"
    loaded = load_all([], env, hostname=lambda: "gpu07")
    assert loaded.config.node_id == "gpu07" and loaded.config.metrics_listen == "9101"
    assert loaded.logging.format == "json"


def test_the_router_unit_stops_it_gracefully_within_its_grace() -> None:
    """SIGTERM (the router's graceful stop: the listener closes, streams finish within the shutdown
    grace), and systemd waits longer than that grace before it SIGKILLs."""
    unit = directives("llmgw-router.service")
    assert unit["KillSignal"] == ["SIGTERM"]
    assert unit["Restart"] == ["always"] and unit["StartLimitIntervalSec"] == ["0"]
    assert unit["ExecStart"] == [INSTALLED_BIN + "llmgw-router"]  # reads /etc/llmgw/router.toml
    assert router.config.DEFAULT_CONFIG.parent == Path("/etc/llmgw") and unit["ConfigurationDirectory"] == [
        "llmgw"
    ]
    fields = attrs.fields_dict(RouterConfig)
    # The router's --shutdown-grace (its SIGTERM handling), 30 s by default.
    grace = float(fields["shutdown_grace"].default) if "shutdown_grace" in fields else 30.0
    (stop,) = unit["TimeoutStopSec"]
    assert float(stop) > grace, (stop, grace)
    control = directives("llmgw-control.service")
    for key in ("ProtectSystem", "NoNewPrivileges", "SystemCallFilter", "CapabilityBoundingSet", "User"):
        assert unit[key] == control[key], key  # the same hardening as the control plane's


def test_the_router_example_environment_names_real_settings_and_a_router_starts_from_it() -> None:
    env: dict[str, str] = {}
    named: set[str] = set()
    for line in (SYSTEMD / "router.env.example").read_text().splitlines():
        text = line.lstrip("#").strip()
        key, sep, value = text.partition("=")
        if sep and key.startswith("LLMGW_") and " " not in key:
            named.add(key)
            if not line.startswith("#"):
                env[key] = value
    settings = {router.config.ENV_PREFIX + f.name.upper() for f in attrs.fields(RouterConfig)}
    assert named - settings - {"LLMGW_LOG_FORMAT", "LLMGW_LOG_LEVEL"} == set()
    env["LLMGW_ROUTER_CONTROL_TOKEN"] = "read-token"
    config = router.config.load([], env).config
    assert config.control == "https://cp.example.internal:7443" and config.port == 8080
    assert config.host == "0.0.0.0" and config.log_format == "json"
