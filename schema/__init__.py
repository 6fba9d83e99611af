"""The wire contract shared by the agent and the control plane, and nothing else.

``schema`` holds the generated protobuf messages (``llmgw.v1``), the sans-IO envelope codec both ends
frame them with, and the RPC status vocabulary (gRPC codes, Connect error names, typed errors). The agent
never imports ``control`` and ``control`` never imports ``agent``: this package is all they share.
"""

from schema.gen.llmgw.v1 import (
    Ack,
    AgentMessage,
    ControlMessage,
    DrainShard,
    EngineInstall,
    EngineProfile,
    FabricAttachment,
    Gpu,
    GpuUsage,
    Heartbeat,
    LogsReply,
    LogsRequest,
    ModelRoute,
    PortRange,
    Register,
    RouteTable,
    RouteUpstream,
    ShardLoad,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
    WatchRoutesRequest,
)

SERVICE = "llmgw.v1.AgentService"
METHOD = "Connect"
#: The HTTP/2 path of the one RPC, for gRPC and Connect alike.
CONNECT_PATH = f"/{SERVICE}/{METHOD}"
#: The WebSocket route that carries the same envelopes for HTTP/1.1-only networks.
WEBSOCKET_PATH = f"/ws/{SERVICE}/{METHOD}"
#: The route watch (server streaming: one WatchRoutesRequest in, RouteTable snapshots out), served on
#: the same port as the agent streams, for routers.
ROUTE_SERVICE = "llmgw.v1.RouteService"
WATCH_ROUTES_PATH = f"/{ROUTE_SERVICE}/WatchRoutes"
#: The most lines one LogsRequest gets: the agent reads no more, and the admin API refuses a
#: ``lines`` above it (400 naming the range).
MAX_LOG_LINES = 10_000
#: The most requests a ShardLoad may say are running or waiting (far above any engine's batch plus
#: queue): the agent clamps above it and flags the sample, the control plane refuses it.
MAX_LOAD_REQUESTS = 1_000_000
#: The most generation tokens per second a ShardLoad may say, on the same terms.
MAX_LOAD_TOKENS_PER_SECOND = 10_000_000.0

__all__ = [
    "CONNECT_PATH",
    "MAX_LOAD_REQUESTS",
    "MAX_LOAD_TOKENS_PER_SECOND",
    "MAX_LOG_LINES",
    "METHOD",
    "ROUTE_SERVICE",
    "SERVICE",
    "WATCH_ROUTES_PATH",
    "WEBSOCKET_PATH",
    "Ack",
    "AgentMessage",
    "ControlMessage",
    "DrainShard",
    "EngineInstall",
    "EngineProfile",
    "FabricAttachment",
    "Gpu",
    "GpuUsage",
    "Heartbeat",
    "LogsReply",
    "LogsRequest",
    "ModelRoute",
    "PortRange",
    "Register",
    "RouteTable",
    "RouteUpstream",
    "ShardLoad",
    "ShardState",
    "ShardStatus",
    "StartShard",
    "StopShard",
    "WatchRoutesRequest",
]
