"""``ctl`` as an operator meets it, run as a subprocess against a real control plane and a real
agent whose engines are the simulator: ``get`` with kubectl's output forms and global options
anywhere, ``--watch``, ``describe``, ``logs -f`` and ``--previous`` across a real engine restart,
help, version and exit codes. Plus the log-file functions behind ``-f`` and ``--previous``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.supervise import logfiles
from tests.fleet_procs import Agent, ControlProcess, free_port, poll, sim_version

PORTS = "25300-25399"
TAG = f"c{os.getpid()}"
CHAT, CRASH, HUGE = f"chat-{TAG}", f"crash-{TAG}", f"huge-{TAG}"
SIM = 'engine = "sim"\nmodel = "m"\nenv = { LLMGW_SIM_LOAD_SECONDS = "0.2" }'


def models() -> str:
    return (
        f'[[models]]\nname = "{CHAT}"\n[models.profile]\n{SIM}\n'
        f'[[models]]\nname = "{CRASH}"\n[models.profile]\n{SIM}\n'
        # Eight GPUs on a node that has none: never placed, and the reason says so.
        f'[[models]]\nname = "{HUGE}"\n[models.gpus]\ncount = 8\n[models.profile]\n{SIM}\n'
    )


class Node:
    """One control plane (restarts after 0.5 s, not kubelet's 10) and one CPU-only sim agent."""

    def __init__(self, tmp: Path) -> None:
        self.cp = ControlProcess(
            tmp / "cp",
            f'state_dir = "{tmp / "cp" / "state"}"\nreconcile_interval = 0.3\nbackoff_initial = 0.5\n'
            f'[listen]\nagents = "127.0.0.1:{free_port()}"\napi = "127.0.0.1:0"\nrouter = "127.0.0.1:0"\n'
            f'[engines]\nports = "{PORTS}"\n{models()}',
        )
        self.cp.start()
        self.api = f"http://127.0.0.1:{self.cp.api_port}"
        self.agent = Agent(
            tmp / "agents",
            "gpu07",
            f"http://127.0.0.1:{self.cp.agent_port}",
            None,
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", PORTS, "--engines", f"vllm={sys.executable} -m agent.engines.sim"),
        )
        self.agent.start()

    def shard(self, model: str) -> dict[str, Any]:
        """The model's one shard, once it is ready."""

        def ready() -> dict[str, Any] | None:
            for r in httpx.get(f"{self.api}/api/replicas", timeout=15).json():
                if r["model"] == model and r["state"] == "ready":
                    return dict(r["shards"][0])
            return None

        return dict(poll(f"{model} ready", ready, timeout=90))

    def stop(self) -> None:
        self.cp.terminate()
        self.agent.stop_all()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("ctl"))
    try:
        n.shard(CHAT)
        n.shard(CRASH)
        yield n
    finally:
        n.stop()


def ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "control", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
    )


class Running:
    """A ``ctl`` that runs until told to stop (``-w``, ``-f``), its output collected as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control", "ctl", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        self.reader = threading.Thread(target=lambda: self.out.extend(iter(stdout.readline, "")), daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(list(self.out))

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C, as a person ends a watch: the exit status and stderr."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(10)
        assert self.proc.stderr is not None
        return self.proc.returncode, self.proc.stderr.read()


def header_and_rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = stdout.strip().splitlines()
    return lines[0].split(), [line.split() for line in lines[1:]]


def columns(stdout: str) -> list[dict[str, str]]:
    """Each row as {HEADER: cell}, cut where the header's columns start: aligned columns are the
    contract (a cell may hold spaces, as REASON does)."""
    lines = stdout.rstrip("\n").splitlines()
    found = list(re.finditer(r"\S+", lines[0]))
    names, starts = [m.group() for m in found], [m.start() for m in found]
    ends = [*starts[1:], None]
    return [{n: line[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)} for line in lines[1:]]


# -- get -----------------------------------------------------------------------------------------


def test_get_nodes_columns_wide_json_and_name(node: Node) -> None:
    result = ctl("get", "nodes", "--api", node.api)
    assert result.returncode == 0, result.stderr
    header, rows = header_and_rows(result.stdout)
    assert header == ["NAME", "STATUS", "GPUS", "SHARDS", "AGE"]
    assert rows[0][:4] == ["gpu07", "ready", "0/0", "2"], rows
    wide = ctl("--api", node.api, "get", "nodes", "-o", "wide")
    assert wide.returncode == 0, wide.stderr
    header, rows = header_and_rows(wide.stdout)
    assert header == [
        "NAME",
        "STATUS",
        "GPUS",
        "SHARDS",
        "AGE",
        "GPU",
        "FABRICS",
        "ADDRESS",
        "AUTH",
        "ENGINES",
        "REASON",
    ]
    (row,) = columns(wide.stdout)
    assert [row[c] for c in ("GPU", "FABRICS", "ADDRESS", "AUTH")] == ["-", "ib-a", "127.0.0.1", "join token"]
    assert row["REASON"].startswith("registered"), row
    assert f"vllm={sim_version()},sim={sim_version()}" in wide.stdout
    # -o json and --json anywhere: before the verb, between verb and kind, at the end.
    for argv in (
        ["-o", "json", "get", "nodes", "--api", node.api],
        ["get", "-o", "json", "nodes", "--api", node.api],
        ["get", "nodes", f"--api={node.api}", "-ojson"],
        ["--json", "get", "nodes", "--api", node.api],
        ["get", "nodes", "--output=json", "--api", node.api],
    ):
        result = ctl(*argv)
        assert result.returncode == 0, (argv, result.stderr)
        assert [n["node_id"] for n in json.loads(result.stdout)] == ["gpu07"], argv
    names = ctl("get", "no", "-o", "name", "--api", node.api)
    assert names.returncode == 0 and names.stdout == "node/gpu07\n", names


def test_get_replicas_and_models(node: Node) -> None:
    chat = node.shard(CHAT)
    result = ctl("get", "replicas", "--api", node.api)
    assert result.returncode == 0, result.stderr
    header, rows = header_and_rows(result.stdout)
    assert header == ["NAME", "MODEL", "STATUS", "READY", "NODES"]
    row = next(r for r in rows if r[1] == CHAT)
    assert row[2:] == ["ready", "1/1", "gpu07"], rows

    def wide_row() -> tuple[list[str], list[str]] | None:
        wide = ctl("get", "replicas", "-o", "wide", "--api", node.api)
        header, rows = header_and_rows(wide.stdout)
        row = next(r for r in rows if r[1] == CHAT)
        # Once the agent has two samples of the idle engine: its rate is known too, and no prefix
        # was looked up in the interval (the hit rate is unknown then, not 0).
        idle = row[10:12] == ["0", "0"] and row[12].isdigit() and row[13:] == ["-", "0.0"]
        return (header, row) if idle else None

    header, row = poll("the idle engine's load in get replicas -o wide", wide_row, timeout=30)
    assert header[5:] == [
        "GPUS",
        "PIDS",
        "ENGINE",
        "VERSION",
        "PORTS",
        "RUNNING",
        "WAITING",
        "KV%",
        "HIT%",
        "TOK/S",
    ]
    assert row[5:10] == ["gpu07:-", str(chat["pid"]), "sim", row[8], str(chat["port"])], row
    assert row[8] != "-"  # the node's sim version
    models = ctl("get", "models", "--api", node.api)
    assert models.returncode == 0, models.stderr
    header, rows = header_and_rows(models.stdout)
    assert header == ["NAME", "READY", "PLACED", "WANTED"]
    by_name = {r[0]: r for r in rows}
    assert by_name[CHAT] == [CHAT, "1/1", "1", "1"]
    assert by_name[HUGE] == [HUGE, "0/1", "0", "1"]
    wide = ctl("get", "models", HUGE, "-o", "wide", "--api", node.api)
    assert wide.returncode == 0, wide.stderr
    lines = wide.stdout.splitlines()
    assert lines[0].split()[4:] == [
        "ENGINE",
        "SERVED-AS",
        "GPUS/SHARD",
        "NODES/REPLICA",
        "GENERATION",
        "SOURCE",
        "REVISION",
        "ROLLOUT",
        "REASON",
    ]
    (huge,) = columns(wide.stdout)
    assert [huge["ENGINE"], huge["SERVED-AS"], huge["GPUS/SHARD"]] == ["sim", HUGE, "8"], huge
    assert [huge["GENERATION"], huge["SOURCE"]] == ["1", "file"], huge
    # Its template revision (control.rollout), and a rollout that cannot finish without GPUs.
    assert len(huge["REVISION"]) == 10 and huge["ROLLOUT"] not in ("-", "complete"), huge
    assert huge["REASON"] == "0/1 nodes are available: 1 insufficient free GPUs (need 8, have 0 free).", huge
    doc = json.loads(ctl("get", "models", "--api", node.api, "--json").stdout)
    assert {m["model"]: m["replicas_ready"] for m in doc} == {CHAT: 1, CRASH: 1, HUGE: 0}
    missing = ctl("get", "models", "nosuch", "--api", node.api)
    assert missing.returncode == 1 and "no model 'nosuch'" in missing.stderr


def test_get_watch_prints_again_only_when_a_row_changes(node: Node) -> None:
    watch = Running("get", "nodes", "-w", "--api", node.api)
    try:
        poll("the first table", lambda: "gpu07" in watch.text())
        assert ctl("cordon", "gpu07", "--api", node.api).returncode == 0
        poll("the cordoned row", lambda: "ready,cordoned" in watch.text())
        assert ctl("uncordon", "gpu07", "--api", node.api).returncode == 0
        poll("the uncordoned row", lambda: watch.text().count("NAME") == 3)
    finally:
        ctl("uncordon", "gpu07", "--api", node.api)
        status, stderr = watch.interrupt()
    assert status == 0 and "Traceback" not in stderr, stderr
    # Three tables, one per change: the AGE column, which moves every second, prints nothing.
    tables = watch.text().strip().split("\n\n")
    assert len(tables) == 3, watch.text()
    assert [t.splitlines()[1].split()[1] for t in tables] == ["ready", "ready,cordoned", "ready"]


# -- describe ------------------------------------------------------------------------------------


def test_describe_node_and_model(node: Node) -> None:
    chat = node.shard(CHAT)
    result = ctl("describe", "node", "gpu07", "--api", node.api)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("Name:          gpu07\nState:         ready for "), out
    assert "Fabrics:       ib-a" in out
    assert f"  {chat['shard_id']}" in out and CHAT in out  # its shards, by id and model
    events = out.split("Events:\n", 1)[1]
    # The control plane's event log: the node's liveness, the commands sent, the shard's states.
    (event,) = [e for e in columns(events) if e["OBJECT"] == chat["shard_id"] and e["KIND"] == "command"]
    assert event["CHANGE"] == "start" and event["REASON"] == "StartShard sent", events
    assert any(
        e["OBJECT"] == chat["shard_id"] and e["CHANGE"] == "starting -> ready" for e in columns(events)
    ), events
    assert columns(events)[0]["KIND"] == "node" and columns(events)[0]["CHANGE"] == "ready", events
    model = ctl("describe", "model", CHAT, "--api", node.api)
    assert model.returncode == 0, model.stderr
    assert "Replicas:      1 ready, 1 placed, 1 wanted" in model.stdout
    assert f"    {chat['shard_id']}  ready  on gpu07 GPUs - pid {chat['pid']}  {chat['url']}" in model.stdout
    assert "Generation:    1 (source file)" in model.stdout
    assert "Rollout:       complete, revision " in model.stdout
    assert ": 1/1 updated and ready, 0 old" in model.stdout, model.stdout
    # This model's own events (model/NAME: catalog changes, rollouts) and its shards' only.
    objects = {e["OBJECT"] for e in columns(model.stdout.split("Events:\n", 1)[1])}
    assert chat["shard_id"] in objects and objects <= {chat["shard_id"], f"model/{CHAT}"}, model.stdout
    huge = ctl("describe", "model", HUGE, "--api", node.api)
    assert huge.returncode == 0, huge.stderr
    assert "Replicas:      0 ready, 0 placed, 1 wanted" in huge.stdout
    assert "Cannot run:" in huge.stdout and "    gpu07: " in huge.stdout
    doc = json.loads(ctl("describe", "model", HUGE, "-o", "json", "--api", node.api).stdout)
    assert doc["model"] == HUGE and doc["unplaced"] and doc["placed"] == []
    for argv, says in (
        (["describe", "node", "gpu99"], "no node 'gpu99'"),
        (["describe", "model", "nosuch"], "no model 'nosuch'"),
    ):
        result = ctl(*argv, "--api", node.api)
        assert result.returncode == 1 and says in result.stderr and result.stdout == "", result


# -- logs ----------------------------------------------------------------------------------------


def test_every_model_verb_names_the_known_models(node: Node) -> None:
    """Each verb that takes a model, given one the catalog does not hold, exits 1 with the same
    words (``control.notfound``): the name asked for and every model there is. Nodes likewise."""
    known = ", ".join(sorted([CHAT, CRASH, HUGE]))
    says = f"no model 'nosuch' in the catalog; models: {known}"
    for argv in (
        ["get", "models", "nosuch"],
        ["get", "model", "nosuch", "-o", "wide"],
        ["describe", "model", "nosuch"],
        ["why", "nosuch"],
        ["scale", "nosuch", "2"],
        ["delete", "model/nosuch"],
        ["rollout", "status", "nosuch"],
    ):
        result = ctl(*argv, "--api", node.api)
        assert result.returncode == 1 and says in result.stderr and result.stdout == "", (argv, result)
    for argv in (
        ["get", "nodes", "gpu99"],
        ["describe", "node", "gpu99"],
        ["cordon", "gpu99"],
        ["drain", "gpu99"],
    ):
        result = ctl(*argv, "--api", node.api)
        assert result.returncode == 1 and "no node 'gpu99'; nodes: gpu07" in result.stderr, (argv, result)


def test_logs_lines_out_of_range_say_what_is_expected(node: Node) -> None:
    """``--tail`` is checked by the API, where its bound is defined: 400 with the range and the value,
    not Python's ``invalid literal for int()``."""
    chat = node.shard(CHAT)
    for tail in ("0", "10001"):
        result = ctl("logs", chat["shard_id"], "--tail", tail, "--api", node.api)
        expected = f"HTTP 400: lines must be a whole number from 1 to 10000, got '{tail}'"
        assert result.returncode == 1 and expected in result.stderr, result
    raw = httpx.get(f"{node.api}/api/logs/{chat['shard_id']}?lines=abc", timeout=15)
    assert raw.status_code == 400
    assert raw.json()["error"] == "lines must be a whole number from 1 to 10000, got 'abc'"


def test_logs_follow_picks_up_new_lines_and_ctrl_c_is_0(node: Node) -> None:
    chat = node.shard(CHAT)
    shard = str(chat["shard_id"])
    tail = ctl("logs", shard, "--tail", "3", "--api", node.api)
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) == 3, tail
    follow = Running("logs", shard, "-f", "--tail", "5", "--api", node.api)
    try:
        poll("the tail", lambda: len(follow.out) >= 5)
        marks = [f"/followed-{TAG}-{i}" for i in range(3)]
        for mark in marks:
            # The simulator logs each request with its path: a line only this test can cause.
            httpx.get(f"{chat['url']}{mark}", timeout=15)
        poll("the new lines", lambda: all(mark in follow.text() for mark in marks))
    finally:
        status, stderr = follow.interrupt()
    assert status == 0 and "Traceback" not in stderr, stderr
    text = follow.text()
    assert [text.count(mark) for mark in marks] == [1, 1, 1], text  # each once, in order
    assert text.index(marks[0]) < text.index(marks[1]) < text.index(marks[2])
    # `ctl logs -f | head -1`: the reader leaves, the next line ends ctl quietly with 0.
    head = subprocess.Popen(
        [sys.executable, "-m", "control", "ctl", "logs", shard, "-f", "--tail", "1", "--api", node.api],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert head.stdout is not None and head.stdout.readline()
        head.stdout.close()
        poll(
            "ctl to notice its reader is gone",
            lambda: httpx.get(f"{chat['url']}/gone-{TAG}", timeout=15) and head.poll() is not None,
        )
    finally:
        if head.poll() is None:
            head.kill()
        head.wait(10)
    assert head.stderr is not None
    assert head.returncode == 0 and head.stderr.read() == b""


def test_logs_previous_shows_the_engine_before_its_restart(node: Node) -> None:
    crash = node.shard(CRASH)
    shard, old_pid = str(crash["shard_id"]), int(str(crash["pid"]))
    before = ctl("logs", shard, "--previous", "--api", node.api)
    assert before.returncode == 0 and before.stdout == "", before  # one run so far: no previous one
    old_mark = f"/old-engine-{TAG}"
    httpx.get(f"{crash['url']}{old_mark}", timeout=15)
    poll("the old engine's line", lambda: old_mark in ctl("logs", shard, "--api", node.api).stdout)
    os.killpg(old_pid, signal.SIGKILL)
    new = poll(
        "the restarted engine",
        lambda: (s := node.shard(CRASH)) and s["pid"] != old_pid and s["state"] == "ready" and s,
    )
    new_mark = f"/new-engine-{TAG}"
    httpx.get(f"{new['url']}{new_mark}", timeout=15)
    poll("the new engine's line", lambda: new_mark in ctl("logs", shard, "--api", node.api).stdout)
    previous = ctl("logs", shard, "--previous", "--tail", "1000", "--api", node.api)
    assert previous.returncode == 0, previous.stderr
    lines = previous.stdout.splitlines()
    assert lines[0].startswith("=== llmgw ") and f"starting {shard}" in lines[0], lines
    assert sum(line.startswith("=== llmgw ") for line in lines) == 1, lines  # one run only
    assert old_mark in previous.stdout and new_mark not in previous.stdout
    doc = json.loads(ctl("logs", shard, "-p", "-o", "json", "--api", node.api).stdout)
    assert doc["previous"] is True and any(old_mark in line for line in doc["lines"])


# -- help, version, exit codes -------------------------------------------------------------------


def test_help_and_version() -> None:
    version = importlib.metadata.version("llmgw")
    for argv in (["ctl", "--version"], ["--version"]):
        result = subprocess.run(
            [sys.executable, "-m", "control", *argv], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0 and result.stdout.strip().endswith(version), result
    top = ctl("--help")
    assert top.returncode == 0
    for verb in ("get", "describe", "logs", "cordon", "drain", "uncordon", "token", "node", "why"):
        assert f"\n    {verb} " in top.stdout, verb
    assert "exit status:\n  0  done" in top.stdout and "\n  2  a usage mistake" in top.stdout
    for verb, flags in (
        ("get", ["--watch", "-o {json,wide,name}", "--api URL", "exit status:"]),
        ("logs", ["--follow", "--previous", "--tail N", "exit status:"]),
        ("describe", ["node or model"]),
        ("drain", ["--force", "--wait", "--timeout S"]),
    ):
        result = ctl(verb, "--help")
        assert result.returncode == 0 and all(f in result.stdout for f in flags), (verb, result.stdout)
    server = subprocess.run(
        [sys.executable, "-m", "control", "--help"], capture_output=True, text=True, timeout=60
    )
    assert server.returncode == 0 and "python -m control ctl --help" in server.stdout


def test_usage_mistakes_are_2_and_failures_1() -> None:
    for argv, says in (
        (["get", "nodez"], "invalid choice: 'nodez'"),
        (["get", "nodes", "-o", "yaml"], "invalid choice: 'yaml'"),
        (["describe", "node"], "the following arguments are required: name"),
        (["logs", "s", "--tail", "ten"], "invalid int value: 'ten'"),
        (["get", "nodes", "--api", "localhost:1"], "is not the admin API's URL"),
    ):
        result = ctl(*argv)
        assert result.returncode == 2 and says in result.stderr, (argv, result)
        assert "Traceback" not in result.stderr
    api = f"http://127.0.0.1:{free_port()}"
    for argv in (["get", "models"], ["describe", "node", "x"], ["logs", "s", "-f"], ["get", "nodes", "-w"]):
        result = ctl(*argv, "--api", api)
        assert result.returncode == 1, (argv, result)
        assert result.stderr.startswith(f"ctl: cannot reach the control plane: GET {api}/api/"), result.stderr


# -- the log files behind -f and --previous ------------------------------------------------------


def _start(shard: str, n: int) -> str:
    return f"=== llmgw 2026-01-01T00:00:0{n}+0000: starting {shard}: sim --port 1\n"


def test_previous_run_is_between_the_last_two_start_lines_across_a_rotation(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    log.write_text(_start("s", 1) + "first run\n" + _start("s", 2) + "second run a\n")
    assert logfiles.rotate(log, 10, 2)
    with open(log, "a") as f:
        f.write("second run b key=s3cr3t\n" + _start("s", 3) + "third run\n")
    got = logfiles.previous_run(log, 100, generations=2, redact=["s3cr3t"])
    assert got == [_start("s", 2).rstrip("\n"), "second run a", "second run b key=***"]
    assert logfiles.previous_run(log, 1, generations=2) == ["second run b key=s3cr3t"]
    # The second run's start line rotated away (generations=0 keeps none): no previous run known.
    assert logfiles.previous_run(log, 100, generations=0) == []
    single = tmp_path / "one.log"
    single.write_text(_start("one", 1) + "only run\n")
    assert logfiles.previous_run(single, 100) == []


def test_read_after_follows_across_a_rotation_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    log.write_text("a\nb\n")
    lines, offset = logfiles.tail_and_offset(log, 1)
    assert (lines, offset) == (["b"], 4)
    with open(log, "a") as f:
        f.write("c\npart")
    assert logfiles.read_after(log, offset) == (["c"], 6)
    with open(log, "a") as f:
        f.write("ial\nd\n")
    assert logfiles.rotate(log, 5, 1)  # copytruncate: the live file is empty again
    with open(log, "a") as f:
        f.write("e\n")
    lines, offset = logfiles.read_after(log, 6)
    assert (lines, offset) == (["partial", "d"], 0)  # the rest of the rotated copy, then from 0
    assert logfiles.read_after(log, offset) == (["e"], 2)


def test_every_verb_and_flag_has_help() -> None:
    """Walk ctl's parser: each verb and each of its options and arguments says what it is for."""
    from control.ctl import build_parser

    parser, verbs = build_parser()
    missing = []
    for p in [parser, *verbs]:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{p.prog} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{p.prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    assert {v.prog.split()[-1] for v in verbs} >= {"get", "describe", "logs", "drain", "reset", "token"}


def test_describe_node_from_an_api_without_events_shows_its_state_history() -> None:
    """A control plane older than the event log (no ``/api/nodes/NODE``): ``describe`` builds the
    node from the list documents, and the node's own state history stands in for its events."""
    from control.ctl import describe_node

    node = {
        "node_id": "gpu07",
        "state": "ready",
        "draining": False,
        "cordoned": False,
        "since_s": 3.0,
        "reason": "heard from again",
        "connected": True,
        "heartbeat_age_s": 0.2,
        "mgmt_addr": "10.0.0.7",
        "auth": "credential",
        "gpus": 8,
        "gpus_free": 6,
        "gpu_model": "H100",
        "fabrics": ["ib-a"],
        "labels": {"rack": "r1"},
        "engines": [{"engine": "vllm", "version": "0.18.0", "error": ""}],
        "discovery_error": "",
        "shards": [],
        "history": [
            {"at_s_ago": 90.0, "from": "", "to": "ready", "reason": "registered"},
            {"at_s_ago": 10.0, "from": "ready", "to": "unreachable", "reason": "no heartbeat for 15 s"},
            {"at_s_ago": 3.0, "from": "unreachable", "to": "ready", "reason": "heard from again"},
        ],
        "replicas": [],
    }
    out = describe_node(node)
    assert "GPUs:          2/8 in use (H100)" in out and "Labels:        rack=r1" in out
    events = columns(out.split("Events:\n", 1)[1])
    assert [(e["FROM"], e["TO"]) for e in events] == [
        ("-", "ready"),
        ("ready", "unreachable"),
        ("unreachable", "ready"),
    ]
    assert events[1]["REASON"] == "no heartbeat for 15 s" and events[2]["WHEN"] == "3s ago"


def test_ctl_does_not_load_the_control_plane() -> None:
    """``python -m control ctl`` imports ctl alone, not the server's modules (a third of the start
    time, and a ctl that works whatever state the server's code is in)."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['control', 'ctl', '--help']\n"
        "try:\n    runpy.run_module('control', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
        "loaded = sorted(m for m in sys.modules if m in ('control.plane', 'control.api', 'hypercorn'))\n"
        "print(code, loaded, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stderr.strip() == "0 []", result.stderr
