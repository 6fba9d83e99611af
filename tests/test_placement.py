"""placement.place: examples of each rule, then properties over random fleets and catalogs."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control.placement import (
    EngineView,
    GpuView,
    ModelSpec,
    NodeView,
    Plan,
    ReplicaPlacement,
    ShardAssignment,
    engine_constraint,
    engine_version_problem,
    place,
    shard_id,
)
from schema.ids import SHARD_ID

H100_MIB = 81559  # what NVML reports for an 80 GB H100
ALL = "all"  # every GPU NVLinked to every other (NVSwitch)


def gpus(
    count: int,
    *,
    memory: int = H100_MIB,
    capability: tuple[int, int] = (9, 0),
    nvlink: str | Sequence[Iterable[int]] = ALL,
) -> tuple[GpuView, ...]:
    """`count` GPUs; nvlink is ALL, or a list of islands (each fully connected inside, none across)."""
    islands: list[Iterable[int]] = [range(count)] if isinstance(nvlink, str) else list(nvlink)
    peers = {g: frozenset(i) - {g} for i in islands for g in i}
    return tuple(GpuView(g, memory, capability, peers.get(g, frozenset())) for g in range(count))


def node(
    node_id: str,
    gpu_count: int = 8,
    *,
    fabrics: Iterable[str] = (),
    labels: Mapping[str, str] | None = None,
    state: str = "ready",
    ports: tuple[int, int] = (8000, 8099),
    draining: bool = False,
    **gpu_options: object,
) -> NodeView:
    return NodeView(
        node_id=node_id,
        state=state,
        gpus=gpus(gpu_count, **gpu_options),  # type: ignore[arg-type]
        labels=labels or {},
        fabrics=frozenset(fabrics),
        mgmt_addr=f"10.0.0.{int(node_id[-2:]) if node_id[-2:].isdigit() else 99}",
        port_range=ports,
        draining=draining,
    )


def where(plan: Plan) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """replica id -> [(node, gpus)] for compact assertions."""
    return {r.replica_id: [(s.node_id, s.gpu_indices) for s in r.shards] for r in plan.replicas}


def single(node_id: str, rid: str, gpu_indices: tuple[int, ...], port: int = 8000) -> ReplicaPlacement:
    model = rid.rsplit("-r", 1)[0]
    return ReplicaPlacement(model, rid, (ShardAssignment(f"{rid}-s0", node_id, gpu_indices, port),))


# The fleet of the multi-node examples: two 8-GPU nodes, but on different fabrics.
def split_fleet() -> list[NodeView]:
    return [
        node("gpu01", 8, fabrics=["ib-a"]),
        node("gpu02", 4, fabrics=["ib-a"]),
        node("gpu03", 8, fabrics=["ib-b"]),
    ]


BIG = ModelSpec("big", replicas=1, gpus_per_shard=8, nodes_per_replica=2)


# --- single-node examples ---------------------------------------------------------------------------


def test_two_replicas_of_an_8_gpu_model_take_one_node_each() -> None:
    plan = place([ModelSpec("llama", replicas=2, gpus_per_shard=8)], [node("gpu02"), node("gpu01")], [])
    assert where(plan) == {
        "llama-r0": [("gpu01", tuple(range(8)))],
        "llama-r1": [("gpu02", tuple(range(8)))],
    }
    # Each placement has its own id, a hash of where it runs: the same placement, the same id.
    assert [r.shards[0].shard_id for r in plan.replicas] == ["llama-r0-s0-9d108d", "llama-r1-s0-821a3a"]
    assert [r.shards[0].port for r in plan.replicas] == [8000, 8000]
    assert plan.unplaced == ()


def test_a_third_replica_is_unplaced_with_a_reason_per_node() -> None:
    plan = place([ModelSpec("llama", replicas=3, gpus_per_shard=8)], [node("gpu01"), node("gpu02")], [])
    (why,) = plan.unplaced
    assert why.replica_id == "llama-r2"
    assert why.reason == "0/2 nodes are available: 2 insufficient free GPUs (need 8, have 0 free)."
    assert dict(why.per_node) == {
        "gpu01": "insufficient free GPUs (need 8, have 0 free)",
        "gpu02": "insufficient free GPUs (need 8, have 0 free)",
    }
    assert plan.why("llama-r2") is why and plan.why("llama-r0") is None


def test_best_fit_keeps_a_whole_node_free() -> None:
    fleet = [node("gpu01"), node("gpu02")]
    current = [single("gpu02", "other-r0", (0, 1, 2, 3))]
    models = [ModelSpec("other", 1, 4), ModelSpec("small", 1, 4)]
    plan = place(models, fleet, current)
    # gpu02 has 4 free, gpu01 8: the 4-GPU shard goes where it leaves the fewest free.
    assert where(plan)["small-r0"] == [("gpu02", (4, 5, 6, 7))]


def test_nvlink_islands_a_4_gpu_shard_gets_one_island() -> None:
    islands = [range(4), range(4, 8)]
    fleet = [node("gpu01", nvlink=islands)]
    # GPU 0 is taken, so the lowest indices (1, 2, 3, 4) would straddle the islands.
    current = [single("gpu01", "tiny-r0", (0,))]
    plan = place([ModelSpec("tiny", 1, 1), ModelSpec("mid", 1, 4)], fleet, current)
    assert where(plan)["mid-r0"] == [("gpu01", (4, 5, 6, 7))]


def test_nvlink_islands_first_free_island_when_both_are_free() -> None:
    plan = place([ModelSpec("mid", 2, 4)], [node("gpu01", nvlink=[range(4), range(4, 8)])], [])
    assert where(plan) == {"mid-r0": [("gpu01", (0, 1, 2, 3))], "mid-r1": [("gpu01", (4, 5, 6, 7))]}


def test_nvlink_clique_beats_best_fit_across_nodes() -> None:
    islands = [range(4), range(4, 8)]
    fleet = [node("gpu01", nvlink=islands), node("gpu02", nvlink=islands)]
    # gpu01 keeps 6 free (1-3, 5-7) with no 4-clique; gpu02 has 8 free with two cliques.
    current = [single("gpu01", "pin-r0", (0,)), single("gpu01", "pin-r1", (4,), port=8001)]
    plan = place([ModelSpec("pin", 2, 1), ModelSpec("mid", 1, 4)], fleet, current)
    assert where(plan)["mid-r0"] == [("gpu02", (0, 1, 2, 3))]


def test_no_clique_anywhere_falls_back_to_lowest_indices() -> None:
    fleet = [node("gpu01", nvlink=[])]
    plan = place([ModelSpec("mid", 1, 3)], fleet, [])
    assert where(plan)["mid-r0"] == [("gpu01", (0, 1, 2))]


def test_memory_and_capability_minimums_and_their_reason() -> None:
    fleet = [
        node("gpu01", 8, memory=40960, capability=(8, 0)),  # A100 40 GB
        node("gpu02", 4, memory=81920, capability=(9, 0)),
    ]
    spec = ModelSpec("m", 1, 8, min_gpu_memory_mib=80 * 1024, min_compute_capability=(8, 0))
    plan = place([spec], fleet, [])
    (why,) = plan.unplaced
    assert why.per_node["gpu01"] == (
        "insufficient free GPUs (need 8 with >= 80 GiB and compute capability >= 8.0, have 8 free, 0 qualifying)"
    )
    # The representative detail is the node closest to fitting: gpu02, with 4 qualifying.
    assert why.reason == (
        "0/2 nodes are available: 2 insufficient free GPUs "
        "(need 8 with >= 80 GiB and compute capability >= 8.0, have 4 free, 4 qualifying)."
    )
    smaller = attrs.evolve(spec, gpus_per_shard=4)
    assert where(place([smaller], fleet, [])) == {"m-r0": [("gpu02", (0, 1, 2, 3))]}


def test_selector_picks_the_labelled_node_and_explains_the_others() -> None:
    fleet = [node("gpu01", labels={"zone": "b"}), node("gpu02", labels={"zone": "a", "tier": "gold"})]
    plan = place([ModelSpec("m", 2, 8, selector={"zone": "a"})], fleet, [])
    assert where(plan) == {"m-r0": [("gpu02", tuple(range(8)))]}
    (why,) = plan.unplaced
    assert why.per_node == {
        "gpu01": "missing label zone=a",
        "gpu02": "insufficient free GPUs (need 8, have 0 free)",
    }
    assert why.reason == (
        "0/2 nodes are available: 1 insufficient free GPUs (need 8, have 0 free), 1 missing label zone=a."
    )


def with_engines(view: NodeView, **engines: EngineView) -> NodeView:
    return attrs.evolve(view, engines=engines)


def test_engine_version_constraint_places_only_where_it_is_satisfied_and_says_why_elsewhere() -> None:
    fleet = [
        with_engines(node("gpu01"), vllm=EngineView("0.18.0")),
        with_engines(node("gpu05"), vllm=EngineView(error="vllm: command not found")),
        with_engines(node("gpu07"), vllm=EngineView("0.17.1")),
        node("gpu09"),  # an agent that reports no versions
    ]
    model = ModelSpec("m", 2, 8, engine="vllm", engine_version=">=0.18")
    plan = place([model], fleet, [])
    assert where(plan) == {"m-r0": [("gpu01", tuple(range(8)))]}
    (why,) = plan.unplaced
    assert why.per_node == {
        "gpu01": "insufficient free GPUs (need 8, have 0 free)",
        "gpu05": "vllm not installed (vllm: command not found)",
        "gpu07": "vllm 0.17.1 does not satisfy >=0.18",
        "gpu09": "reports no engine versions (its agent predates version detection); >=0.18 cannot be checked",
    }
    assert why.reason == (
        "0/4 nodes are available: 3 do not have vllm >=0.18, 1 insufficient free GPUs (need 8, have 0 free)."
    )
    # Without a constraint the same fleet takes the model everywhere (ctl nodes shows what is missing).
    free = place([ModelSpec("m", 4, 8, engine="vllm")], fleet, [])
    assert len(free.replicas) == 4


def test_engine_version_constraint_keeps_running_replicas() -> None:
    """Like a changed label, a constraint added later does not evict what already runs."""
    fleet = [with_engines(node("gpu07"), vllm=EngineView("0.17.1"))]
    running = single("gpu07", "m-r0", tuple(range(8)))
    plan = place([ModelSpec("m", 1, 8, engine="vllm", engine_version=">=0.18")], fleet, [running])
    assert plan.replicas == (running,)


@pytest.mark.parametrize(
    ("installed", "constraint", "problem"),
    [
        (EngineView("0.19.0rc1"), ">=0.18", ""),
        (EngineView("0.18.1.dev12+g1234abc"), ">=0.18,<0.19", ""),
        (EngineView("0.33.0"), ">=0.18,<0.33", "vllm 0.33.0 does not satisfy >=0.18,<0.33"),
        (EngineView("garbage"), ">=0.18", "vllm garbage is not a version >=0.18 can be checked against"),
        (EngineView(error="`vllm --version` did not answer within 5 s"), ">=0.18",
         "vllm version unknown (`vllm --version` did not answer within 5 s); >=0.18 cannot be checked"),
        (EngineView(error="vllm not installed: no package 'vllm' in /usr/bin/python3"), ">=0.18",
         "vllm not installed: no package 'vllm' in /usr/bin/python3"),
        (EngineView("0.1.0"), "", ""),
    ],
)  # fmt: skip
def test_engine_version_problems(installed: EngineView, constraint: str, problem: str) -> None:
    assert engine_version_problem("vllm", constraint, {"vllm": installed}) == problem


def test_llamacpp_build_tags_compare_by_number() -> None:
    engines = {"llamacpp": EngineView("b6432")}
    assert engine_version_problem("llamacpp", ">=b6000", engines) == ""
    assert engine_version_problem("llamacpp", ">=6500", engines) == "llamacpp b6432 does not satisfy >=6500"
    assert (
        engine_version_problem("sglang", ">=0.5", engines)
        == "reports no sglang version; >=0.5 cannot be checked"
    )
    with pytest.raises(ValueError, match="'>=zero' is not a PEP 440 version specifier"):
        engine_constraint(">=zero")


def test_summary_groups_reasons_largest_first_like_kubernetes() -> None:
    fleet = [
        node("gpu01", 4),
        node("gpu02", 2),
        node("gpu03", 6),
        node("gpu04", state="unreachable"),
        node("gpu05", state="unreachable"),
    ]
    plan = place([ModelSpec("m", 1, 8, min_gpu_memory_mib=80 * 1024)], fleet, [])
    (why,) = plan.unplaced
    assert why.reason == (
        "0/5 nodes are available: 3 insufficient free GPUs (need 8 with >= 80 GiB, have 6 free, 0 qualifying), "
        "2 unreachable."
    )
    assert why.per_node["gpu04"] == "not ready (unreachable)"


def test_no_nodes_at_all() -> None:
    plan = place([ModelSpec("m", 1, 1)], [], [])
    assert plan.unplaced[0].reason == "0/0 nodes are available."
    assert plan.unplaced[0].per_node == {}


def test_ports_lowest_free_and_exhaustion() -> None:
    fleet = [node("cpu01", 0, ports=(8000, 8001))]
    plan = place([ModelSpec("sim", 3, 0)], fleet, [])
    assert [r.shards[0].port for r in plan.replicas] == [8000, 8001]
    (why,) = plan.unplaced
    assert why.reason == "0/1 nodes are available: 1 no free port in 8000-8001."


def test_disjoint_port_ranges_say_so_instead_of_an_inverted_range() -> None:
    """The control plane passes the overlap of the node's ports and its own; an empty overlap
    (first > last) is a configuration mismatch, not a full node."""
    fleet = [node("cpu01", 0, ports=(21000, 8999))]
    (why,) = place([ModelSpec("sim", 1, 0)], fleet, []).unplaced
    assert why.per_node["cpu01"] == (
        "no engine ports: the agent's --engine-ports and llmgw.toml's [engines] ports do not overlap"
    )
    assert "21000-8999" not in why.reason


def test_cpu_only_models_prefer_nodes_without_gpus_and_spread() -> None:
    fleet = [node("cpu01", 0), node("cpu02", 0), node("gpu01", 8)]
    plan = place([ModelSpec("sim", 3, 0)], fleet, [])
    assert where(plan) == {
        "sim-r0": [("cpu01", ())],
        "sim-r1": [("cpu02", ())],
        "sim-r2": [("cpu01", ())],
    }
    assert [r.shards[0].port for r in plan.replicas] == [8000, 8000, 8001]


def test_draining_nodes_keep_placements_but_take_no_new_ones() -> None:
    first = place([ModelSpec("m", 1, 8)], [node("gpu01")], [])
    fleet = [node("gpu01", draining=True, ports=(8000, 8099))]
    again = place([ModelSpec("m", 2, 8)], fleet, first.replicas)
    assert again.replicas == first.replicas
    assert again.unplaced[0].per_node == {"gpu01": "draining"}


def test_cordoned_nodes_keep_placements_but_take_no_new_ones() -> None:
    first = place([ModelSpec("m", 1, 8)], [node("gpu01")], [])
    again = place([ModelSpec("m", 2, 8)], [attrs.evolve(node("gpu01"), cordoned=True)], first.replicas)
    assert again.replicas == first.replicas
    assert again.unplaced[0].per_node == {"gpu01": "cordoned"}


def test_a_moved_replica_gets_a_shard_id_of_its_own() -> None:
    model = ModelSpec("m", 1, 4)
    first = place([model], [node("gpu01", 4), node("gpu02", 4)], [])
    (old,) = first.replicas
    drained = [attrs.evolve(node(n, 4), draining=n == old.shards[0].node_id) for n in ("gpu01", "gpu02")]
    (moved,) = place([model], drained, []).replicas
    assert moved.replica_id == old.replica_id and moved.node_ids != old.node_ids
    assert moved.shards[0].shard_id != old.shards[0].shard_id
    assert {s.shard_id.rsplit("-", 1)[0] for s in (old.shards[0], moved.shards[0])} == {"m-r0-s0"}


def test_long_model_names_still_give_valid_distinct_shard_ids() -> None:
    long_a, long_b = "x" * 130 + "-a", "x" * 130 + "-b"
    plan = place([ModelSpec(long_a, 2, 0), ModelSpec(long_b, 1, 0)], [node("cpu01", 0)], [])
    ids = [s.shard_id for r in plan.replicas for s in r.shards]
    assert len(ids) == len(set(ids)) == 3
    assert all(SHARD_ID.fullmatch(i) and len(i) == 128 for i in ids)
    assert all(i.endswith(f"-s0-{i[-6:]}") for i in ids)


def test_new_placements_keep_off_gpus_and_ports_held_by_engines_outside_every_placement() -> None:
    """A node back after being lost still runs its old engine on GPUs 0-3 and port 8000 (its replica
    was placed elsewhere meanwhile): a new replica must not be started on top of it."""
    back = attrs.evolve(node("gpu01"), held_gpus=frozenset({0, 1, 2, 3}), held_ports=frozenset({8000}))
    (replica,) = place([ModelSpec("m", 1, 4)], [back], []).replicas
    assert replica.shards[0].gpu_indices == (4, 5, 6, 7) and replica.shards[0].port == 8001
    full = attrs.evolve(back, held_gpus=frozenset(range(8)))
    (why,) = place([ModelSpec("m", 1, 4)], [full], []).unplaced
    assert why.per_node["gpu01"] == "insufficient free GPUs (need 4, have 0 free)"


# --- liveness ----------------------------------------------------------------------------------------


def test_unreachable_nodes_keep_placements_but_take_no_new_ones() -> None:
    fleet = [node("gpu01"), node("gpu02", 4)]
    first = place([ModelSpec("m", 1, 4)], fleet, [])
    assert where(first) == {"m-r0": [("gpu02", (0, 1, 2, 3))]}
    fleet[1] = attrs.evolve(fleet[1], state="unreachable")
    again = place([ModelSpec("m", 3, 4)], fleet, first.replicas)
    assert again.replica("m-r0") == first.replica("m-r0")
    assert where(again)["m-r1"] == [("gpu01", (0, 1, 2, 3))]
    assert where(again)["m-r2"] == [("gpu01", (4, 5, 6, 7))]
    more = place([ModelSpec("m", 4, 4)], fleet, again.replicas)
    assert more.why("m-r3") is not None
    assert more.why("m-r3").per_node["gpu02"] == "not ready (unreachable)"  # type: ignore[union-attr]
    assert "1 unreachable" in more.why("m-r3").reason  # type: ignore[union-attr]


def test_lost_nodes_release_placements_and_replicas_move_elsewhere() -> None:
    fleet = [node("gpu01"), node("gpu02")]
    first = place([ModelSpec("m", 1, 8)], fleet, [])
    assert where(first) == {"m-r0": [("gpu01", tuple(range(8)))]}
    fleet[0] = attrs.evolve(fleet[0], state="lost")
    moved = place([ModelSpec("m", 1, 8)], fleet, first.replicas)
    assert where(moved) == {"m-r0": [("gpu02", tuple(range(8)))]}


def test_a_replica_on_a_lost_node_with_nowhere_to_go_is_unplaced() -> None:
    first = place([ModelSpec("m", 1, 8)], [node("gpu01")], [])
    plan = place([ModelSpec("m", 1, 8)], [node("gpu01", state="lost")], first.replicas)
    assert plan.replicas == ()
    assert plan.unplaced[0].reason == "0/1 nodes are available: 1 lost."


def test_a_node_missing_from_the_fleet_counts_as_lost() -> None:
    first = place([ModelSpec("m", 1, 8)], [node("gpu01")], [])
    plan = place([ModelSpec("m", 1, 8)], [node("gpu02")], first.replicas)
    assert where(plan) == {"m-r0": [("gpu02", tuple(range(8)))]}


def test_a_placement_whose_gpus_vanished_is_placed_again() -> None:
    first = place([ModelSpec("m", 1, 4)], [node("gpu01", 8)], [])
    shrunk = [node("gpu01", 2), node("gpu02", 4)]
    assert where(place([ModelSpec("m", 1, 4)], shrunk, first.replicas)) == {"m-r0": [("gpu02", (0, 1, 2, 3))]}


def test_a_placement_whose_port_left_the_range_is_placed_again() -> None:
    first = place([ModelSpec("m", 1, 4)], [node("gpu01", ports=(8000, 8099))], [])
    plan = place([ModelSpec("m", 1, 4)], [node("gpu01", ports=(9000, 9009))], first.replicas)
    assert plan.replicas[0].shards[0].port == 9000


def test_a_changed_shape_is_placed_again() -> None:
    first = place([ModelSpec("m", 1, 4)], [node("gpu01")], [])
    plan = place([ModelSpec("m", 1, 8)], [node("gpu01")], first.replicas)
    assert where(plan) == {"m-r0": [("gpu01", tuple(range(8)))]}


# --- stability ---------------------------------------------------------------------------------------


def test_placing_again_changes_nothing() -> None:
    fleet = [node("gpu01", fabrics=["ib-a"]), node("gpu02", fabrics=["ib-a"]), node("gpu03", 4)]
    models = [ModelSpec("a", 2, 2), ModelSpec("b", 1, 8, nodes_per_replica=2), ModelSpec("c", 3, 1)]
    first = place(models, fleet, [])
    assert place(models, fleet, first.replicas) == first


def test_adding_a_node_does_not_move_existing_replicas() -> None:
    models = [ModelSpec("a", 2, 4), ModelSpec("b", 1, 2)]
    first = place(models, [node("gpu02")], [])
    # gpu01 sorts first and is empty: a placement from scratch would prefer it for something.
    assert [u.replica_id for u in first.unplaced] == ["b-r0"]
    again = place(models, [node("gpu01"), node("gpu02")], first.replicas)
    assert all(again.replica(r.replica_id) == r for r in first.replicas)
    assert where(again)["b-r0"] == [("gpu01", (0, 1))]


def test_scaling_down_drops_the_highest_replica_ids() -> None:
    fleet = [node("gpu01"), node("gpu02"), node("gpu03")]
    three = place([ModelSpec("m", 3, 8)], fleet, [])
    one = place([ModelSpec("m", 1, 8)], fleet, three.replicas)
    assert one.replicas == (three.replicas[0],)
    assert place([], fleet, three.replicas) == Plan((), ())


def test_current_in_any_order_gives_the_same_plan() -> None:
    fleet = [node("gpu01"), node("gpu02")]
    models = [ModelSpec("a", 2, 4), ModelSpec("b", 2, 2)]
    first = place(models, fleet, [])
    assert place(models, fleet, reversed(first.replicas)) == place(models, fleet, first.replicas)


def test_conflicting_current_placements_keep_the_lower_replica() -> None:
    current = [single("gpu01", "m-r1", (0, 1)), single("gpu01", "m-r0", (1, 2), port=8001)]
    plan = place([ModelSpec("m", 2, 2)], [node("gpu01")], current)
    assert plan.replica("m-r0") == current[1]
    assert where(plan)["m-r1"] == [("gpu01", (0, 3))]
    assert plan.replicas[1].shards[0].port == 8000


def test_duplicates_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate model name: m"):
        place([ModelSpec("m", 1, 1), ModelSpec("m", 2, 1)], [], [])
    with pytest.raises(ValueError, match="duplicate node id: gpu01"):
        place([], [node("gpu01"), node("gpu01")], [])
    with pytest.raises(ValueError, match="GPU indices repeat"):
        NodeView("x", "ready", (GpuView(0, 1, (9, 0)), GpuView(0, 1, (9, 0))), {}, frozenset(), "", (1, 2))
    with pytest.raises(ValueError):
        ModelSpec("m", replicas=1, gpus_per_shard=1, nodes_per_replica=0)


# --- multi-node --------------------------------------------------------------------------------------


def test_a_16_gpu_model_cannot_split_across_fabrics() -> None:
    plan = place([BIG], split_fleet(), [])
    assert plan.replicas == ()
    (why,) = plan.unplaced
    assert why.reason == (
        "0/3 nodes are available for a 2-node replica: 2 fit but share no fabric (gpu01: ib-a, gpu03: ib-b), "
        "1 insufficient free GPUs (need 8, have 4 free)."
    )
    assert why.per_node == {
        "gpu01": "fits, but shares no fabric with enough fitting nodes for a 2-node replica (ib-a: 1 of 2)",
        "gpu02": "insufficient free GPUs (need 8, have 4 free)",
        "gpu03": "fits, but shares no fabric with enough fitting nodes for a 2-node replica (ib-b: 1 of 2)",
    }


def test_a_16_gpu_model_places_on_two_nodes_of_one_fabric() -> None:
    fleet = split_fleet()
    fleet[1] = node("gpu02", 8, fabrics=["ib-a"])
    plan = place([BIG], fleet, [])
    (replica,) = plan.replicas
    assert replica.fabric == "ib-a"
    leader, follower = replica.shards
    assert (leader.node_id, leader.node_rank, follower.node_id, follower.node_rank) == (
        "gpu01",
        0,
        "gpu02",
        1,
    )
    assert [s.shard_id for s in replica.shards] == ["big-r0-s0-81500b", "big-r0-s1-397be7"]
    assert leader.gpu_indices == follower.gpu_indices == tuple(range(8))
    assert leader.nnodes == follower.nnodes == 2
    assert leader.master_addr == follower.master_addr == fleet[0].mgmt_addr == "10.0.0.1"
    assert leader.master_port == follower.master_port == 8001
    assert leader.master_port != leader.port
    assert (leader.port, follower.port) == (8000, 8000)


def test_multi_node_prefers_the_smallest_fabric_that_fits() -> None:
    fleet = [
        node("gpu01", fabrics=["ib-a"]),
        node("gpu02", fabrics=["ib-a"]),
        node("gpu03", fabrics=["ib-a"]),
        node("gpu04", fabrics=["ib-b"]),
        node("gpu05", fabrics=["ib-b"]),
    ]
    plan = place([BIG], fleet, [])
    assert plan.replicas[0].fabric == "ib-b"
    assert plan.replicas[0].node_ids == ("gpu04", "gpu05")


def test_multi_node_leader_needs_a_second_port() -> None:
    fleet = [
        node("gpu01", fabrics=["ib-a"], ports=(8000, 8000)),
        node("gpu02", fabrics=["ib-a"], ports=(8000, 8001)),
    ]
    replica = place([BIG], fleet, []).replicas[0]
    assert [(s.node_id, s.node_rank, s.port) for s in replica.shards] == [
        ("gpu02", 0, 8000),
        ("gpu01", 1, 8000),
    ]
    assert replica.shards[0].master_port == 8001
    assert replica.shards[0].master_addr == "10.0.0.2"

    cramped = [attrs.evolve(fleet[1], port_range=(8000, 8000)), fleet[0]]
    (why,) = place([BIG], cramped, []).unplaced
    assert why.reason == (
        "0/2 nodes are available for a 2-node replica: "
        "2 fit but none can lead: no second free port for the master (ib-a)."
    )


def test_master_port_offset() -> None:
    fleet = [node("gpu01", fabrics=["ib-a"]), node("gpu02", fabrics=["ib-a"])]
    current = [single("gpu01", "pin-r0", (), port=8010)]
    models = [attrs.evolve(BIG, master_port_offset=10), ModelSpec("pin", 1, 0)]
    leader = place(models, fleet, current).for_model("big")[0].shards[0]
    # 8000 + 10 is taken by pin, so the leader takes 8001 and 8011.
    assert (leader.node_id, leader.port, leader.master_port) == ("gpu01", 8001, 8011)


def test_multi_node_replicas_on_unreachable_nodes_are_kept_and_on_lost_ones_moved() -> None:
    fleet = [node(f"gpu0{i}", fabrics=["ib-a"]) for i in range(1, 5)]
    first = place([BIG], fleet, [])
    assert first.replicas[0].node_ids == ("gpu01", "gpu02")
    fleet[1] = attrs.evolve(fleet[1], state="unreachable")
    assert place([BIG], fleet, first.replicas).replicas == first.replicas
    fleet[1] = attrs.evolve(fleet[1], state="lost")
    assert place([BIG], fleet, first.replicas).replicas[0].node_ids == ("gpu01", "gpu03")


def test_a_multi_node_placement_whose_node_left_the_fabric_is_placed_again() -> None:
    fleet = [node(f"gpu0{i}", fabrics=["ib-a"]) for i in range(1, 4)]
    first = place([BIG], fleet, [])
    fleet[1] = attrs.evolve(fleet[1], fabrics=frozenset({"ib-b"}))
    assert place([BIG], fleet, first.replicas).replicas[0].node_ids == ("gpu01", "gpu03")


def test_an_adopted_multi_node_placement_without_a_fabric_gets_the_shared_one() -> None:
    fleet = [
        node("gpu01", fabrics=["ib-b", "ib-c"]),
        node("gpu02", fabrics=["ib-a", "ib-b", "ib-c"]),
        node("gpu03", fabrics=["ib-a"]),
    ]
    adopted = attrs.evolve(place([BIG], fleet[:2], []).replicas[0], fabric="")
    plan = place([BIG], fleet, [adopted])
    assert plan.replicas == (attrs.evolve(adopted, fabric="ib-b"),)
    # Nodes that share no fabric cannot be adopted: the replica is placed again, on one fabric.
    fleet[1] = attrs.evolve(fleet[1], fabrics=frozenset({"ib-a"}))
    assert place([BIG], fleet, [adopted]).replicas[0].node_ids == ("gpu02", "gpu03")


def test_a_node_on_no_fabric_is_named_in_the_summary() -> None:
    (why,) = place([BIG], [node("gpu01"), node("gpu02", fabrics=["ib-a"])], []).unplaced
    assert "2 fit but share no fabric (gpu01: no fabric, gpu02: ib-a)" in why.reason
    assert why.per_node["gpu01"] == "fits, but is attached to no fabric"


def test_scale_smoke_1000_nodes_200_models() -> None:
    """Not a timing test (timings live in the benchmark): only that a fleet of this size goes through."""
    fleet = [
        node(
            f"n{i:04d}",
            (0, 4, 8)[i % 3],
            fabrics=[f"ib-{i % 4}"],
            labels={"zone": "abc"[i % 3]},
            state="unreachable" if i % 17 == 0 else "ready",
            nvlink=[range(4), range(4, 8)] if i % 2 else ALL,
        )
        for i in range(1000)
    ]
    models = [
        ModelSpec(
            f"m{j:03d}",
            replicas=1 + j % 3,
            gpus_per_shard=(0, 1, 2, 4, 8)[j % 5],
            nodes_per_replica=2 if j % 7 == 0 else 1,
            selector={"zone": "abc"[j % 3]} if j % 4 == 0 else {},
        )
        for j in range(200)
    ]
    plan = place(models, fleet, [])
    assert len(plan.replicas) + len(plan.unplaced) == sum(m.replicas for m in models)
    assert place(models, fleet, plan.replicas).replicas == plan.replicas


# --- properties --------------------------------------------------------------------------------------

FABRICS = ("ib-a", "ib-b", "ib-c")
MEMORIES = (24576, 40960, 81920)
CAPABILITIES = ((7, 5), (8, 0), (9, 0))

# Strategies built once: hypothesis spends most of these tests drawing data, so draws are kept few.
gpu_counts = st.sampled_from((0, 1, 2, 4, 8))
topologies = st.sampled_from(("all", "islands", "none", "random"))
states = st.sampled_from(("ready", "ready", "ready", "unreachable", "lost", "joining"))
label_sets = st.sampled_from(({}, {"zone": "a"}, {"zone": "b"}, {"zone": "a", "tier": "a"}, {"tier": "b"}))
fabric_sets = st.sampled_from((frozenset(), *(frozenset({f}) for f in FABRICS), frozenset({"ib-a", "ib-b"})))
# Mostly homogeneous nodes, some with two kinds of GPU (alternating by index).
memory_mixes = st.sampled_from(((81920,), (40960,), (24576,), (40960, 81920), (24576, 81920)))
capability_mixes = st.sampled_from((((9, 0),), ((8, 0),), ((7, 5),), ((8, 0), (9, 0)), ((7, 5), (8, 0))))
graph_seeds = st.integers(0, 255)
drains = st.sampled_from((False, False, False, True))
port_ranges = st.sampled_from(((8000, 7999), (8000, 8000), (8000, 8001), (8000, 8003), (9000, 9004)))


def gpu_list(
    count: int, topology: str, memories: Sequence[int], caps: Sequence[tuple[int, int]], seed: int
) -> tuple[GpuView, ...]:
    out = []
    for g in range(count):
        if topology == "all":
            peers = frozenset(range(count)) - {g}
        elif topology == "islands":
            half = max(1, count // 2)
            peers = frozenset(range(g // half * half, g // half * half + half)) - {g}
        elif topology == "random":
            # A reproducible pseudo-random graph from one drawn seed, instead of a draw per GPU.
            peers = frozenset(h for h in range(count) if (seed >> ((g * count + h) % 8)) & 1)
        else:
            peers = frozenset()
        out.append(GpuView(g, memories[g % len(memories)], caps[g % len(caps)], peers))
    return tuple(out)


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    out = []
    for i in range(draw(st.integers(0, 8))):
        gpus_ = gpu_list(
            draw(gpu_counts), draw(topologies), draw(memory_mixes), draw(capability_mixes), draw(graph_seeds)
        )
        out.append(
            NodeView(
                node_id=f"n{i}",
                state=draw(states),
                gpus=gpus_,
                labels=draw(label_sets),
                fabrics=draw(fabric_sets),
                mgmt_addr=f"10.0.0.{i}",
                port_range=draw(port_ranges),
                draining=draw(drains),
                cordoned=draw(drains),
                held_gpus=draw(st.frozensets(st.integers(0, 8), max_size=3)),
                held_ports=draw(st.frozensets(st.integers(7999, 8005), max_size=2)),
                engines=draw(engine_reports),
            )
        )
    return out


#: What agents report: nothing (an older agent), vllm at some version, or vllm missing.
engine_reports = st.sampled_from(
    (
        {},
        {"vllm": EngineView("0.17.1")},
        {"vllm": EngineView("0.18.0")},
        {"vllm": EngineView("0.33.0")},
        {"vllm": EngineView(error="vllm: command not found")},
    )
)
engine_constraints = st.sampled_from(("", "", ">=0.18", "<0.18", ">=0.18,<0.33"))

model_names = st.lists(st.sampled_from(("a", "b", "c", "d", "e", "a-r1")), unique=True, max_size=5)
selectors = st.sampled_from(({}, {}, {"zone": "a"}, {"tier": "b"}))
memory_minimums = st.sampled_from((0, *MEMORIES))
capability_minimums = st.sampled_from(((0, 0), *CAPABILITIES))
shard_sizes = st.sampled_from((0, 1, 2, 3, 4, 8))
replica_sizes = st.sampled_from((1, 1, 2, 3))
offsets = st.sampled_from((0, 0, 1, 3))
replica_counts = st.integers(0, 4)


@st.composite
def catalogs(draw: st.DrawFn) -> list[ModelSpec]:
    return [
        ModelSpec(
            name,
            replicas=draw(replica_counts),
            gpus_per_shard=draw(shard_sizes),
            min_gpu_memory_mib=draw(memory_minimums),
            min_compute_capability=draw(capability_minimums),
            selector=draw(selectors),
            nodes_per_replica=draw(replica_sizes),
            master_port_offset=draw(offsets),
            engine="vllm",
            engine_version=draw(engine_constraints),
        )
        for name in draw(model_names)
    ]


@st.composite
def garbage(draw: st.DrawFn, fleet: list[NodeView], models: list[ModelSpec]) -> list[ReplicaPlacement]:
    """Arbitrary current placements, mostly invalid or conflicting, to test what `_keep` lets through."""
    if not fleet or not models:
        return []
    out = []
    for _ in range(draw(st.integers(0, 6))):
        model = draw(st.sampled_from(models))
        n = draw(st.sampled_from((1, model.nodes_per_replica)))
        rid = f"{model.name}-r{draw(st.integers(0, 4))}"
        shards = tuple(
            ShardAssignment(
                f"{rid}-s{rank}",
                draw(st.sampled_from(fleet)).node_id,
                tuple(
                    draw(
                        st.lists(
                            st.integers(0, 8), min_size=model.gpus_per_shard, max_size=model.gpus_per_shard
                        )
                    )
                ),
                draw(st.integers(7999, 8005)),
                node_rank=rank,
                nnodes=n,
                master_addr="x",
                master_port=draw(st.integers(7999, 8005)),
            )
            for rank in range(n)
        )
        out.append(ReplicaPlacement(model.name, rid, shards, fabric=draw(st.sampled_from(("", *FABRICS)))))
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[ModelSpec], list[NodeView], list[ReplicaPlacement]]:
    """A catalog, a fleet, and a `current` that is either a previous plan (on a perturbed fleet, for a
    perturbed catalog) or garbage."""
    models = draw(catalogs())
    fleet = draw(fleets())
    kind = draw(st.sampled_from(("none", "previous", "garbage")))
    if kind == "previous":
        before = [
            attrs.evolve(
                n,
                state=draw(st.sampled_from(("ready", n.state))),
                draining=n.draining and draw(st.booleans()),
            )
            for n in fleet
        ]
        before_models = [attrs.evolve(m, replicas=draw(st.integers(0, 4))) for m in models]
        return models, fleet, list(place(before_models, before, []).replicas)
    if kind == "garbage":
        return models, fleet, draw(garbage(fleet, models))
    return models, fleet, []


def check_invariants(
    models: list[ModelSpec], fleet: list[NodeView], current: list[ReplicaPlacement], plan: Plan
) -> None:
    nodes = {n.node_id: n for n in fleet}
    specs = {m.name: m for m in models}
    gpus_used: set[tuple[str, int]] = set()
    ports_used: set[tuple[str, int]] = set()
    # Kept placements are compared without the fabric, the one field `place` may fill in.
    kept = {(r.replica_id, r.shards) for r in current}
    for replica in plan.replicas:
        spec = specs[replica.model]
        assert len(replica.shards) == spec.nodes_per_replica
        node_ids = [s.node_id for s in replica.shards]
        assert len(set(node_ids)) == len(node_ids), "a multi-node replica's nodes are distinct"
        for rank, shard in enumerate(replica.shards):
            n = nodes[shard.node_id]
            assert n.state != "lost"
            assert len(shard.gpu_indices) == spec.gpus_per_shard
            for g in shard.gpu_indices:
                assert (n.node_id, g) not in gpus_used, f"GPU {g} on {n.node_id} used twice"
                gpus_used.add((n.node_id, g))
            ports = [shard.port]
            if spec.nodes_per_replica > 1:
                assert replica.fabric in n.fabrics, "never split across fabrics"
                assert shard.nnodes == spec.nodes_per_replica
                if shard.node_rank == 0:
                    ports.append(shard.master_port)
                    assert shard.master_addr == n.mgmt_addr
            for port in ports:
                assert n.port_range[0] <= port <= n.port_range[1]
                assert (n.node_id, port) not in ports_used, f"port {port} on {n.node_id} used twice"
                ports_used.add((n.node_id, port))
            assert SHARD_ID.fullmatch(shard.shard_id)
            if (replica.replica_id, replica.shards) not in kept:
                assert rank == shard.node_rank
                assert n.state == "ready" and not n.draining and not n.cordoned
                assert shard.shard_id == shard_id(
                    replica.replica_id, rank, shard.node_id, shard.gpu_indices, shard.port
                )
                assert not set(shard.gpu_indices) & n.held_gpus, "a held GPU given to a new placement"
                assert not set(ports) & n.held_ports, "a held port given to a new placement"
                assert all(n.labels.get(k) == v for k, v in spec.selector.items())
                assert not engine_version_problem(spec.engine, spec.engine_version, n.engines)
                by_index = {g.index: g for g in n.gpus}
                for g in shard.gpu_indices:
                    assert by_index[g].memory_total_mib >= spec.min_gpu_memory_mib
                    assert by_index[g].compute_capability >= spec.min_compute_capability
        if spec.nodes_per_replica > 1:
            leader = replica.shards[0]
            assert all(
                (s.master_addr, s.master_port) == (leader.master_addr, leader.master_port)
                for s in replica.shards
            )
    wanted = [f"{m.name}-r{i}" for m in sorted(models, key=lambda m: m.name) for i in range(m.replicas)]
    got = [r.replica_id for r in plan.replicas] + [u.replica_id for u in plan.unplaced]
    assert sorted(got) == sorted(wanted), "every replica is placed or unplaced, exactly once"
    for why in plan.unplaced:
        assert set(why.per_node) == set(nodes)
        assert why.reason.startswith(f"0/{len(nodes)} nodes are available")


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_property_invariants(
    scenario: tuple[list[ModelSpec], list[NodeView], list[ReplicaPlacement]],
) -> None:
    models, fleet, current = scenario
    check_invariants(models, fleet, current, place(models, fleet, current))


@PROPERTY
@given(scenarios(), st.randoms(use_true_random=False))
def test_property_deterministic_and_stable(
    scenario: tuple[list[ModelSpec], list[NodeView], list[ReplicaPlacement]], rng: random.Random
) -> None:
    """Same input, same plan, whatever the order of models and nodes; and a plan fed back as `current`
    is a fixed point (one property test, so hypothesis generates each scenario once)."""
    models, fleet, current = scenario
    first = place(models, fleet, current)
    assert place(models, fleet, current) == first
    shuffled_models, shuffled_fleet = list(models), list(fleet)
    rng.shuffle(shuffled_models)
    rng.shuffle(shuffled_fleet)
    assert place(shuffled_models, shuffled_fleet, current) == first

    second = place(models, fleet, first.replicas)
    assert second.replicas == first.replicas
    assert [u.replica_id for u in second.unplaced] == [u.replica_id for u in first.unplaced]
