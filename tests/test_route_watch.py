"""The route watch (``llmgw.v1.RouteService/WatchRoutes``): grpcio against a real control plane, and
the router's side (``router.watch.WatchedRoutes``) against the server in this process."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import trio
import trio.lowlevel
import trustme

import schema
from control.fleet import Node, NodeState
from control.routewatch import RouteWatch
from router.routes import ModelRoutes, Upstream
from router.watch import WatchedRoutes
from schema.rpc import Code, RpcError
from tests.fleet_procs import free_port, one_node
from tests.support import apoll as _until  # another task's state, with no event to wait on
from transport import PeerIdentity, ServerStream, ServerTLS, StreamServer
from transport.client import CallOptions, server_stream

TOKEN = "route-watch-read-token-0123456789"


def _watch(port: int, metadata: tuple[tuple[str, str], ...], timeout: float = 60) -> grpc.Future:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = channel.unary_stream(
        schema.WATCH_ROUTES_PATH, request_serializer=bytes, response_deserializer=schema.RouteTable.parse
    )
    return stub(schema.WatchRoutesRequest(), metadata=metadata, timeout=timeout)


def test_grpcio_watches_a_real_control_plane(tmp_path: Path) -> None:
    """grpcio subscribes with a read token: the first table names the model with no replica and why,
    then the same stream brings the table with the sim replica READY (its URL and the shard's key),
    at a higher revision. No token, or a wrong one, gets UNAUTHENTICATED and no table."""
    tag = f"w{os.getpid()}"
    model = f"chat-{tag}"
    models = (
        f'[api]\nread_tokens = ["{TOKEN}"]\n'
        f'[[models]]\nname = "{model}"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
        'env = { LLMGW_SIM_LOAD_SECONDS = "2" }\n'
    )
    with one_node(tmp_path, models, "23900-23949") as (cp, _agent):
        for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as info:
                next(iter(_watch(cp.agent_port, metadata, timeout=20)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (metadata, info.value)
            assert "token" in info.value.details()

        call = _watch(cp.agent_port, (("authorization", f"Bearer {TOKEN}"),))
        tables: list[schema.RouteTable] = []
        for table in call:
            tables.append(table)
            (route,) = table.models
            if route.upstreams:
                break
        call.cancel()

    first, last = tables[0], tables[-1]
    assert len(tables) >= 2, tables  # the replica became READY after the watch began: a change arrived
    assert [t.revision for t in tables] == sorted({t.revision for t in tables})
    assert first.epoch == last.epoch and first.epoch
    assert first.models[0].model == model and not first.models[0].upstreams
    assert first.models[0].reason
    (up,) = last.models[0].upstreams
    assert up.replica_id.startswith(model) and up.url.startswith("http://127.0.0.1:239")
    assert len(up.api_key) >= 16


def _table(*urls: str) -> dict[str, ModelRoutes]:
    return {"m": ModelRoutes(tuple(Upstream(f"m-r{i}", u, api_key=f"k{i}") for i, u in enumerate(urls)))}


async def _serve(watch: RouteWatch, port: int, nursery: trio.Nursery) -> trio.CancelScope:
    scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            server = StreamServer(_no_agents, methods=watch.methods())
            await server.serve("127.0.0.1", port, task_status=task_status)

    await nursery.start(serve)
    return scope


async def _no_agents(st: object) -> None:
    raise AssertionError("no agent streams in this test")


@pytest.mark.parametrize("protocol", ["grpc", "connect"])
async def test_router_keeps_routes_while_the_control_plane_is_away_and_resyncs(protocol: str) -> None:
    """WatchedRoutes (no token: a loopback peer) gets the table, follows a change, keeps the last
    table while the server is gone, and takes the new epoch's table once a server is back on the
    same port; a burst of changes reaches it as the latest table, not a queue of stale ones."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    watch = RouteWatch()
    watched = WatchedRoutes(url, backoff_base=0.05, backoff_cap=0.3, protocol=protocol)
    async with trio.open_nursery() as nursery:
        server = await _serve(watch, port, nursery)
        watch.publish(_table("http://127.0.0.1:9001"))
        await nursery.start(watched.run)
        assert watched.routes()["m"].upstreams[0].url == "http://127.0.0.1:9001"
        assert watched.routes()["m"].upstreams[0].api_key == "k0"

        for i in range(200):
            watch.publish(_table("http://127.0.0.1:9001", f"http://127.0.0.1:{9100 + i}"))
        await _until("the latest table", lambda: watched.revision == watch.revision)
        assert [u.url for u in watched.routes()["m"].upstreams][-1] == "http://127.0.0.1:9299"
        assert watched.tables < 200  # coalesced: the watcher was sent the latest, not every revision

        server.cancel()
        await _until("the server gone", lambda: watch.watchers == 0)
        assert len(watched.routes()["m"].upstreams) == 2  # kept while the control plane is away

        restarted = RouteWatch()  # a restarted control plane: new epoch, revision 1 again
        await _serve(restarted, port, nursery)
        restarted.publish(_table("http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"))
        await _until("the restarted control plane's table", lambda: watched.epoch == restarted.epoch)
        assert len(watched.routes()["m"].upstreams) == 3
        nursery.cancel_scope.cancel()


async def test_watch_refuses_a_wrong_token_and_starts_after_a_bounded_wait() -> None:
    """A router with the wrong token gets no routes (the server says UNAUTHENTICATED), and its run()
    still reports started after its first wait, so a router can start while the control plane
    refuses it or is down."""
    port = free_port()
    watch = RouteWatch(["right-token"])
    watched = WatchedRoutes(f"http://127.0.0.1:{port}", token="wrong-token", first_wait=0.5)
    async with trio.open_nursery() as nursery:
        await _serve(watch, port, nursery)
        watch.publish(_table("http://127.0.0.1:9001"))
        await nursery.start(watched.run)
        assert dict(watched.routes()) == {}
        right = WatchedRoutes(f"http://127.0.0.1:{port}", token="right-token")
        await nursery.start(right.run)
        assert list(right.routes()) == ["m"]
        nursery.cancel_scope.cancel()


def test_a_restarted_control_plane_holds_its_table_until_restored_nodes_register_again() -> None:
    """Restored nodes know only the shards of their last Register: the table built from that is
    held back (revision stays 0, nothing is sent) until they register again, or the hold limit.
    A table published before the plane restored its state and opened the port (the embedded
    router's first) does not end the hold: it knows no node at all."""
    now = [100.0]
    watch = RouteWatch(hold_limit=30, clock=lambda: now[0])
    watch.publish({}, [])
    watch.methods()
    restored = Node("gpu01", schema.Register(node_id="gpu01"), NodeState.UNREACHABLE, 0, 0, connected=False)
    lost = Node("gpu02", schema.Register(node_id="gpu02"), NodeState.LOST, 0, 0, connected=False)
    watch.publish({}, [restored, lost])
    assert watch.revision == 0
    restored.connected = True
    watch.publish(_table("http://127.0.0.1:9001"), [restored, lost])
    assert watch.revision == 1

    later = RouteWatch(hold_limit=30, clock=lambda: now[0])
    later.methods()
    restored.connected = False
    later.publish({}, [restored])
    now[0] += 29
    later.publish({}, [restored])
    assert later.revision == 0
    now[0] += 1
    later.publish({}, [restored])
    assert later.revision == 1


async def test_watch_over_tls_verifies_the_control_plane(tmp_path: Path) -> None:
    """``https://`` with ``ca`` (the router's --control-ca): the table arrives over TLS; without
    the CA the control plane's certificate is not trusted and no table is taken from it."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    watch = RouteWatch()
    port = free_port()
    async with trio.open_nursery() as nursery:
        tls = ServerTLS(tmp_path / "server.pem", tmp_path / "server.key")
        server = StreamServer(_no_agents, tls=tls, methods=watch.methods())
        await nursery.start(server.serve, "127.0.0.1", port)
        watch.publish(_table("http://127.0.0.1:9001"))
        trusted = WatchedRoutes(f"https://127.0.0.1:{port}", ca=tmp_path / "ca.pem")
        await nursery.start(trusted.run)
        assert list(trusted.routes()) == ["m"]
        untrusted = WatchedRoutes(f"https://127.0.0.1:{port}", first_wait=0.5)
        await nursery.start(untrusted.run)
        assert dict(untrusted.routes()) == {}
        nursery.cancel_scope.cancel()


def test_without_tokens_only_loopback_peers_may_watch() -> None:
    """No [api] tokens: a loopback peer may watch (as the admin API), any other is PERMISSION_DENIED
    naming the setting; with tokens, a peer's address alone is worth nothing."""

    class Peer(ServerStream):
        def __init__(self, address: str, authorization: str = "") -> None:
            self.peer = PeerIdentity(address)
            self.metadata = {"authorization": authorization} if authorization else {}

    open_watch = RouteWatch()
    open_watch.authorize(Peer("127.0.0.1:5000"))
    open_watch.authorize(Peer("::1:5000"))
    with pytest.raises(RpcError) as info:
        open_watch.authorize(Peer("10.0.0.7:5000"))
    assert info.value.code is Code.PERMISSION_DENIED and "read_tokens" in info.value.message

    guarded = RouteWatch(["t1", "t2"])
    guarded.authorize(Peer("10.0.0.7:5000", "Bearer t2"))
    guarded.authorize(Peer("10.0.0.7:5000", "bearer t1"))
    for peer in (Peer("127.0.0.1:5000"), Peer("127.0.0.1:5000", "Bearer t3"), Peer("10.0.0.7:1", "Basic t1")):
        with pytest.raises(RpcError) as info:
            guarded.authorize(peer)
        assert info.value.code is Code.UNAUTHENTICATED


async def test_a_control_url_naming_an_http1_port_says_which_address_to_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--control pointed at the router's or the admin API's port (HTTP/1.1): the router's one line
    names what answered and the address it should have used, and nothing but the HTTP/2 preface and
    SETTINGS was sent there (no token)."""
    received = bytearray()

    async def http1(stream: trio.SocketStream) -> None:
        received.extend(await stream.receive_some(4096))
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, http1, 0)
        port = listeners[0].socket.getsockname()[1]
        watched = WatchedRoutes(f"http://127.0.0.1:{port}", token="secret-token", first_wait=0.5)
        with caplog.at_level("WARNING", logger="llmgw.router.watch"):
            await nursery.start(watched.run)
        nursery.cancel_scope.cancel()
    line = next(r.getMessage() for r in caplog.records if "no table yet" in r.getMessage())
    assert "answered with HTTP/1.1" in line and "--control is the control plane's [listen] agents" in line
    assert received.startswith(b"PRI * HTTP/2.0") and b"secret-token" not in received


async def test_a_watcher_that_stops_reading_is_sent_the_latest_table_not_a_backlog() -> None:
    """A watcher that stops reading costs the server its HTTP/2 window and one shared table, not a
    queue: 40 changes of a 100 KB table while it does not read (it buffers at most 300 KB), then it
    reads again and gets a few tables ending at the latest revision, not 40."""
    port = free_port()
    watch = RouteWatch()
    key = "k" * 1000

    def big(i: int) -> dict[str, ModelRoutes]:
        ups = tuple(
            Upstream(f"m-r{j}", f"http://10.0.{j // 250}.{j % 250}:{8000 + i}", key) for j in range(100)
        )
        return {"m": ModelRoutes(ups)}

    async with trio.open_nursery() as nursery:
        await _serve(watch, port, nursery)
        watch.publish(big(0))
        request = bytes(schema.WatchRoutesRequest())
        options = CallOptions(max_message_size=300_000)
        url = f"http://127.0.0.1:{port}"
        async with server_stream(url, schema.WATCH_ROUTES_PATH, request, options) as call:
            first = await call.receive()
            assert first is not None and len(first) > 100_000
            for i in range(1, 41):
                watch.publish(big(i))
                await trio.lowlevel.checkpoint()  # the server's handler runs between changes: it may send
            received = 0
            while True:
                payload = await call.receive()
                assert payload is not None
                received += 1
                if schema.RouteTable.parse(payload).revision == watch.revision:
                    break
        nursery.cancel_scope.cancel()
    assert watch.revision == 41
    assert received <= 6, received  # what the client buffered (300 KB and its window), then the latest
