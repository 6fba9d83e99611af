"""The sim's capacity model in a real process: a queue past --max-num-seqs, prefix-cache hits for
prompts that share a prefix, and KV events on ZMQ decoded by vLLM's own msgspec classes (copied
from the pinned wheels into tests/fixtures/vllm_kv_events by ``python -m enginebuild.kvevents``).
"""

# The start_sim fixture is test_sim's, imported: its parameters "redefine" it (F811) by design.
# ruff: noqa: F811

from __future__ import annotations

import importlib.util
import json
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from agent.engines.sim import generate, kvcache
from agent.supervise.probes import IN_FLIGHT
from tests.support import free_port, poll
from tests.test_sim import Sim, StartSim, start_sim  # noqa: F401

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_kv_events"
VERSIONS = ("0.18.0", "0.33.0")


def vllm_events(version: str) -> ModuleType:
    """vLLM's kv_events classes for ``version``, loaded from the committed copy."""
    path = FIXTURES / f"vllm_{version.replace('.', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"vllm_kv_events_{version.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics(sim: Sim) -> dict[str, float]:
    """vLLM's samples by name (labels dropped: one engine, one model), and under "in_flight" what
    the agent's drain reads from the same text (agent.supervise.probes.IN_FLIGHT, summed)."""
    text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    out: dict[str, float] = {"in_flight": sum(float(m.group(3)) for m in IN_FLIGHT.finditer(text.encode()))}
    for m in re.finditer(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        if "le=" not in m.group(0):
            out[m.group(1)] = float(m.group(2))
    return out


def complete(sim: Sim, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}
    reply = httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    doc: dict[str, Any] = reply.json()
    return doc


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_requests_wait_past_max_num_seqs(start_sim: StartSim) -> None:
    sim = start_sim("--max-num-seqs", "2", env={"LLMGW_SIM_ITL_MS": "40", "LLMGW_SIM_TTFT_MS": "1"})
    sim.wait_ready()
    done: list[int] = []

    def one(i: int) -> None:
        done.append(len(complete(sim, f"request {i} " + words(10, "w"), max_tokens=15)["choices"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    def queued() -> dict[str, float] | None:
        m = metrics(sim)
        # (A request that arrives while a step runs waits until the next step even if there is
        # room, as in vLLM: so the sign of a full batch is both gauges together.)
        full = m.get("vllm:num_requests_waiting", 0) > 0 and m.get("vllm:num_requests_running") == 2
        return m if full else None

    seen = poll("vllm:num_requests_waiting > 0 with 6 requests and --max-num-seqs 2", queued, timeout=20)
    # A drain waits for queued requests too, not only for the running ones.
    assert seen["in_flight"] == 2 + seen["vllm:num_requests_waiting"]
    for t in threads:
        t.join(timeout=60)
    assert done == [1] * 6
    after = metrics(sim)
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["vllm:time_to_first_token_seconds_count"] == 6
    # 6 requests x 14 gaps; queued requests waited at least a whole request (15 steps of 40 ms).
    assert after["vllm:inter_token_latency_seconds_count"] == 6 * 14
    assert after["vllm:time_to_first_token_seconds_sum"] > 2 * 15 * 0.040


def test_prefix_hits_rise_when_prompts_share_a_prefix(start_sim: StartSim) -> None:
    sim = start_sim(env={"LLMGW_SIM_ITL_MS": "1", "LLMGW_SIM_TTFT_MS": "1"})
    sim.wait_ready()
    system = words(64, "sys")  # 64 tokens: 4 full blocks of 16
    complete(sim, system + " first question")
    before = metrics(sim)
    assert before["vllm:prefix_cache_queries_total"] == 66
    assert before["vllm:prefix_cache_hits_total"] == 0
    for i in range(3):
        complete(sim, system + f" question number {i}")
    after = metrics(sim)
    assert after["vllm:prefix_cache_queries_total"] == 66 + 3 * 67
    assert after["vllm:prefix_cache_hits_total"] == 3 * 64
    # Nothing shared: no hit.
    complete(sim, words(70, "other"))
    assert metrics(sim)["vllm:prefix_cache_hits_total"] == 3 * 64
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


@pytest.mark.parametrize("version", VERSIONS)
def test_kv_events_decode_with_vllms_own_classes(start_sim: StartSim, version: str) -> None:
    """The sim's bytes on the PUB socket and from the replay socket decode with vLLM's msgspec
    definitions for the imitated version; hashes and token ids are the ones vLLM would compute."""
    vllm = vllm_events(version)
    pub, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    sim = start_sim(
        "--kv-events-config",
        json.dumps(config),
        "--num-gpu-blocks-override",
        "8",
        env={
            "LLMGW_SIM_VLLM_VERSION": version,
            "PYTHONHASHSEED": "7",
            "LLMGW_SIM_ITL_MS": "1",
            "LLMGW_SIM_TTFT_MS": "1",
        },
    )
    sim.wait_ready()
    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        prompts: list[str] = []

        def batch() -> list[bytes] | None:
            # A SUB socket misses what was published before it joined: keep sending new prompts
            # until one batch arrives.
            prompt = words(40, f"p{len(prompts)}x")
            prompts.append(prompt)
            complete(sim, prompt)
            if sub.poll(200):
                return sub.recv_multipart()
            return None

        topic, seq, payload = poll("a KV event batch on the PUB socket", batch, timeout=20)
        assert topic == b"kv" and len(seq) == 8
        decoded = decoder.decode(payload)
        assert decoded.data_parallel_rank == 0 and decoded.ts > 1e9
        stored = [e for e in decoded.events if isinstance(e, vllm.BlockStored)]
        assert stored, decoded

        # The hashes are vLLM's for the tokens the sim's tokenizer gives the prompt.
        event = stored[0]
        matching = [generate.token_ids(p) for p in prompts]
        ids = next((i for i in matching if i[:32] == event.token_ids), None)
        assert ids is not None, f"no prompt sent has the token ids {event.token_ids}"
        fn = kvcache.hash_function("sha256")
        none = kvcache.none_hash(fn, "sha256", {"PYTHONHASHSEED": "7"}, version)
        h0 = kvcache.hash_block_tokens(fn, none, None, ids[:16])
        h1 = kvcache.hash_block_tokens(fn, none, h0, ids[16:32])
        assert event.block_hashes == [kvcache.external_hash(h0), kvcache.external_hash(h1)]
        assert event.parent_block_hash is None
        assert event.token_ids == ids[:32]
        assert (event.block_size, event.medium, event.lora_id) == (16, "GPU", None)

        # A prompt that needs every block evicts cached ones: BlockRemoved, decoded the same way.
        complete(sim, words(120, "big"))
        removed = []
        while sub.poll(2000):
            _, _, more = sub.recv_multipart()
            removed += [e for e in decoder.decode(more).events if isinstance(e, vllm.BlockRemoved)]
            if removed:
                break
        assert removed and all(len(e.block_hashes) == 1 for e in removed)

        # Replay from sequence 0: every buffered batch, in order, then the end marker (seq -1).
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, rtopic, rseq, rpayload = dealer.recv_multipart()
            n = int.from_bytes(rseq, "big", signed=True)
            if n == -1:
                assert (rtopic, rpayload) == (b"", b"")
                break
            assert rtopic == b"kv"
            decoder.decode(rpayload)
            seqs.append(n)
        assert seqs == list(range(len(seqs))) and len(seqs) >= 2
    finally:
        ctx.destroy(linger=0)  # closes every socket, even after a failed assertion


def test_a_client_that_leaves_frees_its_blocks(start_sim: StartSim) -> None:
    """A real engine frees a sequence's KV blocks when its client goes; so does the sim, at once
    (not when the request would have ended)."""
    sim = start_sim(env={"LLMGW_SIM_ITL_MS": "20", "LLMGW_SIM_TTFT_MS": "1"})
    sim.wait_ready()
    body = {"model": "sim-model", "prompt": words(100, "long"), "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=30) as reply:
        chunks = 0
        for line in reply.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                # Still streaming (leaving the loop closes the connection: httpx ends the stream).
                held = metrics(sim)
                assert held["vllm:num_requests_running"] == 1 and held["vllm:kv_cache_usage_perc"] > 0
                break
    poll(
        "the abandoned request's blocks to be freed",
        lambda: (m := metrics(sim))["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0,
        timeout=10,
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_kv_event_bytes_equal_vllms_own_encoding(version: str) -> None:
    """Byte for byte: the sim's payload for a batch equals what vLLM's msgspec classes encode for
    the same events (as its publisher sends them: data_parallel_rank 0, hashes as 64-bit ints)."""
    from agent.engines.sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored
    from agent.engines.sim.kvevents import encode_batch

    vllm = vllm_events(version)
    big = (1 << 64) - 3  # a uint64 above int64's range, as many real hashes are
    ours = [
        BlockStored((big, 12), None, tuple(range(32)), 16),
        BlockStored((99,), 12, tuple(range(32, 48)), 16),
        BlockRemoved((big,)),
        AllBlocksCleared(),
    ]
    extra = {} if version == "0.18.0" else {"group_idx": 0}
    theirs = vllm.KVEventBatch(
        ts=1796425323.25,
        events=[
            vllm.BlockStored(
                block_hashes=[big, 12],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                **extra,
            ),
            vllm.BlockStored(
                block_hashes=[99],
                parent_block_hash=12,
                token_ids=list(range(32, 48)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
                **extra,
            ),
            vllm.BlockRemoved(block_hashes=[big], medium="GPU", **extra),
            vllm.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert encode_batch(1796425323.25, ours, version) == msgspec.msgpack.encode(theirs)
    # A step that evicts many blocks: 20 events, past msgpack's short array header.
    many = [BlockRemoved((i,)) for i in range(20)]
    theirs_many = vllm.KVEventBatch(
        ts=2.5,
        events=[vllm.BlockRemoved(block_hashes=[i], medium="GPU", **extra) for i in range(20)],
        data_parallel_rank=0,
    )
    assert encode_batch(2.5, many, version) == msgspec.msgpack.encode(theirs_many)


def test_the_extractor_keeps_exactly_the_event_format() -> None:
    """enginebuild.kvevents keeps the msgspec classes and MEDIUM_* constants, unchanged and in
    order, drops everything else, and refuses a source whose format moved; the committed copies
    name the wheel they came from."""
    from enginebuild import kvevents
    from enginebuild.flags.core import ExtractError

    classes = "\n\n".join(
        f"class {name}(Base):\n    x: int = {i}" for i, name in enumerate(kvevents.KEEP_CLASSES)
    )
    source = f'import zmq\n\nMEDIUM_GPU = "GPU"\n\n\ndef publisher():\n    pass\n\n\n{classes}\n\n\nclass ZmqEventPublisher:\n    pass\n'
    kept = kvevents.definitions(source)
    assert "import zmq" not in kept and "publisher" not in kept.lower()
    assert kept.startswith('MEDIUM_GPU = "GPU"') and "class KVEventBatch(Base):\n    x: int = 5" in kept
    with pytest.raises(ExtractError, match="has no KVEventBatch"):
        kvevents.definitions(source.replace("class KVEventBatch", "class Renamed"))
    for version in VERSIONS:
        text = (FIXTURES / f"{kvevents.module_name(version)}.py").read_text()
        assert f"vllm-{version}-" in text.splitlines()[2] and f"enginebuild.kvevents {version}" in text
