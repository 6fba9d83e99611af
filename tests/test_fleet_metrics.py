"""The admin API's ``/metrics``: a real control plane and a real sim agent, scraped and parsed with
``prometheus_client``'s own parser, the values set against the fleet as it changes (a ready node
and replica, a crash-looping model's failures and restarts, the agent killed: unreachable, then
lost, and its replica no longer ready)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import schema
from control.fleetmetrics import NOT_IN_CATALOG, FleetMetrics
from tests.fleet_procs import Agent, ControlProcess, free_port, poll

PORTS = "25500-25599"
TAG = f"m{os.getpid()}"
CHAT, CRASH, HUGE = f"chat-{TAG}", f"crash-{TAG}", f"huge-{TAG}"
READ = "read-token-for-the-metrics-test-0123456789"


def _model(name: str, gpus: int, env: str) -> str:
    return (
        f'[[models]]\nname = "{name}"\nreplicas = 1\n[models.gpus]\ncount = {gpus}\n[models.profile]\n'
        f'engine = "vllm"\nmodel = "meta-llama/Llama-3.1-8B-Instruct"\nserved_model_name = "{name}"\n'
        f'tensor_parallel_size = {gpus}\ndtype = "bfloat16"\nenv = {{ {env} }}\n'
    )


def _config(tmp: Path, api_table: str = "") -> str:
    fast = 'LLMGW_SIM_LOAD_SECONDS = "0.3", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "1"'
    return (
        f'state_dir = "{tmp / "cp" / "state"}"\nreconcile_interval = 0.3\nbackoff_initial = 0.5\n'
        f'[listen]\nagents = "127.0.0.1:{free_port()}"\napi = "127.0.0.1:0"\nrouter = ""\n'
        f'[engines]\nports = "{PORTS}"\n'
        "[liveness]\nunreachable_after = 1.5\nlost_after = 3.0\nstartup_grace = 8.0\n"
        f"{api_table}"
        + _model(CHAT, 2, fast)
        # Fails while loading, every time: a failure, then a restart after the backoff, and again.
        + _model(CRASH, 1, f'{fast}, LLMGW_SIM_FAIL_LOADING = "1"')
        # Sixteen GPUs on a node of eight: never placed.
        + _model(HUGE, 16, fast)
    )


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ControlProcess, Agent]]:
    cp = ControlProcess(tmp_path / "cp", _config(tmp_path))
    agent = None
    try:
        cp.start()
        agent = Agent(
            tmp_path / "agents",
            "gpu07",
            f"http://127.0.0.1:{cp.agent_port}",
            "h100x8.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", PORTS, "--mgmt-interface", "lo"),
        )
        agent.start()
        yield cp, agent
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()


def scrape(cp: ControlProcess, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the control plane's ``/metrics``: (name, labels) -> value."""
    resp = httpx.get(f"http://127.0.0.1:{cp.api_port}/metrics", headers=headers, timeout=15)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
NODES = "llmgw_fleet_nodes"


def when(cp: ControlProcess, predicate: Callable[[Samples], bool]) -> Callable[[], Samples | None]:
    """A poll check: the samples of a scrape once ``predicate`` holds for them."""

    def check() -> Samples | None:
        samples = scrape(cp)
        return samples if predicate(samples) else None

    return check


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def test_fleet_metrics_follow_a_real_fleet(fleet: tuple[ControlProcess, Agent]) -> None:
    cp, agent = fleet

    def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        s = scrape(cp)
        ok = (
            value(s, "llmgw_fleet_nodes", state="ready") == 1
            and value(s, "llmgw_fleet_replicas_ready", model=CHAT) == 1
            and value(s, "llmgw_fleet_shard_restarts_total", model=CRASH) >= 1
        )
        return s if ok else None

    s = poll("gpu07 ready, its chat replica ready, the crashing model restarted", settled, timeout=90)
    assert value(s, "llmgw_fleet_nodes", state="unreachable") == 0
    assert value(s, "llmgw_fleet_nodes", state="lost") == 0
    assert value(s, "llmgw_fleet_agent_streams") == 1
    # h100x8: eight GPUs; two for the chat replica, one for the crashing one (placed, failing).
    assert value(s, "llmgw_fleet_gpus", node_state="ready") == 8
    assert value(s, "llmgw_fleet_gpus_in_use", node_state="ready") == 3
    assert value(s, "llmgw_fleet_replicas_wanted", model=CHAT) == 1
    assert value(s, "llmgw_fleet_replicas_placed", model=HUGE) == 0
    assert value(s, "llmgw_fleet_replicas_unplaced", model=HUGE) == 1
    assert value(s, "llmgw_fleet_replicas_ready", model=CRASH) == 0
    assert value(s, "llmgw_fleet_shard_failures_total", model=CRASH) >= 1
    # Every catalog model has its counters, at zero until something happens.
    assert value(s, "llmgw_fleet_shard_failures_total", model=CHAT) == 0
    assert value(s, "llmgw_control_reconcile_pass_seconds_count") >= 1
    assert value(s, "llmgw_control_reconcile_pass_seconds_sum") > 0
    assert value(s, "process_resident_memory_bytes") > 0
    # The same fleet as ctl sees it.
    models = {m["model"]: m for m in cp.api("/api/models")}
    for name in (CHAT, CRASH, HUGE):
        assert value(s, "llmgw_fleet_replicas_wanted", model=name) == models[name]["replicas_wanted"]
        assert value(s, "llmgw_fleet_replicas_placed", model=name) == models[name]["replicas_placed"]

    # OpenMetrics when the scraper asks for it, from the same registry.
    resp = httpx.get(
        f"http://127.0.0.1:{cp.api_port}/metrics",
        headers={"accept": "application/openmetrics-text; version=1.0.0"},
        timeout=15,
    )
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    assert resp.text.rstrip().endswith("# EOF")

    # The agent killed: its stream closes, the node is unreachable, then lost, and its placements go.
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait(10)
    s = poll(
        "gpu07 unreachable after its agent was killed",
        when(cp, lambda s: value(s, NODES, state="ready") == 0),
    )
    assert value(s, "llmgw_fleet_agent_streams") == 0
    assert value(s, NODES, state="unreachable") + value(s, NODES, state="lost") == 1
    s = poll(
        "gpu07 lost and its chat replica no longer ready",
        when(
            cp,
            lambda s: (
                value(s, NODES, state="lost") == 1 and value(s, "llmgw_fleet_replicas_ready", model=CHAT) == 0
            ),
        ),
    )
    assert value(s, "llmgw_fleet_gpus", node_state="lost") == 8
    assert value(s, "llmgw_fleet_gpus_in_use", node_state="lost") == 0
    assert value(s, "llmgw_fleet_replicas_unplaced", model=CHAT) == 1


def test_metrics_need_the_read_role_when_the_api_has_tokens(tmp_path: Path) -> None:
    cp = ControlProcess(tmp_path / "cp", _config(tmp_path, f'[api]\nread_tokens = ["{READ}"]\n'))
    try:
        cp.start()
        url = f"http://127.0.0.1:{cp.api_port}/metrics"
        assert httpx.get(url, timeout=15).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer wrong-token"}, timeout=15).status_code == 401
        s = scrape(cp, authorization=f"Bearer {READ}")
        assert value(s, "llmgw_fleet_replicas_wanted", model=CHAT) == 1
        assert value(s, "llmgw_fleet_nodes", state="ready") == 0
    finally:
        cp.terminate()


def test_a_failure_counts_once_and_a_foreign_model_is_bounded() -> None:
    metrics = FleetMetrics(process=False)
    catalog = {"chat"}

    def status(state: schema.ShardState) -> schema.ShardStatus:
        return schema.ShardStatus(shard_id="chat-r0-s0", replica_id="chat-r0", state=state)

    metrics.shard_reported(None, status(schema.ShardState.STARTING), "chat", catalog)
    metrics.shard_reported(
        status(schema.ShardState.STARTING), status(schema.ShardState.FAILED), "chat", catalog
    )
    # The same failure reported again (a re-register lists it): not a second failure.
    metrics.shard_reported(
        status(schema.ShardState.FAILED), status(schema.ShardState.FAILED), "chat", catalog
    )
    for i in range(50):  # models an agent names that the catalog does not hold: one series
        metrics.shard_reported(None, status(schema.ShardState.FAILED), f"junk{i}", catalog)
    metrics.shard_restarted("chat", catalog)
    assert metrics.registry.get_sample_value("llmgw_fleet_shard_failures_total", {"model": "chat"}) == 1
    assert (
        metrics.registry.get_sample_value("llmgw_fleet_shard_failures_total", {"model": NOT_IN_CATALOG}) == 50
    )
    assert metrics.registry.get_sample_value("llmgw_fleet_shard_restarts_total", {"model": "chat"}) == 1
