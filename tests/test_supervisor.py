"""The supervisor in this process, with real ``sim`` engines, real sockets and the real ``/proc``.

The pure parts (the liveness transition, the adoption decision) are tested as functions; everything
else runs real engine processes, and each test ends the engines it started, by pid.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

import schema
from agent.engines import LaunchContext, ProfileRefused
from agent.supervise import LivenessProbe, Supervisor, procfs
from agent.supervise.adopt import Adopt, Drop, Extra, Gone, plan_adoption
from agent.supervise.probes import liveness_step
from agent.supervise.records import LoadedRecord, RecordStore, ShardRecord
from tests.support import free_port, pid_alive

State = schema.ShardState
SIM = (sys.executable, "-m", "agent.engines.sim")


def sim_spec(
    shard_id: str, port: int, *, served: str = "tiny", api_key: str = "", **profile: object
) -> schema.StartShard:
    env = {"LLMGW_SIM_LOAD_SECONDS": "0.2", "LLMGW_SIM_TTFT_MS": "1", "LLMGW_SIM_ITL_MS": "1"}
    fields: dict[str, object] = {
        "engine": "sim",
        "model": "org/tiny",
        "served_model_name": served,
        "env": env,
    }
    fields.update(profile)
    return schema.StartShard(
        shard_id=shard_id,
        replica_id="r0",
        profile=schema.EngineProfile(**fields),  # type: ignore[arg-type]
        http_port=port,
        ready_timeout_seconds=30,
        api_key=api_key,
    )


def make_supervisor(tmp_path: Path, **kw: object) -> Supervisor:
    return Supervisor(
        node_id="cpu01",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        gpus=(),
        launch_context=lambda _: LaunchContext(argv_prefix=SIM, host="127.0.0.1"),
        stop_grace=3,
        poll_interval=0.05,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[Supervisor]:
    supervisor = make_supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        try:
            yield supervisor
        finally:
            end_engines(supervisor)
            nursery.cancel_scope.cancel()


def end_engines(supervisor: Supervisor) -> None:
    """Engines outlive the supervisor by design: a test ends the ones it started, by marker."""
    for engine in procfs.find_engines(supervisor.owner):
        os.killpg(engine.pid, signal.SIGKILL)


async def wait_state(sup: Supervisor, shard_id: str, *states: schema.ShardState, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while shard_id not in sup.shards or sup.shards[shard_id].state not in states:
            await sup.any_change.wait()


async def wait_gone(pid: int, timeout: float = 15) -> None:
    """Until ``pid`` exits: its pidfd turns readable (no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with trio.fail_after(timeout):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_liveness_step_is_kubelets_rule() -> None:
    step = liveness_step(State.READY, 0, passed=False, threshold=3)
    assert (step.state, step.failures) == (State.READY, 1)
    step = liveness_step(State.READY, 2, passed=False, threshold=3)
    assert (step.state, step.failures) == (State.UNHEALTHY, 3)
    # Still failing: stays UNHEALTHY; one pass: READY again, count reset.
    assert liveness_step(State.UNHEALTHY, 3, passed=False, threshold=3).state is State.UNHEALTHY
    step = liveness_step(State.UNHEALTHY, 7, passed=True, threshold=3)
    assert (step.state, step.failures) == (State.READY, 0)
    # A pass in between resets the run: failures must be in a row.
    assert liveness_step(State.READY, 1, passed=True, threshold=3).failures == 0
    # Other states are not the probe's business.
    assert liveness_step(State.DRAINING, 0, passed=False, threshold=1).state is State.DRAINING
    with pytest.raises(ValueError):
        LivenessProbe(failures=0)


def _record(shard_id: str, pid: int, start: int) -> ShardRecord:
    spec = sim_spec(shard_id, 9000)
    return ShardRecord(shard_id, "sim", pid, start, 9000, f"/logs/{shard_id}.log", spec)


def _engine(shard_id: str, pid: int, start: int, spec: bool = True) -> procfs.MarkedEngine:
    return procfs.MarkedEngine(pid, start, shard_id, sim_spec(shard_id, 9000) if spec else None)


def test_plan_adoption_prefers_the_engine_in_proc_over_the_record() -> None:
    good = LoadedRecord("a", Path("a.json"), _record("a", 10, 100))
    intent = LoadedRecord("b", Path("b.json"), _record("b", 0, 0))
    damaged = LoadedRecord("c", Path("c.json"), None, "damaged (12 bytes)")
    lonely_intent = LoadedRecord("d", Path("d.json"), _record("d", 0, 0))
    gone = LoadedRecord("e", Path("e.json"), _record("e", 50, 500))
    lonely_damage = LoadedRecord("f", Path("f.json"), None, "damaged (0 bytes)")
    bad_name = LoadedRecord("x y", Path("x y.json"), None, "damaged")
    engines = [
        _engine("a", 10, 100),
        _engine("a", 11, 150),  # a second engine for one slot: the record's is kept
        _engine("b", 20, 200),
        _engine("c", 30, 300),
        _engine("g", 40, 400),  # no record at all
        _engine("h", 60, 600, spec=False),  # cannot be identified
    ]
    loaded = [good, intent, damaged, lonely_intent, gone, lonely_damage, bad_name]
    decisions = plan_adoption(loaded, engines, recorded_running={"a"})
    by_kind: dict[str, list[object]] = {}
    for d in decisions:
        by_kind.setdefault(type(d).__name__, []).append(d)
    adopted = {d.shard_id: d for d in by_kind["Adopt"] if isinstance(d, Adopt)}
    assert {k: (v.pid, v.rewrite) for k, v in adopted.items()} == {
        "a": (10, False),
        "b": (20, True),
        "c": (30, True),
        "g": (40, True),
    }
    assert (
        "intent" in adopted["b"].note and "damaged" in adopted["c"].note and "no record" in adopted["g"].note
    )
    extras = sorted((d.shard_id, d.pid) for d in by_kind["Extra"] if isinstance(d, Extra))
    assert extras == [("a", 11), ("h", 60)]
    drops = {d.loaded.shard_id: d.set_aside for d in by_kind["Drop"] if isinstance(d, Drop)}
    assert drops == {"d": False, "f": True, "x y": True}
    assert [d.record.shard_id for d in by_kind["Gone"] if isinstance(d, Gone)] == ["e"]


def test_record_files_are_named_by_the_shard_id_one_to_one(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.create()
    store.save(_record("llama_r0", 0, 0))
    assert [p.name for p in store.dir.iterdir()] == ["llama_r0.json"]
    # Ids that would fold into another file, or leave the directory, are not file names at all.
    for bad in ("llama/r0", "", "..", ".hidden", "a" * 129):
        with pytest.raises(ValueError, match="shard_id"):
            store.path(bad)
    # Truncated and corrupt records are reported, by the id their file name carries.
    text = _record("cut", 5, 6).to_json()
    (store.dir / "cut.json").write_text(text[: len(text) // 2])
    (store.dir / "junk.json").write_bytes(b"\x00\xff{not json")
    (store.dir / "left.json.tmp").write_text("a crash mid-write")
    loaded = {r.shard_id: r for r in store.load_all()}
    assert loaded["llama_r0"].record is not None
    assert loaded["cut"].record is None and "damaged" in loaded["cut"].problem
    assert loaded["junk"].record is None
    assert not (store.dir / "left.json.tmp").exists()


# ---------------------------------------------------------------------------------------------
# /proc, against real sockets and processes


def test_listening_socket_is_found_with_its_holder() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert procfs.listening_inodes(port) == set()  # bound, not listening yet
        listener.listen()
        inodes = procfs.listening_inodes(port)
        assert len(inodes) == 1
        assert procfs.socket_holders(inodes) == {os.getpid()}
        assert procfs.port_in_use(port).startswith(f"pid {os.getpid()} (")
        assert procfs.listener_problem(port, os.getpgid(0)) == ""
        problem = procfs.listener_problem(port, 1)
        assert f"port {port} is held by pid {os.getpid()}" in problem and "not by the engine" in problem
    assert procfs.port_in_use(port) == ""


def test_find_engines_sees_only_its_owners_group_leaders(tmp_path: Path) -> None:
    spec = sim_spec("marked", 9000)
    script = "import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    procs = []
    try:
        for owner in ("/state/one", "/state/two"):
            env = {**os.environ, **procfs.marker_env("marked", owner, spec)}
            procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True))
        deadline = time.monotonic() + 10
        while len(procfs.find_engines("/state/one")) != 1 or len(procfs.group_pids(procs[0].pid)) < 2:
            assert time.monotonic() < deadline, "the marked processes did not show up in /proc"
            time.sleep(0.05)
        (found,) = procfs.find_engines("/state/one")
        # The leader only (its child carries the marker too, but is part of the engine).
        assert found.pid == procs[0].pid and found.shard_id == "marked" and found.spec == spec
        assert len(procfs.marked_members(procs[0].pid, "/state/one", "marked")) == 2
        assert procfs.find_engines("/state/three") == []
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_open_pidfd_refuses_a_pid_with_another_start_time() -> None:
    stat = procfs.read_stat(os.getpid())
    assert stat is not None
    fd = procfs.open_pidfd(os.getpid(), stat.start_time)
    assert fd is not None and not procfs.pidfd_exited(fd)
    os.close(fd)
    assert procfs.open_pidfd(os.getpid(), stat.start_time + 1) is None


# ---------------------------------------------------------------------------------------------
# Starts


async def test_served_name_mismatch_fails_at_once_and_stops_the_engine(sup: Supervisor) -> None:
    # The engine is told to serve another name (the last --served-model-name wins, as in vLLM).
    spec = sim_spec("mis-s0", free_port(), served="asked", extra_args=["--served-model-name", "other"])
    spec.ready_timeout_seconds = 120
    began = trio.current_time()
    shard = await sup.start(spec)
    pid = shard.pid
    await wait_state(sup, "mis-s0", State.FAILED, timeout=20)
    assert trio.current_time() - began < 20, "a wrong model is a failure at once, not a ready timeout"
    assert "engine serves 'other', StartShard asked for 'asked'" in shard.error
    assert "stopping the engine" in shard.error
    await wait_gone(pid)


async def test_start_without_served_name_or_with_a_bad_id_is_refused(sup: Supervisor) -> None:
    with pytest.raises(ProfileRefused) as refused:
        await sup.start(sim_spec("noname-s0", free_port(), served=""))
    assert refused.value.rule == "served-model-name"
    for bad in ("", "llama/r0", "../x"):
        with pytest.raises(ProfileRefused) as refused:
            await sup.start(sim_spec(bad, free_port()))
        assert refused.value.rule == "shard-id" and "shard_id" in str(refused.value)
        assert bad not in sup.shards
    assert procfs.find_engines(sup.owner) == []
    assert sorted(p.name for p in (sup.records.dir).iterdir()) == []


async def test_start_on_a_port_in_use_fails_at_once_naming_it(sup: Supervisor) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        shard = await sup.start(sim_spec("busy-s0", port))
        assert shard.state is State.FAILED and shard.pid == 0
        assert f"port {port} is already in use by pid {os.getpid()}" in shard.error
        assert procfs.find_engines(sup.owner) == [], "nothing may be spawned"
        assert not (sup.records.dir / "busy-s0.json").exists()


@pytest.mark.parametrize("verify_listener", [True, False])
async def test_readiness_does_not_count_answers_from_another_process_on_the_port(
    tmp_path: Path, verify_listener: bool
) -> None:
    """The engine listens elsewhere (a stray ``--port`` in extra_args); an impostor answers on the
    shard's port with the right name. Today the impostor's answers would make the shard READY.

    ``verify_listener = false`` (for engines behind a container runtime's port proxy) trusts any
    answer on the port, and so takes the impostor's: the setting's trade-off, shown."""
    supervisor = make_supervisor(tmp_path)
    supervisor.verify_listener = verify_listener
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        try:
            await _impostor_on_the_port(supervisor, verify_listener)
        finally:
            end_engines(supervisor)
            nursery.cancel_scope.cancel()


async def _impostor_on_the_port(sup: Supervisor, verify_listener: bool) -> None:
    port, elsewhere = free_port(), free_port()
    spec = sim_spec("trust-s0", port, extra_args=["--port", str(elsewhere)])
    spec.ready_timeout_seconds = 4
    shard = await sup.start(spec)
    impostor = await trio.lowlevel.open_process(
        [
            *SIM,
            "serve",
            "org/tiny",
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env={**os.environ, "LLMGW_SIM_LOAD_SECONDS": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        await wait_state(sup, "trust-s0", State.READY, State.FAILED)
        if not verify_listener:
            assert shard.state is State.READY
            return
        assert shard.state is State.FAILED
        assert f"port {port} is held by pid {impostor.pid}" in shard.error
        assert "not by the engine" in shard.error
        async with httpx.AsyncClient() as client:  # the impostor did answer all along
            assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    finally:
        impostor.kill()
        await impostor.wait()


async def test_two_starts_for_one_id_while_spawning_make_one_engine(sup: Supervisor) -> None:
    spec = sim_spec("twice-s0", free_port())
    shards = []

    async def start() -> None:
        shards.append(await sup.start(spec))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
        nursery.start_soon(start)
    assert shards[0] is shards[1] and shards[0].pid > 0
    await wait_state(sup, "twice-s0", State.READY)
    assert [e.pid for e in procfs.find_engines(sup.owner)] == [shards[0].pid]
    again = await sup.start(spec)
    assert again is shards[0]


async def test_start_does_its_file_work_off_the_event_loop(sup: Supervisor) -> None:
    """The log file is a FIFO here: opening it blocks until a reader comes. Done on trio's thread,
    that would freeze every task (heartbeats included); in a worker thread, the loop keeps running.

    The reader is opened by a task on the loop once a thread of this process is seen waiting in the
    FIFO's open (the kernel's wait_for_partner, in /proc/self/task/*/wchan; after 200 ticks where
    the kernel does not say): a loop that can still look was not blocked by the start. Should the
    loop be blocked, a watchdog thread opens the reader after 10 s instead, so that the test fails
    saying so rather than hanging."""
    spec = sim_spec("fifo-s0", free_port())
    fifo = sup.log_dir / "fifo-s0.log"
    os.mkfifo(fifo)
    ticks = 0
    lock = threading.Lock()
    opened = threading.Event()
    opened_by: list[str] = []
    reader: list[int] = []

    def open_reader(by: str) -> None:
        with lock:
            if not opened.is_set():
                # O_NONBLOCK: opening a FIFO's read end this way never waits for a writer.
                reader.append(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
                opened_by.append(by)
                opened.set()

    def watchdog() -> None:
        if not opened.wait(10):  # a bounded wait for the loop, not a sleep
            open_reader("the watchdog thread")

    def a_thread_waits_on_the_fifo() -> bool:
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "wchan").read_text().strip() == "wait_for_partner":
                    return True
            except OSError:  # the thread ended meanwhile
                continue
        return False

    async def tick() -> None:
        nonlocal ticks
        while not opened.is_set():
            ticks += 1
            if ticks >= 200 or a_thread_waits_on_the_fifo():
                open_reader("the event loop")
            await trio.sleep(0.01)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            shard = await sup.start(spec)
        assert opened_by == ["the event loop"], (
            f"the event loop stood still while the start waited on its log file ({ticks} ticks)"
        )
        assert shard.pid > 0
    finally:
        opened.set()
        thread.join()
        for fd in reader:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# Liveness


@pytest.mark.chaos
async def test_sigstopped_engine_goes_unhealthy_and_back_to_ready(tmp_path: Path) -> None:
    probe = LivenessProbe(period=0.3, timeout=0.3, failures=3)
    supervisor = make_supervisor(tmp_path, liveness=probe)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        try:
            shard = await supervisor.start(sim_spec("live-s0", free_port()))
            await wait_state(supervisor, "live-s0", State.READY)
            os.kill(shard.pid, signal.SIGSTOP)
            stopped_at = trio.current_time()
            await wait_state(supervisor, "live-s0", State.UNHEALTHY, timeout=10)
            took = trio.current_time() - stopped_at
            # period x failures, plus one timeout, plus slack for a loaded machine.
            assert took < probe.period * probe.failures + probe.timeout + 1.5, took
            assert shard.error == "liveness probe failed 3 times in a row: GET /health timed out after 0.3 s"
            assert pid_alive(shard.pid)
            os.kill(shard.pid, signal.SIGCONT)
            await wait_state(supervisor, "live-s0", State.READY, timeout=10)
            assert shard.error == ""
        finally:
            end_engines(supervisor)
            nursery.cancel_scope.cancel()


def test_marker_spec_round_trips() -> None:
    spec = sim_spec("m-s0", 1234)
    env = procfs.marker_env("m-s0", "/owner", spec)
    assert env[procfs.MARK_SHARD] == "m-s0" and env[procfs.MARK_OWNER] == "/owner"
    assert schema.StartShard.parse(base64.b64decode(env[procfs.MARK_SPEC])) == spec


# ---------------------------------------------------------------------------------------------
# The shard's key


async def test_probes_carry_the_shards_key_and_an_adopted_engine_is_probed_with_it(tmp_path: Path) -> None:
    """The engine answers 401 on /v1 without its key, so READY (which reads /v1/models) proves the
    readiness probe sent it; a second supervisor on the same state directory (an agent restart)
    adopts the engine READY at once, with the key from the record. What leaves the node
    (ShardStatus) has no key."""
    port = free_port()
    first = make_supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        try:
            shard = await first.start(sim_spec("key-s0", port, api_key="shard-secret-0123"))
            await wait_state(first, "key-s0", State.READY)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
                assert (await client.get("/v1/models")).status_code == 401
                headers = {"Authorization": "Bearer shard-secret-0123"}
                assert (await client.get("/v1/models", headers=headers)).status_code == 200
            [status] = first.statuses()
            assert status.spec is not None and status.spec.api_key == "" and status.spec.http_port == port
            assert shard.spec.api_key == "shard-secret-0123"
            nursery.cancel_scope.cancel()  # the agent stops; the engine keeps serving
        except BaseException:
            end_engines(first)
            raise
    second = make_supervisor(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        try:
            adopted = second.shards["key-s0"]
            assert adopted.adopted and adopted.state is State.READY and adopted.pid == shard.pid
        finally:
            end_engines(second)
            nursery.cancel_scope.cancel()
