"""deploy/systemd: the unit files pass ``systemd-analyze verify`` and keep the properties that matter.

The agent's unit must leave engines running when the agent stops (``KillMode=process``), restart
forever, and not hide the GPUs; the example environment file must name only real settings, and an
agent must start from it. ``systemd-analyze`` is skipped where it does not exist (a container
without systemd); everything else runs everywhere.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from agent.config import AgentConfig, load_all

SYSTEMD = Path(__file__).parent.parent / "deploy" / "systemd"
UNITS = ("llmgw-agent.service", "llmgw-control.service")


def directives(unit: str) -> dict[str, list[str]]:
    """Key -> every value it is given (systemd allows a key several times)."""
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def verify(unit_text: str, name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on ``unit_text``, with ExecStart pointing at this environment's
    installed scripts (verify checks that the command exists and is executable)."""
    scripts = Path(sys.executable).parent
    if not (scripts / "llmgw-agent").exists():
        pytest.skip(f"llmgw is not installed in {scripts} (pip install -e .): no llmgw-agent script")
    path = tmp_path / name
    path.write_text(unit_text.replace("/opt/llmgw/bin/", f"{scripts}/"))
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    return subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed here (Debian: apt-get install systemd)",
)
@pytest.mark.parametrize("unit", UNITS)
def test_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    proc = verify((SYSTEMD / unit).read_text(), unit, tmp_path)
    # verify exits 0 on a key it ignores (a typo) and only says so on stderr: both must be clean.
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
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
