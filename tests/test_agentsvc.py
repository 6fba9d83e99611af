"""The agent service in-process: commands not acknowledged before a disconnect are sent again."""

from __future__ import annotations

from pathlib import Path

import trio

import schema
from control.agentsvc import AgentService
from control.fleet import Fleet
from tests.support import apoll as poll_until
from transport import StreamServer, open_stream


async def _register(stream: object, node_id: str) -> None:
    await stream.send(schema.AgentMessage(message_id=1, register=schema.Register(node_id=node_id)))  # type: ignore[attr-defined]
    ack = await stream.receive()  # type: ignore[attr-defined]
    assert ack is not None and ack.ack is not None and ack.ack.ok


async def test_unacknowledged_commands_are_resent_after_reconnect(nursery: trio.Nursery) -> None:
    fleet = Fleet(15, 300)
    svc = AgentService(fleet, insecure=True)
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
    svc = AgentService(fleet, insecure=True)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    async with open_stream(url) as old, open_stream(url) as new:
        await _register(old, "n1")
        await _register(new, "n1")
        from transport import RpcError

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
    from transport import Code, RpcError

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
            assert (
                refusal is not None
                and refusal.ack is not None
                and not refusal.ack.ok
                and refusal.ack.error == expected
            )
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
        assert ok is not None and ok.ack is not None and ok.ack.ok
    assert list(fleet.nodes) == ["n1"]


async def test_a_stream_reset_while_its_register_is_acknowledged_leaves_no_ghost(
    nursery: trio.Nursery,
) -> None:
    """The peer grants no flow-control window, so the Ack waits; then it resets the stream, which
    cancels the handler inside that send. The registration must be undone with it, or the node stays
    "ready" on a stream that no longer exists and every command queued to it is lost."""
    import h2.config
    import h2.connection
    import h2.errors
    import h2.settings

    from schema import envelope

    fleet = Fleet(15, 300)
    svc = AgentService(fleet, insecure=True)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    )
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", f"127.0.0.1:{port}".encode()),
            (b":path", schema.CONNECT_PATH.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ],
    )
    register = schema.AgentMessage(message_id=1, register=schema.Register(node_id="n1"))
    conn.send_data(sid, envelope.encode(bytes(register)))
    await sock.send_all(conn.data_to_send())
    await poll_until("n1 registered", lambda: "n1" in fleet.nodes)
    conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    await sock.send_all(conn.data_to_send())
    await poll_until("n1's stream forgotten", lambda: not svc.connected("n1"))
    assert fleet.nodes["n1"].state.value == "unreachable"
    await sock.aclose()


async def test_shard_ids_are_checked_in_register_and_shard_status(nursery: trio.Nursery) -> None:
    from transport import Code, RpcError

    fleet = Fleet(15, 300)
    svc = AgentService(fleet, insecure=True)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    bad = schema.ShardStatus(shard_id="llama/r0", replica_id="llama-r0", state=schema.ShardState.READY)
    async with open_stream(url) as stream:
        await stream.send(
            schema.AgentMessage(message_id=1, register=schema.Register(node_id="n1", shards=[bad]))
        )
        refusal = await stream.receive()
        assert refusal is not None and refusal.ack is not None and not refusal.ack.ok
        assert refusal.ack.error == (
            "Register from node 'n1' refused: shards[0].shard_id 'llama/r0' is not valid; it must be "
            "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
        try:
            await stream.receive()
            raise AssertionError("the stream should end")
        except RpcError as exc:
            assert exc.code is Code.INVALID_ARGUMENT
    assert "n1" not in fleet.nodes
    async with open_stream(url) as stream:
        await _register(stream, "n1")
        for shard_id in ("", "llama/r0", "ok-r0-s0"):
            status = schema.ShardStatus(shard_id=shard_id, replica_id="r", state=schema.ShardState.READY)
            await stream.send(schema.AgentMessage(message_id=2, shard=status))
        await poll_until("the valid status", lambda: "ok-r0-s0" in fleet.nodes["n1"].shards)
        assert list(fleet.nodes["n1"].shards) == ["ok-r0-s0"]


async def _join(url: str, token: str = "", node_credential: str = "") -> schema.Ack:
    """One Register for n1; the control plane's Ack (the stream is left without another message)."""
    async with open_stream(url) as stream:
        await stream.send(
            schema.AgentMessage(
                message_id=1,
                register=schema.Register(node_id="n1", token=token, node_credential=node_credential),
            )
        )
        reply = await stream.receive()
        assert reply is not None and reply.ack is not None
        return reply.ack


async def test_a_credential_not_shown_kept_may_be_issued_again_then_only_it_speaks(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An Ack carrying a new credential can be lost with its connection: until the agent sends
    anything after it (it does only once it kept the credential), the join token may join the node
    again. After that, the join token alone is refused, and ``reset`` undoes the binding."""
    from control.joins import JoinBook

    book = await trio.to_thread.run_sync(JoinBook.load, tmp_path)
    token = book.join_token()
    fleet = Fleet(15, 300)
    svc = AgentService(fleet, joins=book)
    port = await nursery.start(StreamServer(svc.handle).serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"

    lost = await _join(url, token=token)
    assert lost.ok and lost.node_credential  # ... and the agent never kept it
    await poll_until("the first stream to end", lambda: not svc.connected("n1"))
    kept = await _join(url, token=token)
    assert kept.ok and kept.node_credential and kept.node_credential != lost.node_credential

    async with open_stream(url) as stream:  # the agent, with its credential, heartbeats
        await stream.send(
            schema.AgentMessage(
                message_id=1, register=schema.Register(node_id="n1", node_credential=kept.node_credential)
            )
        )
        reply = await stream.receive()
        assert reply is not None and reply.ack is not None and reply.ack.ok and not reply.ack.node_credential
        await stream.send(schema.AgentMessage(message_id=2, heartbeat=schema.Heartbeat(node_id="n1")))
        await poll_until("the credential confirmed", lambda: not book.may_join_again("n1"))
        forged = await _join(url, token=token)  # another process, with the join token only
        assert not forged.ok and "already joined with a credential of its own" in forged.error
        assert svc.connected("n1") and svc.admitted_by["n1"] == "credential"
        stale = await _join(url, node_credential=lost.node_credential)
        assert not stale.ok and "presents another" in stale.error

    assert await book.reset("n1")
    again = await _join(url, token=token)
    assert again.ok and again.node_credential
    reloaded = await trio.to_thread.run_sync(JoinBook.load, tmp_path)
    assert reloaded.is_credential_of("n1", again.node_credential)
    assert not reloaded.is_credential_of("n1", kept.node_credential)
