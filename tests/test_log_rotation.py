"""Engine logs are rotated by size (copy, then truncate), and tails read across the rotation.

The file functions are checked on their own first; then a real ``sim`` engine under a supervisor
with a small ``log_max_bytes`` writes one access-log line per request (each naming the request's
path, so lines are numbered), and the logs the supervisor answers with (what ``ctl logs`` shows)
are checked across the boundary.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

import schema
from agent.supervise import LivenessProbe, Supervisor, logfiles
from tests.support import free_port, poll
from tests.test_supervisor import end_engines, make_supervisor, sim_spec, wait_state

State = schema.ShardState


def test_rotate_copies_then_truncates_in_place_and_keeps_generations(tmp_path: Path) -> None:
    log = tmp_path / "s0.log"
    # The engine's descriptor: O_APPEND, as the supervisor opens it, held across the rotations.
    engine = open(log, "ab")
    try:
        for gen in range(1, 6):
            engine.write(f"generation {gen}\n".encode() * 20)
            engine.flush()
            assert logfiles.rotate(log, 100, 3)
            assert log.stat().st_size == 0
        engine.write(b"after\n")
        engine.flush()
        # The write landed at the start of the truncated file (O_APPEND), no hole before it.
        assert log.read_bytes() == b"after\n"
        assert not logfiles.rotate(log, 100, 3)  # small: left alone
        kept = {n: (tmp_path / f"s0.log.{n}").read_text().splitlines()[0] for n in (1, 2, 3)}
        assert kept == {1: "generation 5", 2: "generation 4", 3: "generation 3"}
        assert not (tmp_path / "s0.log.4").exists()
        assert not list(tmp_path.glob("*.tmp"))
    finally:
        engine.close()
    # No generations kept: truncated only.
    log.write_bytes(b"x" * 200)
    assert logfiles.rotate(log, 100, 0) and log.stat().st_size == 0
    assert not logfiles.rotate(tmp_path / "missing.log", 1, 3)


def test_tail_spans_the_boundary_and_hides_secrets(tmp_path: Path) -> None:
    log = tmp_path / "s0.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert logfiles.rotate(log, 10, 2)
    log.write_text("line 10 key=s3cr3t\nline 11\n")
    assert logfiles.tail(log, 2) == ["line 10 key=s3cr3t", "line 11"]
    assert logfiles.tail(log, 4, redact=["s3cr3t"]) == ["line 8", "line 9", "line 10 key=***", "line 11"]
    # Just rotated, nothing written since: the previous generation answers alone.
    assert logfiles.rotate(log, 10, 2)
    assert logfiles.tail(log, 3, generations=2) == ["line 9", "line 10 key=s3cr3t", "line 11"]
    # A key as engines print their arguments is hidden even when the shard's key is not known.
    log.write_text("args: --api-key abcdef123 --port 1\nnon-default args: {'api_key': 'abcdef123', 'x': 1}\n")
    assert logfiles.tail(log, 2) == [
        "args: --api-key *** --port 1",
        "non-default args: {'api_key': '***', 'x': 1}",
    ]
    # Fewer lines than asked for in every generation: all of them, oldest first.
    assert logfiles.tail(log, 100, generations=2)[0] == "line 0"
    assert len(logfiles.tail(log, 100, generations=0)) == 2  # the live file alone


@pytest.fixture
async def small_logs(tmp_path: Path) -> AsyncIterator[Supervisor]:
    # No liveness probe during the test: the engine writes only the lines the test asks for.
    supervisor = make_supervisor(
        tmp_path,
        log_max_bytes=3000,
        log_generations=2,
        log_check_interval=0.05,
        liveness=LivenessProbe(period=3600),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        try:
            yield supervisor
        finally:
            end_engines(supervisor)
            nursery.cancel_scope.cancel()


MARK = re.compile(r'"GET /mark-(\d+) ')


def _marks(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := MARK.search(line))]


async def test_a_running_engines_log_is_rotated_and_its_tail_spans_the_boundary(
    small_logs: Supervisor, tmp_path: Path
) -> None:
    sup = small_logs
    port = free_port()
    shard = await sup.start(sim_spec("rot-s0", port))
    await wait_state(sup, "rot-s0", State.READY)
    log = tmp_path / "logs" / "rot-s0.log"
    first = log.with_name("rot-s0.log.1")
    second = log.with_name("rot-s0.log.2")
    sent = 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        # Numbered requests until the log has been rotated twice (each line is ~80 bytes, so about
        # 40 lines a generation), with a deadline rather than a count.
        with trio.fail_after(30):
            while not await trio.to_thread.run_sync(second.exists):
                await client.get(f"/mark-{sent:05d}")
                sent += 1
        # A few more after the last rotation seen, so that the live file holds some.
        for _ in range(3):
            await client.get(f"/mark-{sent:05d}")
            sent += 1

    def settled() -> bool:
        """Nothing more to rotate and no rotation half done: the engine writes nothing now."""
        return log.stat().st_size <= 3000 and not list(tmp_path.glob("logs/*.tmp"))

    await trio.to_thread.run_sync(lambda: poll("the last rotation to finish", settled, timeout=10))
    assert shard.state is State.READY and shard.pid > 0
    # The engine kept writing into the same (truncated) file: small, and no hole of NULs.
    live = log.read_bytes()
    assert len(live) < 3000 + 200 and not live.startswith(b"\0")
    files = await trio.to_thread.run_sync(lambda: sorted(tmp_path.glob("logs/rot-s0.log*")))
    assert len(files) == 3  # live + 2 generations, no more
    live_marks = _marks(live.decode().splitlines())
    assert live_marks and live_marks[-1] == sent - 1
    # What `ctl logs` shows: more lines than the live file has, so the previous generation's last
    # lines come first, then the live ones, in the order the engine wrote them.
    live_lines = live.decode().splitlines()
    lines = await sup.logs("rot-s0", len(live_lines) + 5)
    previous = first.read_text().splitlines()
    assert lines == previous[-5:] + live_lines
    marks = _marks(lines)
    assert marks == sorted(marks) and marks[-1] == sent - 1 and marks[0] < live_marks[0]
    # The failure tail reads across it too: stop the engine, and the tail's last line is its own.
    sup.stop("rot-s0")
    await wait_state(sup, "rot-s0", State.STOPPED)
    assert shard.output_tail and len(shard.output_tail) == 20


async def test_a_crash_looping_engines_log_is_rotated_at_each_start(tmp_path: Path) -> None:
    """An engine that dies at once does not live to see a periodic check: the start rotates."""
    sup = make_supervisor(tmp_path, log_max_bytes=200, log_generations=1, log_check_interval=3600)
    env = {"LLMGW_SIM_FAIL_LOADING": "boom " * 20}
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        try:
            for attempt in range(3):
                spec = sim_spec("crash-s0", free_port(), env=env)
                await sup.start(spec)
                await wait_state(sup, "crash-s0", State.FAILED)
                assert sup.shards["crash-s0"].output_tail, attempt
        finally:
            end_engines(sup)
            nursery.cancel_scope.cancel()
    log = tmp_path / "logs" / "crash-s0.log"
    # Each start found the previous attempt's output over the limit and rotated it away.
    assert log.read_text().count("=== llmgw") == 1
    assert log.with_name("crash-s0.log.1").read_text().count("=== llmgw") == 1
    assert os.stat(log).st_size < 2000
