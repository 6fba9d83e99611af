"""The command lines as an operator meets them: ``python -m control`` with a mistaken config exits 2 with
one line naming the setting, its file and line, and what to do (never a traceback); ``ctl`` takes its
global options on either side of the subcommand and exits 0, 1 (the operation failed) or 2 (usage)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet_procs import ControlProcess, free_port, poll

MODEL = '[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'


def start_control(
    config: Path, timeout: float = 30, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run the control plane on ``config``; a mistake must end it at once (today's code served on
    several of these and hit this bound, which kills it)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "control", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def config_text(
    state_dir: Path, *, agents: str = "", api: str = "127.0.0.1:0", router: str = "127.0.0.1:0"
) -> str:
    agents = agents or f"127.0.0.1:{free_port()}"
    return f'state_dir = "{state_dir}"\n[listen]\nagents = "{agents}"\napi = "{api}"\nrouter = "{router}"\n'


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a start-up refused with status 2."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_malformed_listen_address_is_one_line_with_key_and_line(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(tmp_path / "state", router="8080") + MODEL)
    line = one_line(start_control(config))
    assert line == (
        f"llmgw-control: listen.router: '8080' has no host; write HOST:PORT, e.g. '0.0.0.0:8080' "
        f"(every interface) or '127.0.0.1:8080' (this machine only) ({config} line 5)"
    )


def test_rule_violations_name_their_own_lines(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.toml"
    text = (
        config_text(tmp_path / "state")
        + "\n[liveness]\nunreachable_after = 15.0\n\n# no node is lost this way\nlost_after = -8.0\n"
        + MODEL
    )
    assert text.splitlines()[10] == "lost_after = -8.0"
    config.write_text(text)
    assert one_line(start_control(config)) == (
        f"llmgw-control: liveness.lost_after must be greater than 0, got -8.0 ({config} line 11)"
    )
    config.write_text("reconcile_interval = -1\n" + config_text(tmp_path / "state") + MODEL)
    assert one_line(start_control(config)) == (
        f"llmgw-control: reconcile_interval must be greater than 0, got -1.0 ({config} line 1)"
    )


def test_an_unknown_engine_names_the_closest_known_one(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(tmp_path / "state") + MODEL.replace('"sim"', '"sglng"'))
    assert one_line(start_control(config)) == (
        "llmgw-control: models[0].profile.engine: unknown engine 'sglng'; did you mean 'sglang'? "
        f"known engines: vllm, sglang, llamacpp, trtllm, sim ({config} line 9)"
    )


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program listens on (this test process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(("key", "line"), [("agents", 3), ("api", 4), ("router", 5)])
def test_a_port_in_use_names_the_listener_and_address(
    tmp_path: Path, held_port: int, key: str, line: int
) -> None:
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(tmp_path / "state", **{key: f"127.0.0.1:{held_port}"}) + MODEL)
    assert one_line(start_control(config)) == (
        f"llmgw-control: listen.{key}: 127.0.0.1:{held_port} is in use: another process holds port "
        f"{held_port} ({config} line {line}); stop it (`ss -ltnp 'sport = :{held_port}'` names it) "
        "or choose another port"
    )


def test_a_port_in_use_by_a_router_only_run(tmp_path: Path, held_port: int) -> None:
    config = tmp_path / "llmgw.toml"
    config.write_text(
        f'[listen]\nrouter = "127.0.0.1:{held_port}"\n[[endpoints]]\nmodel = "m"\nurl = "http://127.0.0.1:9"\n'
    )
    line = one_line(start_control(config))
    assert line.startswith(f"llmgw-control: listen.router: 127.0.0.1:{held_port} is in use"), line


def test_an_unwritable_state_dir_is_refused_before_serving(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(blocker / "state") + MODEL)
    assert one_line(start_control(config)) == (
        f"llmgw-control: state_dir: cannot write {blocker / 'state'}: Not a directory ({config} line 1); "
        f"make {blocker / 'state'} a directory this user (uid {os.geteuid()}) can write, or set state_dir to one"
    )


def test_a_read_only_state_dir_is_refused_before_serving(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o500)
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(state) + MODEL)
    # Root writes through directory permissions (CAP_DAC_OVERRIDE): as root, run the control plane
    # without that capability (util-linux's setpriv), as a service hardened that way would run.
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search") if os.geteuid() == 0 else ()
    line = one_line(start_control(config, prefix=prefix))
    assert line.startswith(f"llmgw-control: state_dir: cannot write {state}/.llmgw-write-test-"), line
    assert "Permission denied" in line and f"({config} line 1)" in line


@pytest.fixture
def control(tmp_path: Path) -> Iterator[ControlProcess]:
    cp = ControlProcess(tmp_path / "cp", config_text(tmp_path / "state") + MODEL)
    cp.start()
    try:
        yield cp
    finally:
        cp.terminate()


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "control", "ctl", *args], capture_output=True, text=True, timeout=60
    )


def test_ctl_global_options_go_before_or_after_the_subcommand(control: ControlProcess) -> None:
    api = f"http://127.0.0.1:{control.api_port}"
    for argv in (
        ["--api", api, "--json", "nodes"],
        ["--api", api, "nodes", "--json"],
        ["nodes", "--json", "--api", api],
        ["--json", "nodes", f"--api={api}"],
    ):
        result = ctl(*argv)
        assert result.returncode == 0, (argv, result.stderr)
        assert json.loads(result.stdout) == [], argv
    result = ctl("replicas", "--api", api)
    assert result.returncode == 0 and result.stdout.startswith("REPLICA"), result
    # The model is placed nowhere (no agents), and why says so, with --json after its argument.
    result = ctl("why", "m", "--json", "--api", api)
    assert result.returncode == 0 and json.loads(result.stdout)["model"] == "m", result


def test_ctl_a_failed_operation_is_status_1_naming_the_url(control: ControlProcess) -> None:
    api = f"http://127.0.0.1:{control.api_port}"
    result = ctl("why", "nosuch", "--api", api)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"ctl: GET {api}/api/why/nosuch: HTTP 404: no model 'nosuch' in the catalog; models: m"
    ]


def test_ctl_an_unreachable_api_is_status_1_naming_the_url() -> None:
    api = f"http://127.0.0.1:{free_port()}"
    result = ctl("nodes", "--api", api)
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"ctl: cannot reach the control plane: GET {api}/api/nodes: "), lines[0]
    assert lines[0].endswith("is it running, and is --api (or LLMGW_API) its admin API address?")


def test_ctl_usage_mistakes_are_status_2() -> None:
    for argv, says in [
        (["--api", "127.0.0.1:7080", "nodes"], "--api '127.0.0.1:7080' is not the admin API's URL"),
        (["nodes", "--api", "127.0.0.1:7080"], "--api '127.0.0.1:7080' is not the admin API's URL"),
        (["nodes", "--jsn"], "unrecognized arguments: --jsn"),
        ([], "the following arguments are required"),
        (["nodez"], "invalid choice: 'nodez'"),
        (["logs", "s", "--lines", "ten"], "invalid int value: 'ten'"),
    ]:
        result = ctl(*argv)
        assert result.returncode == 2 and says in result.stderr, (argv, result)
        assert "Traceback" not in result.stderr


def test_ctl_token_file_mistakes_are_status_2_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for argv, says in [
        (
            ["nodes", "--token-file", str(tmp_path / "nosuch")],
            f"--token-file {tmp_path / 'nosuch'}: cannot read it",
        ),
        (["--token-file", str(empty), "nodes"], f"--token-file {empty} is empty"),
        (["nodes", "--cacert", str(tmp_path / "nosuch.pem")], "No such file"),
    ]:
        result = ctl(*argv)
        assert result.returncode == 2 and says in result.stderr, (argv, result)
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


def test_ctl_sends_the_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    """``ctl`` against an API with tokens: from ``LLMGW_API_TOKEN``, from ``--token-file`` (which
    wins), and without one a 401 that says where a token goes."""
    token = "t" * 24
    cp = ControlProcess(
        tmp_path / "cp",
        config_text(tmp_path / "state") + f'[api]\nread_tokens = ["{token}"]\n' + MODEL,
    )
    cp.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "LLMGW_API_TOKEN"}
        argv = [*cp.ctl_argv(), "nodes", "--json"]
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr and "--token-file" in refused.stderr
        from_env = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env={**env, "LLMGW_API_TOKEN": token}
        )
        assert from_env.returncode == 0 and json.loads(from_env.stdout) == [], from_env.stderr
        token_file = tmp_path / "api.token"
        token_file.write_text(f"{token}\n")
        from_file = subprocess.run(
            [*argv, "--token-file", str(token_file)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "LLMGW_API_TOKEN": "w" * 24},
        )
        assert from_file.returncode == 0, from_file.stderr
    finally:
        cp.terminate()


def test_an_admin_api_certificate_that_cannot_be_loaded_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.toml"
    tls = f'[api.tls]\ncert = "{tmp_path / "nosuch.pem"}"\nkey = "{tmp_path / "nosuch.key"}"\n'
    config.write_text(config_text(tmp_path / "state") + tls + MODEL)
    line = one_line(start_control(config))
    assert line == (
        f"llmgw-control: api.tls.cert: cannot read {tmp_path / 'nosuch.pem'}: No such file or directory "
        f"({config} line 7)"
    )
    # Files that are there but are no certificate: the whole [api.tls] table is named.
    (tmp_path / "nosuch.pem").write_text("not a certificate\n")
    (tmp_path / "nosuch.key").write_text("not a key\n")
    line = one_line(start_control(config))
    assert line.startswith("llmgw-control: api.tls: cannot load the admin API's certificate"), line
    assert f"({config} line 6)" in line, line


def test_the_control_plane_logs_json_lines_and_refuses_an_unknown_level(tmp_path: Path) -> None:
    """``--log-format json`` (telemetry.logs) on ``python -m control``: every log line an object with
    the time, level, logger and message; a level that is not one is status 2 in one line."""
    config = tmp_path / "llmgw.toml"
    config.write_text(config_text(tmp_path / "state") + MODEL)
    bad = subprocess.run(
        [sys.executable, "-m", "control", "--config", str(config), "--log-level", "loud"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert one_line(bad) == (
        "llmgw-control: --log-level 'loud' is not a log level; use one of debug, info, warning, error, critical"
    )
    log = tmp_path / "control.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "control", "--config", str(config), "--log-format", "json"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The warning about an API without tokens is logged at every such start.
        poll("the no-tokens warning", lambda: "no tokens in [api]" in log.read_text(), timeout=60)
        poll("the ready line", lambda: "llmgw control plane ready" in log.read_text(), timeout=60)
    finally:
        proc.terminate()
        proc.wait(30)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    warning = next(r for r in records if "no tokens in [api]" in r["message"])
    assert warning["level"] == "warning" and warning["logger"] == "llmgw.control.api"
    assert warning["time"].endswith("Z"), warning
    # Nothing was written as text, the ready line (stdout) included: one format per process.
    others = [line for line in log.read_text().splitlines() if not line.startswith("{")]
    assert others == [], others
    assert any(r["message"].startswith("llmgw control plane ready") for r in records), records
