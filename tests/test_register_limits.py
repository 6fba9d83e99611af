"""Peer data is bounded: a real control plane refuses a Register over any limit with
INVALID_ARGUMENT naming the field and the limit, keeps nothing of it (its RSS stays flat), and
escapes what a peer sent in its log. The peer is grpcio, a client nobody here wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import hpack
import pytest
import trio
from hyperframe.frame import DataFrame, Frame, HeadersFrame

import schema
from control.agentsvc import MAX_GPUS, MAX_LABELS, MAX_NAME, MAX_SHARDS, REGISTER_TIMEOUT, gpu_usage_problem
from schema import envelope
from tests.fleet_procs import ControlProcess, catalog, poll
from tests.rawh2 import RawPeer
from tests.rawws import binary_frame_head, read_until_closed, ws_connect, ws_frames
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


def _in_range(token: str, **changes: object) -> schema.Register:
    """A Register a real 4-GPU node could send (GPU 2 skipped by discovery: indices have gaps),
    joining with ``token``; ``changes`` replace its fields, ``gpu0`` the first GPU's."""
    gpus = [_gpu(i) for i in (0, 1, 3)]
    gpu0 = changes.pop("gpu0", None)
    if isinstance(gpu0, dict):
        for name, value in gpu0.items():
            setattr(gpus[0], name, value)
    reg = schema.Register(
        node_id="n1",
        hostname="h",
        token=token,
        gpus=gpus,
        cpu_count=224,
        memory_total_mib=2 << 20,
        engine_ports=schema.PortRange(first=8000, last=8999),
        fabrics=[schema.FabricAttachment(fabric="ib0", hca="mlx5_0", port=1)],
    )
    for name, value in changes.items():
        setattr(reg, name, value)
    return reg


OUT_OF_RANGE: list[tuple[str, dict[str, object], str, str]] = [
    # The Register, one value at a time: each was accepted and kept.
    ("port 0", {"engine_ports": schema.PortRange(first=0, last=65535)}, "engine_ports.first is 0", "1-65535"),
    (
        "port 65536",
        {"engine_ports": schema.PortRange(first=8000, last=65536)},
        "engine_ports.last",
        "1-65535",
    ),
    (
        "ports reversed",
        {"engine_ports": schema.PortRange(first=9000, last=8000)},
        "engine_ports",
        "9000-8000",
    ),
    ("gpu index", {"gpu0": {"index": 2**31 - 1}}, "gpus[0].index is 2147483647", f"0-{MAX_GPUS - 1}"),
    ("gpu index twice", {"gpu0": {"index": 3}}, "gpus[2].index is 3", "unique"),
    ("gpu memory", {"gpu0": {"memory_total_mib": 2**63 - 1}}, "gpus[0].memory_total_mib", str(16 << 20)),
    ("capability", {"gpu0": {"compute_capability": "99999.9"}}, "gpus[0].compute_capability", "major.minor"),
    ("nvlink peer", {"gpu0": {"nvlink_peers": [1, 1000]}}, "gpus[0].nvlink_peers[1]", "1000"),
    ("utilization", {"gpu0": {"utilization_percent": 101}}, "gpus[0].utilization_percent", "0-100%"),
    ("node memory", {"memory_total_mib": 2**63 - 1}, "memory_total_mib", str(1 << 30)),
    ("cpus", {"cpu_count": 2**32 - 1}, "cpu_count", "65536"),
    (
        "hca port",
        {"fabrics": [schema.FabricAttachment(fabric="ib0", hca="mlx5_0", port=70000)]},
        "fabrics[0].port",
        "255",
    ),
    (
        "shard port",
        {"shards": [schema.ShardStatus(shard_id="lim-r0-s0", replica_id="lim-r0", http_port=70000)]},
        "shards[0].http_port",
        "0-65535",
    ),
]


@pytest.mark.parametrize("case", OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_a_register_with_a_value_out_of_range_is_refused_naming_the_field(
    cp: ControlProcess, case: tuple[str, dict[str, object], str, str]
) -> None:
    """With the join token, so that only the value stands between it and a node the fleet keeps."""
    _, changes, field, expected = case
    text = _refused(cp.agent_port, _in_range(cp.join_token(), **changes), field, expected)
    assert "\n" not in text
    assert cp.api("/api/nodes") == []


def test_a_register_in_range_is_kept_with_its_values(cp: ControlProcess) -> None:
    """The bounds refuse nothing a real node sends: a GPU skipped by discovery (indices 0, 1, 3),
    an H200's memory, capability 10.0 (Blackwell), the full port range."""
    reg = _in_range(
        cp.join_token(),
        gpu0={"memory_total_mib": 143771, "compute_capability": "10.0", "nvlink_peers": [1, 3]},
        engine_ports=schema.PortRange(first=1, last=65535),
    )
    replies, error = _send(cp.agent_port, reg)
    assert replies and replies[0].ack is not None and replies[0].ack.ok, (replies, error)
    nodes = poll("the node listed", lambda: cp.api("/api/nodes") or None)
    assert [n["node_id"] for n in nodes] == ["n1"]


def test_heartbeat_gpu_figures_have_the_same_ranges() -> None:
    ok = [schema.GpuUsage(index=3, memory_used_mib=143771, utilization_percent=100)]
    assert gpu_usage_problem(ok, "Heartbeat.gpus") == ""
    for usage, field in [
        (schema.GpuUsage(index=2**31 - 1), "Heartbeat.gpus[0].index is 2147483647"),
        (schema.GpuUsage(memory_used_mib=2**63 - 1), "Heartbeat.gpus[0].memory_used_mib"),
        (schema.GpuUsage(utilization_percent=250), "Heartbeat.gpus[0].utilization_percent is 250%"),
    ]:
        assert field in gpu_usage_problem([usage], "Heartbeat.gpus")


# -- the first message's cap, the same on every route ------------------------------------------------

#: What each peer announces as its first message: over the 1 MiB first-message cap, under the
#: stream's 4 MiB message limit (the size the operator's check used).
ANNOUNCED = 3_900_000
#: How much of it each peer sends before it waits: more than the cap (on WebSocket the cap must
#: apply while the frame arrives), never the whole (one that never completes must not be held
#: until the Register timeout).
WS_SENT = 1_500_000


async def _h2_first_message(port: int, content_type: str) -> str:
    """A first message announced at ``ANNOUNCED`` bytes over HTTP/2 (as much as the window takes,
    then nothing); the status the stream ended with."""
    peer = await RawPeer.connect(port)
    try:
        body = envelope.HEADER.pack(0, ANNOUNCED) + b"x" * 60_000  # within the 64 KiB initial window
        frames = peer.headers(1, content_type=content_type)
        frames += b"".join(peer.data(1, body[i : i + 16_000]) for i in range(0, len(body), 16_000))
        await peer.send(frames)

        def ended(fs: list[Frame]) -> bool:
            return any(f.stream_id == 1 and "END_STREAM" in f.flags for f in fs if hasattr(f, "flags"))

        frames_in = await peer.read_until("the stream's end", ended, deadline=REGISTER_TIMEOUT)
    finally:
        await peer.aclose()
    decoder = hpack.Decoder()
    fields = [
        (bytes(k).decode(), bytes(v).decode())
        for f in frames_in
        if isinstance(f, HeadersFrame)
        for k, v in decoder.decode(f.data, raw=True)
    ]
    body_in = b"".join(f.data for f in frames_in if isinstance(f, DataFrame))
    return " ".join(f"{k}={v}" for k, v in fields) + " " + body_in.decode("latin-1")


async def _ws_first_message(port: int) -> str:
    """A WebSocket first message announced at ``ANNOUNCED`` bytes (one binary frame), of which
    ``WS_SENT`` are sent, then nothing; the frames the server answered with, in words."""
    sock, received = await ws_connect(port)
    try:
        payload = envelope.HEADER.pack(0, ANNOUNCED - envelope.HEADER_SIZE) + b"x" * (WS_SENT - 5)
        frame = binary_frame_head(ANNOUNCED) + payload

        async def send() -> None:
            try:
                await sock.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # closed under us: what is expected

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            with trio.fail_after(REGISTER_TIMEOUT):
                received = await read_until_closed(sock, received)
            nursery.cancel_scope.cancel()
    finally:
        await sock.aclose()
    return " ".join(ws_frames(received))


ROUTES = {
    "grpc": (lambda port: _h2_first_message(port, "application/grpc"), "grpc-status=8"),
    "connect": (lambda port: _h2_first_message(port, "application/connect+proto"), "resource_exhausted"),
    "websocket": (_ws_first_message, "resource_exhausted"),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_ten_oversized_first_messages_at_once_are_refused_as_they_arrive(
    cp: ControlProcess, route: str
) -> None:
    """Ten unauthenticated peers at once, each announcing a 3.9 MB first message and sending part
    of it: each is refused within seconds (before its message could complete, long before the
    30 s Register timeout), and the control plane's RSS does not grow by what they announced.
    Read whole before the cap applied, ten such WebSocket messages cost 37 MB."""
    assert cp.proc is not None
    attempt, refusal = ROUTES[route]
    port = cp.agent_port

    async def one(took: list[float], answers: list[str]) -> None:
        began = trio.current_time()
        answers.append(await attempt(port))
        took.append(trio.current_time() - began)

    async def ten() -> tuple[list[float], list[str]]:
        took: list[float] = []
        answers: list[str] = []
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(one, took, answers)
        return took, answers

    trio.run(ten)  # warm-up: code paths, the first connections' buffers
    before = rss_kib(cp.proc.pid)
    took, answers = trio.run(ten)
    after = rss_kib(cp.proc.pid)
    print(
        f"{route}: ten 3.9 MB first messages refused in {min(took):.2f}-{max(took):.2f} s; "
        f"control plane RSS {before} KiB -> {after} KiB"
    )
    assert all(refusal in a for a in answers), answers
    assert max(took) < REGISTER_TIMEOUT / 3, took
    # Each peer may cost at most the cap while its message arrives; none is kept.
    assert after - before < 12 * 1024, (before, after)
    assert cp.api("/api/nodes") == []
