"""control.etcd against a real etcd server (tests/etcdproc.py starts it): KV, ranges, txn, leases,
watches, auth, TLS and failover between endpoints. The kill -9 cases are in test_chaos_etcd.py."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from control.etcd import (
    Compare,
    Delete,
    EtcdAuthError,
    EtcdCompacted,
    EtcdConfig,
    EtcdLeaseLost,
    EtcdProtocolError,
    EtcdUnavailable,
    Lease,
    LeaseKeeper,
    Put,
    Range,
    WatchBatch,
    connect,
    prefix_end,
    wire,
)
from control.etcd.values import PutResult, RangeResult
from tests.etcdproc import Member, Tls
from tests.support import BlackHoleProxy, apoll, apoll_await, free_port


def config(*endpoints: str, **kwargs: object) -> EtcdConfig:
    return EtcdConfig(endpoints=endpoints, **kwargs)  # type: ignore[arg-type]


# -- pure ------------------------------------------------------------------------------------------------


def test_prefix_end_is_etcds_rule() -> None:
    assert prefix_end(b"/llmgw/") == b"/llmgw0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_config_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"'127\.0\.0\.1:2379': want http://HOST:PORT"):
        config("127.0.0.1:2379")
    with pytest.raises(TypeError, match="a list of URLs, got the string"):
        EtcdConfig(endpoints="http://127.0.0.1:2379")
    with pytest.raises(ValueError, match="none given"):
        config()
    with pytest.raises(ValueError, match="cert and key go together"):
        config("https://127.0.0.1:2379", cert=Path("c.pem"))
    with pytest.raises(ValueError, match="no endpoint is https://"):
        config("http://127.0.0.1:2379", ca=Path("ca.pem"))
    with pytest.raises(ValueError, match="user and password go together"):
        config("http://127.0.0.1:2379", user="root")
    assert "secret" not in repr(config("http://127.0.0.1:2379", user="u", password="secret"))


def test_answers_that_are_not_the_gateways_are_named() -> None:
    """A field of the wrong type is refused with the field and where it was, not taken as empty."""
    header = {"header": {"revision": "7"}}
    assert wire.decode_range(header).header.revision == 7  # fields left out are their zero values
    assert wire.decode_range(header).kvs == ()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"header": {"revision": "seven"}}, r"range header: revision is not an integer: 'seven'"),
        ({**header, "kvs": {"key": "a2V5"}}, r"range: kvs is not a list of objects"),
        ({**header, "kvs": [{"key": "not base64!"}]}, r"range kv: key is not base64: 'not base64!'"),
        ({**header, "kvs": [{"key": "a2V5", "version": True}]}, r"range kv: version is not an integer: True"),
        ({**header, "more": "yes"}, r"range: more is not a boolean: 'yes'"),
    ]
    for doc, message in cases:
        with pytest.raises(EtcdProtocolError, match=message):
            wire.decode_range(doc)
    with pytest.raises(EtcdProtocolError, match="a response with none of the four kinds"):
        wire.decode_txn({**header, "responses": [{"response_nothing": {}}]})
    with pytest.raises(EtcdProtocolError, match="an event of unknown type 'EXPIRE'"):
        wire.decode_events({"events": [{"type": "EXPIRE", "kv": {}}]})
    assert wire.error_of({"error": {"code": 16, "message": "etcdserver: invalid auth token"}}, 200) == (
        16,
        "etcdserver: invalid auth token",
    )
    assert wire.error_of({}, 502) == (-1, "HTTP 502")


# -- KV --------------------------------------------------------------------------------------------------


async def test_put_get_round_trip(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        value = bytes(range(256))  # not UTF-8: keys and values are bytes end to end
        first = await client.put(b"/t/k\xff", value)
        kv = await client.get(b"/t/k\xff")
        assert kv is not None
        assert (kv.value, kv.version, kv.create_revision, kv.mod_revision) == (
            value,
            1,
            first.header.revision,
            first.header.revision,
        )
        second = await client.put(b"/t/k\xff", b"two", prev_kv=True)
        assert second.prev_kv is not None and second.prev_kv.value == value
        kv = await client.get(b"/t/k\xff")
        assert kv is not None and (kv.value, kv.version, kv.mod_revision) == (
            b"two",
            2,
            second.header.revision,
        )
        # An older revision still holds the first value until it is compacted.
        old = await client.get(b"/t/k\xff", revision=first.header.revision)
        assert old is not None and old.value == value
        assert await client.get(b"/t/missing") is None
        deleted = await client.delete(b"/t/k\xff", prev_kv=True)
        assert deleted.deleted == 1 and deleted.prev_kvs[0].value == b"two"
        assert await client.get(b"/t/k\xff") is None


async def test_prefix_range(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        for key in (b"/llmgw/nodes/b", b"/llmgw/nodes/a", b"/llmgw/nodes0", b"/llmgw/node", b"/other"):
            await client.put(key, key.upper())
        result = await client.get_prefix(b"/llmgw/nodes/")
        assert [kv.key for kv in result.kvs] == [b"/llmgw/nodes/a", b"/llmgw/nodes/b"]
        assert (result.count, result.more) == (2, False)
        limited = await client.get_prefix(b"/llmgw/", limit=2)
        assert (len(limited.kvs), limited.count, limited.more) == (2, 4, True)
        # A read at the prefix's revision sees it as it was then.
        await client.put(b"/llmgw/nodes/c", b"C")
        then = await client.get_prefix(b"/llmgw/nodes/", revision=result.header.revision)
        assert [kv.key for kv in then.kvs] == [b"/llmgw/nodes/a", b"/llmgw/nodes/b"]
        gone = await client.delete_prefix(b"/llmgw/nodes/")
        assert gone.deleted == 3
        assert (await client.get_prefix(b"/llmgw/")).count == 2


async def test_txn_compare_leader_fenced_write(etcd: Member) -> None:
    leader, key = b"/llmgw/leader", b"/llmgw/placements/m-r0"
    async with connect(config(etcd.endpoint)) as client:
        # Take leadership only if nobody has it (version 0: the key does not exist).
        took = await client.txn([Compare.version(leader, "==", 0)], [Put(leader, b"cp-a")], [Range(leader)])
        assert took.succeeded and isinstance(took.responses[0], PutResult)
        again = await client.txn([Compare.version(leader, "==", 0)], [Put(leader, b"cp-b")], [Range(leader)])
        assert not again.succeeded
        held = again.responses[0]
        assert isinstance(held, RangeResult) and held.kvs[0].value == b"cp-a"
        # A write fenced by the leader key: cp-a's goes through, cp-b's does not and changes nothing.
        mine = await client.txn([Compare.value(leader, "==", b"cp-a")], [Put(key, b"a")])
        assert mine.succeeded
        deposed = await client.txn([Compare.value(leader, "==", b"cp-b")], [Put(key, b"b"), Delete(leader)])
        assert not deposed.succeeded and deposed.responses == ()
        kv = await client.get(key)
        assert kv is not None and kv.value == b"a"
        # The other comparison targets: the revisions that created and last changed the key.
        assert (
            await client.txn([Compare.mod_revision(key, "==", kv.mod_revision)], [Put(key, b"a2")])
        ).succeeded
        assert not (
            await client.txn([Compare.mod_revision(key, "==", kv.mod_revision)], [Put(key, b"a3")])
        ).succeeded
        assert (
            await client.txn(
                [Compare.create_revision(key, "==", kv.create_revision), Compare.version(key, ">", 1)]
            )
        ).succeeded
        assert not (await client.txn([Compare.value(key, "!=", b"a2")])).succeeded
        with pytest.raises(TypeError, match="needs bytes"):
            await client.txn([Compare(key, "value", "==", 3)])


# -- leases ----------------------------------------------------------------------------------------------


async def test_lease_expiry_deletes_the_key(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        lease = await client.grant(2)
        await client.put(b"/llmgw/leader", b"cp-a", lease=lease.id)
        kv = await client.get(b"/llmgw/leader")
        assert kv is not None and kv.lease == lease.id
        start = trio.current_time()

        async def gone() -> bool:
            return await client.get(b"/llmgw/leader") is None

        await apoll_await("the leased key to be deleted when its lease expires", gone, timeout=15)
        assert trio.current_time() - start >= 1.0  # not at once: after the TTL
        with pytest.raises(EtcdLeaseLost, match="expired or was revoked"):
            await client.keepalive_once(lease.id)


async def test_keeper_keeps_the_key_past_its_ttl_and_revoke_ends_it(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client, trio.open_nursery() as nursery:
        keeper = await client.keeper(2)
        await client.put(b"/llmgw/leader", b"cp-a", lease=keeper.id)
        await nursery.start(keeper.run)
        start = trio.current_time()
        # Six renewals at TTL/3 span two TTLs: the key would have gone without them.
        await apoll("six renewals", lambda: keeper.renewals >= 6, timeout=20)
        assert trio.current_time() - start > 2
        assert await client.get(b"/llmgw/leader") is not None
        assert keeper.valid() and keeper.valid_until > trio.current_time()
        assert not keeper.valid(margin=2.1)  # renewed at most 2 s ahead (its TTL)
        nursery.cancel_scope.cancel()
        await keeper.revoke()
        assert keeper.lost.is_set()
        assert await client.get(b"/llmgw/leader") is None


async def test_keeper_reports_a_lease_revoked_behind_its_back(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        keeper = await client.keeper(3)

        async def keep() -> None:
            with pytest.raises(EtcdLeaseLost, match="expired or was revoked"):
                await keeper.run()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep)
            await client.revoke(keeper.id)
            with trio.fail_after(10):
                await keeper.lost.wait()
        assert not keeper.valid()
        await client.revoke(keeper.id)  # a lease already gone: not an error


# -- watch -----------------------------------------------------------------------------------------------


async def _collect(watch: object, count: int, into: list[WatchBatch]) -> None:
    async for batch in watch:  # type: ignore[attr-defined]
        into.append(batch)
        if sum(len(b.events) for b in into) >= count:
            return


async def test_watch_sees_every_change_in_order(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        await client.put(b"/llmgw/a", b"before")
        snapshot = await client.get_prefix(b"/llmgw/")
        batches: list[WatchBatch] = []
        async with client.watch_prefix(b"/llmgw/", start_revision=snapshot.header.revision + 1) as watch:
            await client.put(b"/llmgw/a", b"1")
            await client.put(b"/outside", b"x")
            await client.txn([], [Put(b"/llmgw/b", b"2"), Put(b"/llmgw/c", b"3")])
            await client.delete(b"/llmgw/a")
            with trio.fail_after(10):
                await _collect(watch, 4, batches)
        events = [(e.type, e.kv.key, e.kv.value) for b in batches for e in b.events]
        assert events == [
            ("put", b"/llmgw/a", b"1"),
            ("put", b"/llmgw/b", b"2"),
            ("put", b"/llmgw/c", b"3"),
            ("delete", b"/llmgw/a", b""),
        ]
        # The txn's two puts arrive together, at one revision.
        txn_batch = next(b for b in batches if any(e.kv.key == b"/llmgw/b" for e in b.events))
        assert len(txn_batch.events) == 2 and len({e.kv.mod_revision for e in txn_batch.events}) == 1
        revisions = [b.revision for b in batches]
        assert revisions == sorted(set(revisions))
        assert watch.next_revision == batches[-1].revision + 1


async def test_watch_from_now_sees_only_later_changes(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        await client.put(b"/llmgw/x", b"old")
        async with client.watch(b"/llmgw/x") as watch:
            await client.put(b"/llmgw/x", b"new")
            with trio.fail_after(10):
                batch = await watch.__anext__()
        assert [(e.kv.value) for e in batch.events] == [b"new"]


async def test_watch_resumes_after_its_connection_is_cut_without_losing_a_change(
    etcd: Member, nursery: trio.Nursery
) -> None:
    proxy = BlackHoleProxy(etcd.client_port)
    port = await nursery.start(proxy.serve)
    async with (
        connect(config(etcd.endpoint)) as direct,
        connect(config(f"http://127.0.0.1:{port}")) as client,
    ):
        batches: list[WatchBatch] = []
        async with client.watch_prefix(b"/w/") as watch:
            await direct.put(b"/w/1", b"a")
            with trio.fail_after(10):
                await _collect(watch, 1, batches)
            proxy.cut()
            # Changes made while the watch has no connection: the reopened watch must deliver them.
            await direct.put(b"/w/2", b"b")
            await direct.delete(b"/w/1")
            await direct.put(b"/w/3", b"c")
            start = trio.current_time()
            with trio.fail_after(10):
                await _collect(watch, 4, batches)
            resumed = trio.current_time() - start
        assert [(e.type, e.kv.key) for b in batches for e in b.events] == [
            ("put", b"/w/1"),
            ("put", b"/w/2"),
            ("delete", b"/w/1"),
            ("put", b"/w/3"),
        ]
        assert watch.reconnects >= 1 and proxy.cuts >= 1
        print(f"watch resumed after a cut connection in {resumed * 1000:.1f} ms")


async def test_watch_reopens_a_silent_stream_after_its_idle_timeout(
    etcd: Member, nursery: trio.Nursery
) -> None:
    proxy = BlackHoleProxy(etcd.client_port)
    port = await nursery.start(proxy.serve)
    through = config(f"http://127.0.0.1:{port}", request_timeout=0.5)
    async with connect(config(etcd.endpoint)) as direct, connect(through) as client:
        batches: list[WatchBatch] = []
        async with client.watch_prefix(b"/w/", idle_timeout=0.5) as watch, trio.open_nursery() as inner:
            proxy.black_hole = True
            await direct.put(b"/w/lost-on-the-path", b"a")
            inner.start_soon(_collect, watch, 1, batches)
            # Nothing arrives through the black hole: the watch gives up on the silent stream (and
            # on its reopens, which meet the black hole too) ...
            await apoll(
                "the watch to give up on the silent stream", lambda: watch.reconnects >= 1, timeout=10
            )
            assert not batches
            # ... and once the path works again, the stream it opens delivers the swallowed change.
            proxy.black_hole = False
            await apoll("the swallowed change through the reopened stream", lambda: batches, timeout=15)
        assert [e.kv.key for b in batches for e in b.events] == [b"/w/lost-on-the-path"]


async def test_a_compacted_revision_is_a_clear_error(etcd: Member) -> None:
    async with connect(config(etcd.endpoint)) as client:
        first = await client.put(b"/c/k", b"1")
        for value in (b"2", b"3"):
            last = await client.put(b"/c/k", value)
        await client.compact(last.header.revision)
        with pytest.raises(
            EtcdCompacted, match=rf"revision {first.header.revision} has been compacted"
        ) as caught:
            async with client.watch_prefix(b"/c/", start_revision=first.header.revision) as watch:
                with trio.fail_after(10):
                    await watch.__anext__()
        assert caught.value.compact_revision == last.header.revision
        with pytest.raises(EtcdCompacted, match="compacted"):
            await client.get(b"/c/k", revision=first.header.revision)


# -- endpoints, failover, TLS, auth ----------------------------------------------------------------------


async def test_failover_skips_an_endpoint_that_refuses_connections(etcd: Member) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with connect(config(dead, etcd.endpoint)) as client:
        await client.put(b"/f/k", b"v")
        assert client.endpoint == etcd.endpoint
        statuses = await client.statuses()
        assert isinstance(statuses[0], str) and "connect" in statuses[0].lower()
        assert not isinstance(statuses[1], str) and statuses[1].version.startswith("3.")
        assert (await client.status()).leader == statuses[1].header.member_id
    async with connect(config(dead, request_timeout=1.0, retry_timeout=0.5)) as client:
        with pytest.raises(
            EtcdUnavailable,
            match=rf"etcd put of b'/f/k': no etcd endpoint answered within 0.5 s: {dead}: cannot connect",
        ):
            await client.put(b"/f/k", b"v")


async def test_a_write_whose_answer_is_lost_is_not_sent_again(etcd: Member, nursery: trio.Nursery) -> None:
    proxy = BlackHoleProxy(etcd.client_port)
    port = await nursery.start(proxy.serve)
    async with connect(config(f"http://127.0.0.1:{port}", etcd.endpoint, request_timeout=1.0)) as client:
        await client.put(b"/u/k", b"0")
        proxy.black_hole = True
        with pytest.raises(EtcdUnavailable, match="may or may not have been applied") as caught:
            await client.put(b"/u/k", b"1")
        assert caught.value.outcome_unknown
        # Not retried on the second endpoint: the value is the first one's still.
        kv = await client.get(b"/u/k")  # a read fails over
        assert kv is not None and kv.value == b"0" and client.endpoint == etcd.endpoint


async def test_tls_with_client_certificates(tmp_path: Path) -> None:
    tls = Tls.make(tmp_path)
    member = Member(tmp_path, "etcd-tls", tls=tls)
    member.start()
    try:
        member.wait_healthy()
        good = config(member.endpoint, ca=tls.ca, cert=tls.client_cert, key=tls.client_key)
        async with connect(good) as client:
            await client.put(b"/tls/k", b"v")
            kv = await client.get(b"/tls/k")
            assert kv is not None and kv.value == b"v"
        async with connect(config(member.endpoint, ca=tls.ca, request_timeout=2.0)) as client:
            with pytest.raises(EtcdUnavailable, match=member.endpoint):
                await client.get(b"/tls/k")
    finally:
        member.stop()


async def _until_token_lapses(endpoint: str, token: str | None) -> None:
    """Wait until etcd refuses ``token``. Each use of a simple token renews it, so this looks less and
    less often until it has lapsed."""
    async with httpx.AsyncClient() as raw:
        gap = 0.25
        with trio.fail_after(30):
            while True:
                answer = await raw.post(
                    endpoint + "/v3/kv/range",
                    json={"key": "L2xsbWd3L2s="},
                    headers={"Authorization": str(token)},
                )
                if answer.status_code != 200 and "token" in json.loads(answer.content)["message"]:
                    return
                gap *= 2
                await trio.sleep(gap)  # a growing gap, bounded by fail_after: see above


async def test_auth_user_with_a_role_and_an_expiring_token(tmp_path: Path) -> None:
    member = Member(tmp_path, "etcd-auth", extra=["--auth-token-ttl=1"])
    member.start()
    try:
        member.wait_healthy()
        async with connect(config(member.endpoint)) as admin:
            steps: list[tuple[str, dict[str, Any]]] = [
                ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/role/add", {"name": "llmgw"}),
                (
                    "/v3/auth/role/grant",
                    {
                        "name": "llmgw",
                        "perm": {"permType": "READWRITE", "key": "L2xsbWd3Lw==", "range_end": "L2xsbWd3MA=="},
                    },
                ),
                ("/v3/auth/user/add", {"name": "cp", "password": "cppw"}),
                ("/v3/auth/user/grant", {"user": "cp", "role": "llmgw"}),
                ("/v3/auth/enable", {}),
            ]
            for path, body in steps:
                await admin.request(path, body, operation=path, idempotent=False)
        async with connect(config(member.endpoint, user="cp", password="cppw")) as client:
            await client.put(b"/llmgw/k", b"v")
            with pytest.raises(
                EtcdAuthError, match=r"etcd put of b'/other': .* refused: etcdserver: permission denied"
            ):
                await client.put(b"/other", b"v")
            # Let the token lapse (--auth-token-ttl=1, unused): etcd refuses it, then the client
            # authenticates again by itself, for a request and for a watch's stream.
            token = client._token
            await _until_token_lapses(member.endpoint, token)
            kv = await client.get(b"/llmgw/k")
            assert kv is not None and kv.value == b"v" and client._token != token
            token = client._token
            await _until_token_lapses(member.endpoint, token)
            async with client.watch_prefix(b"/llmgw/") as watch:
                assert client._token != token
                await client.put(b"/llmgw/k", b"w")
                with trio.fail_after(10):
                    assert [e.kv.value for e in (await watch.__anext__()).events] == [b"w"]
        with pytest.raises(EtcdAuthError, match="authentication failed"):
            async with connect(config(member.endpoint, user="cp", password="wrong")):
                pass
        async with connect(config(member.endpoint)) as anonymous:
            with pytest.raises(EtcdAuthError, match="authentication enabled: configure a user and password"):
                await anonymous.get(b"/llmgw/k")
    finally:
        member.stop()


# -- the keeper's timing, on trio's MockClock -------------------------------------------------------------


class _ScriptedLeases:
    """Stands in for ``EtcdClient.keepalive_once`` with what a test scripts: each renewal is recorded
    at its (mock) time, then answered with the lease, refused as unavailable, or left hanging."""

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self.mode = "answer"
        self.calls: list[float] = []

    async def keepalive_once(self, lease_id: int) -> Lease:
        self.calls.append(trio.current_time())
        if self.mode == "unavailable":
            raise EtcdUnavailable("etcd lease keepalive: no etcd endpoint answered")
        if self.mode == "hang":
            await trio.sleep_forever()
        return Lease(lease_id, self.ttl)


async def test_keeper_renews_at_a_third_of_its_ttl_and_gives_up_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    leases = _ScriptedLeases(ttl=9)
    keeper = LeaseKeeper(leases, Lease(0x1EA5E, 9), granted_at=trio.current_time())  # type: ignore[arg-type]
    start = trio.current_time()
    lost_at: list[float] = []

    async def keep() -> None:
        with pytest.raises(
            EtcdLeaseLost, match=r"not renewed within its TTL of 9 s \(etcd lease keepalive: no etcd"
        ):
            await keeper.run()
        lost_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep)
        await apoll("three renewals", lambda: len(leases.calls) >= 3, timeout=60)
        assert [round(t - start, 3) for t in leases.calls] == [3.0, 6.0, 9.0]
        assert keeper.valid_until == pytest.approx(start + 18)
        # etcd unreachable from now on: retried (a quarter of the interval apart), then lost at the
        # deadline the last renewal earned, not before and not later.
        leases.mode = "unavailable"
        await apoll("the lease to be lost", lambda: keeper.lost.is_set(), timeout=60)
    assert lost_at[0] == pytest.approx(start + 18, abs=0.01)
    retries = [round(t - start, 3) for t in leases.calls[3:]]
    assert retries[0] == 12.0 and all(b - a == pytest.approx(0.75) for a, b in itertools.pairwise(retries))
    assert not keeper.valid()


async def test_keeper_does_not_wait_past_its_deadline_for_a_renewal_that_hangs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    leases = _ScriptedLeases(ttl=6)
    leases.mode = "hang"
    start = trio.current_time()
    keeper = LeaseKeeper(leases, Lease(7, 6), granted_at=start)  # type: ignore[arg-type]
    with pytest.raises(EtcdLeaseLost, match="not renewed within its TTL of 6 s"):
        await keeper.run()
    assert trio.current_time() == pytest.approx(start + 6, abs=0.01)
    assert leases.calls == [pytest.approx(start + 2)]
    assert keeper.lost.is_set() and "not renewed" in keeper.lost_reason
