"""Random and malformed engine bytes through the native pump's thread, on real socket pairs.

Each case is a body (valid, mutated, or noise), sent by the test as the engine and then closed;
the pump's thread relays it as a body job (``add``) or a whole response (``respond``). Whatever the
bytes, the job must end (never hang), its verdict must match the Python scanner's (done exactly
when ``ChunkedScanner`` finds the body's end, an engine error otherwise, or the head handed back
unsent when the bytes that came with it are malformed), and the client must get exactly the body
and nothing past it, or a prefix of it on an error. ``nox -s fuzz`` runs this
file with the extension built under AddressSanitizer and UndefinedBehaviorSanitizer, many more
cases (``LLMGW_FUZZ_CASES``), so that a read past a buffer shows as a report, not as luck."""

from __future__ import annotations

import os
import random
import select
import socket

import pytest

from router.framing import ChunkedScanner, UpstreamBroken

_pump = pytest.importorskip("router._pump", reason="the native relay pump (router/_pump.c) is not built")

CASES = int(os.environ.get("LLMGW_FUZZ_CASES", "150"))
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
SUFFIX = b"x-llmgw-replica: r0\r\ntransfer-encoding: chunked\r\n\r\n"
NASTY = [b"\r", b"\n", b"\0", b"x", b"0x", b"-", b"+", b" ", b";", b"=", b'"', b":", b"\xff", b"f" * 20]


def body(rng: random.Random) -> bytes:
    out = b""
    for _ in range(rng.randint(0, 6)):
        payload = rng.randbytes(rng.choice([1, 5, 40, 3000, 70000]))
        ext = rng.choice([b"", b";a=b", b' ; q="x\\"y"', b";" + b"e" * 5000])
        out += b"%x" % len(payload) + ext + b"\r\n" + payload + b"\r\n"
    out += b"0\r\n" + rng.choice([b"", b"x-t: 1\r\n", b"t:" + b"v" * 5000 + b"\r\n"]) + b"\r\n"
    return out


def engine_bytes(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.1:
        return rng.randbytes(rng.randint(0, 300))
    data = bytearray(body(rng))
    if kind < 0.7:
        for _ in range(rng.randint(1, 4)):
            at = rng.randint(0, len(data))
            data[at : at + rng.randint(0, 2)] = rng.choice(NASTY)
    if rng.random() < 0.3:
        data += b"HTTP/1.1 200 OK\r\n"  # another response's bytes after the body
    return bytes(data)


def python_verdict(data: bytes) -> tuple[bool, int]:
    """(done, body length) by the Python scanner, or (False, -1) on an error."""
    scanner = ChunkedScanner()
    try:
        used = scanner.feed(data)
    except UpstreamBroken:
        return False, -1
    return scanner.done, used


def run_job(pump: _pump.Pump, data: bytes, whole: bool) -> tuple[int, bytes]:
    """One job to its end: (result code, what the client got)."""
    engine, up = socket.socketpair()
    down, client = socket.socketpair()
    for s in (engine, up, down, client):
        s.setblocking(False)
    try:
        if whole:
            pump.respond(up.fileno(), down.fileno(), SUFFIX)
            data = HEAD + data
        else:
            pump.add(up.fileno(), down.fileno(), 0, 0, b"")
        got = bytearray()
        sent = 0
        results: list[tuple[int, int, bool, str, bytes | None, int, float]] = []
        while not results:
            writers = [engine] if sent < len(data) else []
            readable, writable, _ = select.select([client, pump.notify_fd], writers, [], 10)
            assert readable or writable, "the job neither ended nor moved in 10 s"
            if engine in writable:
                sent += engine.send(data[sent : sent + 65536])
                if sent == len(data):
                    engine.shutdown(socket.SHUT_WR)  # then the engine's end: EOF
            if client in readable:
                got += client.recv(1 << 20)
            if pump.notify_fd in readable:
                results = [r for r in pump.collect() if r[0] == up.fileno()]
        while True:
            try:
                more = client.recv(1 << 20)
            except BlockingIOError:
                break
            got += more
            if not more:
                break
        return results[0][1], bytes(got)
    finally:
        for s in (engine, up, down, client):
            s.close()


@pytest.mark.parametrize("whole", [False, True], ids=["add", "respond"])
def test_any_engine_bytes_end_the_job_as_the_python_scanner_says(whole: bool) -> None:
    pump = _pump.Pump(coalesce_us=0)
    rng = random.Random(int(os.environ.get("LLMGW_FUZZ_SEED", "17")) + whole)
    client_head = _pump.client_head(HEAD[:-4], SUFFIX)
    assert client_head is not None
    prefix = client_head[0] if whole else b""
    try:
        for case in range(CASES):
            data = engine_bytes(rng)
            code, got = run_job(pump, data, whole)
            done, used = python_verdict(data)
            where = f"case {case}: {data[:80]!r}... ({len(data)} bytes)"
            if done:
                assert code == _pump.DONE, where
                assert got == prefix + data[:used], where
            elif code == _pump.HEAD:  # malformed in the bytes that came with the head: handed back
                assert whole and got == b"", where
            else:
                assert code == _pump.ENGINE, where
                assert (prefix + data).startswith(got), where
    finally:
        pump.close()


def test_random_bytes_through_the_scanner_entry_point() -> None:
    """scan_chunked on noise and mutated bodies, from every state the thread can be in."""
    rng = random.Random(int(os.environ.get("LLMGW_FUZZ_SEED", "17")))
    for _ in range(CASES * 20):
        data = engine_bytes(rng)
        state = rng.choice([(0, 0, b""), (1, rng.randint(1, 1 << 40), b""), (2, 1, b""), (2, 2, b"")])
        state = rng.choice([state, (0, 0, rng.randbytes(rng.randint(0, 4096))), (3, 0, b"x:")])
        used, after, error, _ = _pump.scan_chunked(*state, data)
        assert (used == -1) == (error is not None)
        assert -1 <= used <= len(data) and len(after[2]) <= 4096
