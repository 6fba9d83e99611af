"""The simulator's paged KV cache: blocks, vLLM's chained block hashes, prefix caching, LRU.

Pure and sans-IO (no clock, no sockets): the scheduler asks it for blocks and it answers with
block ids and the KV events a real vLLM would publish for what happened (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), which the server hands to the publisher.

It follows vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue`` (``vllm/v1/core/block_pool.py``):

- A fixed number of blocks of ``block_size`` tokens. A block is referenced by the requests using
  it; a block nobody references sits in the free queue, and if it was full and cached it keeps
  its hash there, so a later request with the same prefix takes it back (a prefix hit) instead
  of computing it again.
- Allocation takes blocks from the head of the free queue (the least recently freed); a taken
  block that still held a cached hash is evicted then (``BlockRemoved``). A request frees its
  blocks last block first, so a shared prefix outlives the tails that hang off it.
- Only full blocks are cached and hit; a hit never covers a request's last prompt token (vLLM
  computes at least one token to produce logits).

Block hashes are vLLM's, computed the way ``hash_block_tokens`` does: ``hash_fn((parent_hash,
tuple(token_ids), extra_keys))`` with the first block's parent ``NONE_HASH = hash_fn(seed)``;
``hash_fn`` is one of ``--prefix-caching-hash-algo``'s (``sha256``: SHA-256 over pickle protocol
5, ``sha256_cbor``: SHA-256 over canonical CBOR; ``xxhash``/``xxhash_cbor`` when the ``xxhash``
package is installed). KV events carry each hash as vLLM does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits of the digest, as an integer.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

HashFn = Callable[[Any], bytes]

#: ``--prefix-caching-hash-algo``'s choices, as vLLM names them.
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

#: vLLM >= 0.19's seed for NONE_HASH when PYTHONHASHSEED is unset and the hash is cryptographic
#: (``DEFAULT_NONE_HASH_SEED``); older versions draw 32 random bytes instead.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # imported on use: only this algorithm needs it, as in vLLM

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _xxhash(value: Any, cbor: bool) -> bytes:
    try:
        import xxhash  # type: ignore[import-not-found]
    except ImportError:
        raise ValueError(
            "--prefix-caching-hash-algo xxhash needs the xxhash package (pip install xxhash), as vLLM does"
        ) from None
    if cbor:
        import cbor2

        data = cbor2.dumps(value, canonical=True)
    else:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


def hash_function(name: str) -> HashFn:
    """vLLM's ``get_hash_fn_by_name``; a name it does not know is a ValueError naming it."""
    if name == "sha256":
        return _sha256
    if name == "sha256_cbor":
        return _sha256_cbor
    if name == "xxhash":
        return lambda v: _xxhash(v, False)
    if name == "xxhash_cbor":
        return lambda v: _xxhash(v, True)
    raise ValueError(f"--prefix-caching-hash-algo {name!r}: choose from {', '.join(HASH_ALGOS)}")


def none_hash(hash_fn: HashFn, algo: str, environ: Mapping[str, str], vllm_version: str) -> bytes:
    """The parent hash of every first block, as ``init_none_hash`` makes it.

    PYTHONHASHSEED set: ``hash_fn(seed)`` in every version. Unset: vLLM 0.18 and older draw 32
    random bytes (a prefix cache no other process can predict); newer versions hash the fixed
    ``"vllm-none-hash"`` for the cryptographic algorithms and stay random for xxhash."""
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return hash_fn(seed)
    if _version_tuple(vllm_version) >= (0, 19) and not algo.startswith("xxhash"):
        return hash_fn(DEFAULT_NONE_HASH_SEED)
    return os.urandom(32)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def hash_block_tokens(hash_fn: HashFn, none: bytes, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """vLLM's ``hash_block_tokens`` for a block without extra keys (no LoRA, no multimodal input,
    no cache salt): the parent's hash (``none`` for the first block), the block's token ids as a
    tuple, and None."""
    return hash_fn((parent or none, tuple(token_ids), None))


def external_hash(digest: bytes) -> int:
    """A block hash as KV events carry it (``maybe_convert_block_hash`` with vLLM's default
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's low 64 bits."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


# -- KV events, as values (the publisher encodes them per the imitated vLLM version) ----------


@attrs.frozen
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[int, ...]


@attrs.frozen
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCache:
    """The block pool. Block ids are 0..num_blocks-1; every method is O(blocks it touches)."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        #: Unreferenced blocks, least recently freed first (eviction order).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        #: Cached full blocks by hash.
        self._cached: dict[bytes, int] = {}
        self._events: list[KVEvent] = []

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the fraction of blocks referenced by a request (a
        cached block nobody uses counts as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> int:
        return len(self._cached)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order (one vLLM step's batch)."""
        events, self._events = self._events, []
        return events

    def longest_hit(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of ``hashes`` (a miss ends it)."""
        hit: list[int] = []
        if not self.caching:
            return hit
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on blocks a request reuses (a hit); they leave the free queue."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, or None (and nothing taken) if fewer are free. A taken block
        that held a cached prefix is evicted from the cache (``BlockRemoved``)."""
        if count > len(self._free):
            return None
        out: list[int] = []
        removed: list[int] = []
        for _ in range(count):
            b, _none = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
                    removed.append(external_hash(h))
            self._ref[b] = 1
            out.append(b)
        # One event per evicted block, as vLLM's ``_maybe_evict_cached_block`` publishes them.
        self._events.extend(BlockRemoved((h,)) for h in removed)
        return out

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
    ) -> None:
        """Mark newly full blocks cached under their hashes (one ``BlockStored`` for the run, as
        vLLM's ``cache_full_blocks`` publishes it). A hash already cached in another block (two
        requests computed the same prefix at once) keeps the first; vLLM does the same."""
        if not self.caching or not blocks:
            return
        stored: list[int] = []
        for b, h in zip(blocks, hashes, strict=True):
            self._hash[b] = h
            self._cached.setdefault(h, b)
            stored.append(external_hash(h))
        self._events.append(
            BlockStored(
                block_hashes=tuple(stored),
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=tuple(token_ids),
                block_size=self.block_size,
            )
        )

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a request's references, last block first, so its prefix is evicted last."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached hash (``AllBlocksCleared``); refused
        (False) while any block is in use, as vLLM refuses it."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._events.append(AllBlocksCleared())
        return True
