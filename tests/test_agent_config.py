"""Agent configuration: precedence of flags > env > file > defaults, and errors that name the source."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest

from agent.config import FIELD_HELP, AgentConfig, ConfigError, build_parser, load, load_all, server_problem
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
    with pytest.raises(ConfigError, match=r"server: required.*--server, LLMGW_AGENT_SERVER"):
        load(["--node-id", "gpu07"], {})


def test_node_id_defaults_to_the_host_name() -> None:
    """No node id anywhere: the host name, as kubelet names its node; one given anywhere wins."""
    loaded = load_all(["--server", "http://cp:1"], {}, hostname=lambda: "gpu-host-07.dc1")
    assert loaded.config.node_id == "gpu-host-07.dc1"
    assert loaded.sources["node_id"].startswith("the host name")
    given = load_all(["--server", "http://cp:1"], {"LLMGW_AGENT_NODE_ID": "n1"}, hostname=lambda: "h")
    assert given.config.node_id == "n1"


@pytest.mark.parametrize("hostname", ["", "-leading-dash", "has space", "x" * 200])
def test_a_host_name_that_is_no_node_id_says_how_to_name_the_node(hostname: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_all(["--server", "http://cp:1"], {}, hostname=lambda: hostname)
    text = str(info.value)
    assert text.startswith("node_id: not set, and the host name ") and "cannot stand in for it" in text
    assert "give --node-id, LLMGW_AGENT_NODE_ID or node_id = ... in the file" in text
    assert "\n" not in text and len(text) < 400


def test_every_setting_has_help_naming_its_variable_and_default() -> None:
    """``--help`` is generated from the fields: every one has a line, with its real variable."""
    text = " ".join(build_parser().format_help().split())
    for field in attrs.fields(AgentConfig):
        flag = "--" + field.name.replace("_", "-")
        assert f"{flag} {field.name.upper()}" in text
        assert f"(env LLMGW_AGENT_{field.name.upper()}; default " in text
    for line in ("default 5)", "default 8000-8999)", "default true)", "default the host name)"):
        assert line in text
    assert "--log-format" in text and "LLMGW_LOG_FORMAT" in text and "LLMGW_LOG_LEVEL" in text
    assert set(FIELD_HELP) == {f.name for f in attrs.fields(AgentConfig)}


def test_log_settings_come_with_the_config() -> None:
    loaded = load_all([*BASE, "--log-level", "debug"], {"LLMGW_LOG_FORMAT": "json"})
    assert (loaded.logging.format, loaded.logging.level) == ("json", "debug")
    with pytest.raises(ConfigError, match="LLMGW_LOG_FORMAT 'yaml' is not a log format"):
        load_all(BASE, {"LLMGW_LOG_FORMAT": "yaml"})


def test_metrics_listen_is_checked_with_its_source(tmp_path: Path) -> None:
    assert load([*BASE, "--metrics-listen", "9100"], {}).metrics_listen == "9100"
    path = write(tmp_path, "metrics_listen = 9101\n")  # a port alone, as TOML writes a number
    assert load([*BASE, "--config", str(path)], {}).metrics_listen == "9101"
    with pytest.raises(ConfigError) as info:
        load(BASE, {"LLMGW_AGENT_METRICS_LISTEN": "localhost:http"})
    assert "metrics_listen 'localhost:http': the port 'http' is not 0-65535" in str(info.value)
    assert "(metrics_listen from LLMGW_AGENT_METRICS_LISTEN)" in str(info.value)


def test_backoff_is_jittered_capped_and_spread() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(a, 1.0, 30.0, rng.random()) for a in range(10)]
    steps = [min(30.0, 2.0**a) for a in range(10)]
    assert all(step / 2 <= d <= step for d, step in zip(delays, steps, strict=True))
    # A fleet of 1,000 agents on their 6th attempt does not arrive at one instant.
    fleet = sorted(backoff_delay(5, 1.0, 30.0, rng.random()) for _ in range(1000))
    assert fleet[0] >= 15.0 and fleet[-1] <= 30.0 and fleet[-1] - fleet[0] > 10.0


@pytest.mark.parametrize(
    "server",
    [
        "http://cp:7070",
        "https://cp.example",
        "ws://[::1]:80/agent",
        "wss://gpu_gw.internal:443",
        "HTTP://cp:1",
    ],
)
def test_server_urls_the_transport_opens_are_accepted(server: str) -> None:
    assert server_problem(server) == ""
    assert load(["--node-id", "n", "--server", server], {}).server == server


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        (
            "cp:7070",
            "'cp:7070' is not a URL; write SCHEME://HOST:PORT with scheme http, https, ws, wss, "
            "e.g. 'http://cp:7070'",
        ),
        ("http://cp:0", "port 0 is out of range; use 1-65535"),
        ("http://cp:", "gives no port; add one (1-65535) or drop the ':'"),
        ("http://[::1", "the '[' of an IPv6 host is never closed"),
        ("http://[cp]:7070", "'cp' in brackets is not an IPv6 address"),
        ("http://c p:7070", "'c p' is neither an IP address nor a host name"),
    ],
)
def test_server_url_problems_say_what_to_write(server: str, problem: str) -> None:
    assert problem in server_problem(server)
    with pytest.raises(ConfigError) as info:
        load(["--node-id", "n"], {"LLMGW_AGENT_SERVER": server})
    assert str(info.value) == f"server {server_problem(server)} (server from LLMGW_AGENT_SERVER)"


def test_one_problem_is_one_line_several_are_listed_under_a_heading() -> None:
    with pytest.raises(ConfigError) as info:
        load([*BASE, "--protocol", "grpx"], {})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load([*BASE, "--protocol", "grpx", "--heartbeat-interval", "soon"], {})
    assert str(info.value).splitlines() == [
        "2 problems in the agent configuration:",
        "  heartbeat_interval: invalid value for type, expected float (from --heartbeat-interval)",
        "  protocol: expected one of grpc, connect (from --protocol)",
    ]


def test_an_engine_entry_is_reported_at_its_own_line_unless_a_flag_replaced_the_table(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, 'node_id = "n"\nserver = "http://cp:1"\n[engines]\nsim = "x"\n"llama.cpp" = "y"\n')
    with pytest.raises(ConfigError) as info:
        load(["--config", str(path)], {})
    assert str(info.value) == (
        "engines: unknown engine 'llama.cpp'; did you mean 'llamacpp'? known engines: vllm, sglang, "
        f"llamacpp, trtllm, sim; name one of them or remove the entry (engines from {path} line 5)"
    )
    with pytest.raises(ConfigError, match=r"unknown engine 'trtlm'.*\(engines from --engines\)$"):
        load(["--config", str(path), "--engines", "trtlm=x"], {})
    inline = write(tmp_path, 'node_id = "n"\nserver = "http://cp:1"\nengines = { vllm = "v", slang = "s" }\n')
    with pytest.raises(
        ConfigError, match=rf"'slang'; did you mean 'sglang'.*\(engines from {inline} line 3\)"
    ):
        load(["--config", str(inline)], {})
    assert load(["--config", str(path), "--engines", "sim=z"], {}).engines == {"sim": "z"}


def test_verify_listener_is_on_by_default_and_a_boolean_everywhere(tmp_path: Path) -> None:
    assert load(BASE, {}).verify_listener is True
    assert load([*BASE, "--verify-listener", "false"], {}).verify_listener is False
    assert load(BASE, {"LLMGW_AGENT_VERIFY_LISTENER": "no"}).verify_listener is False
    path = write(tmp_path, "verify_listener = false\n")
    assert load(["--config", str(path), *BASE], {}).verify_listener is False
    with pytest.raises(ConfigError) as err:
        load([*BASE, "--verify-listener", "maybe"], {})
    assert "verify_listener (from --verify-listener): expected true or false, got 'maybe'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load(["--config", str(write(tmp_path, 'verify_listener = "off"\n')), *BASE], {})
    assert "verify_listener" in str(err.value) and "true or false" in str(err.value)


def test_settings_timeout_reaches_the_stream_options() -> None:
    from agent.nursery import stream_options

    assert stream_options(load(BASE, {})).settings_timeout == 5.0
    config = load([*BASE, "--settings-timeout", "1.5"], {})
    assert stream_options(config).settings_timeout == 1.5
    with pytest.raises(ConfigError) as err:
        load(BASE, {"LLMGW_AGENT_SETTINGS_TIMEOUT": "0"})
    assert "settings_timeout" in str(err.value) and "LLMGW_AGENT_SETTINGS_TIMEOUT" in str(err.value)


def test_several_control_planes_are_tried_in_order_and_each_url_is_checked() -> None:
    cfg = load(["--node-id", "n", "--server", "http://cp1:7070, https://cp2:7443"], {})
    assert cfg.servers == ("http://cp1:7070", "https://cp2:7443")
    with pytest.raises(ConfigError, match=r"server \(URL 2 of 2\) 'cp2:7443' is not a URL"):
        load(["--node-id", "n", "--server", "http://cp1:7070,cp2:7443"], {})
