"""The router's own configuration (``router.config``): flags > ``LLMGW_ROUTER_*`` > TOML > defaults,
one frozen ``RouterConfig``, and start-up mistakes as one line naming the key and where its value
came from, with exit status 2 (``python -m router`` run as a real process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import control.config
from router.config import (
    ENV_PREFIX,
    FIELD_HELP,
    ConfigError,
    RouterConfig,
    build_parser,
    load,
)
from router.server import Router
from router.stalls import DEFAULT_RESPONSE_TIMEOUT

REPO = Path(__file__).resolve().parent.parent
STATIC = "m=http://127.0.0.1:9"


def router_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m router`` with ``args``, for a mistake it must refuse before listening."""
    return subprocess.run(
        [sys.executable, "-m", "router", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(
        f'static = ["{STATIC}"]\nresponse_timeout = 30\nstream_idle_timeout = 20\nmax_attempts = 5\n'
        'api_keys = ["k1", "k2"]\n'
    )
    env = {f"{ENV_PREFIX}RESPONSE_TIMEOUT": "40", f"{ENV_PREFIX}STREAM_IDLE_TIMEOUT": "25"}
    loaded = load(["--config", str(toml), "--response-timeout", "50", "--reuse-port"], env)
    c = loaded.config
    assert c.response_timeout == 50.0  # flag over variable over file
    assert c.stream_idle_timeout == 25.0  # variable over file
    assert c.max_attempts == 5 and c.api_keys == ("k1", "k2")  # file
    assert c.static == (STATIC,) and c.reuse_port is True
    assert c.eject_base == 10.0 and c.port == 8080  # defaults
    assert loaded.sources["response_timeout"] == "--response-timeout"
    assert loaded.sources["stream_idle_timeout"] == f"{ENV_PREFIX}STREAM_IDLE_TIMEOUT"
    assert loaded.sources["max_attempts"] == f"{toml} line 4"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.port = 1  # type: ignore[misc]


def test_lists_come_from_repeated_flags_or_comma_separated_variables() -> None:
    env = {f"{ENV_PREFIX}API_KEYS": "a,b", f"{ENV_PREFIX}STATIC": f"{STATIC},m=http://127.0.0.1:10"}
    c = load([], env).config
    assert c.api_keys == ("a", "b") and len(c.static) == 2
    c = load(["--static", STATIC, "--api-key", "x", "--api-key", "y"], env).config
    assert c.api_keys == ("x", "y") and c.static == (STATIC,)


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        ([], {}, "no routes: give --control URL"),
        (["--static", STATIC, "--control", "http://127.0.0.1:7070"], {}, "give exactly one of"),
        (["--static", "llama"], {}, "static (from --static): 'llama': expected MODEL=URL"),
        (["--static", STATIC, "--port", "70000"], {}, "port (from --port): must be a port"),
        (
            ["--static", STATIC, "--eject-after", "1.5"],
            {},
            "eject_after (from --eject-after): expected a whole",
        ),
        (
            [],
            {f"{ENV_PREFIX}STATIC": STATIC, f"{ENV_PREFIX}REUSE_PORT": "maybe"},
            "reuse_port (from LLMGW_ROUTER_REUSE_PORT)",
        ),
        (["--static", STATIC], {f"{ENV_PREFIX}RESPONS_TIMEOUT": "1"}, "did you mean 'response_timeout'"),
        (["--control", "cp:7443"], {}, "control (from --control): 'cp:7443' is not the control plane's URL"),
        (
            ["--static", STATIC, "--control-token", "t"],
            {},
            "control_token (from --control-token) applies to --control only",
        ),
        (
            ["--static", STATIC, "--eject-base", "600"],
            {},
            "eject_base (from --eject-base): (600) must not exceed eject_max",
        ),
        (
            ["--control", "https://127.0.0.1:7443", "--control-ca", "/nonexistent/ca.pem"],
            {},
            "control_ca (from --control-ca): /nonexistent/ca.pem is not a readable file",
        ),
        (
            ["--static", STATIC],
            {f"{ENV_PREFIX}METRICS_KEY": "short"},
            "metrics_key (from LLMGW_ROUTER_METRICS_KEY): must be empty or at least 16 characters",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key_and_its_source(
    argv: list[str], env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(argv, env)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_process_exits_2_with_the_file_and_line_of_a_bad_value(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(f'static = ["{STATIC}"]\n\n# the engines are slow\nresponse_timeout = -5\n')
    done = router_cli("--config", str(toml))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"llmgw-router: response_timeout (from {toml} line 4): must be a number of seconds more "
        "than 0, got -5"
    ]
    toml.write_text(f'static = ["{STATIC}"]\nmax_conections = 10\n')
    done = router_cli(env={f"{ENV_PREFIX}CONFIG": str(toml)})
    assert done.returncode == 2
    assert (
        f"max_conections (from {toml} line 2): unknown setting; did you mean 'max_connections'?"
        in done.stderr
    )
    done = router_cli("--static", STATIC, env={f"{ENV_PREFIX}MAX_CONNECTIONS": "lots"})
    assert done.returncode == 2
    assert (
        "max_connections (from LLMGW_ROUTER_MAX_CONNECTIONS): expected a whole number, got 'lots'"
        in done.stderr
    )
    done = router_cli("--static", STATIC, "--no-such-flag")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_a_secret_is_never_echoed_in_an_error() -> None:
    with pytest.raises(ConfigError) as caught:
        load(["--static", STATIC], {f"{ENV_PREFIX}API_KEYS": "", f"{ENV_PREFIX}CONTROL_TOKEN": "sekrit"})
    assert "sekrit" not in str(caught.value)


def test_help_names_every_settings_variable_and_default() -> None:
    text = build_parser().format_help()
    flat = " ".join(text.split())
    for key in attrs.fields_dict(RouterConfig):
        assert key in FIELD_HELP
        assert f"{ENV_PREFIX}{key.upper()}" in flat.replace("- ", "-").replace(" _", "_"), key
    assert f"default {DEFAULT_RESPONSE_TIMEOUT:g})" in flat
    assert "--static MODEL=URL" in text and "--control URL" in text and "--reuse-port" in text


def test_the_router_takes_every_setting_from_the_config() -> None:
    c = RouterConfig(
        api_keys=("k",),
        affinity_chars=64,
        affinity_slack=1,
        max_attempts=2,
        eject_after=5,
        eject_base=1.0,
        eject_max=2.0,
        connect_timeout=0.5,
        response_timeout=7.0,
        stream_idle_timeout=3.0,
        pool_max_idle=8,
        pool_idle_timeout=2.0,
        header_timeout=4.0,
        client_idle_timeout=9.0,
        max_connections=12,
        max_body_bytes=1000,
        relay_coalesce_us=0,
        metrics_key="mk" * 8,
    )
    r = Router(lambda: {}, c)
    assert r.api_keys == (b"k",) and r.metrics_key == b"mk" * 8
    assert (r.affinity_chars, r.policy.slack, r.max_attempts) == (64, 1, 2)
    assert (r.ejection.eject_after, r.ejection.eject_base, r.ejection.eject_max) == (5, 1.0, 2.0)
    assert (r.pool.connect_timeout, r.pool.max_idle, r.pool.idle_timeout) == (0.5, 8, 2.0)
    assert (r.response_timeout, r.stream_idle_timeout, r.max_body_bytes) == (7.0, 3.0, 1000)
    assert r.client_limits == c.client_limits
    assert (r.client_limits.header_timeout, r.client_limits.idle_timeout, r.max_connections) == (4.0, 9.0, 12)


def test_the_control_planes_embedded_router_gets_its_router_keys() -> None:
    cfg = control.config.parse(
        'api_keys = ["sk-1"]\nmetrics_key = "mkmkmkmkmkmkmkmk"\nrouter_coalesce_us = 0\nrouter_response_timeout = 120\n'
        "router_stream_idle_timeout = 7.5\nrouter_header_timeout = 3\nrouter_client_idle_timeout = 30\n"
        "router_max_connections = 99\n",
        "llmgw.toml",
    )
    rc = cfg.router_config
    assert rc.api_keys == ("sk-1",) and rc.metrics_key == "mk" * 8 and rc.relay_coalesce_us == 0
    assert (rc.response_timeout, rc.stream_idle_timeout) == (120.0, 7.5)
    assert (rc.header_timeout, rc.client_idle_timeout, rc.max_connections) == (3.0, 30.0, 99)
