"""One definition of chunked framing: the Python scanner (``router.framing.ChunkedScanner``, which
the router's task and the Python pump run) and the native pump's (``router/_pump.c``, ``scan``,
reached through ``_pump.scan_chunked``) must give the same answer for every input, however it is
split into reads: the bytes that belong to the body, the state they stop in, done, or an error,
and the chunks begun (the events the pumps' per-event facts for /metrics count).

A disagreement is a framing hole: one path would relay bytes of the next response to a client, or
take a body's end where the other does not."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from router.framing import ChunkedScanner, UpstreamBroken
from router.pumpconst import MAX_CHUNK_LINE


def test_the_c_header_of_the_shared_constants_is_fresh() -> None:
    """router/_pump_const.h is what router/pumpconst.py generates (the C pump includes it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "router.pumpconst", "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


_pump = pytest.importorskip("router._pump", reason="the native relay pump (router/_pump.c) is not built")

# More under ``nox -s fuzz`` (tests/fuzz/asan.py), where the native scanner runs under the sanitizers
# and each run explores anew. Elsewhere (``nox -s tests``, CI) a fixed budget: the same examples
# every run and no example database, so a red run is the code's doing and reproduces.
FUZZING = "LLMGW_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("LLMGW_FUZZ_EXAMPLES", "600"))


def budget(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not FUZZING,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# ("ok" or "error", bytes used, state after, chunks begun so far)
Outcome = tuple[str, int, tuple[int, int, bytes], int]


def python_feeds(parts: list[bytes], *, decode: bool = False) -> tuple[list[Outcome], ChunkedScanner]:
    scanner = ChunkedScanner(decode=decode)
    out: list[Outcome] = []
    for part in parts:
        try:
            used = scanner.feed(part)
        except UpstreamBroken:
            out.append(("error", -1, (0, 0, b""), 0))
            break
        out.append(("ok", used, scanner.snapshot(), scanner.events))
        if scanner.done:
            break
    return out, scanner


def native_feeds(parts: list[bytes]) -> list[Outcome]:
    state: tuple[int, int, bytes] = (0, 0, b"")
    out: list[Outcome] = []
    events = 0
    for part in parts:
        used, after, error, begun = _pump.scan_chunked(*state, part)
        if error is not None:
            assert used == -1
            out.append(("error", -1, (0, 0, b""), 0))
            break
        state = after
        events += begun
        out.append(("ok", used, state, events))
        if state[0] == 4:  # done
            break
    return out


def check_same(data: bytes, cuts: list[int]) -> None:
    """Both scanners, the same reads: the same result after each read. And the verdict does not
    depend on where the reads end."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    parts = [data[a:b] for a, b in itertools.pairwise(bounds)] or [b""]
    py, scanner = python_feeds(parts)
    assert native_feeds(parts) == py, f"scanners differ on {data!r} read as {parts!r}"
    whole, _ = python_feeds([data])
    if py[-1][0] == "error" or whole[-1][0] == "error":
        assert py[-1][0] == whole[-1][0] == "error", f"{data!r}: an error depends on the reads {parts!r}"
    else:
        assert sum(o[1] for o in py) == whole[-1][1] and py[-1][2] == whole[-1][2], (data, parts)
    decoded, dscanner = python_feeds(parts, decode=True)
    assert [(o[0], o[1], o[3]) for o in decoded] == [(o[0], o[1], o[3]) for o in py], (
        "decode changes the framing"
    )
    del scanner, dscanner


# -- inputs -----------------------------------------------------------------------------------------

TOKEN = st.text("abcXYZ019!#$%&'*+-.^_`|~", min_size=1, max_size=6).map(str.encode)
QUOTED = st.lists(
    st.one_of(
        st.sampled_from([b"a", b" ", b"\t", b"!", b"\x80", b"\xff", b"#", b"~"]),
        st.sampled_from([b'\\"', b"\\\\", b"\\a", b"\\\t"]),
    ),
    max_size=5,
).map(lambda xs: b'"' + b"".join(xs) + b'"')
BWS = st.sampled_from([b"", b"", b" ", b"\t", b"  "])


@st.composite
def extension(draw: st.DrawFn) -> bytes:
    out = draw(BWS) + b";" + draw(BWS) + draw(TOKEN)
    if draw(st.booleans()):
        out += draw(BWS) + b"=" + draw(BWS) + draw(st.one_of(TOKEN, QUOTED))
    return out


@st.composite
def chunk_line(draw: st.DrawFn, size: int) -> bytes:
    digits = b"%x" % size
    digits = draw(st.sampled_from([digits, digits.upper(), b"00" + digits]))
    exts = b"".join(draw(st.lists(extension(), max_size=2)))
    return digits + exts + draw(st.sampled_from([b"", b"", b" ", b"\t"])) + b"\r\n"


@st.composite
def valid_body(draw: st.DrawFn) -> bytes:
    out = b""
    for payload in draw(st.lists(st.binary(min_size=1, max_size=40), max_size=5)):
        out += draw(chunk_line(len(payload))) + payload + b"\r\n"
    out += draw(chunk_line(0))
    for name, value in draw(st.lists(st.tuples(TOKEN, st.binary(max_size=8)), max_size=2)):
        out += name + b":" + value.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"") + b"\r\n"
    return out + b"\r\n"


# Bytes that break framing where a mutation puts them: CR, LF, NUL, signs, hex prefixes, spaces.
NASTY = st.sampled_from(
    [b"\r", b"\n", b"\0", b"x", b"0x", b"-", b"+", b"_", b" ", b";", b"=", b'"', b":", b"g"]
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_body()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["insert", "delete", "replace"]))
        if kind == "insert":
            data[at:at] = draw(NASTY)
        elif kind == "delete" and at < len(data):
            del data[at]
        elif at < len(data):
            data[at : at + 1] = draw(NASTY)
    return bytes(data)


INPUTS = st.one_of(valid_body(), mutated(), st.binary(max_size=64))
TAIL = st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n", b"5\r\nhello\r\n"])  # the next response's bytes


@budget(EXAMPLES)
@given(data=INPUTS, tail=TAIL, cuts=st.lists(st.integers(0, 400), max_size=6))
@example(data=b"-5\r\nhello\r\n0\r\n\r\n", tail=b"", cuts=[])
@example(data=b"0x5\r\nhello\r\n0\r\n\r\n", tail=b"", cuts=[2])
@example(data=b"5\r\nhelloXY0\r\n\r\n", tail=b"", cuts=[9])
def test_the_two_scanners_agree_on_any_input_split_anywhere(
    data: bytes, tail: bytes, cuts: list[int]
) -> None:
    check_same(data + tail, cuts)


@given(body=valid_body(), tail=TAIL, cuts=st.lists(st.integers(0, 400), max_size=6))
@budget(EXAMPLES // 3)
def test_a_valid_body_ends_exactly_at_its_end(body: bytes, tail: bytes, cuts: list[int]) -> None:
    """Whatever follows a body (another response's bytes) is never taken as part of it."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body) + len(tail)]
    data = body + tail
    parts = [data[a:b] for a, b in itertools.pairwise(bounds)]
    outcomes, scanner = python_feeds(parts)
    assert scanner.done and sum(o[1] for o in outcomes) == len(body)
    assert native_feeds(parts) == outcomes


BAD = [
    b"0x5\r\nhello\r\n0\r\n\r\n",  # a hex prefix (int(x, 16) took it)
    b"1_0\r\n",  # an underscore (int() took it)
    b"+5\r\nhello\r\n",  # a sign
    b"-5\r\nhello\r\n",  # a negative size (moved the scan backwards)
    b" 5\r\nhello\r\n",  # whitespace before the digits
    b"5 5\r\nhello\r\n",  # whitespace inside the digits
    b"\r\n",  # no digits
    b"1000000000000000\r\n",  # 16 digits: absurd
    b"0000000000000005\r\nhello\r\n",  # 16 digits, even of zeros
    b"5\nhello\r\n",  # a bare LF
    b"5\r\nhello\n0\r\n\r\n",  # the CRLF after the data, short
    b"5\r\nhelloXY0\r\n\r\n",  # something else where the CRLF goes
    b"5\r\nhello\r\r\n",  # a CR then a CR
    b"5;\r\nhello\r\n",  # an extension with no name
    b"5;a=\r\nhello\r\n",  # an extension with no value
    b'5;a="b\r\nhello\r\n',  # an unclosed quoted string
    b"5;a b\r\nhello\r\n",  # two names
    b"5\x00\r\nhello\r\n",  # a NUL
    b"5\rx\r\nhello\r\n",  # a CR inside the line
    b"0\r\nno colon\r\n\r\n",  # a trailer line without a name
    b"0\r\nx: a\rb\r\n\r\n",  # a CR inside a trailer
    b"0\r\n\n",  # a bare LF for the last line
    b"0\r\n \r\n",  # a blank-looking last line that is not empty
    b"5" + b";a" * MAX_CHUNK_LINE + b"\r\n",  # a line over the bound
]
GOOD = [
    b"5\r\nhello\r\n0\r\n\r\n",
    b"5;a=b\r\nhello\r\n0\r\n\r\n",
    b'5 ; a = "x\\"y" ;b\r\nhello\r\n0;last\r\n\r\n',
    b"A\r\n0123456789\r\n000\r\nx-trailer: 1\r\ny:\r\n\r\n",
    b"5\t\r\nhello\r\n0 \r\n\r\n",  # whitespace before the CRLF, as h11 takes it
]


@pytest.mark.parametrize("data", BAD)
def test_malformed_framing_is_refused_by_both(data: bytes) -> None:
    for cut in range(len(data) + 1) if len(data) < 64 else (0, 3, len(data) // 2):
        parts = [p for p in (data[:cut], data[cut:]) if p]
        py, _ = python_feeds(parts)
        assert py[-1][0] == "error", f"{data!r} split at {cut} was taken"
        assert native_feeds(parts) == py


@pytest.mark.parametrize("data", GOOD)
def test_well_formed_framing_is_taken_by_both(data: bytes) -> None:
    for cut in range(len(data) + 1):
        parts = [p for p in (data[:cut], data[cut:]) if p]
        py, scanner = python_feeds(parts)
        assert scanner.done and sum(o[1] for o in py) == len(data), (data, cut)
        assert native_feeds(parts) == py


# -- the pumps' per-event facts ---------------------------------------------------------------------

FACT_BOUNDS = (0.2, 5.0)  # gaps of events read together (~0 s), and of events 0.4 s or 1 s apart


def event(text: bytes) -> bytes:
    payload = b"data: " + text + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def pump_facts(kind: str) -> tuple[int, list[int], float, float, bytes]:
    """One body through a real pump of ``kind``: a first event 1 s before the relay (as if it came
    with the head), two events in one write, 0.4 s, half an event, the rest with one more and the
    last chunk. Returns (events, gap counts per bucket, gap sum, first_at offset, tail)."""
    import socket
    import time

    import trio

    from router.relay import StreamFacts, make_pump
    from tests.support import apoll

    pump = make_pump(kind, 0, FACT_BOUNDS)
    engine, up = socket.socketpair()
    down, client = socket.socketpair()
    for s in (engine, up, down, client):
        s.setblocking(False)
    got = bytearray()

    def received(n: int) -> bool | None:
        try:
            got.extend(client.recv(1 << 16))
        except BlockingIOError:
            pass
        return True if len(got) >= n else None

    third = event(b"three")
    parts = [event(b"one") + event(b"two"), third[:5], third[5:] + event(b"four") + b"0\r\n\r\n"]
    body = b"".join(parts)
    start = time.monotonic()
    facts = StreamFacts(FACT_BOUNDS, want_tail=True)
    facts.saw(1, start - 1.0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            nursery.start_soon(pump.relay, up, down.fileno(), ChunkedScanner(), facts)
            engine.send(parts[0])
            await apoll("the first write relayed", lambda: received(len(parts[0])))
            await trio.sleep(0.4)  # the input's own timing: a gap of 0.4 s, not a wait for an event
            engine.send(parts[1])
            await apoll("the half event relayed", lambda: received(len(parts[0]) + len(parts[1])))
            engine.send(parts[2])
            await apoll("the whole body relayed", lambda: received(len(body)))
            await apoll("the relay to end", lambda: True if pump.stats() == (0, 0) else None)
            nursery.cancel_scope.cancel()
    finally:
        for s in (engine, up, down, client):
            s.close()
    assert bytes(got) == body
    return facts.events, facts.gaps, facts.gap_sum, facts.first_at - start, facts.tail


async def test_the_two_pumps_report_the_same_facts_for_the_same_body() -> None:
    """The native pump (``_pump.c``, ``observe``) and the Python one (``StreamFacts.saw`` from
    ``PythonRelayPump._readable``) count the same events, put the same gaps in the same buckets,
    go on from the events before the relay (``since``), and keep the same tail."""
    native = await pump_facts("native")
    python = await pump_facts("python")
    for events, gaps, gap_sum, first_at, tail in (native, python):
        assert events == 5  # the one before the relay, then four chunks (the last chunk is no event)
        # Gaps: 1 s from the event before the relay, 0 s (read together), 0.4 s (the third's size
        # line), and the fourth a moment after the third's (the test's poll, far under 0.2 s).
        assert gaps == [2, 2, 0], gaps
        assert 1.4 <= gap_sum < 3.0 and abs(first_at + 1.0) < 1e-6
        assert tail.endswith(b"0\r\n\r\n") and b"data: one" in tail
    assert native[0] == python[0] and native[1] == python[1] and native[4] == python[4]
