"""The wire contract: generated messages are fresh, and the envelope codec frames and refuses correctly."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schema
from schema import envelope
from schema.rpc import (
    Code,
    decode_connect_end_stream,
    decode_grpc_message,
    encode_connect_end_stream,
    encode_grpc_message,
)


def test_generated_messages_are_fresh() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.protogen", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_messages_round_trip_with_oneof() -> None:
    msg = schema.ControlMessage(
        message_id=7,
        start=schema.StartShard(
            shard_id="r1-s0",
            replica_id="r1",
            profile=schema.EngineProfile(engine="vllm", model="m", tensor_parallel_size=8, env={"A": "1"}),
            gpu_indices=[0, 1, 2, 3, 4, 5, 6, 7],
        ),
    )
    back = schema.ControlMessage.parse(bytes(msg))
    assert back == msg
    import betterproto2

    assert betterproto2.which_one_of(back, "msg")[0] == "start"


@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(min_value=1, max_value=64))
def test_decoder_reassembles_any_chunking(payloads: list[bytes], chunk: int) -> None:
    wire = b"".join(envelope.encode(p) for p in payloads)
    dec = envelope.EnvelopeDecoder()
    out: list[bytes] = []
    for i in range(0, len(wire), chunk):
        dec.receive_data(wire[i : i + chunk])
        while isinstance(ev := dec.next_event(), envelope.Envelope):
            out.append(ev.payload)
    dec.receive_data(b"")
    assert dec.next_event() is None
    assert out == payloads


def test_oversized_length_is_refused_from_the_header_alone() -> None:
    dec = envelope.EnvelopeDecoder(max_size=1024)
    dec.receive_data(envelope.HEADER.pack(0, 4 * 1024**3 - 1))
    with pytest.raises(envelope.MessageTooLarge, match=r"incoming message of 4294967295 bytes exceeds"):
        dec.next_event()


def test_outgoing_oversized_is_refused() -> None:
    with pytest.raises(envelope.MessageTooLarge, match="outgoing"):
        envelope.encode(b"x" * 11, max_size=10)


def test_truncated_envelope_is_named() -> None:
    dec = envelope.EnvelopeDecoder()
    dec.receive_data(envelope.encode(b"hello")[:-2])
    assert dec.next_event() is envelope.NEED_DATA
    dec.receive_data(b"")
    with pytest.raises(envelope.TruncatedEnvelope, match=r"8 byte\(s\) of 10 received"):
        dec.next_event()


def test_a_websocket_message_holds_exactly_one_envelope() -> None:
    assert envelope.decode_one(envelope.encode(b"hi", envelope.FLAG_END_STREAM)).end_stream
    for bad in (b"", envelope.encode(b"a") + envelope.encode(b"b"), envelope.encode(b"abc")[:-1]):
        with pytest.raises(envelope.FramingError):
            envelope.decode_one(bad)
    with pytest.raises(envelope.MessageTooLarge, match="exceeds the limit of 2 bytes"):
        envelope.decode_one(envelope.encode(b"abc"), max_size=2)


def test_content_types_name_their_protocol() -> None:
    from schema.rpc import protocol_of, request_headers

    for protocol in ("grpc", "connect"):
        assert protocol_of(dict(request_headers(protocol))["content-type"]) == protocol
    assert protocol_of("application/grpc; charset=utf-8") == "grpc"
    assert protocol_of("application/json") is None
    with pytest.raises(ValueError, match="'rest': expected one of grpc, connect"):
        request_headers("rest")


def test_grpc_message_percent_coding_round_trips_unicode() -> None:
    text = "gpu07: refusé ✓ 100%\n"
    encoded = encode_grpc_message(text)
    assert encoded.isascii() and "%25" in encoded
    assert decode_grpc_message(encoded) == text
    assert decode_grpc_message("bad %zz escape") == "bad %zz escape"


def test_connect_end_stream() -> None:
    assert decode_connect_end_stream(encode_connect_end_stream(Code.OK)) is None
    err = decode_connect_end_stream(encode_connect_end_stream(Code.CANCELLED, "bye"))
    assert err is not None and err.code is Code.CANCELLED and err.message == "bye"
    assert b'"canceled"' in encode_connect_end_stream(Code.CANCELLED)
    bad = decode_connect_end_stream(b"{nope")
    assert bad is not None and bad.code is Code.INTERNAL
