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
    PortRange,
    Register,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)

SERVICE = "llmgw.v1.AgentService"
METHOD = "Connect"
#: The HTTP/2 path of the one RPC, for gRPC and Connect alike.
CONNECT_PATH = f"/{SERVICE}/{METHOD}"
#: The WebSocket route that carries the same envelopes for HTTP/1.1-only networks.
WEBSOCKET_PATH = f"/ws/{SERVICE}/{METHOD}"

__all__ = [
    "CONNECT_PATH",
    "METHOD",
    "SERVICE",
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
    "PortRange",
    "Register",
    "ShardState",
    "ShardStatus",
    "StartShard",
    "StopShard",
]
