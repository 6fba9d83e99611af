"""The agent port's HTTP/2 decisions, sans-IO (transport.h2proto): a real h2 client's requests fed to
a bare h2 server connection, the decisions and what they queued read back by the same client."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events

import schema
from schema import envelope
from schema.rpc import Code, decode_connect_end_stream, request_headers
from transport import ServerLimits
from transport.h2proto import Refused, ServerProtocol, StartCall

PATHS = [schema.CONNECT_PATH, "/llmgw.v1.RouteService/WatchRoutes"]


class Pair:
    """A client and a server connection joined without sockets, and the server's protocol."""

    def __init__(self, limits: ServerLimits | None = None) -> None:
        # The client may send what a careful one would not (control characters): the server decides.
        config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False)
        self.client = h2.connection.H2Connection(config)
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.client.initiate_connection()
        self.server.initiate_connection()
        self.proto = ServerProtocol(self.server, limits or ServerLimits(), PATHS)
        self.server.receive_data(self.client.data_to_send())
        self.client.receive_data(self.server.data_to_send())

    def request(
        self, headers: list[tuple[str, str]], *, accepting: bool = True, open_streams: int = 0
    ) -> tuple[object, list[h2.events.Event]]:
        """Send one request; the protocol's decision, and the client's events for the answer."""
        sid = self.client.get_next_available_stream_id()
        base = [(":method", "POST"), (":scheme", "http"), (":path", schema.CONNECT_PATH), (":authority", "x")]
        pseudo = dict(base) | {k: v for k, v in headers if k.startswith(":")}
        self.client.send_headers(
            sid, [*pseudo.items(), *((k, v) for k, v in headers if not k.startswith(":"))]
        )
        decisions = [
            self.proto.receive(event, 0.0, accepting=accepting, open_streams=open_streams)
            for event in self.server.receive_data(self.client.data_to_send())
        ]
        decision = next(d for d in decisions if d is not None)
        return decision, self.client.receive_data(self.server.data_to_send())


def _answer(events: list[h2.events.Event]) -> tuple[dict[str, str], bytes]:
    fields: dict[str, str] = {}
    body = b""
    for event in events:
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            fields.update({bytes(k).decode(): bytes(v).decode() for k, v in event.headers or []})
        if isinstance(event, h2.events.DataReceived):
            body += event.data or b""
    return fields, body


def test_a_grpc_call_starts_with_its_metadata() -> None:
    pair = Pair()
    decision, events = pair.request([*request_headers("grpc"), ("x-llmgw-node", "gpu01")])
    assert isinstance(decision, StartCall)
    assert (decision.protocol, decision.path, decision.ended) == ("grpc", schema.CONNECT_PATH, False)
    assert decision.metadata["x-llmgw-node"] == "gpu01"
    fields, _ = _answer(events)
    assert fields[":status"] == "200" and fields["content-type"] == "application/grpc+proto"


def test_a_request_that_is_not_an_rpc_gets_415_naming_what_is_taken() -> None:
    decision, events = Pair().request([("content-type", "application/json\x1b[2J")])
    assert isinstance(decision, Refused) and "'application/json\\x1b[2J'" in decision.reason
    fields, body = _answer(events)
    assert fields[":status"] == "415"
    assert b"application/grpc, application/grpc+proto or application/connect+proto" in body


def test_refusals_before_a_call_begins_speak_the_callers_protocol() -> None:
    pair = Pair()
    decision, events = pair.request([*request_headers("grpc"), (":path", "/nope\x1b")])
    assert isinstance(decision, Refused) and "'/nope\\x1b'" in decision.reason
    fields, _ = _answer(events)
    assert fields["grpc-status"] == str(int(Code.UNIMPLEMENTED)) and "served:" in fields["grpc-message"]

    decision, events = pair.request(request_headers("connect"), accepting=False)
    assert isinstance(decision, Refused)
    fields, body = _answer(events)
    assert fields["content-type"] == "application/connect+proto"
    status = decode_connect_end_stream(body[envelope.HEADER_SIZE :])
    assert status is not None and status.code is Code.UNAVAILABLE and status.message == "server shutting down"

    decision, events = pair.request(request_headers("grpc"), open_streams=ServerLimits().max_streams)
    fields, _ = _answer(events)
    assert fields["grpc-status"] == str(int(Code.RESOURCE_EXHAUSTED))

    decision, events = pair.request([*request_headers("grpc"), ("grpc-encoding", "gzip")])
    fields, _ = _answer(events)
    assert fields["grpc-status"] == str(int(Code.UNIMPLEMENTED)) and "gzip" in fields["grpc-message"]


def test_open_streams_at_the_limit_refuse_only_new_calls() -> None:
    limits = ServerLimits(max_streams=10)
    pair = Pair(limits)
    decision, _ = pair.request(request_headers("grpc"), open_streams=9)
    assert isinstance(decision, StartCall)
    decision, _ = pair.request(request_headers("grpc"), open_streams=10)
    assert isinstance(decision, Refused) and "limit of 10 streams" in decision.reason
