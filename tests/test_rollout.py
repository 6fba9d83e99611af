"""Rolling change of a model (control/rollout.py): the pure decisions, placement's part, and end to
end with a real control plane, a sim agent and the openai client through the embedded router."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest

import schema
from control.config import ConfigError, ModelConfig, ProfileConfig, RolloutConfig, parse
from control.placement import GpuView, ModelSpec, NodeView, ReplicaPlacement, place
from control.rollout import (
    Phase,
    ReplicaView,
    RolloutGoal,
    Rollouts,
    decide,
    revision,
    spec_matches,
    status_of,
)
from tests.fleet_procs import Agent, ControlProcess, free_port, pid_alive, poll, sim_processes

OLD, NEW = "aaaaaaaaaa", "bbbbbbbbbb"


def view(rid: str, rev: str = OLD, ready: bool = True, failure: str = "") -> ReplicaView:
    return ReplicaView(rid, rev, ready, failure)


def model(**kw: object) -> ModelConfig:
    profile = kw.pop("profile", ProfileConfig(engine="vllm", model="m"))
    return ModelConfig(name="chat", profile=profile, **kw)  # type: ignore[arg-type]


# -- the revision ---------------------------------------------------------------------------------


def test_the_revision_changes_with_the_template_not_with_the_count_or_the_rollout_settings() -> None:
    base = model()
    rev = revision(base)
    assert len(rev) == 10 and rev == revision(model())
    assert revision(attrs.evolve(base, replicas=5)) == rev
    assert revision(attrs.evolve(base, rollout=RolloutConfig(max_surge=2))) == rev
    assert revision(attrs.evolve(base, ready_timeout=30)) == rev
    changed = [
        attrs.evolve(base, profile=ProfileConfig(engine="vllm", model="m", dtype="bfloat16")),
        attrs.evolve(base, profile=ProfileConfig(engine="vllm", model="m", env={"A": "1"})),
        attrs.evolve(base, gpus=attrs.evolve(base.gpus, count=2)),
        attrs.evolve(base, selector={"zone": "a"}),
        attrs.evolve(base, nodes_per_replica=2),
    ]
    revs = {revision(m) for m in changed}
    assert rev not in revs and len(revs) == len(changed)


def test_a_running_spec_is_judged_against_the_template() -> None:
    m = model()
    profile = schema.EngineProfile(engine="vllm", model="m", served_model_name="chat")
    spec = schema.StartShard(profile=profile, gpu_indices=[], nnodes=1)
    assert spec_matches(m, profile, spec)
    other = schema.EngineProfile(engine="vllm", model="m", served_model_name="chat", dtype="half")
    assert not spec_matches(m, other, spec)
    assert not spec_matches(attrs.evolve(m, gpus=attrs.evolve(m.gpus, count=1)), profile, spec)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("max_surge = -1", "models[0].rollout.max_surge must be >= 0, got -1"),
        ("max_unavailable = -2", "models[0].rollout.max_unavailable must be >= 0, got -2"),
        ("max_surge = 0", "max_surge and max_unavailable are both 0"),
    ],
)
def test_rollout_settings_are_checked_naming_the_key(table: str, message: str) -> None:
    text = (
        f'[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n[models.rollout]\n{table}\n'
    )
    with pytest.raises(ConfigError) as err:
        parse(text, "llmgw.toml")
    assert message in str(err.value) and "llmgw.toml line" in str(err.value)
    ok = parse(text.replace(table, "max_surge = 0\nmax_unavailable = 1"), "llmgw.toml")
    assert ok.models[0].rollout == RolloutConfig(max_surge=0, max_unavailable=1)


# -- the decisions ----------------------------------------------------------------------------------


def test_surge_one_unavailable_zero_adds_a_new_replica_and_drains_an_old_one_only_once_it_is_ready() -> None:
    t = RolloutGoal("chat", 2, NEW, max_surge=1, max_unavailable=0)
    old = [view("chat-r0"), view("chat-r1")]
    # Step 1: one new replica beside the two old ones (index 2: r0 and r1 are taken).
    d = decide(t, old)
    assert (d.old, d.new, d.retired) == (("chat-r0", "chat-r1"), ("chat-r2",), ())
    # While it loads nothing changes: no old replica may go, no second new one may come.
    d = decide(t, [*old, view("chat-r2", NEW, ready=False)])
    assert (d.old, d.new, d.retired) == (("chat-r0", "chat-r1"), ("chat-r2",), ())
    # Ready: the highest old one is retired and the next new one added in the same step.
    d = decide(t, [*old, view("chat-r2", NEW)])
    assert (d.old, d.new, d.retired) == (("chat-r0",), ("chat-r2", "chat-r3"), ("chat-r1",))
    d = decide(t, [old[0], view("chat-r2", NEW), view("chat-r3", NEW, ready=False)])
    assert (d.old, d.new, d.retired) == (("chat-r0",), ("chat-r2", "chat-r3"), ())
    d = decide(t, [old[0], view("chat-r2", NEW), view("chat-r3", NEW)])
    assert (d.old, d.new, d.retired) == ((), ("chat-r2", "chat-r3"), ("chat-r0",))
    # Done: the steady state keeps what it has.
    d = decide(t, [view("chat-r2", NEW), view("chat-r3", NEW)])
    assert (d.old, d.new, d.retired) == ((), ("chat-r2", "chat-r3"), ())


def test_every_step_keeps_the_ready_count_and_the_total_within_bounds() -> None:
    """Simulate a rollout where each wanted new replica becomes ready one pass after it is added."""
    for n, surge, unavailable in [
        (1, 1, 0),
        (2, 1, 0),
        (3, 1, 0),
        (3, 2, 0),
        (3, 0, 1),
        (3, 1, 1),
        (4, 2, 2),
    ]:
        t = RolloutGoal("m", n, NEW, surge, unavailable)
        placed = {f"m-r{i}": view(f"m-r{i}") for i in range(n)}
        for _ in range(4 * n + 4):
            d = decide(t, list(placed.values()))
            assert len(d.wanted) <= n + surge
            for rid in d.retired:
                del placed[rid]
            assert sum(r.ready for r in placed.values()) >= n - unavailable, (n, surge, unavailable)
            # A replica placed last pass is ready now; those wanted now are placed (loading).
            placed = {rid: attrs.evolve(r, ready=True) for rid, r in placed.items()}
            for rid in d.new:
                placed.setdefault(rid, view(rid, NEW, ready=False))
        assert all(r.revision == NEW and r.ready for r in placed.values()) and len(placed) == n


def test_new_ids_skip_those_agents_still_report() -> None:
    t = RolloutGoal("chat", 1, NEW)
    d = decide(t, [view("chat-r0")], taken=["chat-r0", "chat-r1", "chat-r3"])
    assert d.new == ("chat-r2",)
    assert decide(RolloutGoal("chat", 2, NEW), []).new == ("chat-r0", "chat-r1")


def test_unavailable_one_retires_an_old_replica_first() -> None:
    """No surge (a fleet without spare GPUs): an old replica goes, then its replacement comes."""
    t = RolloutGoal("chat", 2, NEW, max_surge=0, max_unavailable=1)
    old = [view("chat-r0"), view("chat-r1")]
    d = decide(t, old)
    assert (d.old, d.new, d.retired) == (("chat-r0",), ("chat-r2",), ("chat-r1",))
    d = decide(t, [old[0], view("chat-r2", NEW, ready=False)])
    assert (d.old, d.new, d.retired) == (("chat-r0",), ("chat-r2",), ())
    # (The agent still reports r1, draining or stopped: its id is not taken again.)
    d = decide(t, [old[0], view("chat-r2", NEW)], taken=["chat-r1"])
    assert (d.old, d.new, d.retired) == ((), ("chat-r2", "chat-r3"), ("chat-r0",))


def test_old_replicas_that_do_not_serve_go_first() -> None:
    t = RolloutGoal("chat", 2, NEW)
    d = decide(t, [view("chat-r0", ready=False), view("chat-r1"), view("chat-r2", NEW)])
    assert d.retired == ("chat-r0",) and d.old == ("chat-r1",)


def test_a_scale_down_drops_the_highest_or_the_unready() -> None:
    t = RolloutGoal("chat", 1, NEW)
    assert decide(t, [view("chat-r0", NEW), view("chat-r1", NEW)]).retired == ("chat-r1",)
    d = decide(t, [view("chat-r0", NEW, ready=False), view("chat-r1", NEW)])
    assert (d.new, d.retired) == (("chat-r1",), ("chat-r0",))
    # To zero (ctl delete): everything goes, old and new, a failed rollout or not.
    d = decide(RolloutGoal("chat", 0, NEW), [view("chat-r0"), view("chat-r1", NEW)], failure="x failed")
    assert d.wanted == () and set(d.retired) == {"chat-r0", "chat-r1"} and not d.failure


def test_a_failing_new_replica_stops_the_rollout_and_frees_its_gpus() -> None:
    t = RolloutGoal("chat", 2, NEW)
    old = [view("chat-r0"), view("chat-r1")]
    failing = view("chat-r2", NEW, ready=False, failure="chat-r2-s0-abcdef on gpu07 failed: exit 1")
    d = decide(t, [*old, failing])
    assert d.failure == failing.failure
    assert (d.old, d.new, d.retired, d.abandoned) == (("chat-r0", "chat-r1"), (), (), ("chat-r2",))
    # Remembered: the next pass adds nothing even with the failed replica gone.
    d = decide(t, old, failure=d.failure)
    assert (d.old, d.new, d.retired) == (("chat-r0", "chat-r1"), (), ())
    # A new replica that already serves stays; the old ones all stay.
    d = decide(t, [old[0], view("chat-r2", NEW), view("chat-r3", NEW, ready=False)], failure="f")
    assert (d.old, d.new, d.abandoned) == (("chat-r0",), ("chat-r2",), ("chat-r3",))


def test_the_memory_times_out_a_new_replica_and_forgets_the_failure_with_a_new_revision() -> None:
    rollouts = Rollouts()
    t = RolloutGoal("chat", 1, NEW)
    old = view("chat-r0")
    assert rollouts.decide(t, [old], ready_timeout=60, now=0).new == ("chat-r1",)
    loading = view("chat-r1", NEW, ready=False)
    assert not rollouts.decide(t, [old, loading], ready_timeout=60, now=10).failure
    d = rollouts.decide(t, [old, loading], ready_timeout=60, now=71)
    assert d.failure == "chat-r1 not ready within 60 s" and d.abandoned == ("chat-r1",)
    assert rollouts.failure("chat") == d.failure
    assert rollouts.decide(t, [old], ready_timeout=60, now=72).new == ()
    # The old definition applied back: the old replica is current again, and that is complete.
    back = RolloutGoal("chat", 1, OLD)
    d = rollouts.decide(back, [old], ready_timeout=60, now=73)
    assert (d.old, d.new, d.failure) == ((), ("chat-r0",), "")
    # The new one again: starts over, a fresh replica id.
    assert rollouts.decide(t, [old], ready_timeout=60, now=74, taken=["chat-r1"]).new == ("chat-r2",)


def test_status_words() -> None:
    t = RolloutGoal("chat", 2, NEW)
    s = status_of(t, [view("chat-r0"), view("chat-r1"), view("chat-r2", NEW, ready=False)], {}, generation=3)
    assert (s.phase, s.updated, s.updated_ready, s.ready, s.old, s.observed_generation) == (
        Phase.PROGRESSING, 1, 0, 2, 2, 3,
    )  # fmt: skip
    assert "waiting for chat-r2 to be ready" in s.reason
    s = status_of(t, [view("chat-r0"), view("chat-r1")], {"chat-r2": "0/1 nodes are available: 1 gpus."})
    assert s.reason.startswith("chat-r2 cannot be placed: 0/1 nodes are available")
    s = status_of(t, [view("chat-r0"), view("chat-r1")], {}, failure="chat-r2-s0-x on gpu07 failed: boom")
    assert s.phase is Phase.FAILED and "boom" in s.reason
    s = status_of(t, [view("chat-r2", NEW), view("chat-r3", NEW)], {})
    assert (s.phase, s.reason) == (Phase.COMPLETE, "")
    assert s.to_doc()["state"] == "complete" and s.to_doc()["updated_replicas"] == 2


def test_ctl_rollout_lines_read_like_kubectl() -> None:
    from control.ctl import rollout_line

    t = RolloutGoal("chat", 2, NEW)

    def line(placed: list[ReplicaView], unplaced: dict[str, str] | None = None, **kw: Any) -> tuple[str, str]:
        doc = status_of(t, placed, unplaced or {}, generation=2, **kw).to_doc(kw.pop("generation", 2))
        return rollout_line("chat", doc)

    old = [view("chat-r0"), view("chat-r1")]
    assert line([*old, view("chat-r2", NEW, ready=False)]) == (
        "Waiting for rollout to finish: 1 out of 2 new replicas have been updated...",
        "progressing",
    )
    waiting, _ = line(old, {"chat-r2": "0/1 nodes are available: 1 insufficient free GPUs."})
    assert waiting.endswith("(chat-r2 cannot be placed: 0/1 nodes are available: 1 insufficient free GPUs.)")
    assert line([old[0], view("chat-r2", NEW), view("chat-r3", NEW)])[0] == (
        "Waiting for rollout to finish: 1 old replicas are pending termination..."
    )
    assert line([view("chat-r2", NEW), view("chat-r3", NEW, ready=False)])[0] == (
        "Waiting for rollout to finish: 1 of 2 updated replicas are ready..."
    )
    assert line([view("chat-r2", NEW), view("chat-r3", NEW)]) == (
        "model/chat successfully rolled out",
        "complete",
    )
    assert line(old, failure="chat-r2-s0-x on gpu07 failed: boom") == (
        "error: model/chat rollout failed: chat-r2-s0-x on gpu07 failed: boom",
        "failed",
    )
    # Right after an apply the status is the last definition's: not complete until a pass acts on it.
    stale = status_of(t, [view("chat-r2", NEW), view("chat-r3", NEW)], {}, generation=2).to_doc(3)
    assert rollout_line("chat", stale) == (
        "Waiting for rollout to finish: generation 3 not acted on yet...",
        "progressing",
    )


def test_a_replica_is_judged_by_what_its_agent_reports() -> None:
    from control.fleet import Fleet
    from control.placement import ShardAssignment
    from control.rollout import observed_view, recovered

    m = model(gpus=attrs.evolve(model().gpus, count=1))
    profile = schema.EngineProfile(engine="vllm", model="m", served_model_name="chat")
    spec = schema.StartShard(shard_id="chat-r0-s0-aaaaaa", profile=profile, gpu_indices=[0], nnodes=1)
    fleet = Fleet(15, 300)
    st = schema.ShardStatus(
        shard_id="chat-r0-s0-aaaaaa", replica_id="chat-r0", state=schema.ShardState.READY, spec=spec
    )
    fleet.registered(schema.Register(node_id="gpu07", shards=[st]), now=0)
    placed = ReplicaPlacement("chat", "chat-r0", (ShardAssignment("chat-r0-s0-aaaaaa", "gpu07", (0,), 8000),))
    assert recovered(placed, fleet.nodes, m, profile, NEW).revision == NEW
    other = schema.EngineProfile(engine="vllm", model="m", served_model_name="chat", dtype="half")
    assert recovered(placed, fleet.nodes, m, other, NEW).revision == "unknown"  # old: rolled out
    unseen = ReplicaPlacement("chat", "chat-r1", (ShardAssignment("chat-r1-s0-bbbbbb", "gpu07", (1,), 8001),))
    assert recovered(unseen, fleet.nodes, m, other, NEW) == unseen  # not reported yet: not judged
    assert recovered(attrs.evolve(placed, revision=OLD), fleet.nodes, m, profile, NEW).revision == OLD
    assert observed_view(placed, fleet.nodes, lambda n, s: 0, NEW) == ReplicaView("chat-r0", NEW, True)
    failed = dataclasses.replace(
        st,
        state=schema.ShardState.FAILED,
        error="engine exited with code 1 while loading",
        output_tail=["loading", "OSError: weights not found\x1b[2J", ""],
    )
    fleet.shard_status("gpu07", failed)
    seen = observed_view(placed, fleet.nodes, lambda n, s: 1, NEW)
    assert not seen.ready and seen.failure == (
        "chat-r0-s0-aaaaaa on gpu07 failed: engine exited with code 1 while loading; "
        "its last output: OSError: weights not found\\x1b[2J"
    )


def test_a_draining_engine_gets_no_new_request_even_with_nothing_else_ready() -> None:
    """The router's table leaves DRAINING engines out: their agent stops them once their requests
    are done, which new ones would put off until the deadline cuts them. A READY engine no placement
    wants any more is still the fallback until it is drained."""
    from control.fleet import Fleet
    from control.placement import ShardAssignment
    from control.routetable import route_table

    m = model()

    def st(shard: str, rid: str, state: schema.ShardState, port: int) -> schema.ShardStatus:
        spec = schema.StartShard(
            shard_id=shard, replica_id=rid, http_port=port, profile=schema.EngineProfile()
        )
        return schema.ShardStatus(shard_id=shard, replica_id=rid, state=state, spec=spec)

    fleet = Fleet(15, 300)
    fleet.registered(
        schema.Register(
            node_id="gpu07",
            mgmt_addr="10.0.0.7",
            shards=[
                st("chat-r0-s0-aaaaaa", "chat-r0", schema.ShardState.DRAINING, 8000),
                st("chat-r1-s0-bbbbbb", "chat-r1", schema.ShardState.DRAINING, 8001),
            ],
        ),
        now=0,
    )
    placed = [ReplicaPlacement("chat", "chat-r0", (ShardAssignment("chat-r0-s0-aaaaaa", "gpu07", (), 8000),))]
    routes = route_table([m], placed, fleet.nodes)
    assert routes["chat"].upstreams == ()
    fleet.shard_status("gpu07", st("chat-r1-s0-bbbbbb", "chat-r1", schema.ShardState.READY, 8001))
    assert [u.url for u in route_table([m], placed, fleet.nodes)["chat"].upstreams] == [
        "http://10.0.0.7:8001"
    ]


# -- placement's part -------------------------------------------------------------------------------


def node(gpus: int, held: tuple[int, ...] = ()) -> NodeView:
    return NodeView(
        node_id="gpu07",
        state="ready",
        gpus=[GpuView(i, 81559, (9, 0)) for i in range(gpus)],
        labels={},
        fabrics=frozenset(),
        mgmt_addr="10.0.0.7",
        port_range=(8000, 8009),
        held_gpus=held,
    )


def test_placement_keeps_old_replicas_of_another_shape_and_puts_the_surge_on_free_gpus() -> None:
    one = ModelSpec(name="chat", replicas=2, gpus_per_shard=1, revision=OLD)
    plan = place([one], [node(4)])
    assert [r.revision for r in plan.replicas] == [OLD, OLD]
    used = {g for r in plan.replicas for s in r.shards for g in s.gpu_indices}
    # The change asks for 2 GPUs a replica: the old ones keep their single GPU, the new one gets two
    # of the free ones.
    two = ModelSpec(
        name="chat",
        replicas=2,
        gpus_per_shard=2,
        revision=NEW,
        replica_ids=("chat-r0", "chat-r1", "chat-r2"),
        retained=frozenset({"chat-r0", "chat-r1"}),
    )
    plan2 = place([two], [node(4)], plan.replicas)
    assert plan2.replicas[:2] == plan.replicas
    new = plan2.replica("chat-r2")
    assert new is not None and new.revision == NEW
    assert len(new.shards[0].gpu_indices) == 2 and not used & set(new.shards[0].gpu_indices)
    # No free GPUs (a third one held by an engine that still runs): the surge waits, with the reason.
    plan3 = place([two], [node(4, held=(2,))], plan.replicas)
    assert plan3.replica("chat-r2") is None
    why = plan3.why("chat-r2")
    assert why is not None and "insufficient free GPUs (need 2, have 1 free)" in why.reason
    # A retained replica that cannot stay (its node's GPU is gone) is not placed anew.
    smaller = ModelSpec(name="chat", replicas=2, gpus_per_shard=2, revision=NEW, replica_ids=("chat-r1",))
    moved = [attrs.evolve(r, shards=(attrs.evolve(r.shards[0], gpu_indices=(9,)),)) for r in plan.replicas]
    kept = place([attrs.evolve(smaller, retained=frozenset({"chat-r1"}))], [node(4)], moved)
    assert kept.replicas == () and kept.unplaced == ()


def test_a_placement_without_a_revision_reads_back_from_an_old_state_file() -> None:
    from control.state import parse_state, state_doc

    placement = ReplicaPlacement("m", "m-r0", ())
    import json

    doc = json.dumps(state_doc({}, [placement], []))
    assert "revision" not in doc
    assert parse_state(doc).placements == (placement,)
    with_rev = attrs.evolve(placement, revision=NEW)
    assert parse_state(json.dumps(state_doc({}, [with_rev], []))).placements == (with_rev,)


# -- end to end: a real control plane, a sim agent with 4 GPUs, the openai client ---------------------


@attrs.define
class Outcome:
    ok: bool
    error: str = ""


def _config(tmp: Path, ports: str) -> str:
    return f"""
state_dir = "{tmp / "cp" / "state"}"
reconcile_interval = 0.3
backoff_initial = 0.5
stop_grace = 3
drain_deadline = 10
[listen]
agents = "127.0.0.1:{free_port()}"
api = "127.0.0.1:0"
router = "127.0.0.1:0"
[engines]
ports = "{ports}"
"""


def _model(name: str, itl_ms: int = 5, fail: str = "", gpus: int = 1, rollout: str = "") -> str:
    env = f'LLMGW_SIM_LOAD_SECONDS = "1", LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "{itl_ms}"'
    if fail:
        env += f', LLMGW_SIM_FAIL_LOADING = "{fail}"'
    return f"""
[[models]]
name = "{name}"
replicas = 2
ready_timeout = 60
[models.gpus]
count = {gpus}
[models.profile]
engine = "vllm"
model = "meta-llama/Llama-3.1-8B-Instruct"
served_model_name = "{name}"
tensor_parallel_size = {gpus}
env = {{ {env} }}
{f"[models.rollout]{chr(10)}{rollout}" if rollout else ""}
"""


@contextlib.contextmanager
def _one_node(tmp: Path, name: str, ports: str, gpus: int = 1) -> Iterator[ControlProcess]:
    """A control plane running ``name`` (2 replicas of ``gpus`` GPUs each) and one sim agent with 4
    GPUs: room for a surge replica of one GPU, none for one of two."""
    cp = ControlProcess(tmp / "cp", _config(tmp, ports) + _model(name, gpus=gpus))
    agent = None
    try:
        cp.start()
        agent = Agent(
            tmp / "agents",
            "gpu07",
            f"http://127.0.0.1:{cp.agent_port}",
            "h100x4.toml",
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", ports),
        )
        agent.start()
        yield cp
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()
        for pid in sim_processes(name):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _ready(cp: ControlProcess, name: str) -> list[dict[str, Any]]:
    return [r for r in cp.api("/api/replicas") if r["model"] == name and r["state"] == "ready"]


def _rollout(cp: ControlProcess, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = cp.api(f"/api/models/{name}")["rollout"]
    return doc


def _load(router: int, model: str, stop: threading.Event, out: list[Outcome]) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router}/v1", api_key="none", timeout=30, max_retries=0
    )
    while not stop.is_set():
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "tell me about rollouts"}],
                stream=True,
                max_tokens=24,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            out.append(Outcome(bool(text), "" if text else "empty answer"))
        except openai.OpenAIError as exc:
            out.append(Outcome(False, f"{type(exc).__name__}: {exc}"))


def _apply(cp: ControlProcess, tmp: Path, text: str) -> None:
    path = tmp / "model.toml"
    path.write_text(text)
    out = cp.ctl("apply", "-f", str(path))
    assert out.returncode == 0, out


def test_a_rolling_change_under_streaming_load_fails_no_request(tmp_path: Path) -> None:
    """A change of the profile replaces both replicas one at a time under streaming load through
    the embedded router: no request fails, at no sample are fewer than 2 replicas ready, and in the
    end both are of the new revision and the old engines are gone."""
    name = f"roll-{os.getpid()}"
    with _one_node(tmp_path, name, "26200-26249") as cp:
        old = poll("2 ready replicas", lambda: r if len(r := _ready(cp, name)) == 2 else None, timeout=60)
        old_pids = [s["pid"] for r in old for s in r["shards"]]
        old_ids = sorted(r["replica_id"] for r in old)
        before = poll(
            "the rollout complete", lambda: d if (d := _rollout(cp, name))["state"] == "complete" else None
        )
        stop, outcomes, samples = threading.Event(), list[Outcome](), list[int]()

        def sample() -> None:
            while not stop.is_set():
                samples.append(len(_ready(cp, name)))

        threads = [
            threading.Thread(target=_load, args=(cp.router_port, name, stop, outcomes)) for _ in range(4)
        ]
        threads.append(threading.Thread(target=sample))
        for t in threads:
            t.start()
        try:
            poll("requests flowing", lambda: sum(o.ok for o in outcomes) >= 8, timeout=30)
            began = time.monotonic()
            _apply(cp, tmp_path, _model(name, itl_ms=6))
            out = cp.ctl("rollout", "status", name, "--wait", "--timeout", "120")
            took = time.monotonic() - began
            assert out.returncode == 0, out
            assert out.stdout.splitlines()[-1] == f"model/{name} successfully rolled out", out.stdout
            assert "Waiting for rollout to finish:" in out.stdout, out.stdout
            # The old engines drain and stop; load goes on a little on the new ones alone.
            poll("the old engines gone", lambda: not any(pid_alive(p) for p in old_pids), timeout=60)
            after = len(outcomes)
            poll("more requests after", lambda: sum(o.ok for o in outcomes[after:]) >= 8, timeout=30)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        failed = [o for o in outcomes if not o.ok]
        print(f"\nrollout of 2 replicas (engines loading 1 s) complete {took:.1f} s after the apply; "
              f"{len(outcomes)} streamed requests during it, {len(failed)} failed; "
              f"ready replicas sampled {len(samples)} times, fewest {min(samples)}")  # fmt: skip
        assert not failed, failed[:3]
        assert samples and min(samples) >= 2, samples
        done = _rollout(cp, name)
        assert done["state"] == "complete" and done["revision"] != before["revision"]
        assert (done["updated_replicas"], done["ready_replicas"], done["old_replicas"]) == (2, 2, 0)
        new = _ready(cp, name)
        assert len(new) == 2 and not {r["replica_id"] for r in new} & set(old_ids), new
        assert len(sim_processes(name)) == 2
        # A control plane killed and started again knows each replica's revision (the state file):
        # it rolls nothing out again and restarts no engine.
        pids = sorted(s["pid"] for r in new for s in r["shards"])
        cp.kill9()
        cp.start()
        # (Progressing until the agent has reported its engines ready again.)
        again = poll(
            "the rollout complete after a restart",
            lambda: d if (d := _rollout(cp, name)) and d["state"] == "complete" else None,
            timeout=30,
        )
        assert again["revision"] == done["revision"] and again["updated_replicas"] == 2, again
        poll("2 ready replicas again", lambda: len(_ready(cp, name)) == 2 or None, timeout=30)
        assert sorted(s["pid"] for r in _ready(cp, name) for s in r["shards"]) == pids
        assert sorted(sim_processes(name)) == pids


def test_a_rollout_whose_new_replica_cannot_start_stops_and_the_old_ones_serve(tmp_path: Path) -> None:
    """The new profile's engine fails while loading: the rollout stops as failed naming the shard
    and the error, `ctl rollout status --wait` exits 1, the old replicas keep serving and the failed
    one's GPU is freed; applying the old definition back completes at once."""
    name = f"fail-{os.getpid()}"
    with _one_node(tmp_path, name, "26250-26299") as cp:
        old = poll("2 ready replicas", lambda: r if len(r := _ready(cp, name)) == 2 else None, timeout=60)
        old_pids = sorted(s["pid"] for r in old for s in r["shards"])
        _apply(cp, tmp_path, _model(name, fail="weights not found: simulated"))
        out = cp.ctl("rollout", "status", name, "--wait", "--timeout", "60")
        assert out.returncode == 1, out
        assert f"error: model/{name} rollout failed:" in out.stderr, out.stderr
        assert "weights not found: simulated" in out.stderr, out.stderr
        failed = _rollout(cp, name)
        assert failed["state"] == "failed" and f"{name}-r2-s0-" in failed["reason"], failed
        assert "weights not found: simulated" in failed["reason"], failed
        # The old replicas serve, with the same engines; the failed replica is given up (its GPU freed).
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="none", max_retries=0
        )
        for _ in range(4):
            answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content
        assert sorted(s["pid"] for r in _ready(cp, name) for s in r["shards"]) == old_pids
        poll(
            "only the old replicas placed",
            lambda: (
                sorted(
                    r["replica_id"]
                    for r in cp.api("/api/replicas")
                    if r["model"] == name and r["shards"][0]["placed"]
                )
                == sorted(r["replica_id"] for r in old)
            ),
        )
        assert _rollout(cp, name)["state"] == "failed"  # and it stays so: nothing new is tried
        as_json = cp.ctl("rollout", "status", name, "-o", "json")
        assert as_json.returncode == 1 and json.loads(as_json.stdout)["state"] == "failed", as_json
        unknown = cp.ctl("rollout", "status", f"nope-{name}")
        assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr and name in unknown.stderr, unknown
        described = cp.ctl("describe", "model", name)
        assert (
            described.returncode == 0
            and f"rollout of revision {failed['revision']} failed" in described.stdout
        )
        # The old definition back: the old replicas are current again, and that is complete.
        _apply(cp, tmp_path, _model(name))
        out = cp.ctl("rollout", "status", name, "--wait", "--timeout", "30")
        assert out.returncode == 0 and out.stdout.strip().endswith("successfully rolled out"), out
        assert sorted(s["pid"] for r in _ready(cp, name) for s in r["shards"]) == old_pids


def test_without_spare_gpus_the_surge_waits_and_max_unavailable_one_goes_on(tmp_path: Path) -> None:
    """Both replicas fill the node's 4 GPUs: with the defaults the new replica cannot be placed and
    the status says why (old ones untouched); max_unavailable = 1, max_surge = 0 retires an old
    replica first and the rollout completes, never below 1 ready replica."""
    name = f"full-{os.getpid()}"
    with _one_node(tmp_path, name, "26300-26349", gpus=2) as cp:
        old = poll("2 ready replicas", lambda: r if len(r := _ready(cp, name)) == 2 else None, timeout=60)
        old_pids = sorted(s["pid"] for r in old for s in r["shards"])
        _apply(cp, tmp_path, _model(name, itl_ms=6, gpus=2))

        def waiting() -> str | None:
            out = cp.ctl("rollout", "status", name)
            return out.stdout if out.returncode == 0 and "cannot be placed" in out.stdout else None

        line = poll("the rollout waiting for GPUs", waiting, timeout=30)
        assert "insufficient free GPUs (need 2, have 0 free)" in line, line
        assert line.startswith("Waiting for rollout to finish: 0 out of 2 new replicas have been updated")
        assert sorted(s["pid"] for r in _ready(cp, name) for s in r["shards"]) == old_pids
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(len(_ready(cp, name)))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            _apply(cp, tmp_path, _model(name, itl_ms=6, gpus=2, rollout="max_surge = 0\nmax_unavailable = 1"))
            out = cp.ctl("rollout", "status", name, "--wait", "--timeout", "120")
        finally:
            stop.set()
            sampler.join(30)
        assert (
            out.returncode == 0 and out.stdout.splitlines()[-1] == f"model/{name} successfully rolled out"
        ), out
        assert samples and min(samples) >= 1, samples
        poll("the old engines gone", lambda: not any(pid_alive(p) for p in old_pids), timeout=60)
        assert len(_ready(cp, name)) == 2


@pytest.mark.chaos
def test_a_control_plane_killed_mid_rollout_finishes_it_with_one_engine_per_replica(tmp_path: Path) -> None:
    """kill -9 while the surge replica loads: the restarted control plane knows which replicas are
    new (the state file), starts nothing twice, finishes the rollout and leaves two engines."""
    name = f"mid-{os.getpid()}"
    with _one_node(tmp_path, name, "26350-26399") as cp:
        old = poll("2 ready replicas", lambda: r if len(r := _ready(cp, name)) == 2 else None, timeout=60)
        old_pids = sorted(s["pid"] for r in old for s in r["shards"])
        _apply(
            cp,
            tmp_path,
            _model(name, itl_ms=6).replace('LLMGW_SIM_LOAD_SECONDS = "1"', 'LLMGW_SIM_LOAD_SECONDS = "3"'),
        )
        poll(
            "the surge replica loading",
            lambda: (
                ((d := _rollout(cp, name))["updated_replicas"] == 1 and d["updated_ready_replicas"] == 0)
                or None
            ),
            timeout=30,
        )
        cp.kill9()
        cp.start()
        out = cp.ctl("rollout", "status", name, "--wait", "--timeout", "120")
        assert (
            out.returncode == 0 and out.stdout.splitlines()[-1] == f"model/{name} successfully rolled out"
        ), out
        poll("the old engines gone", lambda: not any(pid_alive(p) for p in old_pids), timeout=60)
        new = _ready(cp, name)
        assert len(new) == 2 and sorted(sim_processes(name)) == sorted(
            s["pid"] for r in new for s in r["shards"]
        )
