"""A grpcio server that plays the control plane for agent tests: an independent peer, not our server.

It answers every Register with an Ack, records everything each node sends, and lets a test push
commands down a node's stream. Waiting is done by polling with a deadline (``wait_for``, which is
``tests.support.poll``), never by sleeping a fixed time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

import schema
from tests.support import poll as wait_for  # noqa: F401 (the agent tests import it from here)


class NodeStream:
    """One agent stream as the fake control plane sees it."""

    def __init__(self) -> None:
        self.received: list[schema.AgentMessage] = []
        #: When each of ``received`` arrived (``time.monotonic``), for tests that time heartbeats.
        self.times: list[float] = []
        self.outbox: queue.Queue[schema.ControlMessage | None] = queue.Queue()
        self.closed = threading.Event()
        self._next_id = 1000

    @property
    def register(self) -> schema.Register:
        first = self.received[0]
        assert first.register is not None
        return first.register

    def send(self, **fields: object) -> int:
        self._next_id += 1
        self.outbox.put(schema.ControlMessage(message_id=self._next_id, **fields))  # type: ignore[arg-type]
        return self._next_id

    def shard_updates(self, shard_id: str) -> list[schema.ShardStatus]:
        return [m.shard for m in list(self.received) if m.shard is not None and m.shard.shard_id == shard_id]

    def acks(self) -> dict[int, schema.Ack]:
        return {m.ack.message_id: m.ack for m in list(self.received) if m.ack is not None}


class GrpcioControlPlane:
    def __init__(self) -> None:
        self.streams: list[NodeStream] = []
        self._lock = threading.Lock()
        self.port = 0
        self._server: grpc.Server | None = None

    def _connect(
        self, requests: Iterator[schema.AgentMessage], context: grpc.ServicerContext
    ) -> Iterator[schema.ControlMessage]:
        node = NodeStream()
        with self._lock:
            self.streams.append(node)

        def pump() -> None:
            try:
                for msg in requests:
                    # times first: a reader zipping the two lists never sees a message without its time.
                    node.times.append(time.monotonic())
                    node.received.append(msg)
                    if msg.register is not None:
                        node.outbox.put(
                            schema.ControlMessage(
                                message_id=1, ack=schema.Ack(message_id=msg.message_id, ok=True)
                            )
                        )
            except grpc.RpcError:
                pass
            finally:
                node.closed.set()
                node.outbox.put(None)

        threading.Thread(target=pump, daemon=True).start()
        while (out := node.outbox.get()) is not None:
            yield out

    def start(self, port: int = 0) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handler = grpc.method_handlers_generic_handler(
            schema.SERVICE,
            {
                schema.METHOD: grpc.stream_stream_rpc_method_handler(
                    self._connect, request_deserializer=schema.AgentMessage.parse, response_serializer=bytes
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        self.port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        self._server = server
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(10)
            self._server = None
        for node in self.streams:
            node.outbox.put(None)

    def latest(self, node_id: str, after: int = 0) -> NodeStream | None:
        """The newest registered stream of ``node_id`` among those opened after the first ``after``."""
        for node in reversed(list(self.streams)[after:]):
            if node.received and node.received[0].register and node.received[0].register.node_id == node_id:
                return node
        return None
