"""The simulator's continuous-batching scheduler: a sans-IO step function in vLLM v1's shape.

No clock and no sockets inside: the server adds requests, calls :meth:`Scheduler.step`, sleeps
the step's modelled duration, then delivers the tokens the step produced. Like vLLM v1's
``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``, FCFS policy):

- The running requests are scheduled first, in arrival order: each gets the tokens it still has
  to compute (the rest of its prompt, chunked, or one decode token), within the step's token
  budget ``--max-num-batched-tokens``. When its new tokens need a block and none is free, the
  last running request is preempted (its blocks freed, back to the front of the waiting queue,
  to recompute prompt and output so far later; its freed full blocks stay cached, so the
  recomputation is mostly prefix hits) until the block fits or the request preempted itself.
- Then, if nothing was preempted, waiting requests are admitted in order while there is budget
  and fewer than ``--max-num-seqs`` run: each first takes its longest cached prefix (full blocks
  only, never the last prompt token), then as much of the rest as the budget allows (chunked
  prefill), if its blocks can be allocated; else admission stops.
- A request whose computed tokens reach all its tokens samples one token (the first at the end
  of its prefill, then one per step); it ends after its ``max_tokens``, and its blocks are freed.

The step's modelled duration grows with what it computes (:class:`StepCost`): a base time, a
cost per prefill token actually computed (cached prompt tokens cost nothing), one per decoding
sequence, and one per token of context those sequences attend to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import attrs

from agent.engines.sim.kvcache import KVCache


@attrs.frozen
class StepCost:
    """A step's duration in seconds: ``base + prefill * prefill_tokens + decode * decode_seqs +
    context * context_tokens`` (context tokens: the KV the decoding sequences read)."""

    base: float
    prefill_per_token: float
    decode_per_seq: float
    context_per_token: float = 0.0

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.base
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_seq * decode_seqs
            + self.context_per_token * context_tokens
        )


@attrs.define(eq=False)
class Request:
    """One sequence. ``output_ids`` are the tokens it will generate (the simulator decides them
    up front); ``generated`` counts those produced so far."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    generated: int = 0
    computed: int = 0
    blocks: list[int] = attrs.Factory(list)
    #: Hashes of the request's full blocks so far (prompt and output), computed once each.
    hashes: list[bytes] = attrs.Factory(list)
    #: Full blocks already marked cached in the KV cache.
    cached_blocks: int = 0
    preemptions: int = 0
    queried: bool = False

    @property
    def total_tokens(self) -> int:
        """Tokens whose KV the next sample needs: the prompt and the output so far."""
        return len(self.prompt_ids) + self.generated

    @property
    def finished(self) -> bool:
        return self.generated >= len(self.output_ids)

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids[: end - n])[start:end]


@attrs.frozen
class StepResult:
    """What one step did: its modelled duration, the requests that got a token (in order), those
    that finished, and its shape."""

    seconds: float
    sampled: tuple[Request, ...]
    finished: tuple[Request, ...]
    prefill_tokens: int
    decode_seqs: int
    preempted: int


class Scheduler:
    """Waiting queue, running set, token budget; see the module docstring."""

    def __init__(
        self,
        cache: KVCache,
        hasher: Callable[[bytes | None, Sequence[int]], bytes],
        cost: StepCost,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
        self.cache = cache
        self.hasher = hasher
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: vLLM's prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, request: Request) -> None:
        if len(request.prompt_ids) < 1:
            raise ValueError(f"request {request.request_id}: an empty prompt")
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """The client went away: the request leaves the queue or the batch, its blocks freed."""
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            new = min(req.total_tokens - req.computed, budget)
            if new <= 0:  # cannot happen for a running request; kept safe
                i += 1
                continue
            victim_is_self = False
            while not self._grow(req, req.computed + new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    victim_is_self = True
                    break
            if victim_is_self:
                break
            scheduled.append((req, new))
            budget -= new
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self._admit(req, budget):
                    break
                self.waiting.popleft()
                self.running.append(req)
                new = min(req.total_tokens - req.computed, budget)
                scheduled.append((req, new))
                budget -= new

        prefill_tokens = 0
        decode_seqs = 0
        context = 0
        sampled: list[Request] = []
        finished: list[Request] = []
        for req, new in scheduled:
            if req.total_tokens - req.computed == 1 and req.generated > 0:
                decode_seqs += 1
                context += req.computed
            else:
                prefill_tokens += new
            req.computed += new
            self._cache_full_blocks(req)
            if req.computed >= req.total_tokens:
                req.generated += 1
                sampled.append(req)
                if req.finished:
                    finished.append(req)
        for req in finished:
            self.running.remove(req)
            self._release(req)
        seconds = self.cost.seconds(prefill_tokens, decode_seqs, context)
        return StepResult(
            seconds=seconds,
            sampled=tuple(sampled),
            finished=tuple(finished),
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            preempted=preempted,
        )

    # -- helpers -------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cache.block_size)

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give ``req`` blocks for ``tokens`` tokens; False (nothing taken) when they are not free."""
        need = self._blocks_for(tokens) - len(req.blocks)
        if need <= 0:
            return True
        fresh = self.cache.allocate(need)
        if fresh is None:
            return False
        req.blocks.extend(fresh)
        return True

    def _admit(self, req: Request, budget: int) -> bool:
        """A waiting request's prefix hit and first chunk's blocks; False leaves it waiting."""
        bs = self.cache.block_size
        total = req.total_tokens
        self._extend_hashes(req, total)
        # Never hit the last token: it must be computed to sample from (vLLM caps the hit at
        # num_tokens - 1).
        usable = (total - 1) // bs
        hit = self.cache.longest_hit(req.hashes[:usable])
        computed = len(hit) * bs
        new = min(total - computed, budget)
        need = self._blocks_for(computed + new) - len(hit)
        # Reusing hit blocks takes them out of the free queue first, then the fresh ones.
        self.cache.touch(hit)
        fresh = self.cache.allocate(need)
        if fresh is None:
            self.cache.free(hit)
            return False
        if not req.queried:
            # vLLM counts a request's query once, when it is first scheduled.
            req.queried = True
            self.prefix_queries += total
            self.prefix_hits += computed
        req.blocks = hit + fresh
        req.computed = computed
        req.cached_blocks = len(hit)
        return True

    def _extend_hashes(self, req: Request, tokens: int) -> None:
        bs = self.cache.block_size
        while (len(req.hashes) + 1) * bs <= tokens:
            k = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else None
            req.hashes.append(self.hasher(parent, req.tokens(k * bs, (k + 1) * bs)))

    def _cache_full_blocks(self, req: Request) -> None:
        bs = self.cache.block_size
        full = min(req.computed // bs, len(req.blocks))
        if full <= req.cached_blocks:
            return
        self._extend_hashes(req, full * bs)
        start = req.cached_blocks
        parent = req.hashes[start - 1] if start else None
        self.cache.cache(
            req.blocks[start:full], req.hashes[start:full], parent, req.tokens(start * bs, full * bs)
        )
        req.cached_blocks = full

    def _release(self, req: Request) -> None:
        self.cache.free(req.blocks)
        req.blocks = []
        req.cached_blocks = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.computed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
