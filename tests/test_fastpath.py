"""The heartbeat fast path agrees with betterproto2 on every message, and falls back on anything else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import schema
from schema.fastpath import decode_agent_message

u32 = st.integers(min_value=0, max_value=2**32 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
#: No NaN: NaN != NaN, so equality could not tell the parsers agree (the control plane refuses it).
doubles = st.floats(allow_nan=False)

heartbeats = st.builds(
    schema.AgentMessage,
    message_id=u64,
    heartbeat=st.builds(
        schema.Heartbeat,
        node_id=st.text(max_size=20),
        gpus=st.lists(
            st.builds(schema.GpuUsage, index=u32, memory_used_mib=u64, utilization_percent=u32), max_size=16
        ),
        loads=st.lists(
            st.builds(
                schema.ShardLoad,
                shard_id=st.text(max_size=20),
                replica_id=st.text(max_size=20),
                requests_running=st.none() | u32,
                requests_waiting=st.none() | u32,
                kv_cache_usage=st.none() | doubles,
                prefix_cache_hit_rate=st.none() | doubles,
                generation_tokens_per_second=st.none() | doubles,
                sample_age_seconds=doubles,
                stale=st.booleans(),
                error=st.text(max_size=30),
            ),
            max_size=8,
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


def test_engine_loads_take_the_fast_path() -> None:
    """A heartbeat carrying engine loads (every one does, on a node with engines) is read by the
    fast path itself, not handed to betterproto2: ``_heartbeat`` raises on what it cannot read."""
    from schema.fastpath import _heartbeat

    beat = schema.Heartbeat(
        node_id="gpu07",
        gpus=[schema.GpuUsage(index=0, memory_used_mib=70_000, utilization_percent=93)],
        loads=[
            schema.ShardLoad(
                shard_id="chat-0-0",
                replica_id="chat-0",
                requests_running=0,
                requests_waiting=4,
                kv_cache_usage=0.41,
                generation_tokens_per_second=512.5,
                sample_age_seconds=0.3,
            ),
            schema.ShardLoad(shard_id="big-0-1", stale=True, error="GET /metrics timed out after 5 s"),
        ],
    )
    assert _heartbeat(bytes(beat)) == beat
    # requests_running=0 is present (optional): "none running", not "unknown".
    assert _heartbeat(bytes(beat)).loads[0].requests_running == 0
    assert _heartbeat(bytes(beat)).loads[1].requests_running is None
