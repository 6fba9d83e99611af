"""The router's /metrics through prometheus_client, and its --version and log flags, from a real
``python -m router --static`` process in front of a real sim engine, driven by the ``openai``
client and scraped with ``prometheus_client``'s own parser.

Every count is checked against what the client saw: requests by model and status (a model the
router has no route for under its one fixed label), time to first token once per streamed response,
inter-token gaps once per event after a stream's first, and the tokens the engine's ``usage`` said.
Both relay pumps are run (``LLMGW_RELAY``): the native one relays a stream from its head on, the
Python one from after it, and the facts must come out the same.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import relay
from router.config import load
from router.metrics import TTFT_BUCKETS, UNKNOWN_MODEL, Metrics, ended_with_done, usage_of
from tests.support import free_port, poll
from tests.test_router import MODEL, Engine, start_engine, stop_engines

REPO = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "count the tokens of this prompt"}]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition, by name and labels, as prometheus_client parses it."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float:
    return got.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    started = start_engine(tmp_path_factory.mktemp("engine"), "m", {"LLMGW_SIM_ITL_MS": "10"})
    yield started
    stop_engines([started])


class RouterProc:
    """``python -m router`` with ``args``, its stdout (the listening line) and stderr (logs) in
    files; stopped by pid."""

    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.out, self.err = tmp / "router.out", tmp / "router.err"
        argv = [sys.executable, "-m", "router", "--port", "0", *args]
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, cwd=REPO, env={**os.environ, **(env or {})}
            )

        def port() -> int | None:
            m = re.search(r"listening on [^ ]+:(\d+)", self.out.read_text())
            if m is None and self.proc.poll() is not None:
                raise AssertionError(f"the router exited {self.proc.returncode}: {self.err.read_text()}")
            return int(m.group(1)) if m else None

        self.base = f"http://127.0.0.1:{poll('the router to listen', port)}"

    def metrics(self) -> Samples:
        return samples(httpx.get(f"{self.base}/metrics", timeout=10).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_requests_ttft_itl_and_tokens_match_what_the_client_saw(
    engine: Engine, tmp_path: Path, kind: str
) -> None:
    if kind == "native" and not relay.NATIVE_AVAILABLE:
        pytest.skip("the native relay pump was not built here")
    router = RouterProc(
        tmp_path, ["--static", f"{MODEL}={engine.url}", "--max-body-bytes", "65536"], {"LLMGW_RELAY": kind}
    )
    try:
        c = openai.OpenAI(base_url=f"{router.base}/v1", api_key="unused", max_retries=0, timeout=30)
        chunks_per_stream: list[int] = []
        prompt = completion = 0
        for tokens in (3, 5, 8):  # streams without usage
            chunks = list(
                c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=tokens, stream=True)
            )
            chunks_per_stream.append(len(chunks))
        for tokens in (4, 6):  # streams that ask for usage: its chunk comes last, before [DONE]
            chunks = list(
                c.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    max_tokens=tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            chunks_per_stream.append(len(chunks))
            usage = chunks[-1].usage
            assert usage is not None and usage.completion_tokens == tokens
            prompt += usage.prompt_tokens
            completion += usage.completion_tokens
        for tokens in (2, 7):  # JSON answers
            answer = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=tokens)
            assert answer.usage is not None
            prompt += answer.usage.prompt_tokens
            completion += answer.usage.completion_tokens
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=1)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="another-invented-name", messages=CHAT, max_tokens=1)
        # Refused before its body was read: no model, the router's own 413.
        too_big = [{"role": "user", "content": "x" * 70_000}]
        with pytest.raises(openai.APIStatusError) as refused:
            c.chat.completions.create(model=MODEL, messages=too_big, max_tokens=1)
        assert refused.value.status_code == 413

        # A response's counters follow its last byte, which the client may have read first.
        def answered() -> Samples | None:
            got = router.metrics()
            return got if value(got, "llmgw_router_requests_total", model=MODEL, status="200") >= 7 else None

        got = poll("seven answered requests in /metrics", answered)
        assert value(got, "llmgw_router_requests_total", model=MODEL, status="200") == 7
        # The openai client closes a stream's connection on its [DONE] event, often before the
        # chunked body's end (the engine writes it separately) has reached it: answered, not gone.
        assert value(got, "llmgw_router_requests_total", model=MODEL, status="499") == 0
        assert value(got, "llmgw_router_client_disconnects_total", model=MODEL) == 0
        # Invented names share one series: a client cannot grow /metrics without bound.
        assert value(got, "llmgw_router_requests_total", model=UNKNOWN_MODEL, status="404") == 2
        assert not any("no-such-model" in str(labels) for _, labels in got)
        assert value(got, "llmgw_router_requests_total", model="", status="413") == 1
        # One time to first token per streamed response, in the TTFT buckets.
        assert value(got, "llmgw_router_time_to_first_token_seconds_count", model=MODEL) == 5
        assert value(got, "llmgw_router_time_to_first_token_seconds_bucket", model=MODEL, le="+Inf") == 5
        assert 0 < value(got, "llmgw_router_time_to_first_token_seconds_sum", model=MODEL) < 5 * 10
        top = repr(TTFT_BUCKETS[-1])
        assert value(got, "llmgw_router_time_to_first_token_seconds_bucket", model=MODEL, le=top) == 5
        # A gap per event after each stream's first. The engine's events are the client's chunks
        # and [DONE], which the client does not yield: events - 1 == the chunks the client got.
        itl = value(got, "llmgw_router_inter_token_latency_seconds_count", model=MODEL)
        assert itl == sum(chunks_per_stream), (itl, chunks_per_stream)
        assert value(got, "llmgw_router_inter_token_latency_seconds_bucket", model=MODEL, le="+Inf") == itl
        # The engine paces tokens 10 ms apart: the gaps add up to at least that per token.
        assert value(got, "llmgw_router_inter_token_latency_seconds_sum", model=MODEL) > 0.005 * (3 + 5 + 8)
        # Tokens: exactly the usage the engine reported (streams without include_usage report none).
        assert value(got, "llmgw_router_prompt_tokens_total", model=MODEL) == prompt
        assert value(got, "llmgw_router_completion_tokens_total", model=MODEL) == completion
        # Every answered request's first byte, streamed or not; the process collector is there.
        assert value(got, "llmgw_router_time_to_first_byte_seconds_count", model=MODEL) == 7
        assert value(got, "process_resident_memory_bytes") > 0
        assert value(got, "llmgw_router_info", relay=kind, version=version_of_router()) == 1
        # OpenMetrics for a scraper that asks for it.
        om = httpx.get(
            f"{router.base}/metrics", headers={"accept": "application/openmetrics-text"}, timeout=10
        )
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("tail", "done"),
    [
        (b"data: {}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n", True),  # the client has every event
        (b"e\r\ndata: [DONE]\n\n\r\n0\r\n", True),  # and part of the body's end
        (b"data:[DONE]\r\n\r\n", True),  # decoded for an HTTP/1.0 client, CRLF lines
        (b"e\r\ndata: [DONE]\n", False),  # the event itself is cut short
        (b'c\r\ndata: {"a"}\n\n\r\n', False),  # left mid-stream
        (b'data: {"text": "data: [DONE]"}\n\n\r\n', False),  # the words inside generated text
        (b"", False),
    ],
)
def test_a_stream_that_ended_with_done_is_told_apart(tail: bytes, done: bool) -> None:
    assert ended_with_done(tail) is done


def version_of_router() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "router", "--version"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    m = re.fullmatch(r"llmgw router (\S+)\n", done.stdout)
    assert m, done.stdout
    return m.group(1)


async def test_a_counter_past_a_million_keeps_every_digit() -> None:
    """The hand-written exposition printed 1234567 as 1.23457e+06 (``:g``), which flattens
    ``rate()``; prometheus_client's keeps every digit."""
    from router.pool import Pool
    from router.retry import Ejection

    m = Metrics("test")
    m.requests[(MODEL, "200")] = 1_234_567
    m.prompt_tokens[MODEL] = 98_765_432_101
    pool = Pool(max_idle=1, idle_timeout=1.0, connect_timeout=1.0)
    data, content_type = await m.scrape(Ejection(), pool, relay.PythonRelayPump(), 0.0)
    text = data.decode()
    assert content_type.startswith("text/plain") and "1.23457e+06" not in text
    got = samples(text)
    assert value(got, "llmgw_router_requests_total", model=MODEL, status="200") == 1_234_567
    assert value(got, "llmgw_router_prompt_tokens_total", model=MODEL) == 98_765_432_101


def test_version_prints_the_package_version() -> None:
    assert version_of_router()


def test_json_logs_are_one_object_per_line(tmp_path: Path) -> None:
    """With --log-format json (and --log-level debug) every stderr line is a JSON object; a replica
    that refuses connections is ejected, logged as a warning with its URL in the message."""
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProc(
        tmp_path,
        ["--static", f"{MODEL}={dead}", "--eject-after", "1", "--log-format", "json", "--log-level", "debug"],
    )
    try:
        answer = httpx.post(
            f"{router.base}/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, timeout=30
        )
        assert answer.status_code == 502

        def ejected() -> list[dict[str, object]] | None:
            lines = [json.loads(line) for line in router.err.read_text().splitlines()]
            return lines if any("ejected" in str(d.get("message")) for d in lines) else None

        lines = poll("the ejection to be logged", ejected)
        for doc in lines:
            assert {"time", "level", "logger", "message"} <= set(doc), doc
        warning = next(d for d in lines if "ejected" in str(d["message"]))
        assert warning["level"] == "warning" and dead in str(warning["message"])
        assert any(d["level"] == "info" and "starting" in str(d["message"]) for d in lines)
    finally:
        router.stop()


def test_a_bad_log_setting_exits_2_naming_where_it_came_from(tmp_path: Path) -> None:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "router", "--static", f"{MODEL}=http://127.0.0.1:9", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", **(env or {})},
            timeout=60,
        )

    flag = run("--log-level", "loud")
    assert flag.returncode == 2 and flag.stderr.count("\n") == 1
    assert "--log-level" in flag.stderr and "'loud'" in flag.stderr and "debug, info" in flag.stderr
    variable = run(env={"LLMGW_ROUTER_LOG_FORMAT": "xml"})
    assert (
        variable.returncode == 2
        and "LLMGW_ROUTER_LOG_FORMAT" in variable.stderr
        and "text, json" in variable.stderr
    )
    toml = tmp_path / "router.toml"
    toml.write_text('port = 0\nlog_format = "yaml"\n')
    in_file = run("--config", str(toml))
    assert in_file.returncode == 2 and f"{toml} line 2" in in_file.stderr
    shared = run(env={"LLMGW_LOG_LEVEL": "chatty"})
    assert shared.returncode == 2 and "LLMGW_LOG_LEVEL" in shared.stderr
    # The router's own variable wins over the shared one, and a flag over both.
    static = ["--static", f"{MODEL}=http://127.0.0.1:9"]
    both = {"LLMGW_LOG_LEVEL": "debug", "LLMGW_ROUTER_LOG_LEVEL": "Error", "LLMGW_LOG_FORMAT": "json"}
    config = load(static, both).config
    assert (config.log_level, config.log_format) == ("error", "json")
    assert load([*static, "--log-level", "warning"], both).config.log_level == "warning"


def test_usage_is_read_from_the_last_usage_object_of_a_tail() -> None:
    """What ``usage_of`` takes from a body's last bytes: a stream's usage chunk (chunked framing
    around it), a JSON answer's object with nested details; not a null, a cut-off object, or the
    word inside generated text (escaped quotes there)."""
    stream = (
        b'\r\n5a\r\ndata: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
        b'"total_tokens":10}}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n'
    )
    assert usage_of(stream) == (7, 3)
    answer = (
        b'{"choices":[{"message":{"content":"a \\"usage\\": {\\"prompt_tokens\\": 1}"}}],'
        b'"usage":{"prompt_tokens":12,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":8}}}'
    )
    assert usage_of(answer) == (12, 4)
    assert usage_of(b'data: {"choices":[{"delta":{}}],"usage":null}\n\n') is None
    assert usage_of(b'_tokens":3}}\n\ndata: [DONE]\n\n') is None  # its start fell off the tail
    assert usage_of(b'"usage":{"prompt_tokens":-1,"completion_tokens":2}') is None
    assert usage_of(b'"usage":{"prompt_tokens":true,"completion_tokens":2}') is None
