"""The agent service in-process: commands not acknowledged before a disconnect are sent again."""

from __future__ import annotations

from collections.abc import Callable

import trio

import schema
from agent.transport import open_stream
from control.agentsvc import AgentService
from control.fleet import Fleet
from control.transport import StreamServer


async def poll_until(
    what: str, check: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01
) -> None:
    with trio.fail_after(timeout):
        while not check():  # noqa: ASYNC110 (polling a plain predicate, bounded by the deadline)
            await trio.sleep(interval)
    assert check(), what


async def _register(stream: object, node_id: str) -> None:
    await stream.send(schema.AgentMessage(message_id=1, register=schema.Register(node_id=node_id)))  # type: ignore[attr-defined]
    ack = await stream.receive()  # type: ignore[attr-defined]
    assert ack is not None and ack.ack is not None and ack.ack.ok


async def test_unacknowledged_commands_are_resent_after_reconnect(nursery: trio.Nursery) -> None:
    fleet = Fleet(15, 300)
    svc = AgentService(fleet)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    start = schema.StartShard(shard_id="m-r0-s0", replica_id="m-r0")

    async with open_stream(url) as stream:
        await _register(stream, "n1")
        first = svc.send("n1", start=start)
        got = await stream.receive()
        assert got is not None and got.message_id == first and got.start == start
        # The agent disconnects without acknowledging it.
    await poll_until("the service to notice the disconnect", lambda: not svc.connected("n1"))
    while_away = svc.send("n1", stop=schema.StopShard(shard_id="m-r0-s0"))
    assert fleet.nodes["n1"].state.value == "unreachable"

    async with open_stream(url) as stream:
        await _register(stream, "n1")
        resent = [await stream.receive(), await stream.receive()]
        assert [m.message_id for m in resent if m is not None] == [first, while_away]
        await stream.send(schema.AgentMessage(message_id=2, ack=schema.Ack(message_id=first, ok=True)))
        await stream.send(schema.AgentMessage(message_id=3, ack=schema.Ack(message_id=while_away, ok=True)))
        await poll_until("both acknowledgements", lambda: not svc.pending.get("n1"))
    assert fleet.nodes["n1"].state.value == "unreachable"


async def test_second_stream_replaces_the_first(nursery: trio.Nursery) -> None:
    fleet = Fleet(15, 300)
    svc = AgentService(fleet)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    async with open_stream(url) as old, open_stream(url) as new:
        await _register(old, "n1")
        await _register(new, "n1")
        from agent.transport import RpcError

        try:
            with trio.fail_after(5):
                await old.receive()
            raise AssertionError("the replaced stream should have ended")
        except RpcError as exc:
            assert "replaced by a newer stream" in exc.message
        assert fleet.nodes["n1"].state.value == "ready" and svc.connected("n1")
        svc.send("n1", stop=schema.StopShard(shard_id="x"))
        got = await new.receive()
        assert got is not None and got.stop is not None


async def test_per_node_token_without_tls(nursery: trio.Nursery) -> None:
    from agent.transport import Code, RpcError

    fleet = Fleet(15, 300)
    svc = AgentService(fleet, tokens={"n1": "s3cret"})
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    for node_id, token, expected in (
        ("n1", "wrong", "wrong token for node 'n1'"),
        ("n9", "", "no token is configured for node 'n9'"),
    ):
        async with open_stream(url) as stream:
            await stream.send(
                schema.AgentMessage(message_id=1, register=schema.Register(node_id=node_id, token=token))
            )
            refusal = await stream.receive()
            assert refusal is not None and not refusal.ack.ok and refusal.ack.error == expected
            try:
                await stream.receive()
                raise AssertionError("the stream should end")
            except RpcError as exc:
                assert exc.code is Code.PERMISSION_DENIED
    async with open_stream(url) as stream:
        await stream.send(
            schema.AgentMessage(message_id=1, register=schema.Register(node_id="n1", token="s3cret"))
        )
        ok = await stream.receive()
        assert ok is not None and ok.ack.ok
    assert list(fleet.nodes) == ["n1"]
