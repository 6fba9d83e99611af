"""control.etcd when etcd itself fails: a member killed with SIGKILL and started again, one member of
three killed. Each test checks the invariant (no change lost or seen twice; requests carried on by
the members left; a lease whose renewals fail is reported lost by its deadline, not later)."""

from __future__ import annotations

import pytest
import trio

from control.etcd import EtcdClient, EtcdConfig, EtcdLeaseLost, EtcdUnavailable, WatchBatch, connect
from tests.etcdproc import Cluster, Member
from tests.support import apoll

pytestmark = pytest.mark.chaos


async def _collect(watch: object, count: int, into: list[WatchBatch]) -> None:
    async for batch in watch:  # type: ignore[attr-defined]
        into.append(batch)
        if sum(len(b.events) for b in into) >= count:
            return


def _changes(batches: list[WatchBatch]) -> list[tuple[str, bytes, bytes]]:
    return [(e.type, e.kv.key, e.kv.value) for b in batches for e in b.events]


async def test_watch_resumes_after_etcd_is_killed_and_restarted(etcd: Member) -> None:
    async with connect(EtcdConfig(endpoints=(etcd.endpoint,), request_timeout=2.0)) as client:
        batches: list[WatchBatch] = []
        async with (
            client.watch_prefix(b"/llmgw/", reconnect_timeout=60) as watch,
            trio.open_nursery() as nursery,
        ):
            await client.put(b"/llmgw/a", b"1")
            nursery.start_soon(_collect, watch, 4, batches)
            await apoll("the first change", lambda: batches, timeout=10)
            etcd.kill()
            etcd.start()
            await trio.to_thread.run_sync(etcd.wait_healthy)
            start = trio.current_time()
            # Written after the restart, while the watch may still be reconnecting.
            await client.put(b"/llmgw/b", b"2")
            await client.delete(b"/llmgw/a")
            await client.put(b"/llmgw/a", b"3")
            await apoll(
                "every change after the restart", lambda: sum(len(b.events) for b in batches) >= 4, timeout=30
            )
            caught_up = trio.current_time() - start
        assert _changes(batches) == [
            ("put", b"/llmgw/a", b"1"),
            ("put", b"/llmgw/b", b"2"),
            ("delete", b"/llmgw/a", b""),
            ("put", b"/llmgw/a", b"3"),
        ]
        assert watch.reconnects >= 1
        print(f"watch caught up {caught_up * 1000:.0f} ms after etcd was back, {watch.reconnects} reopen(s)")


async def test_one_member_of_three_killed_requests_and_watch_carry_on(etcd_cluster: Cluster) -> None:
    config = EtcdConfig(endpoints=etcd_cluster.endpoints, request_timeout=3.0, connect_timeout=1.0)
    async with connect(config) as client, connect(config) as writer:
        await client.put(b"/llmgw/k", b"0")
        victim = next(m for m in etcd_cluster.members if m.endpoint == client.endpoint)
        batches: list[WatchBatch] = []
        async with client.watch_prefix(b"/llmgw/", idle_timeout=5) as watch, trio.open_nursery() as nursery:
            nursery.start_soon(_collect, watch, 20, batches)
            # Writes from a second client, across the kill: the watch (on the victim) must see each.
            for i in range(10):
                await writer.put(b"/llmgw/k", str(i + 1).encode())
            victim.kill()
            start = trio.current_time()
            kv = await client.get(b"/llmgw/k")  # the first request after the kill fails over
            failover = trio.current_time() - start
            assert kv is not None and kv.value == b"10" and client.endpoint != victim.endpoint
            for i in range(10, 20):
                # A write can meet the election the kill started (etcd answers "unavailable" or the
                # connection breaks): its outcome is unknown, so this test reads before retrying.
                await _put_surely(writer, b"/llmgw/k", str(i + 1).encode())
            await apoll(
                "all twenty changes through the watch",
                lambda: sum(len(b.events) for b in batches) >= 20,
                timeout=30,
            )
        assert [v for _, _, v in _changes(batches)] == [str(i + 1).encode() for i in range(20)]
        assert watch.reconnects >= 1  # it was opened on the victim (the client's endpoint then)
        statuses = await client.statuses()
        down = [s for s in statuses if isinstance(s, str)]
        assert len(down) == 1, statuses
        print(
            f"failover to the next member took {failover * 1000:.0f} ms; watch reopened {watch.reconnects} time(s)"
        )
        # The member comes back with its data and catches up.
        victim.start()
        await trio.to_thread.run_sync(victim.wait_healthy)
        async with connect(EtcdConfig(endpoints=(victim.endpoint,))) as direct:
            kv = await direct.get(b"/llmgw/k")
            assert kv is not None and kv.value == b"20"


async def _put_surely(client: EtcdClient, key: bytes, value: bytes) -> None:
    with trio.fail_after(30):
        while True:
            try:
                await client.put(key, value)
                return
            except EtcdUnavailable as exc:
                if exc.outcome_unknown:
                    kv = await client.get(key)
                    if kv is not None and kv.value == value:
                        return
                await trio.sleep(0.1)  # an election is under way; fail_after bounds the retries


async def test_keeper_reports_its_lease_lost_by_its_deadline_when_etcd_is_gone(etcd: Member) -> None:
    async with connect(EtcdConfig(endpoints=(etcd.endpoint,), request_timeout=1.0)) as client:
        keeper = await client.keeper(3)
        lost_at: list[float] = []

        async def keep() -> None:
            with pytest.raises(EtcdLeaseLost, match="not renewed within its TTL of 3 s") as caught:
                await keeper.run()
            lost_at.append(trio.current_time())
            assert "cannot connect" in str(caught.value) or "no answer" in str(caught.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep)
            await apoll("a first renewal", lambda: keeper.renewals >= 1, timeout=10)
            deadline_before_kill = keeper.valid_until
            etcd.kill()
            with trio.fail_after(15):
                await keeper.lost.wait()
        # Lost no later than the instant the lease could have lapsed for etcd (plus scheduling), and
        # not before the last renewal's deadline: a leader stops in time, and not for nothing.
        assert lost_at[0] >= deadline_before_kill - 0.01
        assert lost_at[0] <= keeper.valid_until + 0.5
        print(f"lease reported lost {lost_at[0] - keeper.valid_until:+.3f} s from its deadline")


async def test_quorum_lost_is_a_bounded_clear_error_and_its_return_needs_no_new_client(
    etcd_cluster: Cluster,
) -> None:
    config = EtcdConfig(
        endpoints=etcd_cluster.endpoints, request_timeout=2.0, connect_timeout=1.0, retry_timeout=2.0
    )
    async with connect(config) as client:
        await client.put(b"/llmgw/k", b"before")
        survivor, *lost = etcd_cluster.members
        for member in lost:
            member.kill()
        for attempt in ("write", "read"):
            start = trio.current_time()
            with pytest.raises(EtcdUnavailable) as caught:
                if attempt == "write":
                    await client.put(b"/llmgw/k", b"during")
                else:
                    await client.get(b"/llmgw/k")
            waited = trio.current_time() - start
            # Bounded by retry_timeout + request_timeout (and a connect), naming what it met.
            assert waited < config.retry_timeout + config.request_timeout + config.connect_timeout + 1
            assert survivor.endpoint in str(caught.value) or caught.value.outcome_unknown
            print(f"quorum lost: a {attempt} failed after {waited:.2f} s: {caught.value}")
        for member in lost:
            member.start()
        for member in lost:
            await trio.to_thread.run_sync(member.wait_healthy)
        # The same client carries on once a quorum is back; the write that failed did not apply
        # (or, if its outcome was unknown, reading tells).
        kv = await client.get(b"/llmgw/k")
        assert kv is not None and kv.value in (b"before", b"during")
        await client.put(b"/llmgw/k", b"after")
        kv = await client.get(b"/llmgw/k")
        assert kv is not None and kv.value == b"after"
