"""The engine side of HTTP/1.1, sans-IO: a response head's parse and a chunked body's scan.

One definition of each framing rule for the router's Python paths; the native relay pump
(``router/_pump.c``) has its own scanner, held to the same results by a differential test."""

from __future__ import annotations

import re

import attrs

from router.pumpconst import MAX_CHUNK_LINE, MAX_HEAD_BYTES, MAX_SIZE_DIGITS, SCANNER_STATES


class UpstreamError(Exception):
    """The engine failed before a response byte reached the client; ``kind`` labels the metric."""

    def __init__(self, kind: str, message: str, *, got_bytes: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.got_bytes = got_bytes


class UpstreamBroken(Exception):
    """The engine's connection broke after part of the response had been relayed."""


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 response parsing (sans-IO)

NO_BODY = "none"
CHUNKED = "chunked"
LENGTH = "length"
UNTIL_CLOSE = "close"


@attrs.frozen
class ResponseHead:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    framing: str
    length: int
    keep_alive: bool


def parse_response_head(buf: bytes | bytearray) -> tuple[ResponseHead, int] | None:
    """Parse a response head from the start of ``buf``: ``(head, bytes used)``, or None when more
    bytes are needed. Interim 1xx responses are returned too; the caller skips them."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD_BYTES:
            raise UpstreamError("protocol", f"response head over {MAX_HEAD_BYTES} bytes")
        return None
    block = bytes(buf[:end])
    if (
        b"\0" in block
        or block.count(b"\n") != block.count(b"\r\n")
        or block.count(b"\r") != block.count(b"\n")
    ):
        # Relayed headers go to the client as they are: a bare CR or LF would split them there.
        raise UpstreamError("protocol", "response head with a bare CR, LF or NUL")
    lines = block.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise UpstreamError("protocol", f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(code)
    headers: list[tuple[bytes, bytes]] = []
    chunked = False
    length = -1
    close = version == b"HTTP/1.0"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise UpstreamError("protocol", f"malformed header line {line[:80]!r}")
        name = name.strip().lower()
        value = value.strip()
        headers.append((name, value))
        if name == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
        elif name == b"content-length":
            if not value.isdigit():
                raise UpstreamError("protocol", f"bad content-length {value[:40]!r}")
            length = int(value)
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens:
                close = False
    if status < 200 or status in (204, 304):
        framing = NO_BODY
    elif chunked:
        framing = CHUNKED
    elif length >= 0:
        framing = LENGTH if length else NO_BODY
    else:
        framing, close = UNTIL_CLOSE, True
    head = ResponseHead(status, reason, headers, framing, max(length, 0), not close)
    return head, end + 4


# Chunked framing (RFC 9112 §7.1), decided once for both scanners (this one and _pump.c's scan):
#   chunk-line   = 1*15HEXDIG *( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] ) OWS CRLF
#   after a chunk's data: exactly CRLF
#   trailer-line = token ":" *( any byte but CR, LF, NUL ) CRLF, the section ended by an empty line
# Every line ends in CRLF: a bare LF is malformed (RFC 9112 §2.2 lets a recipient accept one; the
# bytes go on to the client as they are, and a client that reads lines otherwise would be framed
# differently). The optional whitespace before the CRLF is what h11 takes too. A line is at most
# MAX_CHUNK_LINE bytes before its LF; a size is at most MAX_SIZE_DIGITS (15) hex digits (leading
# zeros count), so that it fits 60 bits in C with room to add (both in router.pumpconst).
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_EXT = rb"[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?"
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,%d})(?:%s)*[ \t]*\r" % (MAX_SIZE_DIGITS, _EXT))
_TRAILER_LINE = re.compile(_TOKEN + rb":[^\r\n\x00]*\r")


def _chunk_size(line: bytes) -> int:
    """The size on a chunk line (``line``: the bytes before its LF)."""
    match = _CHUNK_LINE.fullmatch(line)
    if match is None:
        raise UpstreamBroken(f"bad chunk size line {line[:40]!r}: expected hex digits, extensions, CRLF")
    return int(match[1], 16)


class ChunkedScanner:
    """Finds where a chunked body ends, without copying or decoding it, and checks its framing
    (the rules above; ``UpstreamBroken`` on a malformed body).

    ``feed(data)`` returns how many bytes of ``data`` belong to the body (all of it until the last
    chunk and trailers arrive); ``done`` turns true at the end. With ``decode=True`` the chunk
    payloads are also collected in ``payloads`` (for clients that cannot take chunked framing).
    ``events`` counts the chunks begun (engines write one SSE event per chunk), for the relay
    pumps' per-event facts (``router.relay.StreamFacts``).
    The native pump's scanner (``router/_pump.c``, ``scan``) is the same state machine with the
    same state (``snapshot``/``resume``), held to the same results by
    tests/test_framing_differential.py."""

    _SIZE, _DATA, _CRLF, _TRAILER, _DONE = (value for _, value in SCANNER_STATES)

    def __init__(self, *, decode: bool = False) -> None:
        self.decode = decode
        self.payloads: list[bytes] = []
        self._state = self._SIZE
        self._remaining = 0  # bytes left in the chunk's data, or of its CRLF (2: CR next, 1: LF)
        self._line = b""
        self.events = 0

    @classmethod
    def resume(cls, state: int, remaining: int, line: bytes) -> ChunkedScanner:
        """A scanner that goes on from ``snapshot``'s values (the native pump's, handed back)."""
        scanner = cls()
        scanner.restore(state, remaining, line)
        return scanner

    def restore(self, state: int, remaining: int, line: bytes) -> None:
        """Take over ``snapshot``'s values: where another scanner (the native pump's) stopped."""
        if not self._SIZE <= state <= self._DONE or remaining < 0 or len(line) > MAX_CHUNK_LINE:
            raise ValueError(f"bad scanner state {(state, remaining, len(line))}")
        self._state, self._remaining, self._line = state, remaining, bytes(line)

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def snapshot(self) -> tuple[int, int, bytes]:
        """(state, bytes left in the chunk or its CRLF, partial line): what the native relay pump
        takes over to go on scanning where this left off."""
        return self._state, self._remaining, self._line

    @property
    def at_chunk_end(self) -> bool:
        """What was fed so far ends with a whole chunk: another chunk may follow it."""
        return self._state == self._SIZE and not self._line

    def feed(self, data: bytes) -> int:
        i, n = 0, len(data)
        while i < n:
            state = self._state
            if state == self._SIZE and not self._line:
                # Fast path, the usual case: a whole size line and often the whole chunk is here.
                nl = data.find(b"\n", i)
                if nl < 0:
                    self._partial(data[i:])
                    return n
                line = data[i:nl]
                if len(line) > MAX_CHUNK_LINE:
                    raise UpstreamBroken(f"chunk line over {MAX_CHUNK_LINE} bytes")
                size = _chunk_size(line)
                i = nl + 1
                if not size:
                    self._state = self._TRAILER
                    continue
                self.events += 1
                if i + size + 2 <= n and not self.decode:
                    i += size
                    if data[i : i + 2] != b"\r\n":
                        raise UpstreamBroken(f"chunk data not followed by CRLF: {data[i : i + 2]!r}")
                    i += 2  # the payload and its CRLF, checked and skipped in one step
                else:
                    self._state, self._remaining = self._DATA, size
            elif state == self._DATA:
                take = min(self._remaining, n - i)
                if self.decode:
                    self.payloads.append(data[i : i + take])
                i += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state, self._remaining = self._CRLF, 2
            elif state == self._CRLF:
                want = 13 if self._remaining == 2 else 10  # CR, then LF
                if data[i] != want:
                    raise UpstreamBroken(f"chunk data not followed by CRLF: {data[i : i + 1]!r}")
                i += 1
                self._remaining -= 1
                if self._remaining == 0:
                    self._state = self._SIZE
            elif state == self._DONE:
                return i
            else:  # a size line split across reads, or a trailer line
                nl = data.find(b"\n", i)
                if nl < 0:
                    self._partial(self._line + data[i:])
                    return n
                line = self._line + data[i:nl]
                self._line = b""
                if len(line) > MAX_CHUNK_LINE:
                    raise UpstreamBroken(f"chunk line over {MAX_CHUNK_LINE} bytes")
                i = nl + 1
                if state == self._SIZE:
                    size = _chunk_size(line)
                    if size:
                        self.events += 1
                        self._state, self._remaining = self._DATA, size
                    else:
                        self._state = self._TRAILER
                elif line == b"\r":  # the empty line after the (usually absent) trailers
                    self._state = self._DONE
                    return i
                elif _TRAILER_LINE.fullmatch(line) is None:
                    raise UpstreamBroken(f"bad trailer line {line[:40]!r}: expected name: value CRLF")
        return i

    def _partial(self, line: bytes) -> None:
        if len(line) > MAX_CHUNK_LINE:
            raise UpstreamBroken(f"chunk line over {MAX_CHUNK_LINE} bytes")
        self._line = line
