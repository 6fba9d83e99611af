"""The control plane's rooms: who imports whom, the route table and the state file as pure functions.

No processes and no sockets here: each room below is a function of values, which is the point of
having split them out of ``control/plane.py``.
"""

from __future__ import annotations

import ast
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import trio

import schema
from control.config import parse
from control.fleet import Cordon, Fleet, NodeState
from control.placement import Plan, ReplicaPlacement, ShardAssignment, Unplaced
from control.routetable import route_table
from control.state import SavedState, StateFileError, keyless, parse_state, state_doc
from router.routes import ModelRoutes

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "state"
State = schema.ShardState


# -- the import graph --------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str = "") -> Iterator[str]:
    """Every module ``path`` imports, at any depth of its code (a lazy import inside a function is an
    import all the same: ``plane.run``'s ``from control.api import serve_api`` was the cycle)."""
    module = module or _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            yield stem
            # ``from control import api`` imports control.api.
            for alias in node.names:
                yield f"{stem}.{alias.name}"


def import_graph(*packages: str) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (names that are not modules are dropped)."""
    files = {
        _module_name(path): path
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if "gen" not in path.relative_to(ROOT).parts
    }
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


PACKAGES = (
    "schema",
    "transport",
    "telemetry",
    "settings",
    "statefile",
    "enginedefs",
    "agent",
    "control",
    "router",
)


def test_the_import_graph_follows_the_house_plan() -> None:
    graph = import_graph(*PACKAGES)
    assert "control.plane" in graph and "control.api" in graph and "router.server" in graph
    # The admin API depends on the query interface, never on the composition root (not even
    # through another module), so the api <-> plane cycle cannot come back.
    assert "control.plane" not in reachable(graph, "control.api")
    assert "control.query" in graph["control.api"]
    # The pure rooms know nothing of the plane either.
    for room in (
        "control.routetable",
        "control.state",
        "control.query",
        "control.placement",
        "control.fleet",
    ):
        assert "control.plane" not in reachable(graph, room), room

    def crossing(src: str, dst: tuple[str, ...]) -> list[str]:
        return sorted(
            f"{m} imports {t}"
            for m, targets in graph.items()
            if m.split(".")[0] == src
            for t in targets
            if t.split(".")[0] in dst
        )

    assert crossing("router", ("control", "agent")) == []
    assert crossing("agent", ("control", "router")) == []
    assert crossing("control", ("agent",)) == []
    assert crossing("schema", ("control", "agent", "router", "transport")) == []
    # The shared packages serve both sides and know neither.
    assert crossing("transport", ("control", "agent", "router")) == []
    assert crossing("telemetry", ("control", "agent", "router")) == []
    assert crossing("settings", ("control", "agent", "router")) == []
    # One configuration loader: every process's config module uses it.
    for module in ("agent.config", "router.config", "control.config"):
        assert any(t.split(".")[0] == "settings" for t in graph[module]), module
    assert crossing("statefile", ("schema", "transport", "telemetry", "control", "agent", "router")) == []
    assert "statefile" in graph["control.state"] and "statefile" in graph["agent.supervise.records"]
    assert crossing("enginedefs", ("control", "agent", "router", "enginebuild")) == []


def test_the_graph_walker_sees_a_lazy_import_and_a_relative_one(tmp_path: Path) -> None:
    """The walker itself: one that missed imports inside functions would pass the test above with
    the old cycle (plane.run importing control.api lazily) still in place."""
    before = tmp_path / "plane.py"
    before.write_text(
        "import trio\n\n\nasync def run():\n    from control.api import serve_api\n    from . import fleet\n"
    )
    found = set(_imports(before, "control.plane"))
    assert {"control.api", "control.api.serve_api", "control.fleet", "trio"} <= found
    cycle = {"control.api": {"control.plane"}, "control.plane": found}
    assert "control.plane" in reachable(cycle, "control.plane")


# -- the route table -----------------------------------------------------------------------------------


CATALOG = (
    'state_dir = "/nonexistent"\n'
    '[[models]]\nname = "m"\nreplicas = 2\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
    'served_model_name = "chat"\n'
    '[[endpoints]]\nmodel = "ext"\nurl = "http://10.9.9.9:9000/"\n'
)


def _shard(replica: str, node: str, port: int) -> ShardAssignment:
    return ShardAssignment(shard_id=f"{replica}-s0-{node}", node_id=node, gpu_indices=(0,), port=port)


def _fleet(*nodes: str) -> Fleet:
    fleet = Fleet(15, 300)
    for i, node_id in enumerate(nodes, 1):
        fleet.registered(schema.Register(node_id=node_id, mgmt_addr=f"10.0.0.{i}"), now=0)
    return fleet


def _report(fleet: Fleet, shard: ShardAssignment, replica: str, state: schema.ShardState) -> None:
    fleet.shard_status(
        shard.node_id,
        schema.ShardStatus(
            node_id=shard.node_id,
            replica_id=replica,
            shard_id=shard.shard_id,
            state=state,
            spec=schema.StartShard(
                shard_id=shard.shard_id, replica_id=replica, http_port=shard.port, nnodes=1
            ),
        ),
    )


def _names(table: Mapping[str, ModelRoutes]) -> list[str]:
    return [u.replica_id for u in table["chat"].upstreams]


def test_route_table_ready_replicas_with_keys_and_static_endpoints() -> None:
    cfg = parse(CATALOG)
    fleet = _fleet("n1", "n2")
    r0, r1 = _shard("m-r0", "n1", 8000), _shard("m-r1", "n2", 8001)
    placements = (ReplicaPlacement("m", "m-r0", (r0,)), ReplicaPlacement("m", "m-r1", (r1,)))
    _report(fleet, r0, "m-r0", State.READY)
    _report(fleet, r1, "m-r1", State.STARTING)

    table = route_table(
        cfg.models,
        placements,
        fleet.nodes,
        (),
        cfg.endpoints,
        key_for=lambda shard, engine: f"k:{shard}:{engine}",
    )
    assert sorted(table) == ["chat", "ext"]
    [up] = table["chat"].upstreams
    assert (up.replica_id, up.url, up.api_key) == ("m-r0", "http://10.0.0.1:8000", "k:m-r0-s0-n1:sim")
    [static] = table["ext"].upstreams
    assert (static.replica_id, static.url) == ("static:http://10.9.9.9:9000/", "http://10.9.9.9:9000")
    with pytest.raises(TypeError):
        table["other"] = table["chat"]  # type: ignore[index]  # a value, not a table to edit

    # Both ready: both routed. A lost node's replica is not, whatever it last said.
    _report(fleet, r1, "m-r1", State.READY)
    assert [u.replica_id for u in route_table(cfg.models, placements, fleet.nodes)["chat"].upstreams] == [
        "m-r0",
        "m-r1",
    ]
    fleet.nodes["n2"].state = NodeState.LOST
    assert _names(route_table(cfg.models, placements, fleet.nodes)) == ["m-r0"]
    # An unreachable node's engines keep serving: the agent is silent, not the engine.
    fleet.nodes["n1"].state = NodeState.UNREACHABLE
    assert _names(route_table(cfg.models, placements, fleet.nodes)) == ["m-r0"]


def test_route_table_drained_and_unplaced_engines_are_the_fallback_only() -> None:
    cfg = parse(CATALOG)
    fleet = _fleet("n1", "n2")
    old, new = _shard("m-r0", "n1", 8000), _shard("m-r0", "n2", 8000)
    moved = (ReplicaPlacement("m", "m-r0", (new,)),)
    _report(fleet, old, "m-r0", State.READY)  # the old copy, that no placement wants any more
    _report(fleet, new, "m-r0", State.STARTING)
    reason = "0/2 nodes are available: 2 insufficient free GPUs"
    unplaced = (Unplaced("m", "m-r1", reason, {}),)

    table = route_table(cfg.models, moved, fleet.nodes, unplaced)
    assert [u.url for u in table["chat"].upstreams] == ["http://10.0.0.1:8000"]
    _report(fleet, new, "m-r0", State.READY)
    table = route_table(cfg.models, moved, fleet.nodes, unplaced)
    assert [u.url for u in table["chat"].upstreams] == ["http://10.0.0.2:8000"]
    # A cordoned-for-drain node's replica serves only while nothing else is ready.
    fleet.cordon("n2", Cordon.DRAINING)
    fleet.nodes["n1"].shards.clear()
    assert [u.url for u in route_table(cfg.models, moved, fleet.nodes)["chat"].upstreams] == [
        "http://10.0.0.2:8000"
    ]
    # No replica at all: the reason is placement's own words.
    nothing = route_table(cfg.models, (), {}, unplaced)
    assert nothing["chat"].upstreams == () and nothing["chat"].reason == reason
    assert route_table(cfg.models, (), {})["chat"].reason == "no replica of m is ready yet"


# -- the state file ------------------------------------------------------------------------------------


def test_a_state_file_written_before_the_split_still_loads() -> None:
    """``control-state-2026-12-03.json`` was written by the control plane as it was before
    ``control/state.py`` existed (the ControlPlane._save of commit f0e4c75)."""
    path = FIXTURES / "control-state-2026-12-03.json"
    saved = parse_state(path.read_text(), path)
    assert [r.node_id for r in saved.registers] == ["gpu01", "gpu02"]
    [shard] = saved.registers[0].shards
    assert (shard.shard_id, shard.state, shard.pid) == ("m-r0-s0-729579", State.READY, 4242)
    assert [r.replica_id for r in saved.placements] == ["m-r0", "m-r1"]
    assert saved.placements[0].shards[0].gpu_indices == (0,)
    assert saved.cordons == (("gpu02", Cordon.CORDONED),)
    # And back: the same document, byte for byte once encoded the same way.
    from control.state import encode_register

    doc = state_doc({r.node_id: encode_register(r) for r in saved.registers}, saved.placements, saved.cordons)
    assert json.dumps(doc, sort_keys=True) == path.read_text()


def test_state_value_round_trips_and_secrets_never_reach_the_document() -> None:
    from control.state import encode_register

    reg = schema.Register(
        node_id="n1",
        mgmt_addr="10.0.0.1",
        token="join-secret",
        node_credential="cred-secret",
        shards=[
            schema.ShardStatus(shard_id="s1", spec=schema.StartShard(shard_id="s1", api_key="shard-secret"))
        ],
    )
    placements = (ReplicaPlacement("m", "m-r0", (_shard("m-r0", "n1", 8000),), fabric=""),)
    text = json.dumps(state_doc({"n1": encode_register(reg)}, placements, [("n1", Cordon.DRAINING)]))
    for secret in ("join-secret", "cred-secret", "shard-secret"):
        assert secret.encode() not in bytes(keyless(reg))
    saved = parse_state(text)
    assert saved == SavedState((keyless(reg),), placements, (("n1", Cordon.DRAINING),))
    assert reg.token == "join-secret"  # the caller's Register is left alone


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{not json", "control-state.json: not JSON"),
        ("[]", "control-state.json: expected a JSON object, got list"),
        ('{"nodes": {"gpu01": "%%%"}}', "control-state.json: nodes['gpu01']: not a base64 Register"),
        ('{"nodes": {"gpu01": 7}}', "control-state.json: nodes['gpu01']: expected base64 text, got int"),
        (
            '{"nodes": {"gpu01": "CgVncHUwMg=="}}',
            "control-state.json: nodes['gpu01']: the Register is for node 'gpu02'",
        ),
        ('{"lost": []}', "control-state.json: lost: expected an object"),
        ('{"lost": {"gpu01": {"register": "CgVncHUwMQ=="}}}', "control-state.json: lost['gpu01']: expected"),
        (
            '{"lost": {"gpu01": {"register": "CgVncHUwMg==", "last_seen": 1}}}',
            "control-state.json: lost['gpu01'].register: the Register is for node 'gpu02'",
        ),
        (
            '{"placements": [{"model": "m", "replica_id": "m-r0", "shards": [{"shard_id": "s", '
            '"node_id": "n1", "gpu_indices": [0]}]}]}',
            "control-state.json: required field missing @ placements[0].shards[0].port",
        ),
        (
            '{"placements": [{"model": "m", "replica_id": "m-r0", "shards": [{"shard_id": "s", '
            '"node_id": "n1", "gpu_indices": [0], "port": "eighty"}]}]}',
            "control-state.json: invalid value for type, expected int @ placements[0].shards[0].port",
        ),
    ],
)
def test_a_damaged_state_file_is_refused_naming_the_file_and_field(doc: str, message: str) -> None:
    with pytest.raises(StateFileError) as info:
        parse_state(doc, "control-state.json")
    assert str(info.value).startswith(message), str(info.value)


async def test_a_lost_node_is_saved_with_its_last_report_and_restored_lost(tmp_path: Path) -> None:
    """What a lost node last said (its Register's shards, then a ShardStatus) and when it was last
    heard from survive a restart; the restored node is lost at once (not unreachable for a grace)
    and ``forget`` removes it, while a node that is not lost is kept."""
    from control.state import StateSaver

    fleet = Fleet(unreachable_after=1.0, lost_after=2.0)
    spec = schema.StartShard(shard_id="m-r0-s0", replica_id="m-r0")
    reg = schema.Register(
        node_id="n1", shards=[schema.ShardStatus(shard_id="m-r0-s0", state=State.STARTING, spec=spec)]
    )
    fleet.registered(reg, 100.0)
    fleet.registered(schema.Register(node_id="n2"), 100.0)
    fleet.shard_status(
        "n1", schema.ShardStatus(shard_id="m-r0-s0", replica_id="m-r0", state=State.READY, spec=spec)
    )
    fleet.disconnected("n1", 110.0, "gone")
    fleet.tick(120.0)
    assert fleet.nodes["n1"].state is NodeState.LOST
    path = tmp_path / "control-state.json"
    saver = StateSaver(path)
    # Monotonic 100 (last heard from) is Unix time 1_800_000_100.
    assert await saver.save(
        fleet.generation, fleet.nodes.values(), (), {}, wall_of=lambda t: t + 1_800_000_000
    )
    saved = parse_state(path.read_text(), path)
    assert [r.node_id for r in saved.registers] == ["n2"]
    [(lost, seen)] = saved.lost
    assert seen == 1_800_000_100.0 and [(s.shard_id, s.state) for s in lost.shards] == [
        ("m-r0-s0", State.READY)
    ]

    restored = Fleet(unreachable_after=1.0, lost_after=2.0)
    restored.restore(saved.registers, 5.0, 30.0, [(lost, 60.0)])
    node = restored.nodes["n1"]
    assert node.state is NodeState.LOST and node.last_heartbeat == -55.0 and not node.connected
    assert node.shards["m-r0-s0"].state == State.READY
    assert "last heard from 60 s ago" in node.history[-1].reason
    assert not restored.forget("n2")  # unreachable, not lost: kept
    assert [t.node_id for t in restored.tick(1000.0)] == ["n2"]  # n2 lost after its grace; n1 already was
    assert node.state is NodeState.LOST  # only a Register or a heartbeat brings it back
    assert restored.forget("n1") and "n1" not in restored.nodes


def test_an_unknown_cordon_is_skipped_with_a_line_saying_so() -> None:
    saved = parse_state('{"cordons": {"n1": "frozen", "n2": "draining"}}', "/s/control-state.json")
    assert saved.cordons == (("n2", Cordon.DRAINING),)
    assert saved.skipped == ("/s/control-state.json: cordons['n1']: unknown mark 'frozen', ignored",)


def test_a_plane_with_a_damaged_state_file_starts_empty_and_says_where(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from control.plane import ControlPlane

    cfg = parse(
        f'state_dir = "{tmp_path}"\n[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
    )
    (tmp_path / "control-state.json").write_text('{"nodes": {"gpu01": "%%%"}}')
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, "llmgw.control"):
        plane.restore()
    assert plane.fleet.nodes == {} and plane.placements == ()
    assert f"{tmp_path}/control-state.json: nodes['gpu01']: not a base64 Register" in caplog.text
    assert "starting with no memory of the fleet" in caplog.text
    # Set aside, not overwritten by the next save: a person can still read and repair it.
    assert f"it is kept as {tmp_path}/control-state.json.damaged" in caplog.text
    assert (tmp_path / "control-state.json.damaged").read_text() == '{"nodes": {"gpu01": "%%%"}}'
    assert not (tmp_path / "control-state.json").exists()
    # The pre-split file restores through the plane too: nodes unreachable until they register.
    (tmp_path / "control-state.json").write_bytes((FIXTURES / "control-state-2026-12-03.json").read_bytes())
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    plane.restore()
    assert {n: node.state for n, node in plane.fleet.nodes.items()} == {
        "gpu01": NodeState.UNREACHABLE,
        "gpu02": NodeState.UNREACHABLE,
    }
    assert plane.fleet.nodes["gpu02"].cordoned and len(plane.placements) == 2
    # Saving what was restored writes the same document back, and the catalog (control.catalog):
    # the file predates it, so the models are llmgw.toml's.
    trio.run(plane.save_now)
    written = json.loads((tmp_path / "control-state.json").read_text())
    assert [(e["name"], e["source"]) for e in written.pop("catalog")] == [("m", "file")]
    assert json.dumps(written, sort_keys=True) == (FIXTURES / "control-state-2026-12-03.json").read_text()


def test_the_api_documents_are_built_from_a_view_alone() -> None:
    """The admin API's documents need no control plane: a ``ControlView`` built by hand will do."""
    from control.api import ApiError, drain_doc, nodes_doc, replicas_doc
    from control.query import ControlView

    cfg = parse(CATALOG)
    fleet = _fleet("n1", "n2")
    old, new = _shard("m-r0", "n1", 8000), _shard("m-r0", "n2", 8000)
    _report(fleet, old, "m-r0", State.READY)
    fleet.cordon("n1", Cordon.DRAINING)
    plan = Plan((ReplicaPlacement("m", "m-r0", (new,)),), ())
    view = ControlView(
        now=5.0,
        nodes=fleet.nodes,
        placements=plan.replicas,
        plan=plan,
        models={m.name: m for m in cfg.models},
        cordons=fleet.cordons,
        admitted_by={"n1": "mtls"},
        backoff=lambda node, shard: (2, 9.0),
    )
    assert drain_doc(view, "n1") == {
        "node_id": "n1",
        "cordon": "draining",
        "node_state": "ready",
        "shards": [
            {
                "shard_id": old.shard_id,
                "replica_id": "m-r0",
                "state": "ready",
                "replacement": "n2",
                "replacement_state": "pending",
            }
        ],
        "empty": False,
    }
    with pytest.raises(ApiError, match="no node 'n9'; nodes: n1, n2"):
        drain_doc(view, "n9")
    [doc] = replicas_doc(view)
    assert [
        (s["node_id"], s["placed"], s["state"], s["failures"], s["retry_in_s"]) for s in doc["shards"]
    ] == [
        ("n2", True, "pending", 2, 4.0),
        ("n1", False, "draining", 0, None),
    ]
    assert [(n["node_id"], n["auth"], n["cordoned"]) for n in nodes_doc(view)] == [
        ("n1", "mtls", True),
        ("n2", "", False),
    ]


# -- events -----------------------------------------------------------------------------------------


def test_the_event_log_is_bounded_per_subject_and_in_shards() -> None:
    from control.events import Event, EventLog, Kind

    log = EventLog(per_node=3, per_shard=3, max_shards=2)
    for i in range(5):
        log.record(Event(Kind.NODE, float(i), 1e9 + i, "n1", new=f"s{i}"))
    assert [e.new for e in log.for_node("n1")] == ["s2", "s3", "s4"]
    for sid, at in (("a", 1.0), ("b", 2.0), ("a", 3.0), ("c", 4.0)):
        log.record(Event(Kind.SHARD, at, 0.0, "n1", shard_id=sid, replica_id=f"m-r0-{sid}", new="ready"))
    # "b" was touched least recently: forgotten, with its replica; the node's own events are apart.
    assert log.for_shard("b") == () and [e.at for e in log.for_shard("a")] == [1.0, 3.0]
    assert log.shards_of(lambda rid: rid.startswith("m-r0")) == ("a", "c")
    assert [e.at for e in log.for_shards(["c", "a", "a"])] == [1.0, 3.0, 4.0]
    assert len(log.for_node("n1")) == 3
    log.record(Event(Kind.NODE, 9.0, 0.0, "n1", reason="x" * 2000))
    assert len(log.for_node("n1")[-1].reason) == 500


def test_describe_documents_carry_the_transitions_where_they_happened(tmp_path: Path) -> None:
    """Node liveness, a shard's reported states, the reconciler's commands and an operator's cordon
    are recorded where they happen, with the monotonic and the wall clock, and shown per node and
    per model (shards no longer placed included)."""
    from control.api import ApiError, model_doc, node_doc
    from control.plane import ControlPlane

    now = [100.0]
    cfg = parse(
        f'state_dir = "{tmp_path}"\n[[models]]\nname = "m"\nreplicas = 1\n'
        '[models.profile]\nengine = "sim"\nmodel = "m"\nserved_model_name = "chat"\n'
    )
    plane = ControlPlane(cfg, clock=lambda: now[0], wall_clock=lambda: 1_764_806_400.25 + now[0])
    plane.agents.send = lambda node_id, **fields: 1  # type: ignore[method-assign]  # no agents here
    register = schema.Register(
        node_id="n1", mgmt_addr="10.0.0.1", engine_ports=schema.PortRange(first=8000, last=8010)
    )
    plane.fleet.registered(register, now[0])
    trio.run(plane.reconcile_once)
    [replica] = plane.placements
    shard = replica.shards[0]
    now[0] = 110.0
    for state in (State.STARTING, State.READY, State.READY):  # the repeat is no transition
        plane.fleet.shard_status(
            "n1", schema.ShardStatus(shard_id=shard.shard_id, replica_id="m-r0", state=state, pid=7)
        )
    now[0] = 120.0
    plane.fleet.shard_status(
        "n1",
        schema.ShardStatus(
            shard_id=shard.shard_id,
            replica_id="m-r0",
            state=State.FAILED,
            pid=7,
            error="engine exited with 1",
        ),
    )
    trio.run(plane.cordon_node, "n1")
    now[0] = 130.0
    view = plane.query.view()

    node = node_doc(view, "n1")
    assert [(e["kind"], e["shard_id"], e["from"], e["to"]) for e in node["events"]] == [
        ("node", "", "", "ready"),
        ("command", shard.shard_id, "", "start"),
        ("shard", shard.shard_id, "", "starting"),
        ("shard", shard.shard_id, "starting", "ready"),
        ("shard", shard.shard_id, "ready", "failed"),
        ("operator", "", "", "cordoned"),
    ]
    first, *_, failed, cordon = node["events"]
    assert (first["at_s_ago"], first["time"], first["reason"]) == (
        30.0,
        "2025-12-04T00:01:40.250Z",
        "registered",
    )
    assert failed["reason"] == "engine exited with 1" and failed["replica_id"] == "m-r0"
    assert cordon["reason"] == "cordoned by an admin: takes no new replicas"
    assert node["cordoned"] and [r["replica_id"] for r in node["replicas"]] == ["m-r0"]
    with pytest.raises(ApiError, match="no node 'n9'"):
        node_doc(view, "n9")

    model = model_doc(view, "m")
    assert (model["served_model_name"], model["engine"], model["replicas_wanted"]) == ("chat", "sim", 1)
    assert [e["to"] for e in model["events"]] == ["start", "starting", "ready", "failed"]
    # Once the shard is no placement's any more, its history still belongs to the model.
    plane.placements = ()
    plane.fleet.nodes["n1"].shards.clear()
    assert [e["to"] for e in model_doc(plane.query.view(), "m")["events"]] == [
        "start",
        "starting",
        "ready",
        "failed",
    ]
    with pytest.raises(ApiError, match="no model 'x' in the catalog; models: m"):
        model_doc(view, "x")


# -- a drain, judged before it is made ---------------------------------------------------------------


def test_drain_verdict_refuses_only_a_drain_that_stops_a_models_last_ready_engine() -> None:
    from control.reconcile import drain_verdict

    fleet = _fleet("n1", "n2")
    here, there = _shard("m-r0", "n1", 8000), _shard("m-r1", "n2", 8000)
    now = (ReplicaPlacement("m", "m-r0", (here,)), ReplicaPlacement("m", "m-r1", (there,)))
    _report(fleet, here, "m-r0", State.READY)
    nowhere = Unplaced("m", "m-r0", "0/2 nodes are available: 1 draining, 1 insufficient free GPUs", {})
    stuck = Plan((now[1],), (nowhere,))

    verdict = drain_verdict("n1", now, stuck, fleet.nodes)
    assert verdict.moves == (
        "m-r0 cannot move: 0/2 nodes are available: 1 draining, 1 insufficient free GPUs",
    )
    assert verdict.refusals == (
        "m would have no ready replica: nowhere else can take m-r0 (0/2 nodes are available: 1 draining, "
        "1 insufficient free GPUs)",
    )
    # Another ready replica elsewhere: the model keeps serving, so the drain may go on.
    _report(fleet, there, "m-r1", State.READY)
    assert drain_verdict("n1", now, stuck, fleet.nodes).refusals == ()
    # Or the replica can move (its old engine serves until the new one is ready).
    fleet.nodes["n2"].shards.clear()
    moved = Plan((ReplicaPlacement("m", "m-r0", (_shard("m-r0", "n2", 8001),)), now[1]), ())
    verdict = drain_verdict("n1", now, moved, fleet.nodes)
    assert verdict == type(verdict)(("m-r0 moves to n2",), ())
    # Nothing on the node: nothing to say.
    assert drain_verdict("n9", now, moved, fleet.nodes) == type(verdict)((), ())


def test_shards_no_placement_knows_are_adopted_not_started_again() -> None:
    """A control plane without its state file: the engines the agents report become placements."""
    from control.reconcile import adopted_placements

    fleet = _fleet("n1", "n2")
    rank0, rank1 = _shard("big-r0", "n1", 8000), _shard("big-r0", "n2", 8000)
    for shard, rank in ((rank1, 1), (rank0, 0)):
        fleet.shard_status(
            shard.node_id,
            schema.ShardStatus(
                node_id=shard.node_id,
                replica_id="big-r0",
                shard_id=shard.shard_id,
                state=State.READY if rank == 0 else State.STARTING,
                spec=schema.StartShard(
                    shard_id=shard.shard_id, http_port=8000, gpu_indices=[0], nnodes=2, node_rank=rank
                ),
            ),
        )
    _report(fleet, _shard("gone-r0", "n1", 8001), "gone-r0", State.READY)  # not in the catalog
    _report(fleet, _shard("big-r1", "n2", 8002), "big-r1", State.STOPPED)  # not running
    [adopted] = adopted_placements((), fleet.nodes, {"big"})
    assert (adopted.model, adopted.replica_id) == ("big", "big-r0")
    assert [(s.node_id, s.node_rank, s.nnodes, s.port) for s in adopted.shards] == [
        ("n1", 0, 2, 8000),
        ("n2", 1, 2, 8000),
    ]
    # Known to a placement already: nothing to adopt.
    assert adopted_placements((adopted,), fleet.nodes, {"big"}) == []
