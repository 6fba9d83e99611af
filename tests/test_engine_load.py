"""Engine load in heartbeats: the parser and rates on engine text, the control plane's bounds and
views, and real fleets (an agent against grpcio, a control plane with sim engines under traffic).

No recording of a real vLLM ``/metrics`` is in the repository (tests/fixtures has none), so
``VLLM_METRICS`` is written from vLLM's own definitions (vllm/v1/metrics/loggers.py,
``PrometheusStatLogger``: the gauges, the ``_total`` counters and a histogram, with its
``model_name`` and ``engine`` labels), and ``SGLANG_METRICS`` from SGLang's production-metrics
example (docs/references/production_metrics.md).
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import schema
from agent.engineload import LOAD_SERIES, MAX_REQUESTS, Reading, figures, parse
from control.agentsvc import shard_load_problem
from control.ctl.text import load_cells, load_words
from control.query import EngineLoad, replica_load
from tests.fleet_procs import ControlProcess, catalog, free_port, one_node, poll
from tests.test_agent import agent_process, registered, start_spec, state_of

State = schema.ShardState

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 50000.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.5
"""

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 28.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
"""


def _vllm(at: float, **changes: str) -> Reading:
    text = VLLM_METRICS
    for name, value in changes.items():
        text = "\n".join(
            line.rsplit(" ", 1)[0] + " " + value if line.startswith(f"vllm:{name}{{") else line
            for line in text.splitlines()
        )
    return parse(text, LOAD_SERIES["vllm"], at)


def test_vllm_text_parses_to_its_figures() -> None:
    r = _vllm(10.0)
    assert (r.running, r.waiting, r.kv_usage) == (3.0, 7.0, 0.4125)
    assert (r.prefix_hits, r.prefix_queries, r.generation_tokens) == (3000.0, 12000.0, 50000.0)
    assert r.problems == ()
    # One reading alone: gauges only, no rates yet (unknown, not 0).
    f = figures(None, r)
    assert (f.running, f.waiting, f.kv_usage, f.hit_rate, f.tokens_per_second) == (3, 7, 0.4125, None, None)
    # The sim publishes vLLM's names: one table entry serves both.
    assert LOAD_SERIES["sim"] is LOAD_SERIES["vllm"]


def test_rates_over_the_interval_and_across_a_restart() -> None:
    before = _vllm(10.0)
    after = _vllm(
        12.0,
        prefix_cache_queries_total="14000",
        prefix_cache_hits_total="4500",
        generation_tokens_total="50600",
    )
    f = figures(before, after)
    assert f.hit_rate == pytest.approx(1500 / 2000)  # this interval's hits per query, not the lifetime 0.25
    assert f.tokens_per_second == pytest.approx(300.0)  # 600 tokens in 2 s
    # No queries in the interval: the hit rate is unknown, not 0 and not the lifetime figure.
    assert figures(before, _vllm(12.0)).hit_rate is None
    assert figures(before, _vllm(12.0)).tokens_per_second == 0.0
    # A counter that went down is an engine restarted: no rate from it.
    restarted = _vllm(12.0, generation_tokens_total="10", prefix_cache_queries_total="5")
    assert figures(before, restarted).tokens_per_second is None
    assert figures(before, restarted).hit_rate is None


def test_sglang_hit_rate_is_its_own_gauge() -> None:
    r = parse(SGLANG_METRICS, LOAD_SERIES["sglang"], 1.0)
    f = figures(None, r)
    assert (f.running, f.waiting, f.kv_usage) == (28, 0, 0.28)
    assert f.hit_rate == pytest.approx(0.0075075, rel=1e-3)
    second = parse(SGLANG_METRICS.replace("7.557572e+06", "7.557672e+06"), LOAD_SERIES["sglang"], 3.0)
    assert figures(r, second).tokens_per_second == pytest.approx(50.0)


def test_peer_numbers_are_bounded_and_named() -> None:
    r = _vllm(1.0, num_requests_running="NaN", num_requests_waiting="-4", kv_cache_usage_perc="1.7")
    assert r.running is None and r.waiting is None  # refused: unknown, never a number made up
    assert r.kv_usage == 1.0
    assert r.problems == (
        "vllm:num_requests_running is nan: refused",
        "vllm:num_requests_waiting is -4.0: refused",
        "vllm:kv_cache_usage_perc is 1.7: clamped to 1",
    )
    huge = _vllm(1.0, num_requests_waiting="1e30", generation_tokens_total="+Inf")
    assert huge.waiting == MAX_REQUESTS and huge.generation_tokens is None
    assert "vllm:num_requests_waiting is 1e+30: clamped to 1000000" in huge.problems
    assert "vllm:generation_tokens_total is inf: refused" in huge.problems
    with pytest.raises(ValueError):
        parse("vllm:num_requests_running{ 3\n", LOAD_SERIES["vllm"], 1.0)


def test_control_refuses_loads_out_of_range_naming_the_field() -> None:
    good = schema.ShardLoad(shard_id="chat-0-0", replica_id="chat-0", requests_running=3, kv_cache_usage=0.5)
    assert shard_load_problem([good], "Heartbeat.loads") == ""
    cases = {
        "Heartbeat.loads[0].kv_cache_usage is nan; expected 0-1": {"kv_cache_usage": math.nan},
        "Heartbeat.loads[0].prefix_cache_hit_rate is 1.5; expected 0-1": {"prefix_cache_hit_rate": 1.5},
        "Heartbeat.loads[0].requests_waiting is 4000000000; expected 0-1000000": {
            "requests_waiting": 4_000_000_000
        },
        "Heartbeat.loads[0].generation_tokens_per_second is -1.0; expected 0-1e+07": {
            "generation_tokens_per_second": -1.0
        },
        "Heartbeat.loads[0].sample_age_seconds is inf; expected 0-86400": {"sample_age_seconds": math.inf},
    }
    for expected, change in cases.items():
        bad = schema.ShardLoad(shard_id="chat-0-0", replica_id="chat-0", **change)  # type: ignore[arg-type]
        assert shard_load_problem([bad], "Heartbeat.loads") == expected
    assert "shard_id" in shard_load_problem([schema.ShardLoad(shard_id="../x")], "Heartbeat.loads")


def test_replica_load_and_its_words() -> None:
    a = EngineLoad(
        running=2, waiting=1, kv_usage=0.3, hit_rate=0.5, tokens_per_second=10.0, age=0.2, stale=False
    )
    b = EngineLoad(
        running=1, waiting=None, kv_usage=0.6, hit_rate=None, tokens_per_second=5.0, age=0.4, stale=False
    )
    both = replica_load([a, None, b])
    assert both == EngineLoad(
        running=3, waiting=1, kv_usage=0.6, hit_rate=0.5, tokens_per_second=15.0, age=0.4, stale=False
    )
    assert replica_load([None]) is None
    assert load_cells(both.doc() if both else None) == ["3", "1", "60", "50", "15.0"]
    stale = EngineLoad(running=9, age=31.0, stale=True, error="GET /metrics timed out after 0.3 s")
    assert load_cells(stale.doc()) == ["stale", "-", "-", "-", "-"]  # old figures never shown as current
    assert load_words(stale.doc()) == "load stale (31s old): GET /metrics timed out after 0.3 s"
    assert load_cells(None) == ["-"] * 5


# -- a real agent against grpcio ---------------------------------------------------------------


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _beats_after(node: Any, count: int, since: float) -> list[tuple[float, schema.Heartbeat]]:
    """The next ``count`` heartbeats received after monotonic time ``since``, with their times."""

    def enough() -> list[tuple[float, schema.Heartbeat]] | None:
        beats = [
            (t, m.heartbeat)
            for t, m in zip(list(node.times), list(node.received), strict=False)
            if m.heartbeat is not None and t > since
        ]
        return beats[:count] if len(beats) >= count else None

    return poll(f"{count} heartbeats", enough, timeout=60)


def test_a_hanging_metrics_never_delays_heartbeats_and_shows_stale(tmp_path: Path) -> None:
    from tests.grpcio_cp import GrpcioControlPlane

    cp = GrpcioControlPlane()
    cp.start()
    agent = agent_process(cp.port, tmp_path)
    try:
        agent.start()
        node = registered(cp, "gpu07")
        ports = [free_port(), free_port()]
        node.send(start=start_spec("good-0-0", ports[0]))
        poll("good-0-0 READY", lambda: state_of(node, "good-0-0", State.READY), timeout=60)
        # Without a hang: the interval's jitter, and a fresh load for the engine.
        calm = _beats_after(node, 15, time.monotonic())
        fresh = [b.loads[0] for _, b in calm if b.loads and not b.loads[0].stale]
        # Most beats carry a fresh sample (a scrape on this busy machine may now and then be late).
        assert len(fresh) >= 10, [b.loads for _, b in calm]
        assert fresh[-1].shard_id == "good-0-0" and fresh[-1].error == "", fresh[-1]
        assert fresh[-1].requests_running == 0 and fresh[-1].requests_waiting == 0, fresh[-1]

        spec = start_spec("hung-0-0", ports[1], env={"LLMGW_SIM_HANG": "metrics"})
        spec.gpu_indices = [2, 3]
        node.send(start=spec)
        poll("hung-0-0 READY", lambda: state_of(node, "hung-0-0", State.READY), timeout=60)
        hung_since = time.monotonic()
        hung = _beats_after(node, 15, hung_since)
        calm_gaps, hung_gaps = _gaps([t for t, _ in calm]), _gaps([t for t, _ in hung])
        # Each scrape of the hung engine waits its whole timeout (one interval, 0.3 s) and is
        # cancelled; were the heartbeat waiting on it, every gap would grow by that much.
        assert max(hung_gaps) < max(calm_gaps) + 0.25, (calm_gaps, hung_gaps)
        assert sum(hung_gaps) / len(hung_gaps) < sum(calm_gaps) / len(calm_gaps) + 0.1, (calm_gaps, hung_gaps)
        loads = [{load.shard_id: load for load in b.loads} for _, b in hung]
        # Every beat says the hung engine's load is stale, with no figures made up, and why once a
        # scrape has run out its bound (1 s: the first beats say there is no sample yet).
        assert all(d["hung-0-0"].stale and d["hung-0-0"].requests_running is None for d in loads), loads
        assert loads[-1]["hung-0-0"].error == "GET /metrics timed out after 1 s", loads[-1]
        assert sum(not d["good-0-0"].stale for d in loads) >= 10, loads
        print(
            f"heartbeat gaps (s): calm max {max(calm_gaps):.3f} mean {sum(calm_gaps) / len(calm_gaps):.3f}; "
            f"with a hung /metrics max {max(hung_gaps):.3f} mean {sum(hung_gaps) / len(hung_gaps):.3f}"
        )
    finally:
        agent.stop_all()
        cp.stop()


# -- a real fleet under traffic ------------------------------------------------------------------


def _engine_gauges(url: str) -> tuple[float, float, float]:
    """The engine's own running, waiting and KV-usage gauges, read straight from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    }
    return (
        values["vllm:num_requests_running"],
        values["vllm:num_requests_waiting"],
        values["vllm:kv_cache_usage_perc"],
    )


def _ctl_load(api: int) -> dict[str, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "control",
            "ctl",
            "get",
            "replicas",
            "-o",
            "wide",
            "--api",
            f"http://127.0.0.1:{api}",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    cells = dict(zip(header.split(), row.split(), strict=False))
    return {k: cells[k] for k in ("RUNNING", "WAITING", "KV%", "HIT%", "TOK/S")}


def test_load_follows_traffic_and_ctl_matches_the_engine(tmp_path: Path) -> None:
    model = f"load{os.getpid()}"
    models = (
        f'[[models]]\nname = "{model}"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
        # 64 blocks of 16 tokens: six streams of 75 tokens fill a visible part of the KV cache.
        'extra_args = ["--num-gpu-blocks-override", "64"]\n'
        'env = { LLMGW_SIM_LOAD_SECONDS = "0.2", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "40" }\n'
    )
    with one_node(tmp_path, models, "24700-24749") as (cp, _agent):

        def replica() -> dict[str, Any] | None:
            reps = [r for r in cp.api("/api/replicas") if r["model"] == model]
            load = reps[0]["load"] if reps and reps[0]["state"] == "ready" else None
            return reps[0] if load and not load["stale"] else None

        # Its first heartbeats say "no sample yet" (stale), until the first scrape is in.
        ready = poll("a ready replica with a fresh load", replica, timeout=90)
        assert ready["load"]["running"] == 0, ready
        url = ready["shards"][0]["url"]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        streams = 6
        done = threading.Barrier(streams + 1)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                # 75 tokens at 40 ms each: each request streams for about 3 s.
                chunks = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=75, stream=True
                )
                for _ in chunks:
                    pass
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.wait(timeout=120)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()

        def busy() -> dict[str, Any] | None:
            load = cp.api("/api/replicas")[0]["load"]
            return load if load and not load["stale"] and load["running"] > 0 else None

        seen = poll("the heartbeat-carried running count above 0", busy, timeout=30)
        assert seen["running"] <= streams, seen

        def agree() -> tuple[tuple[float, float, float], dict[str, str]] | None:
            # ctl's figures against the engine's own, read around them: the counts equal while
            # the engine's gauges held still across the ctl call (ctl's are at most an interval
            # old); KV use only grows while the streams run, so ctl's lies between the two reads.
            before = _engine_gauges(url)
            shown = _ctl_load(cp.api_port)
            after = _engine_gauges(url)
            same = before[:2] == after[:2] and [shown["RUNNING"], shown["WAITING"]] == [
                f"{v:.0f}" for v in before[:2]
            ]
            return (after, shown) if same else None

        engine, shown = poll("ctl's RUNNING and WAITING equal the engine's /metrics", agree, timeout=30)
        assert engine[0] > 0 and float(shown["TOK/S"]) > 0, shown
        assert 0 < float(shown["KV%"]) <= round(engine[2] * 100), (shown, engine)
        print(f"under load: ctl {shown}; the engine's own gauges after it {engine}")
        done.wait(timeout=120)
        assert not errors, errors

        def idle() -> dict[str, Any] | None:
            load = cp.api("/api/replicas")[0]["load"]
            return load if load and not load["stale"] and load["running"] == 0 else None

        poll("the running count back to 0", idle, timeout=30)

        def settled() -> tuple[tuple[float, float, float], dict[str, str]] | None:
            # At rest the engine's gauges hold still: ctl shows exactly what the engine says.
            before, shown, after = _engine_gauges(url), _ctl_load(cp.api_port), _engine_gauges(url)
            cells = [shown["RUNNING"], shown["WAITING"], shown["KV%"]]
            expected = [f"{before[0]:.0f}", f"{before[1]:.0f}", f"{before[2] * 100:.0f}"]
            return (before, shown) if before == after and cells == expected else None

        poll("ctl's figures equal the engine's at rest", settled, timeout=30)
        metrics = httpx.get(f"http://127.0.0.1:{cp.api_port}/metrics", timeout=10).text
        gauges = {
            (s.name, s.labels.get("model")): s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name.startswith("llmgw_replica_")
        }
        assert gauges[("llmgw_replica_requests_running", model)] == 0, gauges
        assert gauges[("llmgw_replica_load_stale", model)] == 0, gauges
        assert ("llmgw_replica_kv_cache_usage", model) in gauges, gauges
        assert gauges[("llmgw_replica_generation_tokens_per_second", model)] >= 0, gauges


def test_a_load_out_of_range_is_dropped_and_the_heartbeat_still_counts(tmp_path: Path) -> None:
    """A real control plane, a grpcio agent stream: a heartbeat whose engine load says NaN keeps
    the stream and the node (the heartbeat proves it alive), and the load is refused by name."""
    cp = ControlProcess(tmp_path / "cp", catalog("ld", tmp_path / "cp" / "state"))
    cp.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{cp.agent_port}")
    finish = threading.Event()
    outcome: list[object] = []
    try:
        call = channel.stream_stream(
            schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse
        )
        bad = schema.ShardLoad(shard_id="chat-0-0", replica_id="chat-0", kv_cache_usage=math.nan)

        def requests() -> Iterator[schema.AgentMessage]:
            yield schema.AgentMessage(
                message_id=1, register=schema.Register(node_id="n1", hostname="h", token=cp.join_token())
            )
            yield schema.AgentMessage(message_id=2, heartbeat=schema.Heartbeat(node_id="n1", loads=[bad]))
            finish.wait(60)

        def run() -> None:
            try:
                outcome.extend(call(requests(), timeout=90))
            except grpc.RpcError as exc:
                outcome.append(exc)

        reader = threading.Thread(target=run, daemon=True)
        reader.start()
        warning = (
            "n1: ignored a heartbeat's engine loads: Heartbeat.loads[0].kv_cache_usage is nan; expected 0-1"
        )
        poll("the refused load named in the log", lambda: warning in cp.log.read_text(), timeout=30)
        nodes = cp.api("/api/nodes")
        assert [(n["node_id"], n["state"], n["connected"]) for n in nodes] == [("n1", "ready", True)], nodes
        finish.set()
        reader.join(30)
        assert not any(isinstance(o, grpc.RpcError) for o in outcome), outcome
    finally:
        finish.set()
        channel.close()
        cp.terminate()
