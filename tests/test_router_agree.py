"""Several routers: separate ``python -m router`` processes agree on where a prompt prefix goes
(the prefix's hash is stable, not Python's salted ``hash``), and ``--reuse-port`` lets N of them
serve one port on one host, the rest answering when one dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from tests.support import free_port, poll
from tests.test_router import MODEL, REPO, Engine, start_engine, stop_engines


@attrs.define
class RouterProc:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_router(tmp: Path, name: str, *args: str, hash_seed: str = "random") -> RouterProc:
    """A router process; each gets its own ``PYTHONHASHSEED`` unless told, as separate hosts
    would, so nothing that hashes with Python's ``hash`` can agree by chance."""
    log = tmp / f"router-{name}.log"
    argv = [sys.executable, "-m", "router", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
    router = RouterProc(proc, log)

    def port() -> int | None:
        m = re.search(r"listening on [^ ]+:(\d+)", log.read_text())
        if m is None and proc.poll() is not None:
            raise AssertionError(f"router {name} exited {proc.returncode}:\n{log.read_text()}")
        return int(m.group(1)) if m else None

    router.port = poll(f"router {name} to listen", port)
    return router


def stop(routers: list[RouterProc]) -> None:
    for r in routers:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    tmp = tmp_path_factory.mktemp("engines")
    started: list[Engine] = []
    try:
        for name in ("a", "b", "c"):
            started.append(start_engine(tmp, name, {"LLMGW_SIM_ITL_MS": "1"}))
        yield started
    finally:
        stop_engines(started)


def replica_for(client: httpx.Client, base: str, prompt: str) -> str:
    """Which replica answered a one-token request for ``prompt`` (the router's own header)."""
    doc = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    r = client.post(f"{base}/v1/chat/completions", json=doc)
    assert r.status_code == 200, r.text
    return r.headers["x-llmgw-replica"]


def test_two_router_processes_send_each_prefix_to_the_same_replica(
    three: list[Engine], tmp_path: Path
) -> None:
    static = [arg for e in three for arg in ("--static", f"{MODEL}={e.url}")]
    routers = [
        start_router(tmp_path, "one", *static, "--port", "0", hash_seed="1"),
        start_router(tmp_path, "two", *static, "--port", "0", hash_seed="2"),
    ]
    try:
        prompts = [f"shared system prompt number {i}: you are a helpful assistant" for i in range(24)]
        with httpx.Client(timeout=30) as client:
            # One request at a time: no replica is busier than another, so each router's choice
            # is the prefix's rendezvous ranking alone.
            chosen = [[replica_for(client, r.base, p) for p in prompts] for r in routers]
            again = [replica_for(client, routers[0].base, p) for p in prompts]
        assert chosen[0] == chosen[1], "the two routers sent some prefix to different replicas"
        assert again == chosen[0]  # and a router keeps to its choice
        assert len(set(chosen[0])) >= 2, f"24 prefixes all went to {set(chosen[0])}: not a spread"
    finally:
        stop(routers)


def test_reuse_port_lets_router_processes_share_a_port_and_survive_one_dying(tmp_path: Path) -> None:
    port = str(free_port())
    dead = "http://127.0.0.1:9"
    # Different routes per process, so /v1/models says which process answered a connection.
    first = start_router(tmp_path, "a", "--static", f"model-a={dead}", "--port", port, "--reuse-port")
    second = start_router(tmp_path, "b", "--static", f"model-b={dead}", "--port", port, "--reuse-port")
    routers = [first, second]
    try:
        assert first.port == second.port == int(port)
        # Without --reuse-port the port is taken: a clear refusal, not a silent second listener.
        done = subprocess.run(
            [sys.executable, "-m", "router", "--static", f"m={dead}", "--port", port],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert (
            done.returncode == 1
            and f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
        )

        def models() -> str:
            # A fresh connection each time: the kernel picks a listener per connection.
            with httpx.Client(timeout=10) as c:
                return str(c.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"])

        seen: set[str] = set()

        def both() -> bool:
            seen.add(models())
            return seen == {"model-a", "model-b"}

        poll("both router processes to answer on the shared port", both)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        answers = [models() for _ in range(40)]  # none fails: the survivor takes every connection
        assert set(answers) == {"model-b"}
    finally:
        stop(routers)


def test_a_router_with_control_serves_the_control_planes_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m router --control URL`` against a real control plane and sim agent: the route
    watch runs in the router's nursery and the model the plane places is served through it."""
    from tests.fleet_procs import one_node

    token = "r" * 32
    model = f"svc-{os.getpid()}"
    models = (
        f'[api]\nread_tokens = ["{token}"]\n'
        f'[[models]]\nname = "{model}"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
        'env = { LLMGW_SIM_LOAD_SECONDS = "0.3", LLMGW_SIM_ITL_MS = "1" }\n'
    )
    with one_node(tmp_path, models, "24700-24749") as (cp, _agent):
        monkeypatch.setenv("LLMGW_ROUTER_CONTROL_TOKEN", token)  # the variable keeps it out of ps
        router = start_router(
            tmp_path, "svc", "--control", f"http://127.0.0.1:{cp.agent_port}", "--port", "0"
        )
        try:
            doc = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

            def served() -> httpx.Response | None:
                r = httpx.post(f"{router.base}/v1/chat/completions", json=doc, timeout=30)
                return r if r.status_code == 200 else None

            answer = poll("the router to serve the placed model", served, timeout=60)
            assert answer.headers["x-llmgw-replica"].startswith(model)
            assert "routes from http://127.0.0.1:" in router.log.read_text()
        finally:
            stop([router])


def test_before_its_first_table_a_watching_router_answers_503_to_retry(tmp_path: Path) -> None:
    """A router started while the control plane is down serves (after the watch's bounded first
    wait) and tells clients to retry: a 503 naming the control plane, not a 404 for a model that
    only has not been heard of yet."""
    control = f"http://127.0.0.1:{free_port()}"
    router = start_router(tmp_path, "early", "--control", control, "--port", "0")
    try:
        doc = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{router.base}/v1/chat/completions", json=doc, timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "no_routes_yet" and control in error["message"]
    finally:
        stop([router])
