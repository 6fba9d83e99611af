"""The Grafana dashboard in deploy/grafana/ loads and names only series the fleet really exports.

The dashboard JSON is parsed, its panels checked for what Grafana needs to load them (ids, grid
positions, a Prometheus datasource, queries), and every metric each query names is resolved against
the ``/metrics`` of real processes: a control plane with its embedded router, a CPU-only agent
with its metrics port, and the sim engine the agent started (vLLM's series). Each label a query
groups by must be on that metric (``le``, and ``instance`` and ``job``, which Prometheus adds at
scrape time, apart), so a renamed series or label fails here rather than on an operator's screen.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet_procs import free_port, one_node, poll

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "llmgw-fleet.json"
#: Our series and vLLM's: every metric name a query may use has one of these prefixes.
METRIC = re.compile(r"\b(?:llmgw_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
SCRAPE_LABELS = {"le", "instance", "job"}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) for every query of every panel; asserts each panel would load."""
    out: list[tuple[str, str]] = []
    ids: set[int] = set()
    for panel in dashboard["panels"]:
        assert isinstance(panel["id"], int) and panel["id"] not in ids, panel.get("title")
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            out.append((panel["title"], target["expr"]))
    return out


#: The sample names a family of each type has (a family with no series yet is still declared,
#: with its type: a counter whose label values have not occurred, an error that has not happened).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposition(url: str) -> dict[str, set[str] | None]:
    """Every sample name of an exposition at ``url``, with the label names its samples carry (None:
    declared, no sample yet, so its labels cannot be checked)."""
    response = httpx.get(url, timeout=15)
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:200]}"
    names: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(response.text):
        for suffix in SUFFIXES.get(family.type, ()):
            names.setdefault(family.name + suffix, None)
        for sample in family.samples:
            names[sample.name] = (names.get(sample.name) or set()) | set(sample.labels)
    return names


def test_the_dashboard_names_only_series_the_processes_export(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]
    exprs = queries(dashboard)
    assert len(exprs) >= 20

    model = f"dash{os.getpid()}"
    models = (
        f'[[models]]\nname = "{model}"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
        'env = { LLMGW_SIM_LOAD_SECONDS = "0.2", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "1" }\n'
    )
    agent_port = free_port()
    with one_node(tmp_path, models, "24800-24899", agent_extra=("--metrics-listen", str(agent_port))) as (
        cp,
        _,
    ):

        def ready_url() -> str | None:
            for replica in cp.api("/api/replicas"):
                if replica["model"] == model and replica["state"] == "ready":
                    return str(replica["shards"][0]["url"])
            return None

        engine = poll("the replica to be ready", ready_url, timeout=60)
        router = f"http://127.0.0.1:{cp.router_port}"
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=30)

        def answered() -> bool:
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                return len(list(stream)) > 0
            except openai.APIStatusError:  # the router's routes may trail the replica by a pass
                return False

        # A streamed answer with its usage, so the router's histograms and token counters have
        # series for the model.
        poll("a streamed answer through the embedded router", answered, timeout=30)
        exported: dict[str, set[str] | None] = {}
        for url in (
            f"{router}/metrics",
            f"http://127.0.0.1:{cp.api_port}/metrics",
            f"http://127.0.0.1:{agent_port}/metrics",
            f"{engine}/metrics",
        ):
            for name, labels in exposition(url).items():
                known = exported.get(name)
                exported[name] = labels if known is None else known | (labels or set())

    unresolved: list[str] = []
    unchecked: set[str] = set()
    for title, expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"panel {title!r}: {expr!r} names no llmgw or vLLM series"
        grouped = {label.strip() for clause in BY.findall(expr) for label in clause.split(",")} - {""}
        for name in names:
            if name not in exported:
                unresolved.append(f"{title}: {name} is exported by none of the processes")
                continue
            labels = exported[name]
            if labels is None:
                unchecked.add(name)
                continue
            for label in sorted(grouped - SCRAPE_LABELS - labels):
                unresolved.append(f"{title}: {name} has no label {label!r}")
    assert not unresolved, "\n".join(unresolved)
    # Only series of events that did not happen here (upstream errors, retries, ejections) may
    # go without a sample; the rest had their labels checked.
    assert unchecked <= {
        "llmgw_router_upstream_errors_total",
        "llmgw_router_retries_total",
        "llmgw_router_ejections_total",
        "llmgw_fleet_shard_failures_total",
        "llmgw_fleet_shard_restarts_total",
        "llmgw_agent_engine_failures_total",
    }, unchecked
