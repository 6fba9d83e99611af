"""TLS settings for both ends: which CA to trust and which certificate to present (mutual TLS)."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs


@attrs.frozen
class ClientTLS:
    """TLS settings for a client's connection (the agent's, the route watch's); all fields optional.

    With no ``ca_file`` the system trust store is used. With ``cert_file`` and ``key_file`` the agent
    presents a client certificate: the control plane binds the stream to the node identity in it.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    #: Name to verify the server certificate against, when it differs from the URL's host.
    server_hostname: str | None = None

    def context(self, alpn: list[str]) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca_file is not None:
            ctx.load_verify_locations(cafile=str(self.ca_file))
        if self.cert_file is not None:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file) if self.key_file else None)
        elif self.key_file is not None:
            raise ValueError("a TLS key file was given without its certificate file")
        ctx.set_alpn_protocols(alpn)
        return ctx


@attrs.frozen
class ServerTLS:
    """Server certificate, and the CA that client certificates must chain to (mutual TLS).

    Also the value of the control plane's ``[tls]`` and ``[api.tls]`` tables, structured straight
    from llmgw.toml: the field names are the file's keys."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    require_client_cert: bool = False

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        if self.client_ca is not None:
            ctx.load_verify_locations(cafile=str(self.client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        elif self.require_client_cert:
            raise ValueError("require_client_cert needs client_ca: the CA that signs node certificates")
        # h2 for gRPC and Connect; http/1.1 for the WebSocket route.
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        return ctx
