"""HTTP/2 plumbing shared by the agent's client and the control plane's server.

``h2`` is a sans-IO state machine: it turns bytes into events and calls into bytes, and leaves every
socket operation, every wait and every lock to us. This module is that "us", written once for both ends:

- :class:`H2Transport` owns one trio stream and one ``H2Connection``: the single writer lock (bytes must
  leave in the order h2 produced them), waiting for flow-control window, keepalive PINGs that detect a
  black-holed peer within seconds rather than after TCP's minutes, and the connection's fatal error.
- :class:`H2Stream` is one HTTP/2 stream carrying envelopes (gRPC, Connect): outbound messages wait for
  window instead of overrunning the peer; inbound bytes are acknowledged to the peer only while the
  application keeps up, so a slow consumer slows the sender down instead of growing our memory.

The client and server each drive their own read loop (their events differ: requests vs responses) and
call :meth:`H2Transport.handle_common` for what is the same on both sides.
"""

from __future__ import annotations

import itertools
import math

import h2.connection
import h2.events
import h2.exceptions
import trio
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from schema import envelope

#: How long one write to the peer may take before the connection is given up (see ``flush``).
SEND_TIMEOUT = 10.0
#: The 24 bytes a client opens every HTTP/2 connection with (RFC 9113 3.4).
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class TransportError(Exception):
    """The connection or the stream under an RPC failed; a session should reconnect."""


class ConnectionLost(TransportError):
    """The peer closed the connection, or the socket failed."""


class PeerUnresponsive(TransportError):
    """The peer did not answer an HTTP/2 PING in time: the connection is black-holed or the peer hung."""


class GoAwayReceived(TransportError):
    """The peer sent GOAWAY: it will take no new streams, and ended ours with the given code.

    With ``NO_ERROR`` this is a graceful goodbye (a control plane shutting down), not a failure of
    either side; the debug text is the peer's and is shown escaped and cut to a bounded length.
    """

    def __init__(self, error_code: int, last_stream_id: int, debug: bytes) -> None:
        name = _error_name(error_code)
        detail = f": {peer_text(debug)}" if debug else ""
        super().__init__(f"peer sent GOAWAY ({name}, last stream {last_stream_id}){detail}")
        self.error_code = error_code
        self.last_stream_id = last_stream_id
        self.debug = debug

    @property
    def graceful(self) -> bool:
        return self.error_code == ErrorCodes.NO_ERROR


class StreamReset(TransportError):
    """The peer reset our stream (RST_STREAM) with the given HTTP/2 error code."""

    def __init__(self, error_code: int, stream_id: int) -> None:
        super().__init__(f"peer reset stream {stream_id} ({_error_name(error_code)})")
        self.error_code = error_code


class StalledMessage(TransportError):
    """A peer sent part of a message and then nothing for too long."""


def _cause(exc: BaseException) -> str:
    """The most telling text of a socket failure: trio wraps TLS alerts (a refused client
    certificate, say) in BrokenResourceError with the SSLError as the cause."""
    cause = exc.__cause__ or exc.__context__ or exc
    return str(cause) or str(exc) or type(cause).__name__


#: Peer-supplied text shown in a log line or an error message is cut to this many characters.
PEER_TEXT_LIMIT = 256


def peer_text(value: bytes | str, limit: int = PEER_TEXT_LIMIT) -> str:
    """A peer-supplied string made safe for a log line: escaped (``repr``), and cut to ``limit``.

    Whatever a peer sends (GOAWAY debug data, a request line, a header) may hold control characters
    that would forge log lines or drive a terminal; ``repr`` shows them as escapes instead.
    """
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if len(text) > limit:
        return repr(text[:limit]) + f" (cut at {limit} of {len(text)} characters)"
    return repr(text)


def _error_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"error code {code}"


_FRAME_HEADER_SIZE = 9
_GOAWAY = 0x7


class GoAwayFinder:
    """Finds where the peer's first GOAWAY frame ends in the bytes it sends (sans-IO).

    h2 moves its connection to CLOSED as soon as it reads a GOAWAY, and from then on raises
    ``ProtocolError`` for every other frame: a WINDOW_UPDATE, a PING or the rest of a stream that the
    peer wrote just after its GOAWAY (RFC 9113 6.8 allows all of them) would turn a graceful goodbye
    into "HTTP/2 protocol error ... in state CLOSED", and the GOAWAY itself would be lost with the
    batch. So bytes are fed to h2 up to the end of the first GOAWAY frame and no further; what follows
    is absorbed, since both ends of this transport end every stream at a GOAWAY anyway.

    Only frame headers are read (9 bytes each); payloads are skipped, so the cost is one small step
    per frame. ``skip`` is the number of bytes to pass over first: a server's 24-byte client preface.
    """

    def __init__(self, skip: int = 0) -> None:
        self._skip = skip
        self._head = b""
        self._in_goaway = False

    def end_of_goaway(self, data: bytes) -> int | None:
        """The offset in ``data`` just past the end of the first GOAWAY frame, or ``None``."""
        pos, size = 0, len(data)
        while pos < size:
            if self._skip:
                step = min(self._skip, size - pos)
                self._skip -= step
                pos += step
                if not self._skip and self._in_goaway:
                    return pos
                continue
            take = _FRAME_HEADER_SIZE - len(self._head)
            self._head += data[pos : pos + take]
            pos += take
            if len(self._head) < _FRAME_HEADER_SIZE:
                return None
            length = int.from_bytes(self._head[:3], "big")
            self._in_goaway = self._head[3] == _GOAWAY
            self._head = b""
            self._skip = length
            if self._in_goaway and not length:
                return min(pos, size)  # malformed (too short); h2 says so when it reads it
        return None


class H2Transport:
    """One HTTP/2 connection over one trio stream; see the module docstring."""

    def __init__(self, stream: trio.abc.Stream, conn: h2.connection.H2Connection) -> None:
        self.stream = stream
        self.conn = conn
        # A server reads the client's connection preface before the first frame.
        self._goaway_finder = GoAwayFinder(0 if conn.config.client_side else len(PREFACE))
        #: True once the peer's GOAWAY was fed to h2: every later byte is absorbed unread.
        self.peer_went_away = False
        #: True once we announced a graceful GOAWAY (see :meth:`announce_goaway`).
        self.goaway_announced = False
        self.error: TransportError | None = None
        self.streams: dict[int, H2Stream] = {}
        self._send_lock = trio.Lock()
        self._window_event = trio.Event()
        self._ping_counter = itertools.count(1)
        self._ping_waiters: dict[bytes, trio.Event] = {}
        self._closed = trio.Event()

    # -- writing ---------------------------------------------------------------------------------

    async def flush(self, timeout: float = SEND_TIMEOUT) -> None:
        """Send whatever h2 has queued. Taken under the lock so bytes leave in the order h2 made them.

        Once taken out of h2 the bytes must leave whole, whoever called: they may hold any stream's
        frames, and a caller cancelled mid-send (a handler whose stream the peer just reset) would
        drop them, a lost WINDOW_UPDATE starving the whole connection (the next call on it hung
        until its deadline) and a half-sent frame corrupting it. So the send is shielded from the
        caller's cancellation and bounded by ``timeout`` instead: a peer that reads nothing for that
        long fails the connection, which is closed (what was half sent cannot be taken back).
        """
        async with self._send_lock:
            data = self.conn.data_to_send()
            if not data:
                return
            with trio.CancelScope(shield=True):
                try:
                    with trio.move_on_after(timeout) as timer:
                        await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise self.fail(ConnectionLost(f"connection lost while sending: {_cause(exc)}")) from exc
                if timer.cancelled_caught:
                    error = self.fail(
                        PeerUnresponsive(f"peer did not take {len(data)} bytes within {timeout:g} s")
                    )
                    await self.abort()
                    raise error

    async def wait_window(self) -> None:
        """Block until a WINDOW_UPDATE, a SETTINGS change, a reset or a failure could free window."""
        await self._window_event.wait()

    def wake_senders(self) -> None:
        self._window_event.set()
        self._window_event = trio.Event()

    # -- keepalive -------------------------------------------------------------------------------

    async def ping(self, timeout: float) -> bool:
        """Send a PING and wait for its ACK; ``False`` when none came within ``timeout`` seconds."""
        payload = next(self._ping_counter).to_bytes(8, "big")
        acked = trio.Event()
        self._ping_waiters[payload] = acked
        try:
            self.conn.ping(payload)
            await self.flush()
            with trio.move_on_after(timeout):
                await acked.wait()
            return acked.is_set()
        finally:
            self._ping_waiters.pop(payload, None)

    async def keepalive(self, interval: float, timeout: float) -> None:
        """Ping every ``interval`` seconds; fail the connection when a PING goes unanswered.

        This is the dead-peer detector: on a black-holed path TCP keeps retransmitting for many
        minutes before giving up, while a PING with a timeout notices within ``interval + timeout``.
        """
        if interval <= 0 or math.isinf(interval):
            return
        while self.error is None:
            await trio.sleep(interval)
            if self.error is not None or self.peer_went_away:
                return
            try:
                answered = await self.ping(timeout)
            except (TransportError, h2.exceptions.ProtocolError):
                # h2 refuses a PING once either side sent GOAWAY: the connection is ending anyway.
                return
            if not answered:
                self.fail(PeerUnresponsive(f"peer did not answer an HTTP/2 PING within {timeout:g} s"))
                await self.abort()
                return

    # -- reading ---------------------------------------------------------------------------------

    async def receive_events(self, max_bytes: int = 65536) -> list[h2.events.Event]:
        """Read once from the socket and feed h2; an empty list never means end of connection."""
        try:
            data = await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self.fail(ConnectionLost(f"connection lost: {_cause(exc)}")) from exc
        if not data:
            raise self.fail(ConnectionLost("peer closed the connection"))
        return self.feed(bytes(data))

    def feed(self, data: bytes) -> list[h2.events.Event]:
        """Feed the peer's bytes to h2 and return its events; see :class:`GoAwayFinder`.

        Raises ``h2.exceptions.ProtocolError`` for a real protocol violation by the peer.
        """
        if self.peer_went_away:
            return []
        end = self._goaway_finder.end_of_goaway(data)
        if end is not None:
            data = data[:end]
            self.peer_went_away = True
        return self.conn.receive_data(data)

    def handle_common(self, event: h2.events.Event) -> bool:
        """Handle what both ends treat alike; ``True`` when the event was consumed here."""
        if isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self.wake_senders()
            return True
        if isinstance(event, h2.events.PingAckReceived):
            waiter = self._ping_waiters.get(bytes(event.ping_data or b""))
            if waiter is not None:
                waiter.set()
            return True
        if isinstance(event, h2.events.DataReceived):
            st = self.streams.get(event.stream_id)
            if st is None:
                # Data for a stream we already finished: give the window back and drop it (not
                # after a GOAWAY: then the connection is ending and nothing more is sent on it).
                if event.flow_controlled_length and not self.peer_went_away and self.error is None:
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return True
            st.on_data(event.data or b"", event.flow_controlled_length or 0)
            return True
        if isinstance(event, h2.events.StreamEnded):
            st = self.streams.get(event.stream_id)
            if st is not None:
                st.on_remote_end()
            return True
        if isinstance(event, h2.events.StreamReset):
            st = self.streams.get(event.stream_id)
            if st is not None:
                st.on_reset(StreamReset(int(event.error_code or 0), event.stream_id))
            self.wake_senders()
            return True
        if isinstance(event, h2.events.ConnectionTerminated):
            err = GoAwayReceived(
                int(event.error_code or 0),
                int(event.last_stream_id or 0),
                bytes(event.additional_data or b""),
            )
            # Streams above last_stream_id were never processed; streams at or below it may finish,
            # but we hold one long-lived stream per connection, so ending them all is the useful choice.
            self.fail(err)
            return True
        return isinstance(
            event,
            h2.events.PingReceived
            | h2.events.SettingsAcknowledged
            | h2.events.PriorityUpdated
            | h2.events.UnknownFrameReceived,
        )

    # -- teardown --------------------------------------------------------------------------------

    def fail(self, error: TransportError) -> TransportError:
        """Record the connection's fatal error (the first one wins) and wake everything waiting."""
        if self.error is None:
            self.error = error
        for st in list(self.streams.values()):
            st.on_reset(self.error)
        self.wake_senders()
        self._closed.set()
        return self.error

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def abort(self) -> None:
        """Close the socket without ceremony (a blocked send or receive then fails at once)."""
        await trio.aclose_forcefully(self.stream)

    async def announce_goaway(self, debug: str = "") -> None:
        """Graceful GOAWAY: tell the peer to open no new streams while ours keep working.

        h2 moves its state machine to CLOSED on ``close_connection`` and then refuses every frame
        that follows, which would cut off the very streams a graceful shutdown means to drain. So the
        frame is built here and written after whatever h2 has queued, leaving h2's state open.
        """
        if self.goaway_announced or self.error is not None:
            return
        self.goaway_announced = True
        frame = GoAwayFrame(0)
        frame.last_stream_id = self.conn.highest_inbound_stream_id
        frame.error_code = ErrorCodes.NO_ERROR
        frame.additional_data = debug.encode()[:1024]
        async with self._send_lock:
            data = self.conn.data_to_send() + frame.serialize()
            try:
                with trio.move_on_after(1):
                    await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def refuse(self, exc: h2.exceptions.ProtocolError, debug: str) -> None:
        """Answer the peer's protocol violation with one GOAWAY that says why, best effort.

        h2 has already queued a bare GOAWAY of its own (with the violation's error code); it is
        replaced by one with the same code and our words, and nothing else queued is sent: after a
        violation the peer's view of the connection is broken, so only the explanation matters.
        """
        self.conn.data_to_send()
        code = getattr(exc, "error_code", None) or ErrorCodes.PROTOCOL_ERROR
        await self.goaway(ErrorCodes(code), debug)

    async def goaway(self, error_code: ErrorCodes = ErrorCodes.NO_ERROR, debug: str = "") -> None:
        """Send GOAWAY, best effort: the peer may already be gone."""
        try:
            self.conn.close_connection(error_code=error_code, additional_data=debug.encode()[:1024])
        except h2.exceptions.ProtocolError:
            return
        try:
            await self.flush(timeout=1)
        except TransportError:
            pass


class H2Stream:
    """One HTTP/2 stream that carries length-prefixed envelopes in both directions."""

    def __init__(
        self,
        transport: H2Transport,
        stream_id: int,
        max_message_size: int = envelope.DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        self.transport = transport
        self.stream_id = stream_id
        self.max_message_size = max_message_size
        self.decoder = envelope.EnvelopeDecoder(max_message_size)
        self.remote_ended = False
        self.local_ended = False
        self.error: TransportError | None = None
        self._event = trio.Event()
        self._deferred_ack = 0
        # Keep acknowledging while what is buffered fits in one maximal message: enough for any single
        # message to arrive whole, and a bound on what a consumer that stopped reading can cost us.
        self._ack_limit = max_message_size + envelope.HEADER_SIZE
        transport.streams[stream_id] = self

    # -- inbound ---------------------------------------------------------------------------------

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        self.decoder.receive_data(data)
        padding = flow_controlled_length - len(data)
        ack_now = padding
        if self.decoder.buffered <= self._ack_limit:
            ack_now += len(data) + self._deferred_ack
            self._deferred_ack = 0
        else:
            self._deferred_ack += len(data)
        self._acknowledge(ack_now)
        self._wake()

    def on_remote_end(self) -> None:
        self.remote_ended = True
        self.decoder.receive_data(b"")
        self._wake()

    def on_reset(self, error: TransportError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        self._event.set()
        self._event = trio.Event()

    def _acknowledge(self, n: int) -> None:
        # No WINDOW_UPDATE once the connection failed or the peer sent GOAWAY: h2 would still queue
        # one, and the peer would read a frame on a connection it has finished with.
        if n <= 0 or self.transport.error is not None or self.transport.peer_went_away:
            return
        try:
            self.transport.conn.acknowledge_received_data(n, self.stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass

    async def receive_envelope(self, stall_timeout: float = math.inf) -> envelope.Envelope | None:
        """The next envelope, or ``None`` once the peer ended the stream cleanly.

        Raises the stream's :class:`TransportError`, :class:`envelope.FramingError` for bytes that are
        not envelopes, and :class:`StalledMessage` when part of a message arrived and the rest did not
        within ``stall_timeout`` seconds (a peer that stalls mid-message must not hold a slot forever).
        """
        while True:
            event = self.decoder.next_event()
            if isinstance(event, envelope.Envelope):
                if self._deferred_ack and self.decoder.buffered <= self._ack_limit:
                    self._acknowledge(self._deferred_ack)
                    self._deferred_ack = 0
                    await self.transport.flush()
                return event
            if event is None:
                return None
            if self.error is not None:
                raise self.error
            waiting = self._event
            if self.decoder.buffered:
                with trio.move_on_after(stall_timeout) as scope:
                    await waiting.wait()
                if scope.cancelled_caught:
                    raise StalledMessage(
                        f"peer sent {self.decoder.progress()} of a message and then nothing "
                        f"for {stall_timeout:g} s"
                    )
            else:
                await waiting.wait()

    # -- outbound --------------------------------------------------------------------------------

    async def send_data(self, data: bytes, end_stream: bool = False) -> None:
        """Send ``data`` as DATA frames, waiting for flow-control window rather than overrunning it."""
        transport = self.transport
        view = memoryview(data)
        if not view and not end_stream:
            return
        while True:
            if self.error is not None:
                raise self.error
            if transport.error is not None:
                raise transport.error
            if not view:
                if end_stream:
                    transport.conn.end_stream(self.stream_id)
                    self.local_ended = True
                    await transport.flush()
                return
            try:
                window = transport.conn.local_flow_control_window(self.stream_id)
            except h2.exceptions.StreamClosedError as exc:
                raise self.error or StreamReset(ErrorCodes.STREAM_CLOSED, self.stream_id) from exc
            if window <= 0:
                await transport.wait_window()
                continue
            n = min(window, transport.conn.max_outbound_frame_size, len(view))
            last = end_stream and n == len(view)
            transport.conn.send_data(self.stream_id, view[:n].tobytes(), end_stream=last)
            if last:
                self.local_ended = True
            view = view[n:]
            await transport.flush()
            # Handed over whole: a reset that arrives now (a server that answered and ended the
            # stream while this was in flight) is for the reader to report, not a failed send.
            if last or (not view and not end_stream):
                return

    async def send_message(self, payload: bytes, flags: int = 0) -> None:
        await self.send_data(envelope.encode(payload, flags, self.max_message_size))

    async def reset(self, error_code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        """RST_STREAM, best effort (the stream or the connection may already be gone)."""
        try:
            self.transport.conn.reset_stream(self.stream_id, error_code)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self.local_ended = True
        try:
            await self.transport.flush()
        except TransportError:
            pass

    def forget(self) -> None:
        """Drop the stream from the connection's table once both sides are done with it."""
        self.transport.streams.pop(self.stream_id, None)
