"""The control plane's side of the agent stream: one port for gRPC, Connect and WebSocket."""

from control.transport.server import (
    Handler,
    PeerIdentity,
    ServerLimits,
    ServerStream,
    ServerTLS,
    StreamServer,
)

__all__ = ["Handler", "PeerIdentity", "ServerLimits", "ServerStream", "ServerTLS", "StreamServer"]
