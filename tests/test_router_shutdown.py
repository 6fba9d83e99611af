"""``python -m router`` stops like a service: a real router process in front of a real sim engine,
a stream from the ``openai`` client in flight when SIGTERM (or SIGINT) arrives.

The listener closes at once (a new connection is refused, so a load balancer moves on), the
stream in flight ends whole, and the process exits 0; a stream longer than ``--shutdown-grace``
is cut at the grace, and the process still exits 0, within the grace and a bound.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support import poll
from tests.test_router import MODEL, Engine, start_engine, stop_engines
from tests.test_router_metrics import CHAT, RouterProc

#: The engine's pace: a stream of N tokens lasts about N * 40 ms.
ITL_MS = 40


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    started = start_engine(tmp_path_factory.mktemp("engine"), "m", {"LLMGW_SIM_ITL_MS": str(ITL_MS)})
    yield started
    stop_engines([started])


class Stream:
    """One streamed chat completion read by the ``openai`` client in a thread: its text chunks,
    whether it ended with a finish reason, and the error that ended it otherwise."""

    def __init__(self, base: str, tokens: int) -> None:
        self.chunks: list[str] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        self.thread = threading.Thread(target=self._read, args=(client, tokens), daemon=True)
        self.thread.start()

    def _read(self, client: openai.OpenAI, tokens: int) -> None:
        try:
            for chunk in client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=tokens, stream=True
            ):
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.chunks.append(choice.delta.content)
                    if choice.finish_reason:
                        self.finish_reason = choice.finish_reason
        except BaseException as exc:  # the test reads it
            self.error = exc

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the stream was still open after {timeout:g} s"


def refused(port: int) -> bool | None:
    """True once a connection to the router's port is refused (its listener closed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return None
    except ConnectionRefusedError:
        return True


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stream_in_flight_ends_whole_and_the_router_exits_0(
    engine: Engine, tmp_path: Path, signum: signal.Signals
) -> None:
    router = RouterProc(tmp_path, ["--static", f"{MODEL}={engine.url}"])
    try:
        tokens = 40  # about 1.6 s at the engine's pace: the signal comes early in it
        stream = Stream(router.base, tokens)
        poll("the stream's first tokens", lambda: len(stream.chunks) >= 2)
        router.proc.send_signal(signum)
        poll("the router's port to refuse connections", lambda: refused(port_of(router.base)))
        stream.join(60)
        assert stream.error is None, repr(stream.error)
        assert len(stream.chunks) == tokens and stream.finish_reason == "length"
        assert router.proc.wait(timeout=30) == 0, router.err.read_text()
        log = router.err.read_text()
        assert f"{signum.name}: stopping" in log and "every response in progress ended" in log
    finally:
        router.stop()


def test_a_stream_longer_than_the_grace_is_cut_and_the_router_still_exits_0(
    engine: Engine, tmp_path: Path
) -> None:
    grace = 1.0
    router = RouterProc(tmp_path, ["--static", f"{MODEL}={engine.url}", "--shutdown-grace", str(grace)])
    try:
        stream = Stream(router.base, 1000)  # about 40 s at the engine's pace
        poll("the stream's first tokens", lambda: len(stream.chunks) >= 2)
        signalled = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0, router.err.read_text()
        # The grace, and a bound for a process on a busy CI host to close its sockets and exit.
        assert time.monotonic() - signalled < grace + 10
        stream.join(30)
        assert stream.finish_reason is None and 2 <= len(stream.chunks) < 1000
        assert isinstance(stream.error, openai.APIError | openai.APIConnectionError), repr(stream.error)
        assert (
            "1 client connections still open after the 1 s shutdown grace were cut" in router.err.read_text()
        )
    finally:
        router.stop()
