"""The heartbeat fast path agrees with betterproto2 on every message, and falls back on anything else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import schema
from schema.fastpath import decode_agent_message

u32 = st.integers(min_value=0, max_value=2**32 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)

heartbeats = st.builds(
    schema.AgentMessage,
    message_id=u64,
    heartbeat=st.builds(
        schema.Heartbeat,
        node_id=st.text(max_size=20),
        gpus=st.lists(
            st.builds(schema.GpuUsage, index=u32, memory_used_mib=u64, utilization_percent=u32), max_size=16
        ),
    ),
)
others = st.one_of(
    st.builds(
        schema.AgentMessage,
        message_id=u64,
        register=st.builds(schema.Register, node_id=st.text(max_size=10), cpu_count=u32),
    ),
    st.builds(
        schema.AgentMessage,
        message_id=u64,
        shard=st.builds(schema.ShardStatus, shard_id=st.text(max_size=10), exit_code=st.integers(-5, 300)),
    ),
    st.builds(
        schema.AgentMessage, message_id=u64, ack=st.builds(schema.Ack, message_id=u64, ok=st.booleans())
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(heartbeats, others))
def test_agrees_with_betterproto2(message: schema.AgentMessage) -> None:
    payload = bytes(message)
    assert decode_agent_message(payload) == schema.AgentMessage.parse(payload) == message


def test_unknown_fields_take_the_generic_path() -> None:
    beat = bytes(schema.AgentMessage(message_id=3, heartbeat=schema.Heartbeat(node_id="n1")))
    # An extra field 99 (varint) that a newer agent might send: the generic parser skips it.
    assert decode_agent_message(beat + b"\x98\x06\x01") == schema.AgentMessage.parse(beat + b"\x98\x06\x01")


def test_truncated_heartbeat_is_an_error_like_betterproto2s() -> None:
    beat = bytes(schema.AgentMessage(message_id=3, heartbeat=schema.Heartbeat(node_id="node-01")))
    try:
        schema.AgentMessage.parse(beat[:-2])
        generic_fails = False
    except Exception:
        generic_fails = True
    try:
        decode_agent_message(beat[:-2])
        fast_fails = False
    except Exception:
        fast_fails = True
    assert fast_fails == generic_fails
