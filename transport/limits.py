"""What one peer may cost the agent-stream server: sizes, counts and timings, in one frozen value."""

from __future__ import annotations

import attrs

from schema import envelope


@attrs.frozen
class ServerLimits:
    """Bounds on what one peer can cost the server, and the timings of keepalive and shutdown."""

    max_message_size: int = envelope.DEFAULT_MAX_MESSAGE_SIZE
    #: The first message of a stream (the Register) comes before anything the peer says is believed,
    #: so it gets a tighter bound: a forged 30,000-GPU Register is refused by its envelope header,
    #: before its bytes are buffered or parsed. A real Register is a few KiB (64 GPUs, a few shards).
    max_first_message_size: int = 1024 * 1024
    #: SETTINGS_MAX_CONCURRENT_STREAMS per connection (an agent needs one).
    max_streams_per_connection: int = 8
    #: Streams across all connections; beyond it new streams end with RESOURCE_EXHAUSTED.
    max_streams: int = 100_000
    #: Seconds between server PINGs on a connection, and how long an answer may take.
    keepalive_interval: float = 30.0
    keepalive_timeout: float = 10.0
    #: A TLS handshake or a connection preface must complete within this many seconds, and an
    #: HTTP/2 connection must open its first stream within as many again.
    handshake_timeout: float = 10.0
    #: A message begun must be finished within this many seconds of its last byte.
    stall_timeout: float = 30.0
    #: Shutdown: after GOAWAY, streams get this long to end before they are ended with UNAVAILABLE.
    #: Our agents leave at the GOAWAY at once; the grace is for peers that finish their stream first
    #: (grpcio keeps its stream open), and bounds how long a hung agent delays a SIGTERM.
    shutdown_grace: float = 5.0
    #: Streams a peer may reset within ``peer_reset_window`` seconds on one connection; beyond it the
    #: connection ends with GOAWAY(ENHANCE_YOUR_CALM) (HTTP/2 rapid reset, CVE-2023-44487).
    max_peer_resets: int = 64
    peer_reset_window: float = 10.0
    #: Control frames (SETTINGS, PING, WINDOW_UPDATE, PRIORITY, unknown types, empty DATA) a peer
    #: may send within ``control_frame_window`` seconds on one connection; beyond it the connection
    #: ends with GOAWAY(ENHANCE_YOUR_CALM) (the HTTP/2 floods of CVE-2019-9512, -9513, -9515 and
    #: -9518: each such frame costs parsing and often an answer, while it carries no request). A
    #: budget per time window, not per lifetime: an agent PINGs every few seconds for months, and a
    #: gRPC client's flow control and BDP probes send a few a second while data flows.
    max_control_frames: int = 2000
    control_frame_window: float = 10.0
    #: Lines that come in bursts (connections closed for sending nothing in time, failed TLS
    #: handshakes): the first ``log_burst_keep`` of a burst are logged one by one, the rest summed up
    #: in one line per ``log_burst_interval`` seconds (see :mod:`transport.bursts`).
    log_burst_keep: int = 3
    log_burst_interval: float = 10.0

    def message_limit(self, received: int) -> int:
        """The payload limit of a stream's next message after ``received`` messages: the first is
        held to ``max_first_message_size`` (on every route), the rest to ``max_message_size``."""
        if received == 0:
            return min(self.max_message_size, self.max_first_message_size)
        return self.max_message_size
