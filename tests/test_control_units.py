"""Pure parts of the control plane: liveness transitions, reconciler decisions, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import schema
from control.config import ConfigError, parse
from control.fleet import Fleet, NodeState
from control.placement import Plan, ReplicaPlacement, ShardAssignment
from control.reconcile import Drain, Reconciler, Start, Stop

State = schema.ShardState


def reg(node_id: str, *shards: schema.ShardStatus) -> schema.Register:
    return schema.Register(node_id=node_id, shards=list(shards))


def test_liveness_ready_unreachable_lost_and_back() -> None:
    fleet = Fleet(unreachable_after=15, lost_after=300)
    assert [t.new for t in fleet.registered(reg("n1"), now=0)] == [NodeState.READY]
    fleet.heartbeat("n1", schema.Heartbeat(node_id="n1"), now=10)
    assert fleet.tick(now=24) == []
    [t] = fleet.tick(now=25.5)
    assert t.new is NodeState.UNREACHABLE and t.reason == "no heartbeat for 15.5 s"
    assert fleet.tick(now=300) == []
    [t] = fleet.tick(now=325.5)
    assert t.new is NodeState.LOST and "unreachable for 300.0 s" in t.reason
    [t] = fleet.registered(reg("n1"), now=400)
    assert t.new is NodeState.READY and "after being lost" in t.reason
    assert [h.new for h in fleet.nodes["n1"].history] == ["ready", "unreachable", "lost", "ready"]


def test_closed_stream_is_unreachable_at_once() -> None:
    fleet = Fleet(unreachable_after=15, lost_after=300)
    fleet.registered(reg("n1"), now=0)
    [t] = fleet.disconnected("n1", now=1, reason="eof")
    assert t.new is NodeState.UNREACHABLE and "stream closed" in t.reason
    assert fleet.nodes["n1"].lost_deadline == 301 and fleet.next_deadline(1) == 61


def test_restart_grace_before_lost() -> None:
    fleet = Fleet(unreachable_after=15, lost_after=300)
    fleet.restore([reg("n1")], now=1000, grace=60)
    assert fleet.nodes["n1"].state is NodeState.UNREACHABLE
    assert fleet.tick(now=1059) == []
    assert [t.new for t in fleet.tick(now=1060)] == [NodeState.LOST]


def placement(node: str = "n1", shard: str = "m-r0-s0") -> Plan:
    return Plan((ReplicaPlacement("m", "m-r0", (ShardAssignment(shard, node, (0,), 8000),)),), ())


def spec(shard: str = "m-r0-s0") -> schema.StartShard:
    return schema.StartShard(
        shard_id=shard,
        replica_id="m-r0",
        gpu_indices=[0],
        http_port=8000,
        profile=schema.EngineProfile(engine="sim"),
    )


def status(state: schema.ShardState, pid: int = 1, shard: str = "m-r0-s0") -> schema.ShardStatus:
    return schema.ShardStatus(shard_id=shard, replica_id="m-r0", state=state, pid=pid, spec=spec(shard))


def test_start_once_then_wait_for_the_agent() -> None:
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1"), now=0)
    r = Reconciler()
    specs = {"m-r0-s0": spec()}
    assert r.step(placement(), fleet.nodes, specs, now=0) == [Start("n1", spec())]
    assert r.step(placement(), fleet.nodes, specs, now=1) == []  # idempotent: the start is on its way
    fleet.shard_status("n1", status(State.STARTING))
    assert r.step(placement(), fleet.nodes, specs, now=2) == []


def test_crash_loop_backoff_doubles_and_resets() -> None:
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1"), now=0)
    r = Reconciler(backoff_initial=10, backoff_max=300, backoff_reset_after=600)
    specs = {"m-r0-s0": spec()}
    starts = []
    now = 0.0
    for pid in range(1, 8):
        fleet.shard_status("n1", status(State.FAILED, pid=pid))
        # Not before the backoff has passed...
        assert r.step(placement(), fleet.nodes, specs, now=now) == []
        delay = r.backoff(pid)
        starts.append(delay)
        now += delay
        assert r.step(placement(), fleet.nodes, specs, now=now) == [Start("n1", spec())]
    assert starts == [10, 20, 40, 80, 160, 300, 300]
    fleet.shard_status("n1", status(State.READY, pid=99))
    r.step(placement(), fleet.nodes, specs, now=now)
    r.step(placement(), fleet.nodes, specs, now=now + 600)
    assert r.failures("n1", "m-r0-s0") == 0


def test_extra_shards_are_drained_and_unreachable_nodes_left_alone() -> None:
    """An extra READY engine is drained (in-flight streams finish), one still loading is stopped;
    a drain that is not followed by the engine stopping is followed by a stop past the deadline."""
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1", status(State.READY, shard="old-r0-s0")), now=0)
    fleet.registered(reg("n2", status(State.READY, shard="gone-r0-s0")), now=0)
    fleet.registered(reg("n3", status(State.STARTING, shard="new-r0-s0")), now=0)
    fleet.disconnected("n2", now=1, reason="eof")
    r = Reconciler(stop_grace=30, drain_deadline=60, start_timeout=30)
    cmds = r.step(Plan((), ()), fleet.nodes, {}, now=2)
    assert cmds == [Drain("n1", "old-r0-s0", 60), Stop("n3", "new-r0-s0", 30)]
    assert r.step(Plan((), ()), fleet.nodes, {}, now=3) == []
    fleet.shard_status("n1", status(State.DRAINING, shard="old-r0-s0"))
    fleet.shard_status("n3", status(State.STOPPED, shard="new-r0-s0"))
    assert r.step(Plan((), ()), fleet.nodes, {}, now=100) == []
    assert r.step(Plan((), ()), fleet.nodes, {}, now=2 + 60 + 30 + 30) == [Stop("n1", "old-r0-s0", 30)]


def test_drain_waits_for_the_replacement() -> None:
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1", status(State.READY)), now=0)
    fleet.registered(reg("n2"), now=0)
    fleet.nodes["n1"].draining = True
    r = Reconciler(drain_deadline=60)
    moved = placement(node="n2")
    specs = {"m-r0-s0": spec()}
    # Replacement first: start on n2, do not touch n1 yet.
    assert r.step(moved, fleet.nodes, specs, now=1) == [Start("n2", spec())]
    fleet.shard_status("n2", status(State.READY, pid=2))
    assert r.step(moved, fleet.nodes, specs, now=2) == [Drain("n1", "m-r0-s0", 60)]
    assert r.step(moved, fleet.nodes, specs, now=3) == []


def test_changed_shape_replaces_the_running_shard() -> None:
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1", status(State.READY)), now=0)
    r = Reconciler(stop_grace=30)
    wanted = schema.StartShard(
        shard_id="m-r0-s0",
        replica_id="m-r0",
        gpu_indices=[0, 1],
        http_port=8000,
        profile=schema.EngineProfile(engine="sim"),
    )
    assert r.step(placement(), fleet.nodes, {"m-r0-s0": wanted}, now=1) == [Stop("n1", "m-r0-s0", 30)]


CONFIG = """
state_dir = "/tmp/llmgw-test"
[listen]
agents = "127.0.0.1:7070"

[[models]]
name = "a"
[models.profile]
engine = "vllm"
model = "m"

[[models]]
name = "b"
replica = 2
[models.gpus]
count = "8"
[models.profile]
engine = "vllm"
model = "m"
"""


def test_config_errors_name_key_and_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse(CONFIG, "llmgw.toml")
    text = str(info.value)
    assert "models[1].replica: unknown key (llmgw.toml line 14)" in text
    assert "models[1].gpus.count: expected an integer, got '8' (llmgw.toml line 16)" in text


def test_config_defaults_and_router_only() -> None:
    cfg = parse('[[endpoints]]\nmodel = "m"\nurl = "http://127.0.0.1:9"\n')
    assert not cfg.runs_control_plane and cfg.liveness.grace == cfg.liveness.lost_after == 300.0
    with pytest.raises(ConfigError, match="duplicate name"):
        parse(
            '[[models]]\nname="a"\nprofile={engine="sim", model="m"}\n[[models]]\nname="a"\nprofile={engine="sim", model="m"}\n'
        )


def test_router_coalescing_is_checked_and_reaches_the_pump() -> None:
    from router.server import Router

    assert parse("").router_config.relay_coalesce_us == 500
    with pytest.raises(
        ConfigError, match=r"router_coalesce_us must be 0 to 100000 microseconds, got -1 \(<config> line 1\)"
    ):
        parse("router_coalesce_us = -1\n")
    router = Router(dict, parse("router_coalesce_us = 123\n").router_config)
    assert router.pump.kind == "python" or getattr(router.pump, "coalesce_us", None) == 123


def test_routes_move_to_the_replacement_only_once_it_is_ready(tmp_path: object) -> None:
    import trio

    from control.plane import ControlPlane

    cfg = parse(
        f'state_dir = "{tmp_path}"\n[[models]]\nname = "m"\nreplicas = 1\n'
        '[models.profile]\nengine = "sim"\nmodel = "m"\nserved_model_name = "chat"\n'
    )
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    for node_id, addr in (("n1", "10.0.0.1"), ("n2", "10.0.0.2")):
        plane.fleet.registered(
            schema.Register(
                node_id=node_id, mgmt_addr=addr, engine_ports=schema.PortRange(first=8000, last=8010)
            ),
            0,
        )
    trio.run(plane.replan)
    [replica] = plane.placements
    old = replica.shards[0]
    plane.fleet.shard_status(old.node_id, status(State.READY, shard=old.shard_id))
    plane.build_routes()
    assert [u.url for u in plane.routes()["chat"].upstreams] == [f"http://10.0.0.{old.node_id[-1]}:8000"]

    trio.run(plane.drain_node, old.node_id)
    trio.run(plane.replan)
    [moved] = plane.placements
    new = moved.shards[0]
    assert new.node_id != old.node_id
    # The replacement is not ready yet: the old engine keeps serving, and stays listed as draining.
    plane.build_routes()
    assert [u.url for u in plane.routes()["chat"].upstreams] == [f"http://10.0.0.{old.node_id[-1]}:8000"]
    from control.api import replicas_doc

    # The replica is ready: its old engine serves it (the route above), as status says too.
    [doc] = replicas_doc(plane.query.view())
    assert doc["state"] == "ready"
    assert [(s["shard_id"], s["placed"], s["state"]) for s in doc["shards"]] == [
        (new.shard_id, True, "pending"),
        (old.shard_id, False, "draining"),
    ]
    # A replacement failing its liveness probe (UNHEALTHY) is live but never routed.
    plane.fleet.shard_status(new.node_id, status(State.UNHEALTHY, pid=2, shard=new.shard_id))
    plane.build_routes()
    assert [u.url for u in plane.routes()["chat"].upstreams] == [f"http://10.0.0.{old.node_id[-1]}:8000"]
    assert replicas_doc(plane.query.view())[0]["shards"][0]["state"] == "unhealthy"
    # Once it is, traffic moves and the drained replica gets no new requests.
    plane.fleet.shard_status(new.node_id, status(State.READY, pid=2, shard=new.shard_id))
    plane.build_routes()
    assert [u.url for u in plane.routes()["chat"].upstreams] == [
        f"http://10.0.0.{new.node_id[-1]}:{new.port}"
    ]


def test_ctl_replicas_shows_a_failed_engines_output_tail() -> None:
    from control.__main__ import render

    def shard(shard_id: str, state: str, tail: list[str]) -> dict[str, object]:
        return {
            "shard_id": shard_id,
            "node_id": "cpu01",
            "node_state": "ready",
            "state": state,
            "gpus": [],
            "url": "http://127.0.0.1:23700",
            "node_rank": 0,
            "nnodes": 1,
            "master": "",
            "error": "engine killed by SIGKILL after it was ready" if state == "failed" else "",
            "exit_code": 137 if state == "failed" else None,
            "pid": 4242,
            "output_tail": tail,
            "failures": 1 if state == "failed" else 0,
            "retry_in_s": 2.5 if state == "failed" else None,
        }

    doc = [
        {
            "model": "tiny",
            "replica_id": "tiny-r0",
            "shards": [
                shard("tiny-r0-s0", "failed", ["srv  update_slots: all slots are idle"]),
                shard("tiny-r1-s0", "ready", ["not shown: this one is fine"]),
            ],
        }
    ]
    text = render("replicas", doc)
    assert "killed by SIGKILL after it was ready; retry in 2.5s (failures: 1)" in text
    assert "tiny-r0-s0 output (last 1 lines):\n  | srv  update_slots: all slots are idle" in text
    assert "not shown" not in text


def test_a_heartbeat_on_the_open_stream_makes_a_silent_node_ready_at_once() -> None:
    fleet = Fleet(unreachable_after=1.5, lost_after=4)
    fleet.registered(reg("n1"), now=0)
    beat = schema.Heartbeat(node_id="n1")
    [t] = fleet.tick(now=2)
    assert t.new is NodeState.UNREACHABLE
    [t] = fleet.heartbeat("n1", beat, now=3)
    assert t.new is NodeState.READY and t.reason == (
        "heartbeat on its open stream after 3.0 s of silence (was unreachable)"
    )
    assert fleet.heartbeat("n1", beat, now=3.2) == []
    # Past lost_after too: a node that comes back on the same stream is ready, not lost forever.
    fleet.tick(now=5)
    [t] = fleet.tick(now=9.5)
    assert t.new is NodeState.LOST
    [t] = fleet.heartbeat("n1", beat, now=12)
    assert t.new is NodeState.READY and "(was lost)" in t.reason
    assert [h.new for h in fleet.nodes["n1"].history] == [
        "ready",
        "unreachable",
        "ready",
        "unreachable",
        "lost",
        "ready",
    ]
    # A closed stream is not revived by a late heartbeat; only a new Register does that.
    fleet.disconnected("n1", now=13, reason="eof")
    assert fleet.heartbeat("n1", beat, now=13.1) == []
    assert fleet.nodes["n1"].state is NodeState.UNREACHABLE


def test_unhealthy_is_stopped_at_once_and_started_after_the_backoff() -> None:
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1", status(State.UNHEALTHY, pid=7)), now=0)
    r = Reconciler(backoff_initial=10, stop_grace=5, start_timeout=30)
    specs = {"m-r0-s0": spec()}
    # Live: never a second engine; a failure: stopped now.
    assert r.step(placement(), fleet.nodes, specs, now=0) == [Stop("n1", "m-r0-s0", 5)]
    assert r.step(placement(), fleet.nodes, specs, now=1) == []
    assert r.failures("n1", "m-r0-s0") == 1 and r.retry_at("n1", "m-r0-s0") == 10
    # The same process reported FAILED as it goes is the same failure, not a second one.
    fleet.shard_status("n1", status(State.FAILED, pid=7))
    assert r.step(placement(), fleet.nodes, specs, now=2) == []
    assert r.failures("n1", "m-r0-s0") == 1
    fleet.shard_status("n1", status(State.STOPPED, pid=7))
    assert r.step(placement(), fleet.nodes, specs, now=9) == []
    assert r.step(placement(), fleet.nodes, specs, now=10) == [Start("n1", spec())]
    # The next engine fails its probes too: stopped again, and the backoff doubles.
    fleet.shard_status("n1", status(State.READY, pid=8))
    r.step(placement(), fleet.nodes, specs, now=11)
    fleet.shard_status("n1", status(State.UNHEALTHY, pid=8))
    assert r.step(placement(), fleet.nodes, specs, now=12) == [Stop("n1", "m-r0-s0", 5)]
    assert r.retry_at("n1", "m-r0-s0") == 32


def test_a_leftover_engine_serves_until_the_replacement_is_ready_then_is_drained() -> None:
    """n1 was lost, its replica placed on n2 meanwhile; n1 comes back still running the old engine."""
    fleet = Fleet(15, 300)
    fleet.registered(reg("n1", status(State.READY, pid=1, shard="m-r0-s0-aaaaaa")), now=0)
    fleet.registered(reg("n2"), now=0)
    r = Reconciler(stop_grace=5)
    moved = placement(node="n2", shard="m-r0-s0-bbbbbb")
    specs = {"m-r0-s0-bbbbbb": spec("m-r0-s0-bbbbbb")}
    assert r.step(moved, fleet.nodes, specs, now=1) == [Start("n2", spec("m-r0-s0-bbbbbb"))]
    fleet.shard_status("n2", status(State.STARTING, pid=2, shard="m-r0-s0-bbbbbb"))
    assert r.step(moved, fleet.nodes, specs, now=2) == []  # the old engine is the fallback
    fleet.shard_status("n2", status(State.READY, pid=2, shard="m-r0-s0-bbbbbb"))
    assert r.step(moved, fleet.nodes, specs, now=3) == [Drain("n1", "m-r0-s0-aaaaaa", 60)]
    # A leftover that is not ready is no fallback: stopped at once, replacement ready or not.
    fleet.registered(reg("n3", status(State.UNHEALTHY, pid=3, shard="m-r0-s0-cccccc")), now=4)
    fleet.shard_status("n2", status(State.STARTING, pid=4, shard="m-r0-s0-bbbbbb"))
    assert Stop("n3", "m-r0-s0-cccccc", 5) in r.step(moved, fleet.nodes, specs, now=5)


def test_state_is_fsynced_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import os
    import stat

    import trio

    from control.plane import ControlPlane

    cfg = parse(
        f'state_dir = "{tmp_path}"\n[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
    )
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    plane.fleet.registered(schema.Register(node_id="n1", mgmt_addr="10.0.0.1"), 0)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        events.append("fsync dir" if stat.S_ISDIR(mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    trio.run(plane.save_now)
    assert events == ["fsync file", "rename", "fsync dir"]
    assert list(json.loads((tmp_path / "control-state.json").read_text())["nodes"]) == ["n1"]
    trio.run(plane.save_now)  # nothing changed: nothing written again
    assert events == ["fsync file", "rename", "fsync dir"]


def test_cordon_and_drain_outlive_the_node_record_and_only_uncordon_undoes_them() -> None:
    from control.fleet import Cordon

    fleet = Fleet(15, 300)
    with pytest.raises(KeyError, match="no node 'n9'"):
        fleet.cordon("n9", Cordon.CORDONED)
    fleet.registered(reg("n1"), now=0)
    fleet.cordon("n1", Cordon.DRAINING)
    fleet.cordon("n1", Cordon.CORDONED)  # a cordon does not weaken a drain
    assert fleet.nodes["n1"].draining and fleet.nodes["n1"].cordoned
    # Known again after a restart (or after being lost): the mark is applied at registration.
    again = Fleet(15, 300, cordons=dict(fleet.cordons))
    again.registered(reg("n1"), now=0)
    assert again.nodes["n1"].draining
    assert again.uncordon("n1") is Cordon.DRAINING
    assert not again.nodes["n1"].cordoned and not again.nodes["n1"].draining
    assert again.uncordon("n1") is None


def two_node_plane(tmp_path: Path) -> object:
    from control.plane import ControlPlane

    cfg = parse(
        f'state_dir = "{tmp_path}"\n[[models]]\nname = "m"\nreplicas = 1\n[models.gpus]\ncount = 4\n'
        '[models.profile]\nengine = "sim"\nmodel = "m"\n'
    )
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    for node_id, gpus in (("n1", 8), ("n2", 2)):
        plane.fleet.registered(
            schema.Register(
                node_id=node_id,
                mgmt_addr="10.0.0.1",
                engine_ports=schema.PortRange(first=8000, last=8010),
                gpus=[schema.Gpu(index=i, memory_total_mib=81559) for i in range(gpus)],
            ),
            0,
        )
    return plane


def test_a_drain_that_leaves_a_model_without_a_ready_replica_is_refused_unless_forced(
    tmp_path: Path,
) -> None:
    import functools

    import trio

    from control.plane import ControlPlane
    from control.query import DrainRefused

    plane = two_node_plane(tmp_path)
    assert isinstance(plane, ControlPlane)
    trio.run(plane.replan)
    [replica] = plane.placements
    shard = replica.shards[0]
    assert shard.node_id == "n1"  # n2 has 2 GPUs; the model needs 4
    plane.fleet.shard_status("n1", status(State.READY, shard=shard.shard_id))
    with pytest.raises(DrainRefused) as refused:
        trio.run(plane.drain_node, "n1")
    assert str(refused.value) == (
        "drain of n1 refused: m would have no ready replica: nowhere else can take m-r0 (0/2 nodes are "
        "available: 1 insufficient free GPUs (need 4, have 2 free), 1 draining.); add capacity "
        "elsewhere, or drain with --force to stop them anyway"
    )
    assert not plane.fleet.nodes["n1"].cordoned and not plane.fleet.cordons
    moves = trio.run(functools.partial(plane.drain_node, "n1", force=True))
    assert moves == [
        "m-r0 cannot move: 0/2 nodes are available: 1 insufficient free GPUs (need 4, have 2 free), "
        "1 draining."
    ]
    # On disk before the answer, and back after a restart.
    again = ControlPlane(plane.config, clock=lambda: 0.0)
    again.restore()
    assert again.fleet.nodes["n1"].draining and again.fleet.cordons == {"n1": "draining"}


ENGINE_VERSION_CONFIG = """\
[[models]]
name = "m"
replicas = 2
[models.gpus]
count = 1
[models.profile]
engine = "vllm"
model = "m"
engine_version = "{constraint}"
"""


def test_engine_version_is_checked_at_load_naming_its_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse(ENGINE_VERSION_CONFIG.format(constraint="0.18+"), "llmgw.toml")
    assert str(info.value) == (
        "models[0].profile.engine_version '0.18+' is not a PEP 440 version specifier "
        "(Invalid specifier: '0.18+'); write e.g. '>=0.18' or '>=0.18,<0.34' (llmgw.toml line 9)"
    )
    cfg = parse(ENGINE_VERSION_CONFIG.format(constraint=">=0.18,<0.34"))
    assert cfg.models[0].profile.to_proto().engine_version == ">=0.18,<0.34"
    assert parse(ENGINE_VERSION_CONFIG.format(constraint=">=b6000").replace("vllm", "llamacpp"))


def test_the_plane_places_by_the_versions_nodes_report_and_starts_with_the_constraint(tmp_path: Path) -> None:
    """Register.engines reaches placement: a constrained model goes to the node whose vllm satisfies
    it, ``ctl why`` explains the other in the node's own numbers, and the StartShard's profile
    carries the constraint (the agent's adapters see what the operator asked for)."""
    import trio

    from control.__main__ import render
    from control.api import nodes_doc, why_doc
    from control.plane import ControlPlane

    cfg = parse(f'state_dir = "{tmp_path}"\n' + ENGINE_VERSION_CONFIG.format(constraint=">=0.18"))
    plane = ControlPlane(cfg, clock=lambda: 0.0)
    for node_id, vllm in (("gpu01", "0.18.0"), ("gpu07", "0.17.1"), ("gpu09", "")):
        plane.fleet.registered(
            schema.Register(
                node_id=node_id,
                mgmt_addr="10.0.0.1",
                engine_ports=schema.PortRange(first=8000, last=8010),
                gpus=[schema.Gpu(index=0, memory_total_mib=81559)],
                engines=[
                    schema.EngineInstall(
                        engine="vllm", version=vllm, error="" if vllm else "vllm: command not found"
                    ),
                    schema.EngineInstall(engine="sglang", error="sglang not installed: no package 'sglang'"),
                    schema.EngineInstall(engine="sim", version="0.18.0"),
                ],
            ),
            0,
        )
    plan = trio.run(plane.replan)
    assert [r.shards[0].node_id for r in plan.replicas] == ["gpu01"]
    why = render("why", why_doc(plane.query.view(), "m"))
    assert "      gpu07: vllm 0.17.1 does not satisfy >=0.18" in why
    assert "      gpu09: vllm not installed (vllm: command not found)" in why
    replica = plan.replicas[0]
    start = plane.start_spec(replica, replica.shards[0])
    assert start.profile is not None and start.profile.engine_version == ">=0.18"
    nodes = render("nodes", nodes_doc(plane.query.view()))
    header, *rows = nodes.splitlines()
    assert "ENGINES" in header
    assert "vllm 0.18.0, sim 0.18.0; missing: sglang" in rows[0]
    assert "sim 0.18.0; missing: vllm, sglang" in rows[2]
