"""The supervisor: owns every engine process on the node, and outlives every session.

Engines are spawned outside any session, in their own process session (``start_new_session=True``)
with stdout and stderr going to a per-shard log file, never a pipe: a pipe would break the engine
(SIGPIPE, or a full buffer that blocks it) the moment the agent died, and an agent restart must not
cost a model reload.

**One engine per slot, whatever instant the agent dies at.** Before the spawn the shard's intent is
recorded (fsync'd) in the state directory, and every engine carries a marker in its environment
(``procfs``: the shard id, this agent's state directory, the spec). After the spawn the record gets
the pid and the process start time. A restarted agent scans ``/proc`` for its marked engines and
adopts them even when the record is missing, an intent, truncated or corrupt (``adopt``), so a
``kill -9`` between fork and record can no longer leave an orphan that a second copy then fights
for the port. A start whose port another process already listens on fails at once, naming it,
without spawning; and readiness counts an answer only when the socket listening on the port belongs
to the engine's own process group.

**Signals go to the process this agent started, never to a number.** A pidfd is opened at spawn
(the child is ours and unreaped, so its pid cannot have been reused) or at adoption (checked against
the recorded start time *after* opening). The engine's process group is signalled with ``killpg``
only while that pidfd says the leader has not exited: a live leader keeps its pid, and so the group
id, from being reused. (Our own child stays unreaped until its group is swept, which pins the id
even after the leader's exit; an adopted engine is reaped by init, and a reuse in the microseconds
between the check and the signal would need the pid space to wrap.) When the leader exits, what
is left of its group is found by the marker and ended through pidfds of its own: nothing the engine
started outlives it.

**Health after ready.** Each READY engine is probed like kubelet's liveness probe (``probes``):
``failures`` misses in a row make it UNHEALTHY with the reason; a pass makes it READY again. The
control plane stops routing to an UNHEALTHY shard and restarts it.

The supervisor is a service in the trio sense: ``run`` holds the nursery in which every shard's
lifecycle task lives, adopts what it finds (probing each adopted engine once, so that the first
Register already says READY), reports itself through ``task_status.started``, and runs until
cancelled. Cancelling it stops watching, never the engines: an agent stopped on purpose leaves them
serving. Nothing here blocks trio's thread: records, log files, the spawn and ``/proc`` are done in
worker threads.

Commands are idempotent: a repeated ``start`` for a live shard, or one still being spawned, reports
that shard and spawns nothing. ``start`` returns once the process exists; loading takes minutes and
is watched in the background, with every state change announced to subscribers (the session's
per-shard watchers).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import httpx
import trio

import enginedefs
import schema
import statefile
from agent.discovery.model import GpuInfo
from agent.engines import Launch, LaunchContext, ProfileRefused, plan
from agent.supervise import adopt, logfiles, procfs
from agent.supervise.probes import (
    IN_FLIGHT,
    LivenessProbe,
    Verdict,
    auth_headers,
    base_url,
    check_live,
    check_ready,
    in_flight,
    liveness_step,
)
from agent.supervise.records import RecordStore, ShardRecord
from schema.ids import shard_id_problem

log = logging.getLogger("llmgw.agent.supervise")

State = schema.ShardState
LIVE_STATES = (State.STARTING, State.READY, State.UNHEALTHY, State.DRAINING)
TAIL_LINES = 20
DEFAULT_READY_TIMEOUT = 900.0
#: How long the one probe of each adopted engine may take before the supervisor reports started.
ADOPT_PROBE_SECONDS = 3.0

#: How often the running engines' log sizes are checked for rotation.
LOG_CHECK_INTERVAL = 5.0
#: The agent's own settings: never in an engine's environment (the token among them).
AGENT_ENV_PREFIX = "LLMGW_AGENT_"

#: The environment variable of the test hook below, and the points it may name.
TEST_KILL_AT_ENV = "LLMGW_TEST_AGENT_KILL_AT"
TEST_KILL_POINTS = ("after-intent", "after-spawn")

_IN_FLIGHT = IN_FLIGHT  # the name tests/test_e2e_llamacpp.py imports


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
    #: The engine's start time (/proc/PID/stat field 22), which with the pid names one process.
    start_time: int = 0
    #: A pidfd for the engine, from spawn or adoption; -1 when there is none (or it was closed).
    pidfd: int = -1
    log_path: Path | None = None
    launch: Launch | None = None
    proc: subprocess.Popen[bytes] | None = None
    adopted: bool = False
    stopping: bool = False
    #: From spawn until the lifecycle has seen the process exit and removed its record: while set,
    #: no second engine may be started for this shard id, whatever the state says.
    running: bool = False
    #: Ended and included in a Register the control plane acknowledged: not listed again.
    end_reported: bool = False
    version: int = 0
    #: Set once the spawn has finished, either way; a concurrent ``start`` waits on it.
    spawned: trio.Event = attrs.field(factory=trio.Event)
    _public_spec: schema.StartShard | None = attrs.field(default=None, init=False, repr=False)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def public_spec(self) -> schema.StartShard:
        """The spec without the shard's key: what leaves the node in ShardStatus (the control plane
        derives the key itself, and keeps Registers in its state file, which must not hold it)."""
        if not self.spec.api_key:
            return self.spec
        if self._public_spec is None:
            self._public_spec = schema.StartShard.parse(bytes(self.spec))
            self._public_spec.api_key = ""
        return self._public_spec

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
            spec=self.public_spec,
        )


class LaunchFailed(Exception):
    """The engine could not be started (its port is taken, its binary missing); nothing runs."""


@attrs.frozen
class Spawned:
    """What the spawn thread hands back to the trio thread."""

    proc: subprocess.Popen[bytes]
    pidfd: int
    start_time: int
    log_path: Path


def tail(
    path: Path | None, n: int = TAIL_LINES, *, generations: int = 1, redact: Iterable[str] = ()
) -> list[str]:
    """The last ``n`` lines of a log file, across a rotation (``logfiles.tail``). Blocks: call it
    from a worker thread."""
    return logfiles.tail(path, n, generations=generations, redact=redact)


def engine_environment(
    base: Mapping[str, str], ours: Mapping[str, str], secrets: Iterable[str] = ()
) -> dict[str, str]:
    """An engine's environment: ``base`` (the agent's) without the agent's own settings
    (``LLMGW_AGENT_*``, the token among them), without any variable whose value is one of the
    agent's ``secrets`` (however it was named), and without the test hook; then ``ours`` on top."""
    hidden = {s for s in secrets if s}
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith(AGENT_ENV_PREFIX) and k != TEST_KILL_AT_ENV and v not in hidden
    }
    env.update(ours)
    return env


def redact_argv(argv: Sequence[str], secret: str) -> str:
    """A command line for the log with ``secret`` (the shard's key) shown as ``***``."""
    text = " ".join(argv)
    return text.replace(secret, logfiles.REDACTED) if secret else text


def _describe_exit(code: int) -> tuple[int, str]:
    """Popen's negative signal codes, as the shell reports them (128 + N) and in words."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return 128 - code, f"killed by {name}"
    return code, f"exited with code {code}"


def write_files(files: Mapping[str, str]) -> None:
    """An engine's secret files (``Command.files``), through the one state-file write: mode 0600
    from their creation on, so the key is never readable by another user for a moment, and a stale
    one (a crash-looping engine's) replaced whole. Blocks: call it from a worker thread."""
    for path, content in files.items():
        statefile.write_atomic(Path(path), content, mode=0o600)


def remove_files(files: Mapping[str, str]) -> None:
    """Remove an engine's secret files once it has exited (missing ones are fine). Blocks."""
    for path in files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", path, exc.strerror or exc)


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
        liveness: LivenessProbe | None = None,
        verify_listener: bool = True,
        log_max_bytes: int = 50 * 1024 * 1024,
        log_generations: int = 3,
        log_check_interval: float = LOG_CHECK_INTERVAL,
        secrets: Iterable[str] = (),
        test_kill_at: str = "",
    ) -> None:
        """``test_kill_at`` is a test hook, never set in production: ``after-intent`` or
        ``after-spawn`` makes the agent SIGKILL itself at that point of the next start, which is
        how the tests reach the window between fork and record deterministically.

        ``secrets`` are the agent's own (its token): no engine's environment carries them, under
        any name."""
        if test_kill_at and test_kill_at not in TEST_KILL_POINTS:
            raise ValueError(
                f"{TEST_KILL_AT_ENV}={test_kill_at!r}: expected one of {', '.join(TEST_KILL_POINTS)}"
            )
        self.node_id = node_id
        self.verify_listener = verify_listener
        self.gpus = tuple(gpus)
        self.launch_context = launch_context
        self.stop_grace = stop_grace
        self.poll_interval = poll_interval
        self.probe_host = probe_host
        self.liveness = liveness or LivenessProbe()
        self.test_kill_at = test_kill_at
        self.log_dir = log_dir
        self.log_max_bytes = log_max_bytes
        self.log_generations = log_generations
        self.log_check_interval = log_check_interval
        self.secrets = tuple(s for s in secrets if s)
        #: The marker value that makes an engine this agent's: its state directory, absolute.
        self.owner = os.path.abspath(state_dir)
        self.records = RecordStore(state_dir)
        #: Key files of engines that read the shard's key from a file (``Command.files``).
        self.key_dir = Path(self.owner) / "keys"
        self.shards: dict[str, Shard] = {}
        #: Shards being spawned: not announced until their pid is known.
        self._pending: dict[str, Shard] = {}
        #: Set and replaced on every state change of any shard: the session's watchers wait on it.
        self.any_change = trio.Event()
        self._nursery: trio.Nursery | None = None

    # -- the service -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.to_thread.run_sync(self._create_dirs)
            await self._adopt_all()
            nursery.start_soon(self._rotate_logs)
            task_status.started(self)
            await trio.sleep_forever()

    def _create_dirs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.records.create()
        self.key_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.key_dir, 0o700)

    def _sweep_keys(self, keep: set[str]) -> None:
        """Remove every key file but ``keep``'s (blocking)."""
        try:
            stale = [str(p) for p in self.key_dir.iterdir() if str(p) not in keep]
        except OSError as exc:
            log.warning("cannot list %s: %s", self.key_dir, exc.strerror or exc)
            return
        remove_files(dict.fromkeys(stale, ""))

    def _context(self, engine: str) -> LaunchContext:
        """The engine's launch context, with this supervisor's key directory."""
        return attrs.evolve(self.launch_context(engine), key_dir=str(self.key_dir))

    def _survey(self) -> tuple[list[adopt.Decision], list[str]]:
        """Records and ``/proc``, read in a worker thread, and what to do about each shard."""
        loaded = self.records.load_all()
        engines = procfs.find_engines(self.owner)
        recorded_running = {
            r.shard_id
            for r in loaded
            if r.record is not None
            and not r.record.intent
            and procfs.process_start_time(r.record.pid) == r.record.start_time
        }
        notes = [f"{r.path}: {r.problem}" for r in loaded if r.record is None]
        return adopt.plan_adoption(loaded, engines, recorded_running), notes

    async def _adopt_all(self) -> None:
        decisions, notes = await trio.to_thread.run_sync(self._survey)
        for note in notes:
            log.warning("shard record %s", note)
        adopted: list[Shard] = []
        for decision in decisions:
            if isinstance(decision, adopt.Adopt):
                shard = await trio.to_thread.run_sync(self._take_over, decision)
                if shard is not None:
                    self.shards[shard.shard_id] = shard
                    adopted.append(shard)
            elif isinstance(decision, adopt.Gone):
                record = decision.record
                await trio.to_thread.run_sync(self.records.remove, record.shard_id)
                shard = Shard(
                    spec=record.spec, engine=record.engine, pid=record.pid, log_path=Path(record.log_path)
                )
                shard.adopted = True
                self.shards[record.shard_id] = shard
                self._set(
                    shard,
                    State.FAILED,
                    error=(
                        f"engine pid {record.pid} recorded before the agent restarted is gone "
                        "(no process with that pid and start time); not restarted"
                    ),
                    output_tail=await trio.to_thread.run_sync(self._tail, shard),
                )
            elif isinstance(decision, adopt.Drop):
                log.warning("shard record %s dropped: %s", decision.loaded.path, decision.why)
                await trio.to_thread.run_sync(self._drop, decision)
            else:
                log.warning(
                    "stopping engine pid %d of shard %s: %s", decision.pid, decision.shard_id, decision.why
                )
                assert self._nursery is not None
                self._nursery.start_soon(self._end_stray, decision.pid, decision.start_time)
        # Key files of engines that did not survive the agent's absence (the files of the adopted
        # ones stay until they exit): nothing else would ever remove them.
        keep = {path for shard in adopted if shard.launch for path in shard.launch.command.files}
        await trio.to_thread.run_sync(self._sweep_keys, keep)
        # Each adopted engine is probed once, together and bounded, so that the first Register
        # already says READY for a healthy one (the router would otherwise lose it for a moment).
        async with trio.open_nursery() as probes:
            for shard in adopted:
                probes.start_soon(self._probe_adopted, shard)
        for shard in adopted:
            self._spawn_lifecycle(shard)

    def _take_over(self, decision: adopt.Adopt) -> Shard | None:
        """Open the adopted engine's pidfd (checking it is still that process), rewrite its record
        when needed, and build its Shard. Runs in a worker thread."""
        fd = procfs.open_pidfd(decision.pid, decision.start_time)
        if fd is None:
            log.warning(
                "engine pid %d of shard %s exited while being adopted", decision.pid, decision.shard_id
            )
            self.records.remove(decision.shard_id)
            return None
        spec = decision.spec
        engine = spec.profile.engine if spec.profile else ""
        log_path = self.log_dir / f"{decision.shard_id}.log"
        if decision.rewrite:
            log.warning(
                "shard %s: %s; record rebuilt from the engine's marker", decision.shard_id, decision.note
            )
            self.records.save(
                ShardRecord(
                    shard_id=decision.shard_id,
                    engine=engine,
                    pid=decision.pid,
                    start_time=decision.start_time,
                    port=spec.http_port,
                    log_path=str(log_path),
                    spec=spec,
                )
            )
        shard = Shard(
            spec=spec,
            engine=engine,
            pid=decision.pid,
            start_time=decision.start_time,
            pidfd=fd,
            log_path=log_path,
            adopted=True,
            running=True,
        )
        shard.spawned.set()
        try:
            shard.launch = plan(spec, self.gpus, self._context(engine))
        except ProfileRefused as exc:
            log.warning(
                "adopted shard %s no longer validates (%s); watching it anyway", decision.shard_id, exc
            )
        log.info("adopted %s: engine pid %d still running", decision.shard_id, decision.pid)
        return shard

    def _tail(self, shard: Shard) -> list[str]:
        """The failure tail of a shard's log (across a rotation, its key hidden); blocks."""
        return tail(
            shard.log_path, TAIL_LINES, generations=self.log_generations, redact=(shard.spec.api_key,)
        )

    async def _rotate_logs(self) -> None:
        """Every ``log_check_interval``, rotate the logs of running engines that grew past
        ``log_max_bytes`` (``logfiles.rotate``: copy, then truncate), in a worker thread."""
        while True:
            await trio.sleep(self.log_check_interval)
            paths = [s.log_path for s in self.shards.values() if s.running and s.log_path is not None]
            if paths:
                await trio.to_thread.run_sync(self._rotate_paths, paths)

    def _rotate_paths(self, paths: Sequence[Path]) -> None:
        for path in paths:
            try:
                if logfiles.rotate(path, self.log_max_bytes, self.log_generations):
                    log.info("rotated %s (over %d bytes)", path, self.log_max_bytes)
            except OSError as exc:
                log.warning("cannot rotate %s: %s", path, exc.strerror or exc)

    def _drop(self, decision: adopt.Drop) -> None:
        if decision.set_aside:
            try:
                self.records.set_aside(decision.loaded)
            except OSError as exc:
                log.warning("cannot move %s aside: %s", decision.loaded.path, exc)
        else:
            decision.loaded.path.unlink(missing_ok=True)

    async def _probe_adopted(self, shard: Shard) -> None:
        launch = shard.launch
        if launch is None or launch.readiness.follow_rank0:
            return
        with trio.move_on_after(ADOPT_PROBE_SECONDS):
            async with self.engine_client(shard, timeout=ADOPT_PROBE_SECONDS) as client:
                verdict, detail = await self._check_ready(client, shard)
            if verdict is Verdict.READY:
                self._set(shard, State.READY)
            else:
                log.info("adopted %s not ready yet (%s); polling", shard.shard_id, detail)

    async def _end_stray(self, pid: int, start_time: int) -> None:
        """Stop an engine of ours that must not run (a duplicate): SIGTERM, SIGKILL after the grace."""
        fd = await trio.to_thread.run_sync(procfs.open_pidfd, pid, start_time)
        if fd is None:
            return
        try:
            _killpg_while_alive(fd, pid, signal.SIGTERM)
            with trio.move_on_after(self.stop_grace):
                await trio.lowlevel.wait_readable(fd)
            _killpg_while_alive(fd, pid, signal.SIGKILL)
        finally:
            os.close(fd)

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
        """Every shard this supervisor knows, live or ended."""
        return [s.status(self.node_id) for s in self.shards.values()]

    def register_statuses(self) -> list[schema.ShardStatus]:
        """What Register lists (the proto's ``Register.shards``): every live shard, and the shards
        that ended since the last Register the control plane acknowledged."""
        return [s.status(self.node_id) for s in self.shards.values() if s.live or not s.end_reported]

    def register_acknowledged(self, listed: Iterable[schema.ShardStatus]) -> None:
        """The control plane has the Register that listed ``listed``: ended shards in it, at the
        version listed, are not listed again."""
        for status in listed:
            shard = self.shards.get(status.shard_id)
            if shard is not None and not shard.live and shard.state == status.state:
                shard.end_reported = True

    # -- commands ------------------------------------------------------------------------------

    async def start(self, spec: schema.StartShard) -> Shard:
        """Start a shard, or report the one with that id that is live or still being spawned
        (idempotent). Returns once the process exists (or could not be started); never waits for
        loading.

        Raises :class:`ProfileRefused` when the shard id is invalid (nothing recorded) or the profile
        is one the engine would refuse (recorded as failed, so watchers report it); nothing is
        spawned then. A start that fails otherwise (its port is taken) returns the shard FAILED.
        """
        assert self._nursery is not None, "Supervisor.run() must be started first"
        problem = shard_id_problem(spec.shard_id)
        if problem:
            raise ProfileRefused("shard-id", problem)
        pending = self._pending.get(spec.shard_id)
        if pending is not None:
            await pending.spawned.wait()
            return pending
        existing = self.shards.get(spec.shard_id)
        if existing is not None and (existing.live or existing.running):
            return existing
        engine = spec.profile.engine if spec.profile else ""
        shard = Shard(spec=spec, engine=engine)
        try:
            shard.launch = plan(spec, self.gpus, self._context(engine))
        except ProfileRefused as exc:
            shard.spawned.set()
            self.shards[spec.shard_id] = shard
            self._set(shard, State.FAILED, error=f"StartShard refused: {exc}")
            raise
        self._pending[spec.shard_id] = shard
        self._nursery.start_soon(self._launch, shard)
        await shard.spawned.wait()
        return shard

    async def _launch(self, shard: Shard) -> None:
        """Spawn (in a worker thread), announce, then watch; in the supervisor's nursery, so that a
        session cancelled mid-start cannot leave an engine nobody watches."""
        error = ""
        spawned: Spawned | None = None
        try:
            spawned = await trio.to_thread.run_sync(self._spawn, shard)
        except LaunchFailed as exc:
            error = str(exc)
        except Exception as exc:
            # A daemon that runs for months: one start that fails in a way nobody foresaw is a
            # FAILED shard with the reason, not the end of the supervisor and every engine's watch.
            log.exception("shard %s: start failed unexpectedly", shard.shard_id)
            error = f"cannot start: unexpected {type(exc).__name__}: {exc}"
        finally:
            del self._pending[shard.shard_id]
            self.shards[shard.shard_id] = shard
        if spawned is None:
            self._set(shard, State.FAILED, error=error, output_tail=[])
            shard.spawned.set()
            return
        shard.proc, shard.pid, shard.pidfd = spawned.proc, spawned.proc.pid, spawned.pidfd
        shard.start_time, shard.log_path, shard.running = spawned.start_time, spawned.log_path, True
        self._set(shard, State.STARTING, error="", exit_code=None, output_tail=[])
        shard.spawned.set()
        await self._lifecycle(shard)

    def _spawn(self, shard: Shard) -> Spawned:
        """Port check, intent record, log file, spawn, pidfd, record: the blocking part of a start,
        in a worker thread. Raises :class:`LaunchFailed` with nothing left running."""
        spec, launch = shard.spec, shard.launch
        assert launch is not None
        if spec.http_port and not launch.readiness.follow_rank0:
            holder = procfs.port_in_use(spec.http_port)
            if holder:
                raise LaunchFailed(
                    f"port {spec.http_port} is already in use by {holder}; not starting a second "
                    "engine on it (stop that process, or let the control plane place the shard elsewhere)"
                )
        log_path = self.log_dir / f"{spec.shard_id}.log"
        record = ShardRecord(
            shard_id=spec.shard_id,
            engine=shard.engine,
            pid=0,
            start_time=0,
            port=spec.http_port,
            log_path=str(log_path),
            spec=spec,
        )
        try:
            self.records.save(record)  # the intent: durable before anything can outlive us
        except OSError as exc:
            raise LaunchFailed(
                f"cannot record the intent to start in {self.records.dir}: {exc.strerror or exc}; "
                "not starting an engine the agent could lose track of"
            ) from exc
        self._test_hook("after-intent")
        command = launch.command
        try:
            write_files(command.files)
        except OSError as exc:
            remove_files(command.files)
            self.records.remove(spec.shard_id)
            raise LaunchFailed(f"cannot write the engine's key file: {exc.strerror or exc}") from exc
        # Ours last: a profile's env must not be able to disown or misname the engine.
        env = engine_environment(
            os.environ,
            {**command.env, **procfs.marker_env(spec.shard_id, self.owner, spec)},
            self.secrets,
        )
        try:
            # A crash-looping engine appends a start line and its output per attempt: rotate here too.
            logfiles.rotate(log_path, self.log_max_bytes, self.log_generations)
        except OSError as exc:
            log.warning("cannot rotate %s: %s", log_path, exc.strerror or exc)
        try:
            with open(log_path, "ab") as logf:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                argv = redact_argv(command.argv, spec.api_key)
                logf.write(f"=== llmgw {stamp}: starting {spec.shard_id}: {argv}\n".encode())
                logf.flush()
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
            remove_files(command.files)
            self.records.remove(spec.shard_id)
            raise LaunchFailed(f"cannot start {command.argv[0]}: {exc.strerror or exc}") from exc
        self._test_hook("after-spawn")
        # Our child, not reaped until the lifecycle says so: the pid cannot have been reused yet.
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError as exc:
            os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group id is still this engine's
            proc.wait()
            self.records.remove(spec.shard_id)
            raise LaunchFailed(
                f"cannot open a pidfd for engine pid {proc.pid}: {exc.strerror or exc}"
            ) from exc
        stat = procfs.read_stat(proc.pid)
        start_time = stat.start_time if stat is not None else 0
        try:
            self.records.save(attrs.evolve(record, pid=proc.pid, start_time=start_time))
        except OSError as exc:
            # The intent and the marker are enough for a restarted agent to find this engine.
            log.warning("shard %s: cannot record pid %d: %s", spec.shard_id, proc.pid, exc)
        return Spawned(proc=proc, pidfd=pidfd, start_time=start_time, log_path=log_path)

    def _test_hook(self, point: str) -> None:
        if self.test_kill_at == point:
            log.warning("test hook %s=%s: the agent kills itself now", TEST_KILL_AT_ENV, point)
            os.kill(os.getpid(), signal.SIGKILL)

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

    async def logs(self, shard_id: str, lines: int = 100) -> list[str]:
        """The tail of the shard's log; the log file outlives the shard, so an id this supervisor no
        longer holds is still answered when its file is there."""
        return (await self.read_log(shard_id, lines))[0]

    async def read_log(
        self, shard_id: str, lines: int = 100, *, previous: bool = False, after: int | None = None
    ) -> tuple[list[str], int]:
        """What ``ctl logs`` asks for, and the offset in the live log where the lines end (the
        cursor ``ctl logs -f`` sends back as ``after``): the tail (``logfiles.tail_and_offset``),
        the run before the last restart (``previous``, ``logfiles.previous_run``), or the lines
        written after ``after`` (``logfiles.read_after``)."""
        shard = self.shards.get(shard_id)
        path = shard.log_path if shard is not None else None
        if path is None and not shard_id_problem(shard_id):
            candidate = self.log_dir / f"{shard_id}.log"
            if await trio.to_thread.run_sync(candidate.exists):
                path = candidate
        if shard is None and path is None:
            raise KeyError(f"no shard {shard_id!r} on this node")
        secrets = (shard.spec.api_key,) if shard is not None else ()

        def read() -> tuple[list[str], int]:
            if path is None:
                return [], 0
            if after is not None:
                return logfiles.read_after(path, after, redact=secrets)
            if previous:
                return logfiles.previous_run(path, lines, generations=self.log_generations, redact=secrets), 0
            return logfiles.tail_and_offset(path, lines, generations=self.log_generations, redact=secrets)

        return await trio.to_thread.run_sync(read)

    # -- lifecycle -----------------------------------------------------------------------------

    def _spawn_lifecycle(self, shard: Shard) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._lifecycle, shard)

    async def _lifecycle(self, shard: Shard) -> None:
        """Watch health and exit together; whichever ends first decides the next state."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_health, shard)
            code = await self._wait_exit(shard)
            nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(self.records.remove, shard.shard_id)
        if shard.launch is not None:
            await trio.to_thread.run_sync(remove_files, shard.launch.command.files)
        output = await trio.to_thread.run_sync(self._tail, shard)
        shard.running = False
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
            after_ready = shard.state in (State.READY, State.UNHEALTHY, State.DRAINING)
            when = "after it was ready" if after_ready else "while loading"
            self._set(
                shard, State.FAILED, error=f"engine {how} {when}", exit_code=exit_code, output_tail=output
            )

    async def _wait_exit(self, shard: Shard) -> int | None:
        """Wait for the engine to exit (its pidfd turns readable: no polling, works for adopted
        non-children too), end what is left of its process group, then reap it if it is ours."""
        fd = shard.pidfd
        if fd >= 0:
            await trio.lowlevel.wait_readable(fd)
            await trio.to_thread.run_sync(self._sweep, shard)
            shard.pidfd = -1
            os.close(fd)
        if shard.proc is not None:
            return await trio.to_thread.run_sync(shard.proc.wait)
        return None

    def _sweep(self, shard: Shard) -> None:
        """End the engine's own processes that outlived it (workers, helpers): found by marker and
        process group, each signalled through a pidfd of its own. Runs in a worker thread."""
        for member in procfs.marked_members(shard.pid, self.owner, shard.shard_id):
            fd = procfs.open_pidfd(member.pid, member.start_time)
            if fd is None:
                continue
            try:
                log.warning("shard %s: pid %d outlived its engine; SIGKILL", shard.shard_id, member.pid)
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)

    def engine_client(self, shard: Shard, timeout: float) -> httpx.AsyncClient:
        """A client for the engine's own address, carrying the shard's key: the probes and the
        drain's and the load scraper's ``/metrics`` reads are asked with it like any request (an engine may guard more
        than ``/v1``)."""
        return httpx.AsyncClient(
            base_url=base_url(self.probe_host, shard.spec.http_port),
            headers=auth_headers(shard.spec.api_key),
            timeout=timeout,
        )

    async def _check_ready(self, client: httpx.AsyncClient, shard: Shard) -> tuple[Verdict, str]:
        """One readiness check, then whether the answer came from this engine's own socket."""
        assert shard.launch is not None
        check = await check_ready(client, shard.launch.readiness)
        if check.verdict is not Verdict.READY or shard.pid <= 0 or not self.verify_listener:
            return check.verdict, check.detail
        problem = await trio.to_thread.run_sync(procfs.listener_problem, shard.spec.http_port, shard.pid)
        if problem:
            return Verdict.NOT_YET, f"{problem}: its answers do not count"
        return Verdict.READY, check.detail

    async def _watch_health(self, shard: Shard) -> None:
        """Readiness until READY (unless adopted ready), then liveness for as long as it runs."""
        launch = shard.launch
        if launch is None:
            return
        if launch.readiness.follow_rank0:
            # A worker rank has no HTTP of its own; it is ready when rank 0 is, which only the
            # control plane can see. Running is all this node can vouch for.
            if shard.state is State.STARTING:
                self._set(shard, State.READY)
            return
        if shard.state is State.STARTING and not await self._await_ready(shard):
            return
        await self._watch_liveness(shard)

    async def _await_ready(self, shard: Shard) -> bool:
        timeout = shard.spec.ready_timeout_seconds or DEFAULT_READY_TIMEOUT
        last = "no answer yet"
        async with self.engine_client(shard, timeout=min(5.0, timeout)) as client:
            with trio.move_on_after(timeout):
                while True:
                    verdict, last = await self._check_ready(client, shard)
                    if verdict is Verdict.READY:
                        if shard.state is State.STARTING and not shard.stopping:
                            self._set(shard, State.READY)
                        return shard.state is State.READY
                    if verdict is Verdict.WRONG_MODEL:
                        self._fail_start(shard, f"{last} (GET /v1/models on port {shard.spec.http_port})")
                        return False
                    await trio.sleep(self.poll_interval)
        self._fail_start(shard, f"not ready within {timeout:g} s (last check: {last})")
        return False

    def _fail_start(self, shard: Shard, why: str) -> None:
        """A start that cannot succeed: FAILED with the reason, and the engine stopped."""
        if shard.state is not State.STARTING:
            return
        self._set(shard, State.FAILED, error=f"{why}; stopping the engine")
        assert self._nursery is not None
        self._nursery.start_soon(self._tail_into, shard)
        self._signal_group(shard, signal.SIGTERM)
        self._nursery.start_soon(self._kill_after, shard, self.stop_grace)

    async def _tail_into(self, shard: Shard) -> None:
        output = await trio.to_thread.run_sync(self._tail, shard)
        if shard.state is State.FAILED and not shard.output_tail:
            self._set(shard, State.FAILED, output_tail=output)

    async def _watch_liveness(self, shard: Shard) -> None:
        """kubelet's liveness probe: one probe every ``period`` (each bounded by ``timeout``), and
        ``failures`` misses in a row make the shard UNHEALTHY; a pass makes it READY again."""
        assert shard.launch is not None
        probe = self.liveness
        path = shard.launch.readiness.health_path
        failures = 0
        async with self.engine_client(shard, timeout=probe.timeout) as client:
            next_at = trio.current_time() + probe.period
            while True:
                await trio.sleep_until(next_at)
                # A fixed schedule (not sleep-after-probe): a hung engine is found within
                # period x failures (+ one timeout), however long each failed probe waited.
                next_at = max(next_at + probe.period, trio.current_time())
                if shard.stopping or shard.state not in (State.READY, State.UNHEALTHY):
                    return
                problem = await check_live(client, path, probe.timeout)
                if shard.stopping or shard.state not in (State.READY, State.UNHEALTHY):
                    return
                step = liveness_step(shard.state, failures, not problem, probe.failures)
                failures = step.failures
                if step.state is shard.state:
                    continue
                if step.state is State.UNHEALTHY:
                    error = f"liveness probe failed {failures} times in a row: {problem}"
                    self._set(shard, State.UNHEALTHY, error=error)
                else:
                    log.info("shard %s: liveness probe passes again", shard.shard_id)
                    self._set(shard, State.READY, error="")

    def _begin_stop(self, shard: Shard, grace: float) -> None:
        shard.stopping = True
        self._signal_group(shard, signal.SIGTERM)
        assert self._nursery is not None
        self._nursery.start_soon(self._kill_after, shard, grace)

    async def _kill_after(self, shard: Shard, grace: float) -> None:
        await trio.sleep(grace)
        if shard.running and shard.pidfd >= 0 and not procfs.pidfd_exited(shard.pidfd):
            log.warning("shard %s did not stop within %g s of SIGTERM; SIGKILL", shard.shard_id, grace)
            self._signal_group(shard, signal.SIGKILL)

    def _signal_group(self, shard: Shard, sig: signal.Signals) -> None:
        """Signal the engine's process group, only while its pidfd says the leader has not exited
        (see the module docstring for why that makes the group id safe to use)."""
        if shard.pidfd < 0:
            return
        try:
            _killpg_while_alive(shard.pidfd, shard.pid, sig)
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
        descriptor = enginedefs.lookup(shard.engine)
        metrics = descriptor.publishes.metrics_path if descriptor is not None else "/metrics"
        async with self.engine_client(shard, timeout=2.0) as client:
            while trio.current_time() < end and shard.state is State.DRAINING:
                if await in_flight(client, metrics) == 0:
                    break
                await trio.sleep(min(self.poll_interval, max(end - trio.current_time(), 0)))
        if shard.state is State.DRAINING:
            self._begin_stop(shard, self.stop_grace)


def _killpg_while_alive(pidfd: int, pgid: int, sig: signal.Signals) -> None:
    """``killpg(pgid, sig)`` if the leader behind ``pidfd`` has not exited; a no-op otherwise."""
    if procfs.pidfd_exited(pidfd):
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


__all__ = [
    "LIVE_STATES",
    "LaunchFailed",
    "LivenessProbe",
    "Shard",
    "Supervisor",
    "engine_environment",
    "redact_argv",
    "tail",
]
