"""Crowds at the agent port: each connection closed as before, the log says so once per interval."""

from __future__ import annotations

import logging
import re

import pytest
import trio
from hyperframe.frame import GoAwayFrame, SettingsFrame

from tests.rawh2 import PREFACE, split_frames
from tests.wirepeers import echo_handler
from transport import ServerLimits, StreamServer
from transport.bursts import BurstCounter

CROWD = 300
_LINE = r"127\.0\.0\.1:\d+: no (?:TLS handshake or request|request) within 0\.5 s(?: of the HTTP/2 preface)?; closing"
INDIVIDUAL = re.compile(_LINE)
SUMMARY = re.compile(
    r"closed ([\d,]+) more connections that sent no TLS handshake or request within 0\.5 s, "
    rf"in the last 2 s \(the last: {_LINE}\)"
)


class _Lines(logging.Handler):
    """The transport's log lines, and an event set once ``total`` lines are accounted for: logged
    one by one (``individual``) or counted in a summary line (``summary``, the count its group 1)."""

    def __init__(self, individual: re.Pattern[str], summary: re.Pattern[str], total: int = CROWD) -> None:
        super().__init__(logging.INFO)
        self.patterns = (individual, summary)
        self.total = total
        self.lines: list[str] = []
        self.accounted = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if len(self.individual()) + sum(self.summed()) >= self.total:
            self.accounted.set()

    def individual(self) -> list[str]:
        return [line for line in self.lines if self.patterns[0].fullmatch(line)]

    def summed(self) -> list[int]:
        return [
            int(m.group(1).replace(",", "")) for line in self.lines if (m := self.patterns[1].fullmatch(line))
        ]


@pytest.mark.parametrize("says", ["nothing", "preface"])
async def test_idle_connections_are_closed_and_logged_once_with_a_count(
    nursery: trio.Nursery, says: str
) -> None:
    """``nothing``: TCP connections that send no byte; ``preface``: HTTP/2 connections that send the
    preface and SETTINGS and never open a stream (these were held as long as they answered PINGs)."""
    logger = logging.getLogger("llmgw.transport.server")
    handler = _Lines(INDIVIDUAL, SUMMARY)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        limits = ServerLimits(handshake_timeout=0.5, log_burst_keep=3, log_burst_interval=2.0)
        server = StreamServer(echo_handler, limits=limits)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        conns = []
        for _ in range(CROWD):
            conns.append(conn := await trio.open_tcp_stream("127.0.0.1", port))
            if says == "preface":  # at once: the preface itself is due within the 0.5 s
                await conn.send_all(PREFACE + SettingsFrame(0).serialize())
        closed = 0

        async def wait_closed(conn: trio.SocketStream) -> None:
            nonlocal closed
            got = b""
            try:
                while chunk := await conn.receive_some(65536):
                    got += chunk
            except trio.BrokenResourceError:
                pass  # closed with unread data in flight: a reset, closed all the same
            if says == "nothing":
                assert got == b""
            else:  # our SETTINGS, then a GOAWAY that says why
                goaway = [f for f in split_frames(got) if isinstance(f, GoAwayFrame)]
                assert goaway and goaway[0].additional_data == b"no request within 0.5 s", got
            closed += 1

        with trio.fail_after(20):  # every connection is closed within its timeout, as before
            async with trio.open_nursery() as waiters:
                for conn in conns:
                    waiters.start_soon(wait_closed, conn)
        assert closed == CROWD
        for conn in conns:
            await conn.aclose()
        with trio.fail_after(10):  # the interval's summary comes when the interval ends
            await handler.accounted.wait()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    summaries = handler.summed()
    assert len(handler.individual()) == 3, handler.individual()
    assert 3 + sum(summaries) == CROWD
    # One summary per 2 s interval the crowd's timeouts spanned (a few at most), not 297 lines.
    assert 1 <= len(summaries) <= 4, handler.lines
    assert len(handler.lines) == 1 + 3 + len(summaries), handler.lines  # with "agent streams on ..."


async def test_http1_requests_on_the_agent_port_are_answered_and_logged_once(nursery: trio.Nursery) -> None:
    """A load balancer's health check aimed at the agent port: each request still gets its 400."""
    line = r"127\.0\.0\.1:\d+: HTTP/1\.1 request on the HTTP/2 port: 'GET /healthz HTTP/1\.1'"
    handler = _Lines(
        re.compile(line),
        re.compile(
            rf"([\d,]+) more HTTP/1\.1 requests on the HTTP/2 port in the last 1 s \(the last: {line}\)"
        ),
        total=40,
    )
    logger = logging.getLogger("llmgw.transport.server")
    logger.addHandler(handler)
    try:
        server = StreamServer(echo_handler, limits=ServerLimits(log_burst_interval=1.0))
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        for _ in range(40):
            async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
                await conn.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = b""
                with trio.fail_after(5):
                    while chunk := await conn.receive_some(65536):
                        answer += chunk
                assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
        with trio.fail_after(10):
            await handler.accounted.wait()
    finally:
        logger.removeHandler(handler)
    assert len(handler.individual()) == 3 and 3 + sum(handler.summed()) == 40, handler.lines


def test_burst_counter_keeps_the_first_and_sums_the_rest_per_interval() -> None:
    counter = BurstCounter(keep=2, interval=10.0)
    assert [counter.record(t / 100) for t in range(5)] == [True, True, False, False, False]
    assert counter.window_end == 10.0
    assert counter.close_window() == 3
    # The burst goes on in the next interval: every line is summed, none logged one by one.
    assert [counter.record(12.0 + t) for t in range(3)] == [False, False, False]
    assert counter.close_window() == 3
    # A whole quiet interval after the last window ends the burst: the first lines are logged again.
    assert counter.record(40.0) and counter.record(41.0) and not counter.record(42.0)
    assert counter.close_window() == 1
    # A window with nothing held back sums up nothing.
    assert counter.record(80.0)
    assert counter.close_window() == 0
