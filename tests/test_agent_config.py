"""Agent configuration: precedence of flags > env > file > defaults, and errors that name the source."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agent.config import ConfigError, load
from agent.discovery.model import FabricAttachment
from agent.nursery import backoff_delay

BASE = ["--node-id", "gpu07", "--server", "http://cp:7070"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'node_id = "from-file"\nserver = "http://file:1"\nheartbeat_interval = 7\nreconnect_max = 60\n'
        'mgmt_interface = "ib0"\n[labels]\nzone = "a"\n[[fabrics]]\nfabric = "ib-a"\nhca = "mlx5_0"\n',
    )
    cfg = load(
        ["--config", str(path), "--heartbeat-interval", "2"],
        {
            "LLMGW_AGENT_HEARTBEAT_INTERVAL": "3",
            "LLMGW_AGENT_RECONNECT_MAX": "45",
            "LLMGW_AGENT_SERVER": "https://env:2",
        },
    )
    assert cfg.heartbeat_interval == 2.0  # flag
    assert cfg.reconnect_max == 45.0  # env over file
    assert cfg.server == "https://env:2"
    assert cfg.node_id == "from-file" and cfg.mgmt_interface == "ib0"  # file over default
    assert cfg.reconnect_base == 1.0  # default
    assert cfg.labels == {"zone": "a"}
    assert cfg.fabrics == (FabricAttachment("ib-a", "mlx5_0", 1),)


def test_config_path_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, 'node_id = "n"\nserver = "ws://cp:80"\nprotocol = "connect"\n')
    cfg = load([], {"LLMGW_AGENT_CONFIG": str(path)})
    assert cfg.protocol == "connect" and cfg.server == "ws://cp:80"


def test_bad_value_names_key_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'node_id = "n"\nserver = "http://cp:1"\n\nheartbeat_interval = "soon"\n')
    with pytest.raises(ConfigError) as info:
        load(["--config", str(path)], {})
    assert f"heartbeat_interval: invalid value for type, expected float (from {path} line 4)" in str(
        info.value
    )


def test_bad_value_from_env_and_flag_name_their_source() -> None:
    with pytest.raises(
        ConfigError, match=r"heartbeat_interval must be greater than 0.*LLMGW_AGENT_HEARTBEAT_INTERVAL"
    ):
        load(BASE, {"LLMGW_AGENT_HEARTBEAT_INTERVAL": "-1"})
    with pytest.raises(
        ConfigError, match=r"reconnect_base \(50.0\) must not exceed reconnect_max.*--reconnect-base"
    ):
        load([*BASE, "--reconnect-base", "50"], {})
    with pytest.raises(ConfigError, match=r"protocol: expected one of grpc, connect \(from --protocol\)"):
        load([*BASE, "--protocol", "grpx"], {})
    with pytest.raises(ConfigError, match=r"fabrics \(from --fabrics\): expected FABRIC:HCA\[:PORT\]"):
        load([*BASE, "--fabrics", "ib-a"], {})


def test_unknown_keys_are_errors(tmp_path: Path) -> None:
    path = write(tmp_path, 'node_id = "n"\nserver = "http://cp:1"\nheartbeat_intervall = 3\n')
    with pytest.raises(ConfigError, match=rf"heartbeat_intervall \(from {path} line 3\)"):
        load(["--config", str(path)], {})
    with pytest.raises(ConfigError, match="LLMGW_AGENT_BOGUS: unknown setting 'bogus'"):
        load(BASE, {"LLMGW_AGENT_BOGUS": "1"})


def test_required_settings_say_how_to_set_them() -> None:
    with pytest.raises(ConfigError, match=r"node_id: required.*--node-id, LLMGW_AGENT_NODE_ID"):
        load(["--server", "http://cp:1"], {})


def test_backoff_is_jittered_capped_and_spread() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(a, 1.0, 30.0, rng.random()) for a in range(10)]
    steps = [min(30.0, 2.0**a) for a in range(10)]
    assert all(step / 2 <= d <= step for d, step in zip(delays, steps, strict=True))
    # A fleet of 1,000 agents on their 6th attempt does not arrive at one instant.
    fleet = sorted(backoff_delay(5, 1.0, 30.0, rng.random()) for _ in range(1000))
    assert fleet[0] >= 15.0 and fleet[-1] <= 30.0 and fleet[-1] - fleet[0] > 10.0
