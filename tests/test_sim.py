"""The engine simulator as a real process: lifecycle, the OpenAI API through the real ``openai``
client, fault knobs, client disconnects, and SIGTERM.

Each test starts ``python -m agent.engines.sim`` on a port the kernel picks (``--port 0``; the
simulator logs the port it got), with stdout and stderr going to files as the agent's supervisor
sends them. Every wait polls with a deadline and says what it waited for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

import schema
from agent.discovery.model import GpuInfo
from agent.engines import LaunchContext, flagsets, plan
from agent.engines.sim import ARGV_PREFIX
from tests.support import poll

REPO = Path(__file__).resolve().parent.parent


@attrs.define
class Sim:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self) -> None:
        poll("/health to answer 200", lambda: self.health() == 200)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=2).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} missing from /metrics:\n{text}"
        return float(match.group(1))

    def wait_exit(self, timeout: float = 15.0) -> int:
        return poll(f"the simulator (pid {self.proc.pid}) to exit", lambda: _code(self.proc), timeout)[0]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def _code(proc: subprocess.Popen[bytes]) -> tuple[int] | None:
    code = proc.poll()
    return None if code is None else (code,)


StartSim = Callable[..., Sim]


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[StartSim]:
    started: list[Sim] = []

    def start(
        *args: str,
        env: dict[str, str] | None = None,
        argv: tuple[str, ...] | None = None,
        listen: bool = True,
    ) -> Sim:
        n = len(started)
        out, err = tmp_path / f"sim{n}.out", tmp_path / f"sim{n}.err"
        if argv is None:
            argv = (*ARGV_PREFIX, "serve", "org/sim-model", "--served-model-name", "sim-model")
            argv += ("--host", "127.0.0.1", "--port", "0", *args)
        full_env = {
            **os.environ,
            "LLMGW_SIM_LOAD_SECONDS": "0",
            "LLMGW_SIM_TTFT_MS": "5",
            "LLMGW_SIM_ITL_MS": "1",
        }
        full_env.update(env or {})
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(argv, stdout=o, stderr=e, env=full_env, cwd=REPO, start_new_session=True)
        sim = Sim(proc=proc, out=out, err=err)
        started.append(sim)
        if listen:

            def port() -> int | None:
                m = re.search(r"listening on [^ ]+:(\d+)", sim.stdout())
                if m is None and proc.poll() is not None:
                    raise AssertionError(f"simulator exited {proc.returncode}:\n{sim.stdout()}{sim.stderr()}")
                return int(m.group(1)) if m else None

            sim.port = poll("the simulator to listen", port)
        return sim

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            sim.proc.kill()
        sim.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# Lifecycle and the OpenAI API


def test_health_is_503_while_loading_then_200(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_LOAD_SECONDS": "1.5"})
    assert poll("/health to answer", sim.health) == 503
    assert httpx.get(f"{sim.url}/v1/models").status_code == 503
    sim.wait_ready()
    out = sim.stdout()
    assert "loading model org/sim-model (served as sim-model" in out
    assert f"ready on port {sim.port}" in out
    models = sim.client().models.list()
    assert [m.id for m in models.data] == ["sim-model"]


def test_chat_completions_plain_and_streamed(start_sim: StartSim) -> None:
    sim = start_sim()
    sim.wait_ready()
    client = sim.client()
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "tell me a story"}
    ]
    reply = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=12)
    text = reply.choices[0].message.content
    assert text and len(text.split()) == 12
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == 4 + 4
    # Deterministic: the same prompt, the same words; streamed, the same words again.
    again = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=12)
    assert again.choices[0].message.content == text
    stream = client.chat.completions.create(
        model="sim-model",
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas: list[str] = []
    usage = None
    finish = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(deltas) == text
    assert finish == "length"
    assert usage is not None and usage.total_tokens == 8 + 12


def test_completions_plain_and_streamed(start_sim: StartSim) -> None:
    sim = start_sim("--sim-max-tokens", "7")
    sim.wait_ready()
    client = sim.client()
    reply = client.completions.create(model="sim-model", prompt="once upon a time")
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model="sim-model", prompt="once upon a time", stream=True)
    ]
    assert "".join(pieces) == reply.choices[0].text
    assert sim.metric("llmgw_sim_tokens_generated_total") == 14
    assert sim.metric('llmgw_sim_requests_total{endpoint="/v1/completions"}') == 2


def test_errors_have_the_openai_shape(start_sim: StartSim) -> None:
    sim = start_sim()
    sim.wait_ready()
    client = sim.client()
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
        client.completions.create(model="sim-model", prompt="hi", max_tokens=-1)
    assert httpx.get(f"{sim.url}/nope").status_code == 404
    assert httpx.get(f"{sim.url}/v1/chat/completions").status_code == 405


def test_keep_alive_serves_many_requests_on_one_connection(start_sim: StartSim) -> None:
    sim = start_sim()
    sim.wait_ready()
    with httpx.Client(base_url=sim.url) as http:
        for _ in range(5):
            r = http.post("/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
    assert len(set(re.findall(r"(127\.0\.0\.1:\d+) \"POST", sim.stdout()))) == 1


def test_expect_100_continue_is_answered(start_sim: StartSim) -> None:
    sim = start_sim()
    sim.wait_ready()
    body = json.dumps({"model": "sim-model", "prompt": "x " * 600, "max_tokens": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nexpect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(head)
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        reply = b""
        while b'"usage"' not in reply:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed early: {reply!r}"
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 ")


async def test_hundreds_of_concurrent_streams(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_ITL_MS": "5"})
    await trio.to_thread.run_sync(sim.wait_ready)
    limits = httpx.Limits(max_connections=300)
    done: list[int] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "sim-model", "prompt": f"prompt {i}", "max_tokens": 20, "stream": True}
        tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"finish_reason":null' in line:
                    tokens += 1
        done.append(tokens)

    async with httpx.AsyncClient(base_url=sim.url, limits=limits, timeout=60) as http:
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, http, i)
    assert done == [20] * 200
    assert await trio.to_thread.run_sync(sim.metric, "llmgw_sim_tokens_generated_total") == 4000


# ---------------------------------------------------------------------------------------------
# Client disconnects reach the engine


def test_client_disconnect_mid_stream_is_counted_cancelled(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_ITL_MS": "20"})
    sim.wait_ready()
    body = {"model": "sim-model", "prompt": "long", "max_tokens": 5000, "stream": True}
    with httpx.Client(base_url=sim.url) as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text":' in first
        assert sim.metric("llmgw_sim_requests_running") == 1
    poll("the cancelled request to be counted", lambda: sim.metric("llmgw_sim_requests_cancelled_total") == 1)
    assert sim.metric("llmgw_sim_requests_running") == 0
    assert poll("the 499 log line", lambda: "499 client closed the connection" in sim.stdout())


def test_client_disconnect_while_waiting_for_a_plain_response(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_HANG": "requests"})
    sim.wait_ready()
    body = {"model": "sim-model", "prompt": "x", "max_tokens": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/completions", json=body, timeout=0.5)
    poll("the cancelled request to be counted", lambda: sim.metric("llmgw_sim_requests_cancelled_total") == 1)


# ---------------------------------------------------------------------------------------------
# Fault knobs


def test_fail_loading_prints_and_exits_1(start_sim: StartSim) -> None:
    sim = start_sim(
        env={"LLMGW_SIM_LOAD_SECONDS": "0.2", "LLMGW_SIM_FAIL_LOADING": "CUDA out of memory (test)"}
    )
    assert sim.wait_exit() == 1
    assert "loading model org/sim-model" in sim.stdout()
    assert "engine failed to start: CUDA out of memory (test)" in sim.stdout()
    assert "ERROR CUDA out of memory (test)" in sim.stderr()


def test_exit_after_crashes_with_the_code_asked_for(start_sim: StartSim) -> None:
    sim = start_sim("--sim-exit-after", "0.5", "--sim-exit-code", "3")
    sim.wait_ready()
    assert sim.wait_exit() == 3
    assert "simulated crash after 0.5s" in sim.stdout()


def test_hang_loading_never_becomes_ready(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_HANG": "loading"})
    assert poll("/health to answer", sim.health) == 503
    poll("the hang to be logged", lambda: "hanging while loading" in sim.stdout())
    assert sim.health() == 503
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0


def test_hang_sigterm_ignores_sigterm(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_HANG": "sigterm"})
    sim.wait_ready()
    assert "ignoring SIGTERM" in sim.stdout()
    sim.proc.send_signal(signal.SIGTERM)
    sim.proc.send_signal(signal.SIGINT)
    assert sim.wait_exit() == 0
    # Signals arrive in the order sent: had SIGTERM been honoured, it would be the one logged.
    assert "received SIGINT" in sim.stdout()
    assert "received SIGTERM" not in sim.stdout()


# ---------------------------------------------------------------------------------------------
# SIGTERM


def test_sigterm_exits_0(start_sim: StartSim) -> None:
    sim = start_sim()
    sim.wait_ready()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0
    assert "received SIGTERM: port closed, no new requests" in sim.stdout()


def test_sigterm_drains_in_flight_streams_with_shutdown_timeout(start_sim: StartSim) -> None:
    sim = start_sim("--shutdown-timeout", "30", env={"LLMGW_SIM_ITL_MS": "25"})
    sim.wait_ready()
    body = {"model": "sim-model", "prompt": "drain me", "max_tokens": 40, "stream": True}
    tokens = 0
    with (
        httpx.Client(base_url=sim.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        sim.proc.send_signal(signal.SIGTERM)
        poll("the drain to start", lambda: "draining 1 in-flight request" in sim.stdout())
        assert sim.health() is None  # the listener is closed: no new connections
        rest = list(lines)
    tokens = 1 + sum(1 for line in rest if line.startswith("data: {") and '"finish_reason":null' in line)
    assert tokens == 40
    assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
    assert sim.wait_exit() == 0


def test_sigterm_without_shutdown_timeout_aborts_streams(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_ITL_MS": "25"})
    sim.wait_ready()
    body = {"model": "sim-model", "prompt": "abort me", "max_tokens": 400, "stream": True}
    with (
        httpx.Client(base_url=sim.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        sim.proc.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    assert sim.wait_exit() == 0


# ---------------------------------------------------------------------------------------------
# The vLLM adapter's real argv, run on the simulator


def test_vllm_profile_runs_end_to_end_on_the_simulator(start_sim: StartSim) -> None:
    profile = schema.EngineProfile(
        engine="vllm",
        model="meta-llama/Llama-3.1-8B-Instruct",
        served_model_name="llama-8b",
        tensor_parallel_size=2,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        extra_args=["--enable-prefix-caching", "--max-num-seqs", "64", "--enforce-eager", "--seed", "7"],
        env={"LLMGW_SIM_ITL_MS": "1"},
    )
    spec = schema.StartShard(shard_id="s1", replica_id="r1", profile=profile, gpu_indices=[0, 1], http_port=1)
    node = [GpuInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", (9, 0), 81559) for i in range(2)]
    launch = plan(spec, node, LaunchContext(argv_prefix=ARGV_PREFIX, host="127.0.0.1"))
    # The same argv, on a port the kernel picks (the simulator logs which).
    argv = list(launch.command.argv)
    argv[argv.index("--port") + 1] = "0"
    sim = start_sim(argv=tuple(argv), env=dict(launch.command.env))
    sim.wait_ready()
    models = httpx.get(sim.url + launch.readiness.models_path).content
    assert launch.readiness.model_listed(models)
    reply = sim.client().chat.completions.create(
        model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.model == "llama-8b"
    # The capacity model acts on --enable-prefix-caching and --max-num-seqs; the rest is named.
    assert "ignoring vLLM arguments it does not simulate: --enforce-eager --seed 7" in sim.stderr()
    assert "tp=2 pp=1 dtype=bfloat16 max_model_len=4096" in sim.stdout()


def test_headless_rank_serves_no_http(start_sim: StartSim) -> None:
    argv = (
        *ARGV_PREFIX, "serve", "m", "--tensor-parallel-size", "16",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501",
        "--headless",
    )  # fmt: skip
    sim = start_sim(argv=argv, listen=False)
    poll(
        "the headless worker to join",
        lambda: "headless worker rank 1 of 2 joined 10.0.0.1:29501" in sim.stdout(),
    )
    assert "listening on" not in sim.stdout()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0


def test_vllm_refusals_in_vllms_words_and_status(start_sim: StartSim) -> None:
    """An argv vLLM refuses is refused by the process, with vLLM's usage line, message and exit
    status; the same argv runs where the imitated version accepts it."""
    sim = start_sim("--bogus", "3", listen=False)
    assert sim.wait_exit() == 2
    assert sim.stderr() == (
        "usage: vllm serve [model_tag] [options]\nvllm serve: error: unrecognized arguments: --bogus 3\n"
    )
    sim = start_sim("-q", "gguf", listen=False)  # the newest vLLM dropped gguf
    assert sim.wait_exit() == 2
    assert (
        "vllm serve: error: argument --quantization/-q: invalid choice: 'gguf' (choose from " in sim.stderr()
    )
    sim = start_sim("-q", "fbgemm_fp8", listen=False, env={"LLMGW_SIM_VLLM_VERSION": "0.18.0"})
    assert sim.wait_exit() == 1
    assert "fbgemm_fp8 is deprecated and needs --allow-deprecated-quantization" in sim.stderr()
    sim = start_sim("-q", "gguf", env={"LLMGW_SIM_VLLM_VERSION": "0.18.0"})
    sim.wait_ready()
    assert "command line parsed as vLLM 0.18.0 parses it" in sim.stdout()


def test_version_is_the_imitated_vllms(start_sim: StartSim) -> None:
    sim = start_sim(argv=(*ARGV_PREFIX, "--version"), listen=False)
    assert sim.wait_exit() == 0
    assert sim.stdout().strip() == flagsets.available("vllm")[-1]
    sim = start_sim(argv=(*ARGV_PREFIX, "--version"), listen=False, env={"LLMGW_SIM_VLLM_VERSION": "0.18.5"})
    assert sim.wait_exit() == 0
    assert sim.stdout().strip() == "0.18.0"


def test_api_key_guards_v1_like_vllm(start_sim: StartSim) -> None:
    """--api-key: /v1/* without the bearer (or with another) is 401 {"error": "Unauthorized"};
    /health and /metrics stay open; the openai client with the key is served."""
    sim = start_sim("--api-key", "s3cret")
    sim.wait_ready()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.get(f"{sim.url}/v1/models", headers=headers, timeout=5)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, headers
    r = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": "sim-model", "messages": []}, timeout=5)
    assert r.status_code == 401
    assert httpx.get(f"{sim.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{sim.url}/metrics", timeout=5).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        sim.client().models.list()
    keyed = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="s3cret", max_retries=0)
    reply = keyed.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.model == "sim-model"
    # Without --api-key, as before: open.
    open_sim = start_sim()
    open_sim.wait_ready()
    assert httpx.get(f"{open_sim.url}/v1/models", timeout=5).status_code == 200


def test_usage_errors_exit_2(start_sim: StartSim) -> None:
    sim = start_sim(argv=(sys.executable, "-m", "agent.engines.sim", "serve"), listen=False)
    assert sim.wait_exit() == 2
    assert "no model given" in sim.stderr()
