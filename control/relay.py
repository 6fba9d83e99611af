"""The router's streaming pump: one trio task that moves SSE chunks from engines to clients.

Why one task for all streams. A streamed response costs the router one wake-up per token for as
long as it lasts, and on a busy router that wake-up is most of its CPU. With one task per stream,
each wake-up is a full round of trio's scheduler for that task: re-arming a one-shot epoll
registration (a system call), parking and rescheduling the task, resuming its coroutine stack.
``RelayPump`` instead keeps every streaming engine socket in one level-triggered epoll set of its
own, whose descriptor trio watches like any socket. One trio wake-up then serves every stream with
a chunk waiting: per chunk, exactly one ``recv``, one scan of the chunk-size lines
(``router.ChunkedScanner``) and one ``write``, and no registration calls at all. The busier the
router, the more chunks share a wake-up.

What stays in the response's own task: reading the request, choosing a replica, retries, the
response head (with whatever part of the body came with it), and every decision after the body
ends. The pump only moves bytes, and it runs in trio's thread, so there are
no locks: a job is registered, served and withdrawn between checkpoints.

Ownership. The task that owns a response stays parked in ``relay`` until the body has ended,
failed, or the task is cancelled (its client left, or the router is stopping). Cancellation
withdraws the job from the epoll set before ``relay`` raises, so the caller may close both sockets
at once (closing the engine's socket is what cancels the engine's work).

Back-pressure. A client that reads slower than its engine writes fills its socket buffer; the job
then stops reading the engine (its interest moves to the client's socket becoming writable) until
the buffer drains, so memory per stream stays bounded by one ``recv``.

Two implementations, one contract. ``NativeRelayPump`` runs the loop above in a thread of C
(``control/_pump.c``) that never takes the GIL: a relayed event then costs the router its
``epoll_wait``, ``recv`` and ``send`` and nothing of the interpreter's, and the trio side wakes
once per *ended* body rather than once per event. ``PythonRelayPump`` is the same loop in trio's
thread, for a build without a C compiler (the extension is optional). ``make_pump`` picks the
native one when it is built; ``LLMGW_RELAY=python`` (or ``native``, which then must be there)
overrides, for comparisons and tests.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable
from typing import Protocol

import outcome
import trio

try:
    from control import _pump
except ImportError:  # built without a C compiler: the Python pump serves
    _pump = None  # type: ignore[assignment]

NATIVE_AVAILABLE = _pump is not None

RECEIVE_SIZE = 65536  # per recv, here and in the router
MAX_COALESCE_US = 100_000  # as control/_pump.c checks
# The router's default pause: a decode step's tokens for a few dozen streams arrive within about
# that, and a token delayed by half a millisecond is a few percent of an engine's inter-token
# latency, and only while the pump is busy (an idle pump relays at once). Measured on the sim
# engine (ITL 5 ms), two CPUs, three interleaved rounds: router CPU per event 29.2-30.5 us at
# concurrency 32 and 29.1-32.0 us at 256 with 250 us, 23.7-29.6 and 27.4-31.5 us with 500 us;
# the clients' inter-token gaps and first bytes were no later (on a saturated machine, the CPU
# the router gives back is the engine's and the clients'). 1000 us saved little more.
DEFAULT_COALESCE_US = 500
MAX_EVENTS = 512  # per wake-up; the rest wait for the next round, after other tasks had theirs


class Scanner(Protocol):
    """What the pumps need from a body framing scanner (``router.ChunkedScanner``): the Python
    pump feeds it; the native one takes its state over (and does not hand it back)."""

    @property
    def done(self) -> bool: ...

    def feed(self, data: bytes) -> int: ...

    def snapshot(self) -> tuple[int, int, bytes]: ...


class Pump(Protocol):
    """What the router needs from a pump."""

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...

    async def relay(self, up: socket.socket, client_fd: int, scanner: Scanner) -> bool: ...

    def stats(self) -> tuple[int, int]: ...

    @property
    def kind(self) -> str: ...


def make_pump(kind: str | None = None, coalesce_us: int = 0) -> Pump:
    """The native pump when it is built, else the Python one; ``kind`` (default: the
    ``LLMGW_RELAY`` environment variable) may ask for ``native`` or ``python`` explicitly.
    ``coalesce_us``: the native pump's pause after each wake-up (``_pump.c``, ``serve``), so that
    the tokens one decode step writes to many streams are relayed by one wake-up; the Python pump
    has no such pause (each of its wake-ups costs a trio round anyway)."""
    kind = kind or os.environ.get("LLMGW_RELAY", "") or "auto"
    if not 0 <= coalesce_us <= MAX_COALESCE_US:
        raise ValueError(f"relay coalescing must be 0 to {MAX_COALESCE_US} us, got {coalesce_us}")
    if kind == "python" or (kind == "auto" and _pump is None):
        return PythonRelayPump()
    if kind in ("native", "auto"):
        if _pump is None:
            raise RuntimeError(
                "LLMGW_RELAY=native: the native relay pump (control/_pump.c) was not built; "
                "install llmgw where a C compiler is available, or use LLMGW_RELAY=python"
            )
        return NativeRelayPump(coalesce_us)
    raise ValueError(f"LLMGW_RELAY={kind!r}: expected native, python or auto")


class RelayClosed(Exception):
    """The pump is not running (the router is stopping)."""


class EngineClosed(Exception):
    """The engine's connection failed or closed before the body ended, or sent a bad chunk."""


class ClientGone(Exception):
    """Writing to the client failed: it closed or reset its connection."""


class _Job:
    __slots__ = ("client_fd", "extra", "finished", "pending", "scanner", "task", "up", "up_fd", "watching")

    def __init__(self, up: socket.socket, client_fd: int, scanner: Scanner, task: trio.lowlevel.Task) -> None:
        self.up = up
        self.up_fd = up.fileno()
        self.client_fd = client_fd
        self.scanner = scanner
        self.task = task
        self.pending = b""  # bytes the client's socket did not take yet
        self.extra = False  # the engine sent bytes past the body's end
        self.watching = self.up_fd  # the descriptor this job waits on in the epoll set
        self.finished = False


class NativeRelayPump:
    """The pump's loop in a C thread (``control/_pump.c``); this side parks the tasks that own
    the bodies and wakes each one when its body ended."""

    kind = "native"

    def __init__(self, coalesce_us: int = 0) -> None:
        self.coalesce_us = coalesce_us
        self._native: _pump.Pump | None = None
        self._parked: dict[int, trio.lowlevel.Task] = {}  # engine descriptor -> owning task

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve relays until cancelled; jobs still parked then fail with ``RelayClosed``."""
        native = self._native = _pump.Pump(coalesce_us=self.coalesce_us)
        parked = self._parked
        errors = {_pump.ENGINE: EngineClosed, _pump.CLIENT: ClientGone}
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(native.notify_fd)
                for up_fd, code, extra, message in native.collect():
                    task = parked.pop(up_fd, None)
                    if task is None:
                        continue
                    if code == _pump.DONE:
                        trio.lowlevel.reschedule(task, outcome.Value(not extra))
                    else:
                        trio.lowlevel.reschedule(task, outcome.Error(errors[code](message)))
        finally:
            self._native = None
            native.close()  # joins the thread: from here on nothing touches the descriptors
            trio.lowlevel.notify_closing(native.notify_fd)
            for task in parked.values():
                trio.lowlevel.reschedule(task, outcome.Error(RelayClosed("the router is stopping")))
            parked.clear()

    def stats(self) -> tuple[int, int]:
        """(streams being relayed, of which waiting for a slow client to read), for /metrics."""
        return self._native.stats() if self._native is not None else (0, 0)

    async def relay(self, up: socket.socket, client_fd: int, scanner: Scanner) -> bool:
        """As ``PythonRelayPump.relay``; ``scanner``'s state moves to the thread and the object
        itself is left behind as it was."""
        native = self._native
        if native is None:
            raise RelayClosed("the relay pump is not running")
        up_fd = up.fileno()
        native.add(up_fd, client_fd, *scanner.snapshot())
        self._parked[up_fd] = trio.lowlevel.current_task()

        def abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
            self._parked.pop(up_fd, None)
            native.withdraw(up_fd)  # also drops a result the thread queued meanwhile
            return trio.lowlevel.Abort.SUCCEEDED

        result: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return result


class PythonRelayPump:
    """The pump (see the module docstring) in trio's thread. ``run`` is the service, started in
    the router's nursery; ``relay`` hands over the rest of one response body."""

    kind = "python"

    def __init__(self) -> None:
        self._epoll: select.epoll | None = None
        self._jobs: dict[int, _Job] = {}  # watched descriptor -> job

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve relays until cancelled; jobs still parked then fail with ``RelayClosed``."""
        epoll = self._epoll = select.epoll()
        jobs = self._jobs
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                for fd, _ in epoll.poll(0, MAX_EVENTS):
                    job = jobs.get(fd)
                    if job is None:
                        continue
                    try:
                        if fd == job.up_fd:
                            self._readable(job)
                        else:
                            self._writable(job)
                    except Exception as exc:  # a bug must fail its own response, not every stream
                        self._finish(job, outcome.Error(exc))
        finally:
            self._epoll = None
            for job in list(jobs.values()):
                self._finish(job, outcome.Error(RelayClosed("the router is stopping")))
            trio.lowlevel.notify_closing(epoll.fileno())
            epoll.close()

    def stats(self) -> tuple[int, int]:
        """(streams being relayed, of which waiting for a slow client to read), for /metrics."""
        streams = blocked = 0
        for fd, job in self._jobs.items():
            streams += 1
            blocked += fd == job.client_fd
        return streams, blocked

    async def relay(self, up: socket.socket, client_fd: int, scanner: Scanner) -> bool:
        """Relay the rest of a chunked body from ``up`` to ``client_fd``, as it arrives, byte for
        byte. Returns whether ``up`` may carry another request (the body ended exactly at its last
        chunk). Raises ``EngineClosed``, ``ClientGone``, ``RelayClosed`` or what the scanner raises on
        a malformed chunk; when cancelled, the job is withdrawn first."""
        if self._epoll is None:
            raise RelayClosed("the relay pump is not running")
        job = _Job(up, client_fd, scanner, trio.lowlevel.current_task())
        self._watch(job, job.up_fd, select.EPOLLIN)

        def abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
            self._unwatch(job)
            return trio.lowlevel.Abort.SUCCEEDED

        result: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    # -- inside the pump ------------------------------------------------------------------------

    def _readable(self, job: _Job) -> None:
        try:
            data = job.up.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(job, outcome.Error(EngineClosed(str(exc))))
            return
        if not data:
            self._finish(job, outcome.Error(EngineClosed("the engine closed the connection mid-response")))
            return
        used = job.scanner.feed(data)
        if used < len(data):
            job.extra = True
            data = data[:used]
        self._send(job, data)

    def _writable(self, job: _Job) -> None:
        data, job.pending = job.pending, b""
        self._send(job, data)
        if not job.finished and not job.pending:  # drained: back to reading the engine
            self._unwatch(job)
            self._watch(job, job.up_fd, select.EPOLLIN)

    def _send(self, job: _Job, data: bytes) -> None:
        try:
            sent = os.write(job.client_fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._finish(job, outcome.Error(ClientGone(str(exc))))
            return
        if sent < len(data):
            # The client's socket is full: stop reading the engine until it drains.
            job.pending = data[sent:]
            if job.watching != job.client_fd:
                self._unwatch(job)
                self._watch(job, job.client_fd, select.EPOLLOUT)
            return
        if job.scanner.done:
            self._finish(job, outcome.Value(not job.extra))

    # -- bookkeeping ------------------------------------------------------------------------------

    def _watch(self, job: _Job, fd: int, mask: int) -> None:
        assert self._epoll is not None
        self._epoll.register(fd, mask)
        self._jobs[fd] = job
        job.watching = fd

    def _unwatch(self, job: _Job) -> None:
        fd = job.watching
        if self._jobs.get(fd) is job:
            del self._jobs[fd]
            if self._epoll is not None:
                self._epoll.unregister(fd)

    def _finish(self, job: _Job, result: outcome.Outcome[bool]) -> None:
        if job.finished:
            return
        job.finished = True
        self._unwatch(job)
        trio.lowlevel.reschedule(job.task, result)
