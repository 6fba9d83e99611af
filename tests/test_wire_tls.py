"""TLS and mutual TLS: the handler sees the identity in the client certificate; bad clients are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
import trustme

from tests.wirepeers import echo_handler, register
from transport import (
    CallOptions,
    ClientTLS,
    ConnectionLost,
    ServerLimits,
    ServerTLS,
    StreamServer,
    open_stream,
)


@attrs.frozen
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    node_cert: Path
    node_key: Path
    rogue_cert: Path
    rogue_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(d / "server.pem")
    server.private_key_pem.write_to_path(d / "server.key")
    node = ca.issue_cert("gpu07.nodes.llmgw", common_name="gpu07")
    node.cert_chain_pems[0].write_to_path(d / "node.pem")
    node.private_key_pem.write_to_path(d / "node.key")
    rogue = other_ca.issue_cert("gpu07.nodes.llmgw", common_name="gpu07")
    rogue.cert_chain_pems[0].write_to_path(d / "rogue.pem")
    rogue.private_key_pem.write_to_path(d / "rogue.key")
    return Pki(
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "node.pem",
        d / "node.key",
        d / "rogue.pem",
        d / "rogue.key",
    )


@pytest.fixture
async def mtls_port(nursery: trio.Nursery, pki: Pki) -> AsyncIterator[int]:
    tls = ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca, require_client_cert=True)
    server = StreamServer(echo_handler, tls=tls, limits=ServerLimits(handshake_timeout=5))
    yield await nursery.start(server.serve, "127.0.0.1", 0)


# WebSocket has one framing of its own: the protocol switch applies to HTTP/2 only.
@pytest.mark.parametrize(("scheme", "protocol"), [("https", "grpc"), ("https", "connect"), ("wss", "grpc")])
async def test_handler_sees_certificate_identity(
    mtls_port: int, pki: Pki, scheme: str, protocol: str
) -> None:
    tls = ClientTLS(ca_file=pki.ca, cert_file=pki.node_cert, key_file=pki.node_key)
    async with open_stream(
        f"{scheme}://127.0.0.1:{mtls_port}", CallOptions(protocol=protocol, tls=tls)
    ) as stream:  # type: ignore[arg-type]
        await stream.send(register("whoami"))
        reply = await stream.receive()
    assert reply is not None and reply.ack.error == "gpu07,gpu07.nodes.llmgw"


@pytest.mark.parametrize(
    ("cert", "key"),
    [(None, None), ("rogue_cert", "rogue_key")],
    ids=["no-client-cert", "cert-from-another-ca"],
)
async def test_clients_without_a_valid_certificate_are_refused(
    mtls_port: int, pki: Pki, cert: str | None, key: str | None
) -> None:
    tls = ClientTLS(
        ca_file=pki.ca,
        cert_file=getattr(pki, cert) if cert else None,
        key_file=getattr(pki, key) if key else None,
    )
    with pytest.raises(ConnectionLost) as info:
        async with open_stream(f"https://127.0.0.1:{mtls_port}", CallOptions(tls=tls)) as stream:
            await stream.send(register("whoami"))
            await stream.receive()
    assert "client certificate" in str(info.value)
    # And the server still serves a good client afterwards.
    good = ClientTLS(ca_file=pki.ca, cert_file=pki.node_cert, key_file=pki.node_key)
    async with open_stream(f"https://127.0.0.1:{mtls_port}", CallOptions(tls=good)) as stream:
        await stream.send(register("whoami"))
        assert (await stream.receive()) is not None


async def test_client_refuses_a_server_it_does_not_trust(mtls_port: int, pki: Pki) -> None:
    tls = ClientTLS(cert_file=pki.node_cert, key_file=pki.node_key)  # system CAs only
    with pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
        async with open_stream(f"https://127.0.0.1:{mtls_port}", CallOptions(tls=tls)):
            pass
