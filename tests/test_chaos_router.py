"""Chaos: a ready engine is SIGSTOPped under a streaming load, behind a router-only process.

Two ``python -m agent.engines.sim`` engines (vLLM's flags) serve one model behind
``python -m router --static ...`` with short timeouts; worker threads keep a streaming
load on it with the ``openai`` client. One engine is then stopped (SIGSTOP): a hung process that
still holds its sockets, which the kernel keeps accepting connections for. What must hold: each
request hit by the stop ends within the timeouts, as a 504 or with the stream's error event, never
a hang; the router stops choosing the stopped engine (the time from SIGSTOP is measured and
printed); and every request started after that succeeds, on the live engine. It runs once per
relay pump (``relay_kind``), the router's streamed bodies being relayed by it. The engine is
continued at the end, and every process started here is ended by its pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import openai
import pytest

from tests.test_router import MODEL, REPO, Engine, metrics_of, poll, sample, start_engine, stop_engines

RESPONSE_TIMEOUT = 2.0
IDLE_TIMEOUT = 1.0
#: How late a timeout's answer may reach its client: the stall watch's tick (a tenth of the
#: shorter timeout) and a busy 2-core machine's scheduling.
SLACK = 2.0
WORKERS = 8
#: The router ejects a replica for 10 s the first time (its default ``eject_base``); the load after
#: the ejection ends well within that, so that no request meets the stopped engine re-admitted.
AFTER_EJECTION = 5.0


@attrs.define
class Outcome:
    started: float
    ended: float = 0.0
    replica: str = ""
    #: "ok", "504", "error event", or what else went wrong (a failure of the test).
    result: str = ""
    message: str = ""


TOKENS = 50  # per request: 1 s at the sim's 20 ms per token


def one_request(client: openai.OpenAI, prompt: str, mid_stream: dict[str, threading.Event]) -> Outcome:
    """A streamed chat completion; ``mid_stream[replica]`` is set once a stream from that
    replica has brought a few tokens."""
    out = Outcome(time.monotonic())
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, stream=True
        )
        out.replica = raw.headers.get("x-llmgw-replica", "")
        tokens = 0
        for chunk in raw.parse():
            tokens += sum(1 for c in chunk.choices if c.delta.content)
            if tokens == 3 and out.replica in mid_stream:
                mid_stream[out.replica].set()
        out.result = "ok" if tokens == TOKENS else f"{tokens} tokens"
    except openai.APIStatusError as exc:
        out.result, out.message = str(exc.status_code), exc.message
    except openai.APIConnectionError as exc:  # a broken body, or the client's own timeout: a hang
        out.result, out.message = type(exc).__name__, str(exc)
    except openai.APIError as exc:  # an SSE error event
        body = exc.body if isinstance(exc.body, dict) else {}
        out.result = "error event" if body.get("code") == "upstream_idle_timeout" else "other error event"
        out.message = exc.message
    out.ended = time.monotonic()
    return out


def start_router(tmp: Path, engines: list[Engine]) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp / "router.log"
    argv = [sys.executable, "-m", "router", "--port", "0"]
    for engine in engines:
        argv += ["--static", f"{MODEL}={engine.url}"]
    argv += ["--response-timeout", str(RESPONSE_TIMEOUT), "--stream-idle-timeout", str(IDLE_TIMEOUT)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def port() -> str | None:
        m = re.search(r"listening on [^ ]+:(\d+)", log.read_text())
        if m is None and proc.poll() is not None:
            raise AssertionError(f"the router exited {proc.returncode}:\n{log.read_text()}")
        return m.group(1) if m else None

    try:
        return proc, f"http://127.0.0.1:{poll('the router to listen', port)}"
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise


@pytest.mark.chaos
def test_a_sigstopped_engine_under_streaming_load_is_cut_off_and_routed_around(
    tmp_path: Path, relay_kind: str
) -> None:
    engines: list[Engine] = []
    router: subprocess.Popen[bytes] | None = None
    stopped: Engine | None = None
    done = threading.Event()
    outcomes: list[Outcome] = []
    try:
        engines = [start_engine(tmp_path, "a"), start_engine(tmp_path, "b")]
        router, base = start_router(tmp_path, engines)  # LLMGW_RELAY (relay_kind) chooses its pump
        assert f"{relay_kind} relay pump" in (tmp_path / "router.log").read_text()
        a_replica, b_replica = f"{MODEL}-r0", f"{MODEL}-r1"  # as the router names --static replicas
        mid_stream = {a_replica: threading.Event()}

        def worker(index: int) -> None:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
            n = 0
            while not done.is_set():
                # Distinct prompts: prefix affinity spreads them over both replicas.
                outcomes.append(one_request(client, f"worker {index} request {n}", mid_stream))
                n += 1

        with ThreadPoolExecutor(WORKERS) as pool:
            for i in range(WORKERS):
                pool.submit(worker, i)
            try:
                # Both engines serve before the fault.
                poll(
                    "both replicas to answer streams",
                    lambda: all(
                        sum(o.result == "ok" and o.replica == r for o in list(outcomes)) >= 3
                        for r in (a_replica, b_replica)
                    ),
                    timeout=30,
                )
                # Stopped while a stream from it is under way, so that both timeouts are met: the
                # idle one by the streams it was sending, the response one by requests sent to it
                # after the stop and before the router stops choosing it.
                mid_stream[a_replica].clear()
                poll("a stream from the engine to be under way", mid_stream[a_replica].is_set)
                stopped = engines[0]
                os.kill(stopped.proc.pid, signal.SIGSTOP)
                sigstop_at = time.monotonic()

                def ejected() -> bool:
                    return sample(metrics_of(base), "llmgw_router_upstream_ejected", replica=a_replica) == 1

                poll(
                    "the router to eject the stopped engine",
                    ejected,
                    timeout=IDLE_TIMEOUT + RESPONSE_TIMEOUT + 15,
                )
                ejected_at = time.monotonic()
                poll(
                    f"{2 * WORKERS} requests started after the ejection to end",
                    lambda: sum(o.started > ejected_at for o in list(outcomes)) >= 2 * WORKERS,
                    timeout=AFTER_EJECTION,
                )
            finally:
                done.set()  # the pool's exit waits for the workers' last requests (30 s bound each)

        sent_to_a = [o.started for o in outcomes if o.replica == a_replica or a_replica in o.message]
        last_choice = max(sent_to_a, default=sigstop_at)
        print(
            f"\nSIGSTOP to ejection (the router no longer chooses the engine): {ejected_at - sigstop_at:.2f} s"
            f" (stream idle timeout {IDLE_TIMEOUT:g} s, response timeout {RESPONSE_TIMEOUT:g} s);"
            f" the last request sent to it started {last_choice - sigstop_at:+.2f} s after SIGSTOP"
        )
        before = [o for o in outcomes if o.ended < sigstop_at]
        hit = [o for o in outcomes if o.result != "ok"]
        after = [o for o in outcomes if o.started > ejected_at]
        print(
            f"{len(outcomes)} requests: {len(before)} done before the stop, {len(hit)} hit by it "
            f"({sum(o.result == '504' for o in hit)} 504, {sum(o.result == 'error event' for o in hit)} "
            f"error events), {len(after)} started after the ejection"
        )
        assert all(o.result == "ok" for o in before)
        assert any(o.result == "error event" for o in hit), "no stream was cut off mid-stream"
        for o in hit:
            assert o.result in ("504", "error event"), o
            assert a_replica in o.message, o
            assert o.started < ejected_at, o
            # Within the timeouts of whichever came last: the request or the stop.
            assert o.ended - max(o.started, sigstop_at) < max(RESPONSE_TIMEOUT, IDLE_TIMEOUT) + SLACK, o
        assert len(after) >= WORKERS
        assert [o for o in after if o.result != "ok" or o.replica != b_replica] == []
        text = metrics_of(base)
        assert sample(text, "llmgw_router_upstream_errors_total", replica=a_replica, kind="timeout") == len(
            hit
        )
        assert sample(text, "llmgw_router_ejections_total", replica=a_replica) == 1
        assert sample(text, "llmgw_router_upstream_errors_total", replica=b_replica) == 0
        # The stop was a pause: continued, the engine serves again.
        os.kill(stopped.proc.pid, signal.SIGCONT)
        stopped = None
        poll("the continued engine to answer /health", lambda: engines[0].requests() >= 0)
    finally:
        done.set()
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        if router is not None:
            router.terminate()
            try:
                router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(timeout=10)
        stop_engines(engines)
