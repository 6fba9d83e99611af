"""The one HTTP/2 (gRPC, Connect) and WebSocket package: the client, the server, and what they share.

``schema`` is the wire contract (messages, envelope codec, status vocabulary and content types) and
stays pure; the sockets, trio and h2 driving live here:

- :mod:`transport.h2io`: the connection and stream plumbing both ends use, and the typed errors;
- :mod:`transport.client`: dial once (:func:`~transport.client.connect`), open calls on the
  connection; the route watch's server-streaming call (:func:`~transport.client.server_stream`);
- :mod:`transport.agentstream`: the agent's stream over gRPC, Connect or WebSocket (``open_stream``);
- :mod:`transport.server`: the agent port (sniffing, HTTP/2, WebSocket), its socket IO and handlers;
- :mod:`transport.h2proto`: the server's HTTP/2 event handling, sans-IO (requests, floods);
- :mod:`transport.limits`, :mod:`transport.tls`, :mod:`transport.bursts`: the server's bounds, TLS
  settings for both ends, and log lines that come in bursts;
- :mod:`transport.addresses`: whether a peer is this machine (every listener that answers local
  clients only while it has no tokens).
"""

from schema.rpc import Code, RpcError
from transport.agentstream import AgentStream, open_stream
from transport.client import CallOptions
from transport.h2io import (
    ConnectionLost,
    GoAwayReceived,
    PeerUnresponsive,
    StalledMessage,
    StreamReset,
    TransportError,
)
from transport.limits import ServerLimits
from transport.server import Handler, PeerIdentity, ServerStream, StreamServer
from transport.tls import ClientTLS, ServerTLS

__all__ = [
    "AgentStream",
    "CallOptions",
    "ClientTLS",
    "Code",
    "ConnectionLost",
    "GoAwayReceived",
    "Handler",
    "PeerIdentity",
    "PeerUnresponsive",
    "RpcError",
    "ServerLimits",
    "ServerStream",
    "ServerTLS",
    "StalledMessage",
    "StreamReset",
    "StreamServer",
    "TransportError",
    "open_stream",
]
