"""Fixtures that start real servers on loopback ports chosen by the kernel."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import trio

from router import relay
from tests.etcdproc import etcd, etcd_cluster  # noqa: F401 (fixtures: a real etcd, three members)
from tests.wirepeers import echo_handler
from transport import ServerLimits, StreamServer


@pytest.fixture
async def echo_server(nursery: trio.Nursery) -> AsyncIterator[tuple[StreamServer, int]]:
    server = StreamServer(echo_handler, limits=ServerLimits(stall_timeout=1.0, handshake_timeout=2.0))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    yield server, port


@pytest.fixture(params=["native", "python"])
def relay_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once per relay pump (``router.relay``), with ``LLMGW_RELAY`` set to match, so
    that routers the test builds use that pump. Where the native pump was not built (no C
    compiler) its run is skipped, saying so, unless ``LLMGW_REQUIRE_NATIVE_PUMP`` is set (CI)."""
    kind = str(request.param)
    if kind == "native" and not relay.NATIVE_AVAILABLE:
        if os.environ.get("LLMGW_REQUIRE_NATIVE_PUMP"):
            pytest.fail("the native relay pump (router/_pump.c) was not built")
        pytest.skip("the native relay pump was not built here (no C compiler)")
    monkeypatch.setenv("LLMGW_RELAY", kind)
    return kind
