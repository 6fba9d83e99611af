"""The state backends (control.statestore) against a real etcd: the etcd store holds what the file
holds, one key per object, and writes only what changed (heartbeats write nothing); fenced writes of
a deposed leader change nothing; the leader election (control.leader)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel

import schema
from control.catalog import Catalog
from control.config import ConfigError, parse
from control.etcd import EtcdClient, EtcdConfig, connect
from control.fleet import Cordon, Fleet
from control.leader import LEADER_KEY, campaign
from control.state import StateSaver, parse_state
from control.statestore import EtcdStore, NotLeader, doc_keys, keys_doc
from tests.etcdproc import Member

PREFIX = "/llmgw/"
MODELS = 'name = "m"\nreplicas = 2\n[models.profile]\nengine = "sim"\nmodel = "m"\n'


async def revision(client: EtcdClient) -> int:
    return (await client.get_prefix(b"/nothing-here/")).header.revision


def fleet_of(count: int) -> Fleet:
    fleet = Fleet(unreachable_after=15.0, lost_after=300.0)
    for i in range(count):
        fleet.registered(schema.Register(node_id=f"gpu{i:04d}", agent_version="1"), 0.0)
    return fleet


async def test_a_fleet_of_200_heartbeating_writes_nothing_and_a_cordon_writes_one_key(
    etcd: Member, tmp_path: Path
) -> None:
    fleet = fleet_of(200)
    catalog = Catalog()
    catalog.apply_file(parse(f"[[models]]\n{MODELS}").models)
    async with connect(EtcdConfig(endpoints=(etcd.endpoint,))) as client:
        store = EtcdStore(client, PREFIX)
        assert await store.load() is None
        saver = StateSaver(store)
        file_saver = StateSaver(tmp_path / "control-state.json")
        args = (fleet.nodes.values(), (), fleet.cordons, catalog)
        assert await saver.save(fleet.generation, *args)
        await file_saver.save(fleet.generation, *args)
        first = store.ops_sent
        assert first == 200 + 1 + 1  # a key per node, the model, the format key
        before, started = await revision(client), time.monotonic()
        for beat in range(1, 21):  # 20 rounds of 200 heartbeats, a save after each (as a reconcile pass)
            for node_id in fleet.nodes:
                fleet.heartbeat(node_id, schema.Heartbeat(), float(beat))
            await saver.save(fleet.generation, *args)
        took = time.monotonic() - started
        assert await revision(client) == before, "heartbeats wrote to etcd"
        print(f"etcd writes in {took:.2f} s of 4,000 heartbeats from 200 nodes: 0")
        fleet.cordon("gpu0007", Cordon.DRAINING)
        assert await saver.save(fleet.generation, *args)
        assert await revision(client) == before + 1 and store.ops_sent == first + 1  # one key, one txn
        await file_saver.save(fleet.generation, *args)

        # What etcd holds reads back as what the file holds.
        reloaded = await EtcdStore(client, PREFIX).load()
        assert reloaded == parse_state((tmp_path / "control-state.json").read_text())
        assert reloaded is not None and len(reloaded.registers) == 200
        assert reloaded.cordons == (("gpu0007", Cordon.DRAINING),)

        # A node gone is one delete.
        del fleet.nodes["gpu0100"]
        fleet.generation += 1
        assert await saver.save(fleet.generation, *args)
        assert (await client.get(f"{PREFIX}nodes/gpu0100".encode())) is None
        assert await revision(client) == before + 2


def test_the_key_layout_is_the_file_documents_per_entry() -> None:
    doc = {
        "nodes": {"n1": "CgJuMQ=="},
        "placements": [{"model": "m", "replica_id": "m-r0", "fabric": "", "shards": []}],
        "cordons": {"n1": "cordoned"},
        "catalog": [],
        "lost": {},
    }
    keys = doc_keys(doc)
    assert sorted(keys) == ["cordons/n1", "format", "nodes/n1", "placements/m/m-r0"]
    assert keys_doc(keys, PREFIX) == doc
    assert keys_doc({}, PREFIX) is None
    with pytest.raises(ValueError, match="/llmgw/placements/m/m-r0: not JSON"):
        keys_doc({**keys, "placements/m/m-r0": b"{"}, PREFIX)


async def test_only_the_leader_writes_and_a_deposed_one_changes_nothing(etcd: Member) -> None:
    async with connect(EtcdConfig(endpoints=(etcd.endpoint,))) as client:
        first_keeper = await client.keeper(5)
        led = await campaign(client, PREFIX, "cp-a", first_keeper)
        store = EtcdStore(client, PREFIX, led.fence)
        await store.load()
        await store.write_keys({"format": b'{"version":1}', "cordons/n1": b"cordoned"})
        second_keeper = await client.keeper(5)
        async with trio.open_nursery() as nursery:
            taken = trio.Event()

            async def standby() -> None:
                second = await campaign(client, PREFIX, "cp-b", second_keeper)
                assert second.epoch > led.epoch
                taken.set()

            nursery.start_soon(standby)
            await trio.lowlevel.checkpoint()
            leader = await client.get((PREFIX + LEADER_KEY).encode())
            assert leader is not None and leader.value == b"cp-a"
            await first_keeper.revoke()  # the first leader's lease lapses
            with trio.fail_after(10):
                await taken.wait()
        with pytest.raises(NotLeader, match="another control plane leads"):
            await store.write_keys({"format": b'{"version":1}', "cordons/n1": b"draining"})
        kv = await client.get(f"{PREFIX}cordons/n1".encode())
        assert kv is not None and kv.value == b"cordoned"


def test_the_state_section_is_checked_naming_key_and_line() -> None:
    with pytest.raises(ConfigError, match=r"state.endpoints is empty.*line 1"):
        parse('[state]\nbackend = "etcd"\n')
    with pytest.raises(ConfigError, match=r"state.backend must be 'file' or 'etcd'.*line 2"):
        parse('[state]\nbackend = "consul"\n')
    with pytest.raises(ConfigError, match=r"state.lease_ttl.*line 4"):
        parse('[state]\nbackend = "etcd"\nendpoints = ["http://127.0.0.1:2379"]\nlease_ttl = 1\n')
    cfg = parse('[state]\nbackend = "etcd"\nendpoints = ["http://127.0.0.1:2379"]\nuser = "cp"\n')
    assert cfg.state.prefix == "/llmgw/" and cfg.state.lease_ttl == 10
    assert "sent in clear to http://127.0.0.1:2379" in cfg.state.password_problem(
        {"LLMGW_ETCD_PASSWORD": "pw"}
    )
    assert cfg.state.password_problem({}) == ""
    assert parse("").state.backend == "file"


def migrate(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "control", "migrate-state", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_migrate_state_to_etcd_and_back_keeps_everything_and_refuses_to_overwrite(
    etcd: Member, tmp_path: Path
) -> None:
    from control.joins import JoinBook
    from control.plane import load_shard_key_secret

    source, back = tmp_path / "source", tmp_path / "back"
    fleet = fleet_of(3)
    fleet.cordon("gpu0001", Cordon.CORDONED)
    catalog = Catalog()
    catalog.apply_file(parse(f"[[models]]\n{MODELS}").models)
    source.mkdir()
    trio.run(
        StateSaver(source / "control-state.json").save,
        fleet.generation,
        fleet.nodes.values(),
        (),
        fleet.cordons,
        catalog,
    )
    book = JoinBook.load(source)
    trio.run(book.issue, "gpu0002")
    secret = load_shard_key_secret(source)
    state = etcd_state_section(etcd)
    (tmp_path / "a.toml").write_text(f'state_dir = "{source}"\n{state}')
    (tmp_path / "b.toml").write_text(f'state_dir = "{back}"\n{state}')

    done = migrate(tmp_path / "a.toml", "--to", "etcd")
    assert done.returncode == 0 and "to etcd /llmgw/" in done.stdout, done.stderr
    again = migrate(tmp_path / "a.toml", "--to", "etcd")
    assert again.returncode == 1 and "etcd /llmgw/ is not empty" in again.stderr
    assert migrate(tmp_path / "a.toml", "--to", "etcd", "--force").returncode == 0

    done = migrate(tmp_path / "b.toml", "--to", "file")
    assert done.returncode == 0, done.stderr
    original = parse_state((source / "control-state.json").read_text())
    assert parse_state((back / "control-state.json").read_text()) == original
    assert original.cordons == (("gpu0001", Cordon.CORDONED),) and len(original.registers) == 3
    assert (back / "join-token").read_text() == (source / "join-token").read_text()
    assert json.loads((back / "node-credentials.json").read_text()) == json.loads(
        (source / "node-credentials.json").read_text()
    )
    assert load_shard_key_secret(back) == secret
    refused = migrate(tmp_path / "b.toml", "--to", "file")
    assert refused.returncode == 1 and "control-state.json exists; give --force" in refused.stderr
    file_backend = tmp_path / "c.toml"
    file_backend.write_text(f'state_dir = "{source}"\n')
    assert "set backend = 'etcd'" in migrate(file_backend, "--to", "etcd").stderr


def etcd_state_section(member: Member) -> str:
    return f'[state]\nbackend = "etcd"\nendpoints = ["{member.endpoint}"]\n'


def test_a_leader_whose_lease_may_lapse_sends_no_command(tmp_path: Path) -> None:
    """``may_act`` (the lease keeper's ``valid(margin)`` with etcd) is asked before the commands go
    out: while it says no, a pass sends nothing; once it says yes, the StartShard goes."""
    from control.plane import ControlPlane

    cfg = parse(f'state_dir = "{tmp_path}"\n[[models]]\n{MODELS}'.replace("replicas = 2", "replicas = 1"))
    plane = ControlPlane(cfg, clock=lambda: 100.0)
    sent: list[str] = []
    plane.agents.send = lambda node_id, **fields: sent.append(node_id) or 1  # type: ignore[method-assign,func-returns-value]
    register = schema.Register(
        node_id="n1", mgmt_addr="10.0.0.1", engine_ports=schema.PortRange(first=8000, last=8010)
    )
    plane.fleet.registered(register, 100.0)
    plane.may_act = lambda: False
    trio.run(plane.reconcile_once)
    assert sent == []
    plane.may_act = lambda: True
    trio.run(plane.reconcile_once)
    assert sent == ["n1"]
