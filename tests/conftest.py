"""Fixtures that start real servers on loopback ports chosen by the kernel."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from control.transport import ServerLimits, StreamServer
from tests.wirepeers import echo_handler


@pytest.fixture
async def echo_server(nursery: trio.Nursery) -> AsyncIterator[tuple[StreamServer, int]]:
    server = StreamServer(echo_handler, limits=ServerLimits(stall_timeout=1.0, handshake_timeout=2.0))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    yield server, port
