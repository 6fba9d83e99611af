"""The agent's transport: one full-duplex stream to the control plane over h2 or WebSocket."""

from agent.transport.client import AgentStream, StreamOptions, open_stream
from agent.transport.tls import ClientTLS
from schema.rpc import Code, RpcError
from transport.h2io import (
    ConnectionLost,
    GoAwayReceived,
    PeerUnresponsive,
    StalledMessage,
    StreamReset,
    TransportError,
)

__all__ = [
    "AgentStream",
    "ClientTLS",
    "Code",
    "ConnectionLost",
    "GoAwayReceived",
    "PeerUnresponsive",
    "RpcError",
    "StalledMessage",
    "StreamOptions",
    "StreamReset",
    "TransportError",
    "open_stream",
]
