"""Peer data is bounded: a real control plane refuses a Register over any limit with
INVALID_ARGUMENT naming the field and the limit, keeps nothing of it (its RSS stays flat), and
escapes what a peer sent in its log. The peer is grpcio, a client nobody here wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import schema
from control.agentsvc import MAX_GPUS, MAX_LABELS, MAX_NAME, MAX_SHARDS
from tests.fleet_procs import ControlProcess, catalog, poll
from tests.support import rss_kib


def _gpu(i: int) -> schema.Gpu:
    return schema.Gpu(
        index=i,
        uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000",
        name="NVIDIA H100 80GB HBM3",
        compute_capability="9.0",
        memory_total_mib=81559,
        pci_bus_id=f"00000000:{i % 256:02X}:00.0",
    )


def _send(port: int, reg: schema.Register) -> tuple[list[schema.ControlMessage], grpc.RpcError | None]:
    """One Register over a grpcio stream; what came back and how the stream ended."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)])
    call = channel.stream_stream(
        schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse
    )

    def requests() -> Iterator[schema.AgentMessage]:
        yield schema.AgentMessage(message_id=1, register=reg)

    replies: list[schema.ControlMessage] = []
    try:
        for reply in call(requests(), timeout=30):
            replies.append(reply)
    except grpc.RpcError as exc:
        return replies, exc
    finally:
        channel.close()
    return replies, None


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProcess]:
    proc = ControlProcess(tmp_path / "cp", catalog("lim", tmp_path / "cp" / "state"))
    proc.start()
    yield proc
    proc.terminate()


def _refused(port: int, reg: schema.Register, field: str, limit: int | str) -> str:
    replies, error = _send(port, reg)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, (replies, error)
    assert len(replies) == 1 and replies[0].ack is not None and not replies[0].ack.ok
    text = replies[0].ack.error
    assert field in text and str(limit) in text, text
    return text


OVER_LIMITS = [
    (
        "gpus",
        lambda: schema.Register(node_id="n1", gpus=[_gpu(i) for i in range(MAX_GPUS + 1)]),
        "gpus",
        MAX_GPUS,
    ),
    (
        "labels",
        lambda: schema.Register(node_id="n1", labels={f"k{i}": "v" for i in range(MAX_LABELS + 1)}),
        "labels",
        MAX_LABELS,
    ),
    ("hostname", lambda: schema.Register(node_id="n1", hostname="h" * (MAX_NAME + 1)), "hostname", MAX_NAME),
    (
        "label value",
        lambda: schema.Register(node_id="n1", labels={"zone": "a" * (MAX_NAME + 1)}),
        "label 'zone'",
        MAX_NAME,
    ),
    (
        "gpu name",
        lambda: schema.Register(node_id="n1", gpus=[schema.Gpu(index=0, name="x" * (MAX_NAME + 1))]),
        "gpus[0].name",
        MAX_NAME,
    ),
    (
        "shards",
        lambda: schema.Register(
            node_id="n1",
            shards=[schema.ShardStatus(shard_id=f"s{i}", replica_id="r") for i in range(MAX_SHARDS + 1)],
        ),
        "shards",
        MAX_SHARDS,
    ),
    ("empty node id", lambda: schema.Register(node_id=""), "node_id is empty", "128"),
    ("long node id", lambda: schema.Register(node_id="n" * 200_000), "node_id", "128"),
]


@pytest.mark.parametrize("case", OVER_LIMITS, ids=[c[0] for c in OVER_LIMITS])
def test_a_register_over_a_limit_is_refused_naming_the_field(cp: ControlProcess, case: tuple) -> None:  # type: ignore[type-arg]
    _, build, field, limit = case
    _refused(cp.agent_port, build(), field, limit)
    assert cp.api("/api/nodes") == []


def test_thirty_thousand_gpus_are_refused_and_the_rss_stays_flat(cp: ControlProcess) -> None:
    """A Register is a stream's first message, bounded before anything about the peer is believed
    (``ServerLimits.max_first_message_size``, 1 MiB): a 3 MB one is refused by its envelope header,
    never buffered or parsed, so refusing it costs nothing however often it comes."""
    assert cp.proc is not None
    big = schema.Register(node_id="n1", hostname="h", gpus=[_gpu(i) for i in range(30_000)])
    assert 1 << 20 < len(bytes(big)) < 4 << 20  # over the first message's bound, under the stream's

    def refused() -> str:
        replies, error = _send(cp.agent_port, big)
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (replies, error)
        return error.details() or ""

    refused()  # warm-up: code paths, the first connection's buffers
    before = rss_kib(cp.proc.pid)
    for _ in range(10):
        text = refused()
    after = rss_kib(cp.proc.pid)
    print(f"control plane RSS around ten refused 30,000-GPU Registers: {before} KiB -> {after} KiB")
    assert "1024 KiB" in text, text
    # Accepted, one such Register took a control plane from 47 to 130 MB; refused ones keep it flat.
    assert after - before < 2 * 1024, (before, after, text)
    assert cp.api("/api/nodes") == []


def test_a_node_id_with_a_newline_and_an_escape_is_refused_and_logged_escaped(cp: ControlProcess) -> None:
    forged = "gpu01\n2026-01-01 00:00:00 INFO llmgw.control: \x1b[2Jall good"
    text = _refused(cp.agent_port, schema.Register(node_id=forged), "node_id", "128")
    assert "\n" not in text and "\x1b" not in text
    poll("the refusal in the log", lambda: "refused a stream" in cp.log.read_text())
    log = cp.log.read_text()
    assert "\x1b" not in log and "\nall good" not in log and "all good" in log
    assert "INFO llmgw.control: \x1b" not in log


def test_a_heartbeat_over_the_gpu_limit_ends_the_stream(cp: ControlProcess) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{cp.agent_port}")
    call = channel.stream_stream(
        schema.CONNECT_PATH, request_serializer=bytes, response_deserializer=schema.ControlMessage.parse
    )
    usage = [schema.GpuUsage(index=i, memory_used_mib=1) for i in range(30_000)]

    def requests() -> Iterator[schema.AgentMessage]:
        yield schema.AgentMessage(
            message_id=1, register=schema.Register(node_id="n1", hostname="h", token=cp.join_token())
        )
        yield schema.AgentMessage(message_id=2, heartbeat=schema.Heartbeat(node_id="n1", gpus=usage))

    replies: list[schema.ControlMessage] = []
    try:
        with pytest.raises(grpc.RpcError) as ended:
            for reply in call(requests(), timeout=30):
                replies.append(reply)
    finally:
        channel.close()
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Heartbeat.gpus has 30000 entries; at most 64" in (ended.value.details() or "")
    # It joined (the join token, a credential issued), and then the heartbeat was not believed.
    assert replies[0].ack is not None and replies[0].ack.ok and replies[0].ack.node_credential
