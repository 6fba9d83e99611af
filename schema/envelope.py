"""The 5-byte length-prefixed envelope, as a sans-IO codec shared by both ends.

gRPC, the Connect streaming protocol and our WebSocket route all frame messages the same way: one flags
byte, a 4-byte big-endian length, then the payload. The decoder follows h11's shape: feed bytes in with
``receive_data``, take envelopes out with ``next_event`` until it says ``NEED_DATA``; no sockets inside,
so the same code is tested once and used by the client, the server and the WebSocket route.

The size limit is checked on the header, before any payload is buffered, so a peer that announces a
4 GiB message costs us five bytes, not four gigabytes.
"""

from __future__ import annotations

import enum
import struct
from typing import Final

import attrs

HEADER: Final = struct.Struct(">BI")
HEADER_SIZE: Final = HEADER.size
DEFAULT_MAX_MESSAGE_SIZE: Final = 4 * 1024 * 1024

#: Flag bit 0: the payload is compressed (we never compress, and refuse compressed input).
FLAG_COMPRESSED: Final = 0x01
#: Flag bit 1 (Connect protocol only): the envelope is the end-of-stream JSON, not a message.
FLAG_END_STREAM: Final = 0x02


class FramingError(Exception):
    """The byte stream is not a valid sequence of envelopes; the stream cannot continue."""


class MessageTooLarge(FramingError):
    """An envelope announced (or a sender tried to send) more than the configured limit."""

    def __init__(self, size: int, limit: int, direction: str) -> None:
        super().__init__(
            f"{direction} message of {size} bytes exceeds the limit of {limit} bytes "
            f"({limit // 1024} KiB); raise max_message_size on both ends if this is intended"
        )
        self.size = size
        self.limit = limit


class TruncatedEnvelope(FramingError):
    """The stream ended in the middle of an envelope."""


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = _NeedData.NEED_DATA


@attrs.frozen
class Envelope:
    """One framed message: its flags byte and its payload bytes."""

    flags: int
    payload: bytes

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_COMPRESSED)


def encode(payload: bytes, flags: int = 0, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> bytes:
    """Frame ``payload``; refuses to send what the peer's default limit would refuse to receive."""
    if len(payload) > max_size:
        raise MessageTooLarge(len(payload), max_size, "outgoing")
    return HEADER.pack(flags, len(payload)) + payload


class EnvelopeDecoder:
    """Incremental decoder: bytes in, :class:`Envelope` values out."""

    def __init__(self, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self.max_size = max_size
        self._buf = bytearray()
        self._closed = False

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the transport; ``b""`` means the peer ended the stream."""
        if data:
            self._buf += data
        else:
            self._closed = True

    def next_event(self) -> Envelope | _NeedData | None:
        """The next complete envelope, ``NEED_DATA``, or ``None`` once the stream ended cleanly.

        Raises :class:`MessageTooLarge` as soon as a header announces too much, and
        :class:`TruncatedEnvelope` when the stream ended inside an envelope.
        """
        buf = self._buf
        if len(buf) >= HEADER_SIZE:
            flags, length = HEADER.unpack_from(buf)
            if length > self.max_size:
                raise MessageTooLarge(length, self.max_size, "incoming")
            end = HEADER_SIZE + length
            if len(buf) >= end:
                payload = bytes(buf[HEADER_SIZE:end])
                del buf[:end]
                return Envelope(flags, payload)
        if self._closed:
            if buf:
                raise TruncatedEnvelope(f"stream ended inside an envelope: {self.progress()} received")
            return None
        return NEED_DATA

    def progress(self) -> str:
        """How much of the pending envelope has arrived, for error messages."""
        if len(self._buf) < HEADER_SIZE:
            return f"{len(self._buf)} byte(s) of a {HEADER_SIZE}-byte header"
        _, length = HEADER.unpack_from(self._buf)
        return f"{len(self._buf)} byte(s) of {HEADER_SIZE + length}"

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as an envelope (for flow-control accounting)."""
        return len(self._buf)


def decode_one(data: bytes, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> Envelope:
    """The one envelope that ``data`` holds whole (a WebSocket message carries exactly one).

    Raises :class:`MessageTooLarge` for a header over ``max_size`` and :class:`FramingError` for
    anything but exactly one complete envelope.
    """
    decoder = EnvelopeDecoder(max_size)
    decoder.receive_data(data)
    decoder.receive_data(b"")
    env = decoder.next_event()
    if not isinstance(env, Envelope) or decoder.next_event() is not None:
        raise FramingError("each WebSocket message must hold exactly one envelope")
    return env
