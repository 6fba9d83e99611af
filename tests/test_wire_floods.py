"""HTTP/2 control-frame floods (CVE-2019-9512 PING, -9515 SETTINGS, and their kin): a peer that sends
frames that carry no request faster than anyone needs gets GOAWAY(ENHANCE_YOUR_CALM) and one log
line, while a long-lived agent stream that PINGs all day is never caught: the budget is per time
window, not per lifetime. The floods come from a raw HTTP/2 peer (tests/rawh2.py) at a real server;
the budget's arithmetic over minutes is checked sans-IO with made-up times."""

from __future__ import annotations

import logging
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
import pytest
import trio
from h2.errors import ErrorCodes
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, SettingsFrame, WindowUpdateFrame

from tests.rawh2 import RawPeer
from tests.support import apoll
from tests.wirepeers import echo_handler, heartbeat
from transport import CallOptions, ServerLimits, StreamServer, open_stream
from transport.h2proto import CloseConnection, FrameBudget, ServerProtocol

LOGGER = "llmgw.transport.server"


# -- the budget, sans-IO ---------------------------------------------------------------------------


def test_budget_is_per_window_not_per_lifetime() -> None:
    budget = FrameBudget(10, 1.0)
    # Ten a second for an hour of made-up time: 36,000 frames, never over.
    assert all(budget.spend(i / 10) for i in range(36_000))
    # Then eleven at one instant: the eleventh is over (the bucket had refilled to ten, no more).
    now = 3600.0 + 5
    assert [budget.spend(now) for _ in range(11)] == [True] * 10 + [False]


def _pair(
    limits: ServerLimits,
) -> tuple[h2.connection.H2Connection, h2.connection.H2Connection, ServerProtocol]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())  # the SETTINGS ACK
    return client, server, ServerProtocol(server, limits, ["/x"])


def _decisions(
    client: h2.connection.H2Connection, server: h2.connection.H2Connection, proto: ServerProtocol, now: float
) -> list[object]:
    return [proto.receive(event, now) for event in server.receive_data(client.data_to_send())]


def test_an_agent_pinging_every_few_seconds_for_hours_is_never_caught() -> None:
    """Two hours of an agent's keepalive (a PING every 2 s) and a gRPC client's BDP probes and window
    updates (10 a second): 75,600 control frames over the connection's life, the budget 2,000 per 10 s."""
    client, server, proto = _pair(ServerLimits())
    for second in range(0, 2 * 3600, 2):
        client.ping(second.to_bytes(8, "big"))
        for _ in range(20):
            client.increment_flow_control_window(1)
        assert not any(
            isinstance(d, CloseConnection) for d in _decisions(client, server, proto, float(second))
        )
        server.data_to_send()
    assert sum(proto.control_counts.values()) == 75_600


@pytest.mark.parametrize("kind", ["PING", "SETTINGS", "WINDOW_UPDATE", "PRIORITY", "empty DATA"])
def test_a_burst_over_the_budget_is_named(kind: str) -> None:
    limits = ServerLimits(max_control_frames=100, control_frame_window=10.0)
    client, server, proto = _pair(limits)
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "x")])
    for i in range(101):
        if kind == "PING":
            client.ping(i.to_bytes(8, "big"))
        elif kind == "SETTINGS":
            client.update_settings({})
        elif kind == "WINDOW_UPDATE":
            client.increment_flow_control_window(1)
        elif kind == "PRIORITY":
            client.prioritize(sid, weight=1 + i % 200)
        else:
            client.send_data(sid, b"")
    decisions = [d for d in _decisions(client, server, proto, 1.0) if isinstance(d, CloseConnection)]
    assert len(decisions) == 1, decisions
    assert decisions[0].error_code is ErrorCodes.ENHANCE_YOUR_CALM
    assert f"more than 100 control frames within 10 s ({kind} 101 on this connection)" in decisions[0].detail


# -- floods at a real server -----------------------------------------------------------------------


def _frames(kind: str, n: int) -> bytes:
    if kind == "SETTINGS":
        one = SettingsFrame(0).serialize()
    elif kind == "PING":
        ping = PingFrame(0)
        ping.opaque_data = b"flooding"
        one = ping.serialize()
    else:
        update = WindowUpdateFrame(0)
        update.window_increment = 1
        one = update.serialize()
    return bytes(one) * n


@pytest.mark.parametrize("kind", ["SETTINGS", "PING", "WINDOW_UPDATE"])
async def test_a_flood_of_control_frames_gets_goaway_and_one_warning(
    kind: str, echo_server: tuple[StreamServer, int], caplog: pytest.LogCaptureFixture
) -> None:
    """200,000 frames, as the operator's check sent them; the server stops at its budget (2,000 per
    10 s), answers no more of them, and the agent stream beside it does not notice."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    _, port = echo_server
    async with open_stream(f"http://127.0.0.1:{port}") as bystander:
        peer = await RawPeer.connect(port)

        async def flood() -> None:
            try:
                await peer.send(_frames(kind, 200_000))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # closed under us after the GOAWAY: what is expected

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            frames = await peer.read_until_closed(deadline=30)
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert [g.error_code for g in goaways] == [ErrorCodes.ENHANCE_YOUR_CALM], goaways
        assert b"control-frame flood" in goaways[0].additional_data
        assert kind.encode() in goaways[0].additional_data
        answers: Callable[[Frame], bool] = (
            (lambda f: isinstance(f, PingFrame) and "ACK" in f.flags)
            if kind == "PING"
            else (lambda f: isinstance(f, SettingsFrame) and "ACK" in f.flags)
        )
        # At most the budget was answered (plus the ACK of the preface's SETTINGS), not 200,000.
        assert sum(1 for f in frames if answers(f)) <= 2001
        warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "control-frame flood" in warnings[0].getMessage()
        assert "ENHANCE_YOUR_CALM" in warnings[0].getMessage()
        await bystander.send(heartbeat(7))
        reply = await bystander.receive()
        assert reply is not None and reply.ack is not None and reply.ack.message_id == 7


async def test_a_long_lived_stream_pinging_past_the_lifetime_count_is_never_caught(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget of 8 control frames a second and a client that PINGs 4 times a second: 24 PINGs
    (three budgets' worth) go by on one stream, and it still works."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    limits = ServerLimits(max_control_frames=8, control_frame_window=1.0)
    server = StreamServer(echo_handler, limits=limits)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    options = CallOptions(keepalive_interval=0.25, keepalive_timeout=5.0)
    async with open_stream(f"http://127.0.0.1:{port}", options) as stream:
        await stream.send(heartbeat(1))
        assert (await stream.receive()) is not None

        def pings() -> int | None:
            counts = [p.control_counts.get("PING", 0) for p in server._protocols.values()]
            return counts[0] if counts and counts[0] >= 24 else None

        await apoll("24 PINGs from the client", pings, timeout=60)
        await stream.send(heartbeat(2))
        reply = await stream.receive()
        assert reply is not None and reply.ack is not None and reply.ack.message_id == 2
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
