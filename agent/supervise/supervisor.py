"""The supervisor: owns every engine process on the node, and outlives every session.

Engines are spawned outside any session, in their own process session (``start_new_session=True``)
with stdout and stderr going to a per-shard log file, never a pipe: a pipe would break the engine
(SIGPIPE, or a full buffer that blocks it) the moment the agent died, and an agent restart must not
cost a model reload. Each shard is recorded in the state directory (pid, process start time, spec,
port), so an agent restarted after ``kill -9`` re-adopts the engines that are still the same process,
keeps watching them, and reports the ones that are gone instead of starting anything twice.

The supervisor is a service in the trio sense: ``run`` holds the nursery in which every shard's
lifecycle task lives, reports itself through ``task_status.started``, and runs until cancelled.
Cancelling it stops watching, never the engines: an agent stopped on purpose leaves them serving.

Commands are idempotent: a repeated ``start`` for a live shard reports its state and spawns nothing.
``start`` returns as soon as the process exists; loading takes minutes and is watched in the
background, with every state change announced to subscribers (the session's per-shard watchers).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import httpx
import trio

import schema
from agent.discovery.model import GpuInfo
from agent.engines import Launch, LaunchContext, ProfileRefused, Readiness, plan
from agent.supervise.records import RecordStore, ShardRecord, is_same_process, process_start_time

log = logging.getLogger("llmgw.agent.supervise")

State = schema.ShardState
LIVE_STATES = (State.STARTING, State.READY, State.DRAINING)
TAIL_LINES = 20
DEFAULT_READY_TIMEOUT = 900.0

# Gauges of in-flight requests, by engine: a drain waits for these to reach zero before stopping.
_IN_FLIGHT = re.compile(
    rb"^(vllm:num_requests_running|sglang:num_running_reqs|llamacpp:requests_processing|llamacpp:requests_deferred)(\{[^}]*\})?\s+([0-9.eE+-]+)",
    re.MULTILINE,
)


@attrs.define(eq=False)
class Shard:
    """One shard's live state on this node (mutable: the supervisor moves it through its states)."""

    spec: schema.StartShard
    engine: str
    state: schema.ShardState = State.STARTING
    error: str = ""
    exit_code: int | None = None
    output_tail: list[str] = attrs.field(factory=list)
    pid: int = 0
    log_path: Path | None = None
    launch: Launch | None = None
    proc: subprocess.Popen[bytes] | None = None
    adopted: bool = False
    stopping: bool = False
    version: int = 0

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def status(self, node_id: str) -> schema.ShardStatus:
        return schema.ShardStatus(
            node_id=node_id,
            replica_id=self.spec.replica_id,
            shard_id=self.spec.shard_id,
            state=self.state,
            error=self.error,
            exit_code=self.exit_code,
            output_tail=list(self.output_tail),
            http_port=self.spec.http_port,
            pid=self.pid,
            spec=self.spec,
        )


def tail(path: Path | None, n: int = TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a log file (reads at most the last 256 KiB)."""
    if path is None or n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:]


def _describe_exit(code: int) -> tuple[int, str]:
    """Popen's negative signal codes, as the shell reports them (128 + N) and in words."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return 128 - code, f"killed by {name}"
    return code, f"exited with code {code}"


class Supervisor:
    """Spawns, watches, drains, stops and re-adopts engine processes; see the module docstring."""

    def __init__(
        self,
        *,
        node_id: str,
        state_dir: Path,
        log_dir: Path,
        gpus: Sequence[GpuInfo],
        launch_context: Callable[[str], LaunchContext],
        stop_grace: float = 30.0,
        poll_interval: float = 0.5,
        probe_host: str = "127.0.0.1",
    ) -> None:
        self.node_id = node_id
        self.gpus = tuple(gpus)
        self.launch_context = launch_context
        self.stop_grace = stop_grace
        self.poll_interval = poll_interval
        self.probe_host = probe_host
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.records = RecordStore(state_dir)
        self.shards: dict[str, Shard] = {}
        #: Set and replaced on every state change of any shard: the session's watchers wait on it.
        self.any_change = trio.Event()
        self._nursery: trio.Nursery | None = None

    # -- the service -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._adopt_all()
            task_status.started(self)
            await trio.sleep_forever()

    def _adopt_all(self) -> None:
        records, problems = self.records.load_all()
        for problem in problems:
            log.warning("%s", problem)
        for record in records:
            shard = Shard(
                spec=record.spec, engine=record.engine, pid=record.pid, log_path=Path(record.log_path)
            )
            shard.adopted = True
            self.shards[record.shard_id] = shard
            if is_same_process(record):
                try:
                    shard.launch = plan(record.spec, self.gpus, self.launch_context(record.engine))
                except ProfileRefused as exc:
                    log.warning(
                        "adopted shard %s no longer validates (%s); watching it anyway", record.shard_id, exc
                    )
                log.info("adopted %s: engine pid %d still running", record.shard_id, record.pid)
                self._spawn_lifecycle(shard)
            else:
                self.records.remove(record.shard_id)
                self._set(
                    shard,
                    State.FAILED,
                    error=(
                        f"engine pid {record.pid} recorded before the agent restarted is gone "
                        "(no process with that pid and start time); not restarted"
                    ),
                    output_tail=tail(shard.log_path),
                )

    # -- state ---------------------------------------------------------------------------------

    def _set(self, shard: Shard, state: schema.ShardState, **changes: object) -> None:
        shard.state = state
        for key, value in changes.items():
            setattr(shard, key, value)
        shard.version += 1
        self.any_change.set()
        self.any_change = trio.Event()
        log.info("shard %s: %s%s", shard.shard_id, state.name, f" ({shard.error})" if shard.error else "")

    def statuses(self) -> list[schema.ShardStatus]:
        return [s.status(self.node_id) for s in self.shards.values()]

    # -- commands ------------------------------------------------------------------------------

    def start(self, spec: schema.StartShard) -> Shard:
        """Start a shard, or report the live one with that id (idempotent). Never blocks on loading.

        Raises :class:`ProfileRefused` (after recording the shard as failed, so watchers report it)
        when the profile is one the engine would refuse; nothing is spawned then.
        """
        assert self._nursery is not None, "Supervisor.run() must be started first"
        existing = self.shards.get(spec.shard_id)
        if existing is not None and existing.live:
            return existing
        engine = spec.profile.engine if spec.profile else ""
        shard = Shard(spec=spec, engine=engine)
        self.shards[spec.shard_id] = shard
        try:
            shard.launch = plan(spec, self.gpus, self.launch_context(engine))
        except ProfileRefused as exc:
            self._set(shard, State.FAILED, error=f"StartShard refused: {exc}")
            raise
        shard.log_path = self.log_dir / f"{_safe(spec.shard_id)}.log"
        command = shard.launch.command
        env = {**os.environ, **command.env}
        with open(shard.log_path, "ab") as logf:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            logf.write(f"=== llmgw {stamp}: starting {spec.shard_id}: {' '.join(command.argv)}\n".encode())
            logf.flush()
            try:
                proc = subprocess.Popen(
                    command.argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                self._set(shard, State.FAILED, error=f"cannot start {command.argv[0]}: {exc.strerror or exc}")
                return shard
        shard.proc = proc
        shard.pid = proc.pid
        start_time = process_start_time(proc.pid)
        if start_time is not None:
            self.records.save(
                ShardRecord(
                    shard_id=spec.shard_id,
                    engine=engine,
                    pid=proc.pid,
                    start_time=start_time,
                    port=spec.http_port,
                    log_path=str(shard.log_path),
                    spec=spec,
                )
            )
        self._set(shard, State.STARTING, error="", exit_code=None, output_tail=[])
        self._spawn_lifecycle(shard)
        return shard

    def stop(self, shard_id: str, grace: float | None = None) -> Shard | None:
        """SIGTERM the engine's process group now, SIGKILL after ``grace``; returns at once."""
        shard = self.shards.get(shard_id)
        if shard is None or not shard.live:
            return shard
        self._begin_stop(shard, self.stop_grace if not grace or grace <= 0 else grace)
        return shard

    def drain(self, shard_id: str, deadline: float) -> Shard | None:
        """Stop taking new work (the router sees DRAINING), then stop by ``deadline`` seconds."""
        shard = self.shards.get(shard_id)
        if shard is None or not shard.live or shard.state is State.DRAINING:
            return shard
        self._set(shard, State.DRAINING)
        assert self._nursery is not None
        self._nursery.start_soon(self._drain, shard, max(deadline, 0.0))
        return shard

    def logs(self, shard_id: str, lines: int = 100) -> list[str]:
        shard = self.shards.get(shard_id)
        if shard is None:
            raise KeyError(f"no shard {shard_id!r} on this node")
        return tail(shard.log_path, lines)

    def remove(self, shard_id: str) -> None:
        """Forget a shard that is no longer live (its log file stays for a person to read)."""
        shard = self.shards.get(shard_id)
        if shard is not None and not shard.live:
            del self.shards[shard_id]
            self.records.remove(shard_id)

    # -- lifecycle -----------------------------------------------------------------------------

    def _spawn_lifecycle(self, shard: Shard) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._lifecycle, shard)

    async def _lifecycle(self, shard: Shard) -> None:
        """Watch readiness and exit together; whichever ends first decides the next state."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._readiness, shard)
            code = await self._wait_exit(shard)
            nursery.cancel_scope.cancel()
        self.records.remove(shard.shard_id)
        output = tail(shard.log_path)
        if code is None:
            exit_code, how = None, "exited (exit code unknown: the process was adopted, not our child)"
        else:
            exit_code, how = _describe_exit(code)
        if shard.stopping:
            self._set(shard, State.STOPPED, exit_code=exit_code, output_tail=output)
        elif shard.state is State.FAILED:
            shard.exit_code, shard.output_tail = exit_code, output  # already failed (ready timeout)
            self._set(shard, State.FAILED)
        else:
            when = "after it was ready" if shard.state in (State.READY, State.DRAINING) else "while loading"
            self._set(
                shard, State.FAILED, error=f"engine {how} {when}", exit_code=exit_code, output_tail=output
            )

    async def _wait_exit(self, shard: Shard) -> int | None:
        """Wait for the engine to exit, by pidfd (no polling, works for adopted non-children too)."""
        try:
            fd = os.pidfd_open(shard.pid)
        except ProcessLookupError:
            fd = -1
        if fd >= 0:
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        if shard.proc is not None:
            return await trio.to_thread.run_sync(shard.proc.wait)
        return None

    async def _readiness(self, shard: Shard) -> None:
        launch = shard.launch
        if launch is None:
            return
        ready = launch.readiness
        if ready.follow_rank0:
            # A worker rank has no HTTP of its own; it is ready when rank 0 is, which only the
            # control plane can see. Running is all this node can vouch for.
            self._set(shard, State.READY)
            return
        timeout = shard.spec.ready_timeout_seconds or DEFAULT_READY_TIMEOUT
        base = f"http://{self.probe_host}:{shard.spec.http_port}"
        last = "no answer yet"
        async with httpx.AsyncClient(base_url=base, timeout=min(5.0, timeout)) as client:
            with trio.move_on_after(timeout):
                while True:
                    ok, last = await _probe(client, ready)
                    if ok:
                        if shard.state is State.STARTING:
                            self._set(shard, State.READY)
                        return
                    await trio.sleep(self.poll_interval)
        if shard.state is State.STARTING:
            self._set(
                shard,
                State.FAILED,
                error=f"not ready within {timeout:g} s (last check: {last}); stopping the engine",
                output_tail=tail(shard.log_path),
            )
            self._signal_group(shard, signal.SIGTERM)
            assert self._nursery is not None
            self._nursery.start_soon(self._kill_after, shard, self.stop_grace)

    def _begin_stop(self, shard: Shard, grace: float) -> None:
        shard.stopping = True
        self._signal_group(shard, signal.SIGTERM)
        assert self._nursery is not None
        self._nursery.start_soon(self._kill_after, shard, grace)

    async def _kill_after(self, shard: Shard, grace: float) -> None:
        await trio.sleep(grace)
        if shard.live or shard.state is State.FAILED:
            if process_start_time(shard.pid) is not None:
                log.warning("shard %s did not stop within %g s of SIGTERM; SIGKILL", shard.shard_id, grace)
                self._signal_group(shard, signal.SIGKILL)

    def _signal_group(self, shard: Shard, sig: signal.Signals) -> None:
        if shard.pid <= 0:
            return
        try:
            os.killpg(shard.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.warning("cannot signal shard %s (pid %d): %s", shard.shard_id, shard.pid, exc)

    async def _drain(self, shard: Shard, deadline: float) -> None:
        """Let in-flight requests finish (engines' own gauges say when), then stop by the deadline."""
        launch = shard.launch
        if launch is not None and launch.stop.drains_in_flight:
            # The engine drains on SIGTERM itself (vLLM --shutdown-timeout): signal now, kill at the deadline.
            self._begin_stop(shard, deadline or self.stop_grace)
            return
        end = trio.current_time() + deadline
        url = f"http://{self.probe_host}:{shard.spec.http_port}/metrics"
        async with httpx.AsyncClient(timeout=2.0) as client:
            while trio.current_time() < end and shard.state is State.DRAINING:
                in_flight = await _in_flight(client, url)
                if in_flight == 0:
                    break
                await trio.sleep(min(self.poll_interval, max(end - trio.current_time(), 0)))
        if shard.state is State.DRAINING:
            self._begin_stop(shard, self.stop_grace)


async def _probe(client: httpx.AsyncClient, ready: Readiness) -> tuple[bool, str]:
    try:
        health = await client.get(ready.health_path)
        if health.status_code != 200:
            return False, f"GET {ready.health_path} -> {health.status_code}"
        if ready.models_path:
            models = await client.get(ready.models_path)
            if models.status_code != 200 or not ready.model_listed(models.content):
                return (
                    False,
                    f"GET {ready.models_path} -> {models.status_code}, {ready.model_name!r} not listed",
                )
        return True, "ready"
    except httpx.HTTPError as exc:
        return False, f"GET {ready.health_path}: {type(exc).__name__}"


async def _in_flight(client: httpx.AsyncClient, url: str) -> float | None:
    """Requests the engine is still running, from its Prometheus gauges; ``None`` when unknown."""
    try:
        resp = await client.get(url)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    values = [float(m.group(3)) for m in _IN_FLIGHT.finditer(resp.content)]
    return sum(values) if values else None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


__all__ = ["LIVE_STATES", "Shard", "Supervisor", "tail"]
