"""The sim's capacity model, pure parts: KV blocks, prefix cache, LRU, scheduler, vLLM's hashes.

Plain unit tests on the sans-IO core (agent/engines/sim/kvcache.py, scheduler.py); the real
process under load is tests/test_sim_load.py.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent.engines.sim import generate, kvcache
from agent.engines.sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVCache
from agent.engines.sim.scheduler import Request, Scheduler, StepCost

BS = 4


def _hasher() -> kvcache.HashFn:
    return kvcache.hash_function("sha256")


def _scheduler(blocks: int, *, seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    fn = _hasher()
    none = fn("0")
    cache = KVCache(blocks, BS, caching=caching)
    cost = StepCost(base=0.010, prefill_per_token=0.001, decode_per_seq=0.0005, context_per_token=0.0)
    return Scheduler(
        cache,
        lambda parent, ids: kvcache.hash_block_tokens(fn, none, parent, ids),
        cost,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
    )


def _req(rid: str, prompt: list[int], out: int = 2) -> Request:
    return Request(rid, tuple(prompt), tuple(range(900, 900 + out)))


def _run(s: Scheduler, limit: int = 1000) -> list[object]:
    steps = []
    while not s.idle and limit:
        steps.append(s.step())
        limit -= 1
    assert s.idle, "the scheduler did not drain"
    return steps


# -- vLLM's block hashes, computed independently here ------------------------------------------


def test_block_hashes_are_vllms_sha256_over_pickle() -> None:
    fn = kvcache.hash_function("sha256")
    seed = "42"
    none = kvcache.none_hash(fn, "sha256", {"PYTHONHASHSEED": seed}, "0.33.0")
    expected_none = hashlib.sha256(pickle.dumps(seed, protocol=5)).digest()
    assert none == expected_none
    first = kvcache.hash_block_tokens(fn, none, None, [1, 2, 3, 4])
    assert first == hashlib.sha256(pickle.dumps((expected_none, (1, 2, 3, 4), None), protocol=5)).digest()
    second = kvcache.hash_block_tokens(fn, none, first, [5, 6, 7, 8])
    assert second == hashlib.sha256(pickle.dumps((first, (5, 6, 7, 8), None), protocol=5)).digest()
    # Pinned: these values change only if the algorithm (or pickle protocol 5) does.
    assert none.hex() == "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a"
    assert first.hex() == "8ad1c350703c26ebac1f40b4ddf827396658d0724afbf69e0902fcecc2422367"
    # KV events carry the low 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default).
    assert kvcache.external_hash(first) == int.from_bytes(first[-8:], "big") == 649359390096368487


def test_block_hashes_sha256_cbor() -> None:
    fn = kvcache.hash_function("sha256_cbor")
    none = kvcache.none_hash(fn, "sha256_cbor", {"PYTHONHASHSEED": "0"}, "0.18.0")
    assert none == hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    # canonical CBOR of "0" is text string of length 1: 0x61 0x30
    assert none == hashlib.sha256(b"\x610").digest()
    h = kvcache.hash_block_tokens(fn, none, None, [7, 8])
    # (none, (7, 8), None) as canonical CBOR: array(3) [bytes(32) none, array(2) [7, 8], null]
    raw = b"\x83" + b"\x58\x20" + none + b"\x82\x07\x08" + b"\xf6"
    assert h == hashlib.sha256(raw).digest()
    assert h.hex() == "e5e92c0da820b9cddfd77dc59ac5c9993a61499f1a66183a6fa0f84b7afbd1bb"


def test_none_hash_seed_per_version() -> None:
    fn = kvcache.hash_function("sha256")
    # Newer vLLM: a fixed seed for cryptographic hashes, so processes agree without PYTHONHASHSEED.
    assert kvcache.none_hash(fn, "sha256", {}, "0.33.0") == fn("vllm-none-hash")
    # 0.18: random per process.
    a = kvcache.none_hash(fn, "sha256", {}, "0.18.0")
    b = kvcache.none_hash(fn, "sha256", {}, "0.18.0")
    assert a != b and len(a) == 32
    with pytest.raises(ValueError, match="choose from sha256, sha256_cbor, xxhash, xxhash_cbor"):
        kvcache.hash_function("md5")


def test_tokenizer_is_deterministic_and_prefix_preserving() -> None:
    a = generate.token_ids("the quick brown fox jumps")
    assert a == generate.token_ids("the quick brown fox jumps")
    assert generate.token_ids("the quick brown fox sleeps")[:4] == a[:4]
    assert a[0] != a[1]
    chat = generate.chat_prompt({"messages": [{"role": "user", "content": "hi there"}]})
    assert chat.tokens == len(chat.ids) == 2 + generate.CHAT_TOKENS_PER_MESSAGE


# -- the KV cache -------------------------------------------------------------------------------


def test_allocation_and_free_count_blocks() -> None:
    c = KVCache(4, BS)
    got = c.allocate(3)
    assert got is not None and len(got) == 3 and c.free_blocks == 1
    assert c.usage == pytest.approx(0.75)
    assert c.allocate(2) is None and c.free_blocks == 1, "a failed allocation takes nothing"
    c.free(got)
    assert c.free_blocks == 4 and c.usage == 0


def test_lru_evicts_least_recently_freed_and_reports_removal() -> None:
    c = KVCache(3, BS)
    a, b, d = (c.allocate(1) or [0])[0], (c.allocate(1) or [0])[0], (c.allocate(1) or [0])[0]
    c.cache([a], [b"A" * 32], None, [1, 2, 3, 4])
    c.cache([b], [b"B" * 32], None, [5, 6, 7, 8])
    c.cache([d], [b"D" * 32], None, [9, 9, 9, 9])
    c.take_events()
    c.free([b])
    c.free([a])
    c.free([d])  # freed order: b, a, d -> evicted in that order
    first = c.allocate(1)
    assert first == [b]
    assert c.take_events() == [BlockRemoved((kvcache.external_hash(b"B" * 32),))]
    # a cached block that is hit again leaves the free queue and is not evicted next
    assert c.longest_hit([b"A" * 32, b"D" * 32]) == [a, d]
    c.touch([a])
    assert c.allocate(1) == [d]
    assert c.longest_hit([b"A" * 32]) == [a]


def test_reset_clears_only_when_idle() -> None:
    c = KVCache(2, BS)
    blocks = c.allocate(1) or []
    assert not c.reset()
    c.free(blocks)
    assert c.reset()
    assert c.take_events() == [AllBlocksCleared()]


# -- the scheduler ------------------------------------------------------------------------------


def test_prefix_hits_only_on_full_blocks() -> None:
    s = _scheduler(32)
    s.add(_req("a", list(range(1, 11))))  # 10 tokens: 2 full blocks of 4
    _run(s)
    events = s.cache.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].token_ids[:8] == tuple(range(1, 9))
    assert stored[0].parent_block_hash is None and stored[0].block_size == BS
    # Same first 9 tokens: only the 2 full blocks (8 tokens) hit, never a partial block.
    s.add(_req("b", [*range(1, 10), 77]))
    _run(s)
    assert (s.prefix_queries, s.prefix_hits) == (10 + 10, 8)
    # A prompt that is exactly the cached blocks: the last token is recomputed (hit 4, not 8).
    s.add(_req("c", list(range(1, 9))))
    _run(s)
    assert s.prefix_hits == 8 + 4


def test_uncached_tokens_cost_prefill_time() -> None:
    cold = _scheduler(32)
    cold.add(_req("a", list(range(1, 33)), out=1))
    t_cold = cold.step().seconds
    warm = _scheduler(32)
    warm.add(_req("x", list(range(1, 33)), out=1))
    _run(warm)
    warm.add(_req("a", list(range(1, 33)), out=1))
    result = warm.step()
    assert result.prefill_tokens == 4  # 7 of 8 blocks hit; the last block is computed
    assert result.seconds < t_cold
    assert t_cold == pytest.approx(0.010 + 32 * 0.001)


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = _scheduler(64, budget=16)
    s.add(_req("a", list(range(1, 41)), out=1))
    s.add(_req("b", list(range(100, 104)), out=1))
    first = s.step()
    assert first.prefill_tokens == 16 and not first.sampled
    assert len(s.running) == 1 and len(s.waiting) == 1, "no budget left for b"
    second = s.step()
    assert second.prefill_tokens == 16
    third = s.step()  # 8 tokens of a, then 4 of b fit in 16
    assert third.prefill_tokens == 12
    assert {r.request_id for r in third.sampled} == {"a", "b"}


def test_queue_waits_past_max_num_seqs() -> None:
    s = _scheduler(64, seqs=2)
    for i in range(5):
        s.add(_req(f"r{i}", [i + 1, 2, 3], out=3))
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 3
    _run(s)
    assert len(s.running) == 0


def test_decode_steps_grow_with_the_batch() -> None:
    s = _scheduler(64)
    s.add(_req("a", [1, 2, 3], out=5))
    s.step()  # prefill
    one = s.step()
    assert one.decode_seqs == 1
    t = _scheduler(64)
    for i in range(4):
        t.add(_req(f"r{i}", [i + 10, 2, 3], out=5))
    t.step()
    four = t.step()
    assert four.decode_seqs == 4 and four.seconds > one.seconds


def test_preemption_when_blocks_run_out() -> None:
    s = _scheduler(4, seqs=4, budget=64)  # 4 blocks of 4 = 16 tokens
    s.add(_req("a", [1, 2, 3, 4, 5, 6], out=6))  # grows to 12 tokens: 3 blocks
    s.add(_req("b", [7, 8, 9], out=6))  # grows to 9 tokens: 3 blocks
    steps = _run(s)
    assert s.preemptions >= 1
    assert any(getattr(r, "preempted", 0) for r in steps)
    assert s.cache.free_blocks == 4


def test_abort_frees_blocks() -> None:
    s = _scheduler(8)
    r = _req("a", list(range(1, 10)), out=50)
    s.add(r)
    s.step()
    assert s.cache.free_blocks < 8
    s.abort(r)
    assert s.idle and s.cache.free_blocks == 8


def test_caching_off_hits_nothing() -> None:
    s = _scheduler(32, caching=False)
    s.add(_req("a", list(range(1, 11))))
    _run(s)
    s.add(_req("b", list(range(1, 11))))
    _run(s)
    assert s.prefix_hits == 0 and s.cache.take_events() == []


# -- vLLM's flags the model acts on ------------------------------------------------------------


def test_capacity_flags_parse_as_vllm_spells_them() -> None:
    from agent.engines.sim.config import SimUsageError, kv_blocks, parse_command_line

    c = parse_command_line(["m"], {})
    assert (c.block_size, c.max_num_seqs, c.max_num_batched_tokens) == (16, 1024, 8192)
    assert c.enable_prefix_caching and c.prefix_caching_hash_algo == "sha256"
    assert c.num_gpu_blocks == kv_blocks(0.9, 16) == 27648
    c = parse_command_line(
        ["m", "--block-size", "32", "--max-num-batched-tokens", "2k", "--num-gpu-blocks-override", "99"], {}
    )
    assert (c.block_size, c.max_num_batched_tokens, c.num_gpu_blocks) == (32, 2000, 99)
    # The negation is spelled per version, and it turns caching off (it used to be parsed as on).
    old = {"LLMGW_SIM_VLLM_VERSION": "0.18.0"}
    assert not parse_command_line(["m", "--no-enable-prefix-caching"], old).enable_prefix_caching
    assert not parse_command_line(["m", "--disable-prefix-caching"], {}).enable_prefix_caching
    assert parse_command_line(["m", "--enable-prefix-caching"], {}).enable_prefix_caching
    c = parse_command_line(["m", "--sim-time-scale", "4"], {"LLMGW_SIM_PREFILL_MS_PER_TOKEN": "0.5"})
    assert (c.time_scale, c.prefill_ms_per_token) == (4, 0.5)
    with pytest.raises(SimUsageError, match="unknown field"):
        parse_command_line(["m", "--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'], {})
    with pytest.raises(SimUsageError, match="publisher 'kafka'"):
        parse_command_line(["m", "--kv-events-config", '{"publisher": "kafka"}'], {})
    with pytest.raises(SimUsageError, match="--max-num-seqs must be >= 1"):
        parse_command_line(["m", "--max-num-seqs", "0"], {})
    with pytest.raises(SimUsageError, match="time scale must be >= 0"):
        parse_command_line(["m"], {"LLMGW_SIM_TIME_SCALE": "-1"})


def test_kv_event_encoding_per_version() -> None:
    """The shapes the two encodings take (the decode with vLLM's own classes is in
    test_sim_load.py): positional arrays up to 0.18, tagged maps after."""
    import msgpack

    from agent.engines.sim.kvevents import encode_batch

    events = [BlockStored((5,), None, (1, 2), 2), BlockRemoved((5,)), AllBlocksCleared()]
    old = msgpack.unpackb(encode_batch(1.5, events, "0.18.0"))
    assert old == [
        1.5,
        [
            ["BlockStored", [5], None, [1, 2], 2, None, "GPU", None, [None]],
            ["BlockRemoved", [5], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    new = msgpack.unpackb(encode_batch(1.5, events, "0.33.0"))
    assert new[1][0] == {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
    }
    assert new[1][1:] == [
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.integers(3, 12),
    seqs=st.integers(2, 6),
    budget=st.integers(4, 40),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "step", "step", "abort"]), st.integers(1, 40), st.integers(1, 16)
        ),
        min_size=10,
        max_size=60,
    ),
)
def test_scheduler_invariants_hold_for_any_workload(
    blocks: int, seqs: int, budget: int, ops: list[tuple[str, int, int]]
) -> None:
    """Blocks are conserved (free + referenced = all), the batch never passes --max-num-seqs or
    the token budget, a running request holds blocks for what it computed, and a drained engine
    holds no block."""
    s = _scheduler(blocks, seqs=seqs, budget=budget)
    live: list[Request] = []
    n = 0

    def check(result: object = None) -> None:
        assert len(s.running) <= seqs
        referenced = {b for r in s.running for b in r.blocks}
        assert s.cache.free_blocks + len(referenced) == blocks
        for r in s.running:
            assert len(r.blocks) * BS >= r.computed
        for r in s.waiting:
            assert r.blocks == []
        if result is not None:
            assert result.prefill_tokens + result.decode_seqs <= budget  # type: ignore[attr-defined]

    for op, size, out in ops:
        if op == "add" and size + 1 + out <= blocks * BS:
            # Prompts share prefixes: token i of every prompt is i % 7 until a per-request tail.
            r = _req(f"r{n}", [i % 7 for i in range(size)] + [100 + n], out=out)
            n += 1
            s.add(r)
            live.append(r)
        elif op == "abort" and live:
            s.abort(live.pop(size % len(live)))
        elif op == "step":
            check(s.step())
        check()
    _run(s, limit=5000)
    assert s.cache.free_blocks == blocks
    event(f"preempted: {s.preemptions > 0}")
