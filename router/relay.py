"""The relay of an engine's response to its client: ``Relay`` (at the end: the whole response
by the pump, or from a head the router read), and the streaming pump it hands bodies to, one
trio task that moves SSE chunks from engines to clients.

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
no locks: a job is registered, served and withdrawn between checkpoints. The native pump also
takes the usual response head over (``NativeRelayPump.respond``): an HTTP/1.1 200 with a chunked
body is rewritten for the client and relayed by its thread, so the response's task is woken once
per streamed request rather than twice; any other head is handed back to the task unsent.

Ownership. The task that owns a response stays parked in ``relay`` until the body has ended,
failed, or the task is cancelled (its client left, or the router is stopping). Cancellation
withdraws the job from the epoll set before ``relay`` raises, so the caller may close both sockets
at once (closing the engine's socket is what cancels the engine's work).

Back-pressure. A client that reads slower than its engine writes fills its socket buffer; the job
then stops reading the engine (its interest moves to the client's socket becoming writable) until
the buffer drains, so memory per stream stays bounded by one ``recv``.

Per-event facts for /metrics. Where a pump handles each event anyway (the read and the chunk
scan), it also notes what the router's histograms need: how many events (chunks) a body had, when
its first came and the gaps between them (bucket counts over ``ITL_BUCKETS``), and, for a response
whose token usage the router reads, the body's last ``TAIL_BYTES`` bytes. These travel with the
job's result (``StreamFacts``), and the router folds them into its metrics once per response:
no Python runs per event on the native pump, and nothing is parsed per chunk.

Two implementations, one contract. ``NativeRelayPump`` runs the loop above in a thread of C
(``router/_pump.c``) that never takes the GIL: a relayed event then costs the router its
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
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import attrs
import outcome
import trio

from router.exchange import ClientLeft, Exchange, RouterError
from router.framing import CHUNKED, LENGTH, NO_BODY, UNTIL_CLOSE, ChunkedScanner, ResponseHead, UpstreamBroken
from router.http1 import LAST_CHUNK, chunk, end_of_head, status_block
from router.pumpconst import MAX_COALESCE_US, RECEIVE_SIZE, TAIL_BYTES
from router.routes import Upstream

if TYPE_CHECKING:
    from router.metrics import Metrics
    from router.retry import Ejection
    from router.upstream import UpstreamConn

try:
    from router import _pump
except ImportError:  # built without a C compiler: the Python pump serves
    _pump = None  # type: ignore[assignment]

NATIVE_AVAILABLE = _pump is not None

# The router's default bound on the pause (the pause adapts below it: none with one stream, the
# whole bound from nine on, and never before a response's first event; see _pump.c, serve): a
# decode step's tokens for a few dozen streams arrive within about that, and a token delayed by
# half a millisecond is a few percent of an engine's inter-token latency, and only while the pump
# is busy (an idle pump relays at once). How it was chosen: docs/router.md, 2026-12-04.
DEFAULT_COALESCE_US = 500
MAX_EVENTS = 512  # per wake-up; the rest wait for the next round, after other tasks had theirs

#: Bucket bounds (seconds) of the gaps between a stream's events (inter-token latency). Engines
#: decode a token in about 5 to 100 ms, slower under load or with long contexts, and a stalled one
#: is cut off by the stream idle timeout; the lowest bounds catch events that arrived together (a
#: gap of 0 s: the engine wrote them in one step, or the coalescing pause batched them).
ITL_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
)  # fmt: skip


class StreamFacts:
    """What a pump learned about one response body while relaying it, read by the router once
    the body ended (``Router`` folds it into ``/metrics``): ``events`` (chunks begun), ``first_at``
    and ``last_at`` (``time.monotonic`` seconds of the reads that brought the first and the last),
    the gaps between consecutive events as ``gaps`` (counts per bucket of ``bounds``, the last
    slot for gaps above every bound) and ``gap_sum``, and ``tail`` (with ``want_tail``: the body's
    last ``TAIL_BYTES`` bytes). Events read together are 0 s apart. The Python pump updates it per
    read; the native one hands its own counts over once (``absorb``)."""

    __slots__ = ("bounds", "events", "first_at", "gap_sum", "gaps", "last_at", "tail", "want_tail")

    def __init__(self, bounds: tuple[float, ...] = ITL_BUCKETS, *, want_tail: bool = False) -> None:
        self.bounds = bounds
        self.want_tail = want_tail
        self.events = 0
        self.first_at = self.last_at = self.gap_sum = 0.0
        self.gaps = [0] * (len(bounds) + 1)
        self.tail = b""

    def saw(self, count: int, now: float) -> None:
        """``count`` events began in one read at ``now``."""
        if count <= 0:
            return
        if self.last_at:
            gap = now - self.last_at
            self.gaps[bisect_left(self.bounds, gap)] += 1
            self.gap_sum += gap
        else:
            self.first_at = now
        if count > 1:
            self.gaps[bisect_left(self.bounds, 0.0)] += count - 1
        self.events += count
        self.last_at = now

    def keep(self, data: bytes) -> None:
        """Body bytes relayed: the tail keeps the last ``TAIL_BYTES`` (with ``want_tail``)."""
        if self.want_tail and data:
            self.tail = (self.tail + data)[-TAIL_BYTES:] if len(data) < TAIL_BYTES else data[-TAIL_BYTES:]

    def absorb(self, native: tuple[int, float, float, float, tuple[int, ...], bytes | None] | None) -> None:
        """Add the native pump's facts for the part of the body it relayed (it went on from
        ``last_at``, so its first gap is already counted against the events before it)."""
        if native is None:
            return
        events, first_at, last_at, gap_sum, gaps, tail = native
        if events:
            if not self.events:
                self.first_at = first_at
            self.events += events
            self.last_at = last_at
            self.gap_sum += gap_sum
            for i, n in enumerate(gaps):
                self.gaps[i] += n
        if tail:
            self.keep(tail)


class Scanner(Protocol):
    """What the pumps need from a body framing scanner (``router.ChunkedScanner``): the Python
    pump feeds it; the native one takes its state over, and hands it back (``restore``) when
    the relay is withdrawn, so that the scanner says where the client's body stopped."""

    @property
    def done(self) -> bool: ...

    @property
    def events(self) -> int: ...

    def feed(self, data: bytes) -> int: ...

    def snapshot(self) -> tuple[int, int, bytes]: ...

    def restore(self, state: int, remaining: int, line: bytes) -> None: ...


class Pump(Protocol):
    """What the router needs from a pump."""

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...

    async def relay(
        self, up: socket.socket, client_fd: int, scanner: Scanner, facts: StreamFacts | None = None
    ) -> bool: ...

    def stats(self) -> tuple[int, int]: ...

    def counters(self) -> tuple[int, int, int]: ...

    @property
    def kind(self) -> str: ...

    @property
    def gap_bounds(self) -> tuple[float, ...]: ...


def make_pump(
    kind: str | None = None, coalesce_us: int = 0, gap_bounds: tuple[float, ...] = ITL_BUCKETS
) -> Pump:
    """The native pump when it is built, else the Python one; ``kind`` (default: the
    ``LLMGW_RELAY`` environment variable) may ask for ``native`` or ``python`` explicitly.
    ``coalesce_us``: the upper bound of the native pump's pause after each wake-up (``_pump.c``,
    ``serve``), so that the tokens one decode step writes to many streams are relayed by one
    wake-up; the pause adapts below it (zero at one stream, and cut short by a response's first
    event), so a lone stream's first token is not delayed. The Python pump has no such pause
    (each of its wake-ups costs a trio round anyway). ``gap_bounds``: the buckets of the gaps
    between a body's events (``StreamFacts``)."""
    kind = kind or os.environ.get("LLMGW_RELAY", "") or "auto"
    if not 0 <= coalesce_us <= MAX_COALESCE_US:
        raise ValueError(f"relay coalescing must be 0 to {MAX_COALESCE_US} us, got {coalesce_us}")
    if kind == "python" or (kind == "auto" and _pump is None):
        return PythonRelayPump(gap_bounds)
    if kind in ("native", "auto"):
        if _pump is None:
            raise RuntimeError(
                "LLMGW_RELAY=native: the native relay pump (router/_pump.c) was not built; "
                "install llmgw where a C compiler is available, or use LLMGW_RELAY=python"
            )
        return NativeRelayPump(coalesce_us, gap_bounds)
    raise ValueError(f"LLMGW_RELAY={kind!r}: expected native, python or auto")


class RelayClosed(Exception):
    """The pump is not running (the router is stopping)."""


class EngineClosed(Exception):
    """The engine's connection failed or closed before the body ended, or sent a bad chunk."""


class ClientGone(Exception):
    """Writing to the client failed: it closed or reset its connection."""


class EngineFailedEarly(Exception):
    """The engine's connection failed or closed before its response head was complete; nothing
    reached the client, so another replica may be tried. ``errno`` is the socket error (0: the
    engine closed the connection), ``got_bytes`` whether any of the head had arrived."""

    def __init__(self, message: str, errno: int, got_bytes: bool) -> None:
        super().__init__(message)
        self.errno = errno
        self.got_bytes = got_bytes


@attrs.frozen
class Response:
    """How ``NativeRelayPump.respond`` ended. ``handed_back``: the engine's head was not the
    common case the pump relays itself (see ``_pump.c``, ``client_head``), and these bytes are
    what arrived so far, for the router to read on from; the client has been sent nothing.
    Otherwise the whole response went to the client, and ``reusable`` says whether the engine's
    connection can carry another request."""

    handed_back: bytes | None
    reusable: bool = False


class _Job:
    __slots__ = (
        "client_fd",
        "extra",
        "facts",
        "finished",
        "pending",
        "scanner",
        "task",
        "up",
        "up_fd",
        "watching",
    )

    def __init__(
        self,
        up: socket.socket,
        client_fd: int,
        scanner: Scanner,
        task: trio.lowlevel.Task,
        facts: StreamFacts,
    ) -> None:
        self.up = up
        self.facts = facts
        self.up_fd = up.fileno()
        self.client_fd = client_fd
        self.scanner = scanner
        self.task = task
        self.pending = b""  # bytes the client's socket did not take yet
        self.extra = False  # the engine sent bytes past the body's end
        self.watching = self.up_fd  # the descriptor this job waits on in the epoll set
        self.finished = False


class NativeRelayPump:
    """The pump's loop in a C thread (``router/_pump.c``); this side parks the tasks that own
    the bodies and wakes each one when its body ended."""

    kind = "native"

    def __init__(self, coalesce_us: int = 0, gap_bounds: tuple[float, ...] = ITL_BUCKETS) -> None:
        self.coalesce_us = coalesce_us
        self.gap_bounds = gap_bounds
        self._native: _pump.Pump | None = None
        self._parked: dict[int, trio.lowlevel.Task] = {}  # engine descriptor -> owning task

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve relays until cancelled; jobs still parked then fail with ``RelayClosed``."""
        native = self._native = _pump.Pump(coalesce_us=self.coalesce_us, gap_bounds=self.gap_bounds)
        parked = self._parked
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(native.notify_fd)
                for result in native.collect():
                    task = parked.pop(result[0], None)
                    if task is not None:
                        trio.lowlevel.reschedule(task, outcome.Value(result))
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

    def counters(self) -> tuple[int, int, int]:
        """(wake-ups, coalescing pauses, engine reads that brought bytes) since the start, for
        /metrics: reads per wake-up is what the pause buys."""
        return self._native.counters() if self._native is not None else (0, 0, 0)

    async def relay(
        self, up: socket.socket, client_fd: int, scanner: Scanner, facts: StreamFacts | None = None
    ) -> bool:
        """As ``PythonRelayPump.relay``; ``scanner``'s state moves to the thread, and comes back
        into ``scanner`` when the relay is cancelled (where the body stopped, for the router's
        stall handling); a relay that ended leaves the object as it was. ``facts`` gets the
        thread's facts for this part of the body, however it ended."""
        native = self._native
        if native is None:
            raise RelayClosed("the relay pump is not running")
        up_fd = up.fileno()
        since, want_tail = (facts.last_at, facts.want_tail) if facts is not None else (0.0, False)
        native.add(up_fd, client_fd, *scanner.snapshot(), since, want_tail)
        code, extra, message, _, _, _ = await self._wait(native, up_fd, scanner=scanner, facts=facts)
        if code != _pump.DONE:
            raise (EngineClosed if code == _pump.ENGINE else ClientGone)(message)
        return not extra

    async def respond(
        self,
        up: socket.socket,
        client_fd: int,
        suffix: bytes,
        on_head: Callable[[float], None],
        scanner: Scanner | None = None,
        facts: StreamFacts | None = None,
    ) -> Response:
        """Relay a whole response from its head: the engine's head, rewritten for the client
        with ``suffix`` (the router's own headers and the blank line) appended, then the body,
        all from the pump's thread, when the head is HTTP/1.1 200 with a chunked body; any other
        head is handed back (``Response.handed_back``) before anything is sent. Raises
        ``EngineFailedEarly`` when the engine fails before its head is complete, then as
        ``relay``. The router's own code then runs once per streamed request, not twice: no
        wake-up of its task for the head, and the first token goes out with it when it came
        along. ``on_head(sent_at)`` (``time.monotonic`` seconds) is called once if the head went
        out, however the response ends: completed, failed, or cancelled (the client left).
        ``scanner``, if given, gets the body's chunk state when the response is cancelled, and
        ``facts`` the body's facts however it ended."""
        native = self._native
        if native is None:
            raise RelayClosed("the relay pump is not running")
        up_fd = up.fileno()
        native.respond(up_fd, client_fd, suffix, facts is not None and facts.want_tail)
        code, extra, message, data, errno, sent_at = await self._wait(native, up_fd, on_head, scanner, facts)
        if sent_at:
            on_head(sent_at)
        if code == _pump.DONE:
            return Response(None, not extra)
        if code == _pump.HEAD:
            return Response(data)
        if code == _pump.EARLY:
            raise EngineFailedEarly(message, errno, extra)
        raise (EngineClosed if code == _pump.ENGINE else ClientGone)(message)

    async def _wait(
        self,
        native: _pump.Pump,
        up_fd: int,
        on_head: Callable[[float], None] | None = None,
        scanner: Scanner | None = None,
        facts: StreamFacts | None = None,
    ) -> tuple[int, bool, str, bytes | None, int, float]:
        """Park the calling task until the thread reports on ``up_fd``'s job; when the task is
        cancelled instead, ``on_head`` learns when the job's head went out, if it did, and
        ``scanner`` takes the thread's chunk state back. ``facts`` absorbs the job's facts either way.

        A job that ended before the cancellation came, its result not collected yet, returns
        that result: the cancellation is not lost (it is raised at the task's next checkpoint),
        but what the job did stands. A client that reads a response's last byte and hangs up at
        once is the usual case: its response was sent whole, and must be counted so, not as a
        client that left."""
        task = trio.lowlevel.current_task()
        self._parked[up_fd] = task

        def abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
            self._parked.pop(up_fd, None)
            sent_at, ended, state, running = native.withdraw(up_fd)
            if state is not None and scanner is not None:
                scanner.restore(*state)
            if facts is not None:
                facts.absorb(running)
            if ended is not None:
                trio.lowlevel.reschedule(task, outcome.Value(ended))
                return trio.lowlevel.Abort.FAILED
            if sent_at and on_head is not None:
                on_head(sent_at)
            return trio.lowlevel.Abort.SUCCEEDED

        result: _pump.Result = await trio.lowlevel.wait_task_rescheduled(abort)
        if facts is not None:
            facts.absorb(result[7])
        return result[1:7]


class PythonRelayPump:
    """The pump (see the module docstring) in trio's thread. ``run`` is the service, started in
    the router's nursery; ``relay`` hands over the rest of one response body."""

    kind = "python"

    def __init__(self, gap_bounds: tuple[float, ...] = ITL_BUCKETS) -> None:
        self.gap_bounds = gap_bounds
        self._epoll: select.epoll | None = None
        self._jobs: dict[int, _Job] = {}  # watched descriptor -> job
        self._wakeups = self._reads = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve relays until cancelled; jobs still parked then fail with ``RelayClosed``."""
        epoll = self._epoll = select.epoll()
        jobs = self._jobs
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                self._wakeups += 1
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

    def counters(self) -> tuple[int, int, int]:
        """As ``NativeRelayPump.counters``; this pump does not pause."""
        return self._wakeups, 0, self._reads

    def stats(self) -> tuple[int, int]:
        """(streams being relayed, of which waiting for a slow client to read), for /metrics."""
        streams = blocked = 0
        for fd, job in self._jobs.items():
            streams += 1
            blocked += fd == job.client_fd
        return streams, blocked

    async def relay(
        self, up: socket.socket, client_fd: int, scanner: Scanner, facts: StreamFacts | None = None
    ) -> bool:
        """Relay the rest of a chunked body from ``up`` to ``client_fd``, as it arrives, byte for
        byte. Returns whether ``up`` may carry another request (the body ended exactly at its last
        chunk). Raises ``EngineClosed``, ``ClientGone``, ``RelayClosed`` or what the scanner raises on
        a malformed chunk; when cancelled, the job is withdrawn first. ``facts`` is kept up to
        date per read (``StreamFacts``)."""
        if self._epoll is None:
            raise RelayClosed("the relay pump is not running")
        if facts is None:
            facts = StreamFacts(self.gap_bounds)
        job = _Job(up, client_fd, scanner, trio.lowlevel.current_task(), facts)
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
        self._reads += 1
        scanner = job.scanner
        before = scanner.events
        used = scanner.feed(data)
        if used < len(data):
            job.extra = True
            data = data[:used]
        if scanner.events != before:
            job.facts.saw(scanner.events - before, time.monotonic())
        if job.facts.want_tail:
            job.facts.keep(data)
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


# ---------------------------------------------------------------------------------------------
# The relay of one response to its client


#: Connection-level headers that describe one hop, never relayed (RFC 9110 7.6.1); the body's
#: framing headers are set by the router for the client's hop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
    }
)


class Relay:
    """How one engine response goes to its client, once its engine is chosen and the request
    sent: the whole streamed response by the native pump's thread (``respond_whole``), or from a
    head read by the router (``relay``): chunked bytes passed through by the pump, or a body
    decoded, re-encoded or passed on as it arrives. It notes what /metrics needs on the way (the
    first byte's time, mid-stream failures, the body's facts) and that the engine answered."""

    def __init__(self, pump: Pump, metrics: Metrics, ejection: Ejection, clock: Callable[[], float]) -> None:
        self.pump = pump
        self.metrics = metrics
        self.ejection = ejection
        self.clock = clock

    async def respond_whole(self, ex: Exchange, conn: UpstreamConn, upstream: Upstream) -> Response:
        """The usual streamed response, all of it relayed by the native pump's thread from the
        engine's head on (``NativeRelayPump.respond``): this task is woken once per request,
        when the body has ended, instead of once more for the head. The answer says whether the
        engine's connection is reusable, or holds the head the pump handed back for ``UpstreamConn.read_head``
        and ``relay`` to take from there; raises ``EngineFailedEarly`` when the engine failed
        before its head (another replica may be tried)."""
        suffix = end_of_head(
            ((b"x-llmgw-replica", upstream.replica_id.encode()), (b"transfer-encoding", b"chunked")),
            close=not ex.request.keep_alive,
        )
        pump = cast(NativeRelayPump, self.pump)
        scanner = ChunkedScanner()  # where the body stopped, handed back if the pump is withdrawn
        facts = ex.facts = StreamFacts(pump.gap_bounds, want_tail=ex.want_tail)
        ex.at_chunk_end = lambda: scanner.at_chunk_end

        def head_out(sent_at: float) -> None:
            ex.head_sent = ex.ttfb_done = True
            ex.status = 200  # the only head the pump relays itself
            self.metrics.observe_ttfb(ex.model, self.clock() - ex.started - (time.monotonic() - sent_at))

        try:
            answer = await pump.respond(conn.sock, ex.fd, suffix, head_out, scanner, facts)
        except EngineClosed as exc:  # after the head, or a malformed first chunk with it
            self.ejection.succeeded(upstream)
            self.metrics.upstream_error(upstream, "mid_stream")
            ex.status = 200
            raise UpstreamBroken(str(exc)) from None
        except (ClientGone, RelayClosed) as exc:
            raise ClientLeft(str(exc)) from None
        if answer.handed_back is None:
            self.ejection.succeeded(upstream)
            ex.status = 200
            ex.complete = ex.request.keep_alive
        return answer

    async def write(self, ex: Exchange, data: bytes) -> None:
        """Write to the client: straight to the socket when the kernel takes it all (the usual case
        for an SSE event), avoiding ``send_all``'s scheduler round trips; the readiness wait on the
        upstream is the loop's checkpoint."""
        try:
            sent = os.write(ex.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise ClientLeft(str(exc)) from exc
        if sent < len(data):
            try:
                await ex.client.stream.send_all(data[sent:])
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientLeft(str(exc)) from exc
        if not ex.ttfb_done:
            ex.ttfb_done = True
            self.metrics.observe_ttfb(ex.model, self.clock() - ex.started)

    async def relay(
        self, ex: Exchange, conn: UpstreamConn, head: ResponseHead, buf: bytes, upstream: Upstream
    ) -> bool:
        """Relay the response to the client; returns whether the upstream connection is reusable.

        The body keeps the engine's framing where the client can take it: chunked to an HTTP/1.1
        client (byte for byte), a content-length body as it is. An HTTP/1.0 client gets a chunked
        body decoded, ended by closing; a body the engine ends by closing goes to an HTTP/1.1
        client chunked, so that its connection stays usable."""
        ex.status = head.status
        http11 = ex.request.http11
        ours = [(b"x-llmgw-replica", upstream.replica_id.encode())]
        close = not ex.request.keep_alive
        encode = False
        if head.framing == NO_BODY:
            ours.append((b"content-length", b"0"))
        elif head.framing == LENGTH:
            ours.append((b"content-length", str(head.length).encode()))
        elif http11:  # CHUNKED relayed as it is, or UNTIL_CLOSE chunk-encoded here
            ours.append((b"transfer-encoding", b"chunked"))
            encode = head.framing == UNTIL_CLOSE
        else:
            close = True  # an HTTP/1.0 client: the end of the body is the end of the connection
        # The engine's headers less the hop-by-hop ones, then ours: as the pump's thread writes
        # the heads it relays itself (respond_whole).
        engine = [(k, v) for k, v in head.headers if k not in HOP_BY_HOP]
        out = status_block(head.status, engine, head.reason) + end_of_head(ours, close=close)
        ex.head_sent = True
        try:
            if head.framing == NO_BODY:
                await self.write(ex, out)
                ex.complete = not close
                return head.keep_alive and not buf
            if head.framing == CHUNKED and http11:
                reusable = await self._chunked(ex, conn, buf, out, head.keep_alive)
            else:
                reusable = await self._decoded(ex, conn, head, buf, out, encode)
            ex.complete = not close
            return reusable
        except OSError as exc:  # the engine's socket broke after the response had begun
            self.metrics.upstream_error(upstream, "mid_stream")
            raise UpstreamBroken(str(exc)) from exc
        except UpstreamBroken:
            self.metrics.upstream_error(upstream, "mid_stream")
            raise

    async def _chunked(
        self, ex: Exchange, conn: UpstreamConn, buf: bytes, out: bytes, keep_alive: bool
    ) -> bool:
        """The hot path: chunked bytes pass through unchanged. The head goes out at once, with
        whatever part of the body came with it; the rest of the body goes to the relay pump
        (``router.relay``). An engine sends a stream's head before its first token, so the
        first token is usually relayed by the pump too: from the pump's thread, which is woken
        by the engine's socket directly, that is sooner than a wake-up through trio's loop, and
        it spares this task one wake-up per request."""
        scanner = ChunkedScanner()
        facts = ex.facts = StreamFacts(self.pump.gap_bounds, want_tail=ex.want_tail)
        try:
            used = scanner.feed(buf) if buf else 0
        except UpstreamBroken as exc:  # came with the head, which has not gone out: a 502
            ex.head_sent = False
            raise RouterError(
                502,
                f"model `{ex.model}`: the engine's response is malformed: {exc}",
                "upstream_error",
                "bad_chunk",
            ) from None
        extra = used < len(buf)
        # The Python pump feeds this scanner as it relays; the native one takes its state over
        # and hands it back when the relay is withdrawn (a stalled engine, see Router._timed_out).
        ex.at_chunk_end = lambda: scanner.at_chunk_end
        await self.write(ex, out + buf[:used])
        facts.saw(scanner.events, time.monotonic())
        facts.keep(buf[:used])
        if not scanner.done:
            try:
                extra = not await self.pump.relay(conn.sock, ex.fd, scanner, facts)
            except EngineClosed as exc:
                raise UpstreamBroken(str(exc)) from None
            except (ClientGone, RelayClosed) as exc:
                raise ClientLeft(str(exc)) from None
        return keep_alive and not extra

    async def _decoded(
        self, ex: Exchange, conn: UpstreamConn, head: ResponseHead, buf: bytes, out: bytes, encode: bool
    ) -> bool:
        """Bodies that are not passed through chunk for chunk: content-length (relayed as it
        arrives), chunked to an HTTP/1.0 client (decoded), or an engine body that ends when its
        connection closes (chunk-encoded when ``encode``)."""
        scanner = ChunkedScanner(decode=True) if head.framing == CHUNKED else None
        remaining = head.length
        extra = False
        data = buf
        # Bodies here are JSON answers and errors (streams take _chunked): only their
        # last bytes matter, for usage; a rare decoded stream counts its events too.
        facts = ex.facts = StreamFacts(self.pump.gap_bounds, want_tail=ex.want_tail)
        if encode:  # chunks written here, whole, by this task
            ex.at_chunk_end = _whole_engine_chunks
        while True:
            done = False
            if data:
                if scanner is not None:
                    before = scanner.events
                    used = scanner.feed(data)
                    extra = extra or used < len(data)
                    pieces, scanner.payloads = scanner.payloads, []
                    done = scanner.done
                    facts.saw(scanner.events - before, time.monotonic())
                elif head.framing == LENGTH:
                    if len(data) > remaining:
                        extra, data = True, data[:remaining]
                    remaining -= len(data)
                    pieces, done = [data], remaining == 0
                else:
                    pieces = [data]
                for piece in pieces:
                    facts.keep(piece)
                out += b"".join(chunk(p) for p in pieces if p) if encode else b"".join(pieces)
            if out:
                await self.write(ex, out)
                out = b""
            if done:
                return head.keep_alive and not extra
            data = await conn.recv()
            if not data:
                if head.framing == UNTIL_CLOSE:
                    if encode:
                        await self.write(ex, LAST_CHUNK)
                    return False
                raise UpstreamBroken("the engine closed the connection mid-response")


def _whole_engine_chunks() -> bool:
    """Whether a client's chunked body ends with a whole chunk: always, where this task writes
    each chunk whole (an engine body that ends by closing, chunk-encoded here)."""
    return True
