"""Client-side TLS: which CA to trust, and the client certificate that names this node (mutual TLS)."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs


@attrs.frozen
class ClientTLS:
    """TLS settings for the agent's connection; all fields optional.

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
