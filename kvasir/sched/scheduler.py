"""The head's scheduling: continuous batching with chunked prefill and KV admission.

Each batch is filled with decode rows first, then prefill chunks (running prompts
before newly admitted ones) until ``max_rows`` or ``max_tokens`` is reached. At most
``inflight`` batches are outstanding and a request is never in two of them. Admission
reserves a request's whole KV need (prompt + max output, capped at ``max_seq_len``), so
a running request never runs out of cache.

Admission is fair across clients (the bridge numbers them): the next request admitted
is the oldest waiting one of the client whose running requests hold the fewest KV
blocks, so one client's many long requests cannot keep everyone else waiting; within a
client, requests go in arrival order.

With a KV pool (``[kv_pool]``), blocks evicted from the prefix cache are named in the next
descriptor for the stages to write down (``spill``), and a request whose prompt's next
blocks the pool holds (``pooled``, the bridge's word) is admitted with blocks for them
that every stage reads back (``load``) before it is scheduled; its stages' word on what
they read (``loaded``) sets where its computing starts (docs/architecture.md, The KV pool).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque

import torch

from kvasir.config.plan import Plan
from kvasir.errors import BatchError, RequestError
from kvasir.sched.blocks import BlockAllocator
from kvasir.sched.pool_loads import PoolLoads
from kvasir.sched.prefix import PrefixCache
from kvasir.sched.requests import Emitted, RequestState, ScheduledBatch
from kvasir.sched.speculation import Drafter, NgramDrafter, Speculation
from kvasir.sched.validation import MAX_SEED, check_prompt, check_sampling
from kvasir.wire.batch import BatchDescriptor, NewRequest, Row, SampledToken, SamplingParams
from kvasir.wire.head import BatchResult


class Scheduler:
    def __init__(
        self, plan: Plan, vocab_size: int, reserve_output: bool = True, drafter: Drafter | None = None
    ) -> None:
        """``reserve_output`` False: a prefill pool's head, whose requests leave after their
        first token, reserves blocks for the prompt only. ``drafter``: where a plan with
        [speculative] gets its drafts (default: prompt lookup)."""
        self.block_size = plan.kv.block_size
        self.max_seq_len = plan.model.max_seq_len
        self.vocab_size = vocab_size
        self.blocks = BlockAllocator(plan.kv.num_blocks)
        pool = plan.kv_pool is not None
        self.cache = PrefixCache(self.blocks, self.block_size, enabled=plan.kv.prefix_cache, spill=pool)
        self.pool = PoolLoads(self.cache, self.block_size)
        self._serve(plan, reserve_output, drafter)
        self.waiting: dict[int, RequestState] = {}  # by request id, in arrival order
        self.queues: dict[int, deque[int]] = {}  # per client: its waiting request ids, oldest first (stale ids skipped)
        self.held: dict[int, int] = {}  # per client: KV blocks its running requests hold
        self._arrivals = itertools.count()
        self.running: dict[int, RequestState] = {}
        self.inflight: dict[int, tuple[int, ...]] = {}  # batch id -> request ids
        self._release: list[int] = []
        self._next_request = 1
        self._next_batch = 1

    def _serve(self, plan: Plan, reserve_output: bool, drafter: Drafter | None) -> None:
        """What depends on the pool the head serves: its widths, its reservations, its drafts."""
        self.reserve_output = reserve_output
        self.max_rows = plan.batch.max_rows
        self.max_tokens = plan.batch.max_tokens
        self.inflight_limit = plan.batch.inflight
        # drafts for decode rows (a prefill pool's requests leave before decoding: its
        # head only tells the tail their prompts, which go on to the decode pool's drafter)
        spec = plan.speculative
        self.speculation = None
        if spec is not None and reserve_output:
            self.speculation = Speculation(spec, drafter or NgramDrafter(spec))
        self.announce_prompts = spec is not None and not reserve_output

    def regroup(self, plan: Plan, reserve_output: bool, drafter: Drafter | None = None) -> None:
        """Serve another pool (a moving instance, kvasir/stage/roles.py): ``plan``'s widths,
        ``reserve_output`` and drafts as in the constructor; its KV blocks and prefix cache
        stay (the same cache in every pool). Refused while it holds a request."""
        if not self.idle:
            raise BatchError(
                f"the head holds {len(self.waiting) + len(self.running)} requests and "
                f"{len(self.inflight)} batches in flight: it changes pools only once empty"
            )
        self._serve(plan, reserve_output, drafter)

    # -- entry points -------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        request_id: int | None = None,
        client: int = 0,
        cache_root: bytes = b"",
        pooled: int = 0,
        peers: tuple[tuple[int, int], ...] = (),
    ) -> int:
        """Queue a validated request and return its id; raise RequestError if refused.

        ``request_id`` is the id the bridge gave the request; without one the
        scheduler numbers requests itself. ``cache_root``: its prefix-cache namespace
        (kvasir/sched/prefix.py namespace_root); it shares blocks only with requests of
        the same root. ``pooled``: how many of its prompt's first blocks the KV pool holds
        (``peers``: where its stages read what their hosts lack).
        """
        ids = check_prompt(prompt, self.vocab_size, self.max_seq_len)
        check_sampling(sampling, self.vocab_size)
        total = min(len(ids) + sampling.max_tokens, self.max_seq_len) if self.reserve_output else len(ids)
        need = -(-total // self.block_size)
        seed = sampling.seed if sampling.seed is not None else secrets.randbelow(MAX_SEED)
        if request_id is None:
            request_id = self._next_request
            self._next_request += 1
        elif request_id in self.running or request_id in self.waiting:
            raise RequestError("invalid_request", f"request id {request_id} is already in use")
        rid = request_id
        self.waiting[rid] = RequestState(
            rid,
            ids,
            sampling,
            seed,
            need,
            client=client,
            arrival=next(self._arrivals),
            cache_root=cache_root,
            pooled=max(0, pooled),
            peers=peers,
        )
        self.queues.setdefault(client, deque()).append(rid)
        return rid

    def cancel(self, request_id: int) -> Emitted | None:
        """Cancel a request; its terminal event now, or when its in-flight batch returns."""
        state = self.waiting.pop(request_id, None)
        if state is not None:
            return Emitted(request_id, None, len(state.output), "cancelled")
        state = self.running.get(request_id)
        if state is None or state.cancelled or state.parked:
            return None  # a parked request is ended by whoever holds its hand-off
        state.cancelled = True
        if state.in_flight:
            return None
        self._retire(state)
        return Emitted(request_id, None, len(state.output), "cancelled")

    def propose(self, request_id: int, tokens: list[int]) -> None:
        """Candidate next tokens for a running request (speculative decoding's drafts): its
        next decode row carries as many as fit, and the tail keeps those the model confirms."""
        state = self.running.get(request_id)
        if state is None or state.parked:
            raise RequestError("unknown_request", f"request {request_id} is not running here")
        if any(not 0 <= token < self.vocab_size for token in tokens):
            raise RequestError("invalid_request", f"draft tokens must be ids below {self.vocab_size}")
        state.draft = list(tokens)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.inflight

    # -- building batches ---------------------------------------------------------
    def next_batch(self) -> ScheduledBatch | None:
        """The next batch to run, or None when the ring is full or nothing is ready."""
        if len(self.inflight) >= self.inflight_limit:
            return None
        tokens: list[int] = []
        new: list[NewRequest] = []
        ready = [s for s in self.running.values() if not s.in_flight and not s.parked and not s.loading]
        decode = [s for s in ready if s.computed >= s.prompt_len]
        prefill = [s for s in ready if s.computed < s.prompt_len]
        if self.speculation is not None and decode:
            count = min(len(decode), self.max_rows)
            self.speculation.draft(decode[:count], self.max_tokens - count - self._prompts_pending(prefill))
        candidates = itertools.chain(decode, prefill, self._admit())
        rows: list[Row] = []
        while len(rows) < self.max_rows and len(tokens) < self.max_tokens:
            state = next(candidates, None)
            if state is None:
                break
            rows.append(self._row(state, self.max_tokens - len(tokens), tokens, new))
        if not rows:
            return None
        registered, spill = self.cache.take_pool_news()
        batch_id = self._next_batch
        self._next_batch += 1
        solo = not self.inflight  # the ring holds no other batch: its stages' cores are idle
        self.inflight[batch_id] = tuple(row.request_id for row in rows)
        descriptor = BatchDescriptor(
            batch_id=batch_id,
            slot=0,
            num_tokens=len(tokens),
            rows=tuple(rows),
            release=tuple(self._release),
            new_requests=tuple(new),
            scheduled_ns=time.monotonic_ns(),
            registered=registered,
            spill=spill,
            load=self.pool.take(),
            solo=solo,
        )
        self._release.clear()
        return ScheduledBatch(descriptor, torch.tensor(tokens, dtype=torch.long))

    def _prompts_pending(self, prefill: list[RequestState]) -> int:
        """Prompt tokens waiting to be computed (running prompts' rest, then waiting
        requests'), counted up to a batch's budget: drafts only take what they leave."""
        pending = 0
        for state in itertools.chain(prefill, self.waiting.values()):
            pending += state.prompt_len - state.computed
            if pending >= self.max_tokens:
                break
        return pending

    def release_only(self) -> BatchDescriptor | None:
        """A descriptor that carries only pending releases, spills and loads (none when
        nothing is pending).

        Sent when no batch can be built, so every stage frees ended requests' KV (and
        writes down or reads back pool blocks) without waiting for the next real batch.
        It is not a batch in flight.
        """
        registered, spill = self.cache.take_pool_news()
        if not self._release and not registered and not spill and not self.pool.pending:
            return None
        descriptor = BatchDescriptor(
            batch_id=0,
            slot=-1,
            num_tokens=0,
            rows=(),
            release=tuple(self._release),
            new_requests=(),
            scheduled_ns=time.monotonic_ns(),
            registered=registered,
            spill=spill,
            load=self.pool.take(),
        )
        self._release.clear()
        return descriptor

    def _admit(self):
        """Admit waiting requests, fairest client first, while their KV reservation fits.
        When the fairest client's next request does not fit, nobody overtakes it."""
        while self.waiting:
            first = self._fairest()
            if first is None:
                return
            cached = self.cache.lookup(self.cache.prompt_keys(first))
            blocks = self.cache.take(cached, first.need_blocks - len(cached))
            if blocks is None:
                return
            if self.cache.enabled and first.sampling.prompt_logprobs < 0:
                self.cache.note(first.prompt_len, len(cached) * self.block_size)
            first.registered = len(cached)
            first.computed = first.cached_tokens = len(cached) * self.block_size
            state = self.waiting.pop(first.request_id)
            queue = self.queues[state.client]
            queue.popleft()
            if not queue:
                del self.queues[state.client]
            state.blocks = blocks
            self.held[state.client] = self.held.get(state.client, 0) + len(blocks)
            self.running[state.request_id] = state
            if not self.pool.ask(state, self.cache.prompt_keys(state), len(cached)):
                yield state

    def loaded(self, request_id: int, tiers: list[str]) -> None:
        """Every stage has read back the first ``len(tiers)`` of a loading request's pool
        blocks (kvasir/sched/pool_loads.py); a request no longer loading is left alone."""
        state = self.running.get(request_id)
        if state is not None and state.loading:
            self.pool.answered(state, tiers)

    def _fairest(self) -> RequestState | None:
        """The oldest waiting request of the client holding the fewest blocks (ties: the
        older request). Ids of requests cancelled while waiting are dropped here."""
        best: RequestState | None = None
        for client in list(self.queues):
            queue = self.queues[client]
            while queue and queue[0] not in self.waiting:
                queue.popleft()
            if not queue:
                del self.queues[client]
                continue
            state = self.waiting[queue[0]]
            if best is None or (self.held.get(client, 0), state.arrival) < (
                self.held.get(best.client, 0),
                best.arrival,
            ):
                best = state
        return best

    def _row(self, state: RequestState, budget: int, tokens: list[int], new: list[NewRequest]) -> Row:
        start = state.computed
        count = min(state.length - start, budget)
        emit = start + count == state.length
        draft = self._drafts(state, budget - count) if emit else ()
        stop = start + count + len(draft)
        needed = -(-stop // self.block_size)
        growth = tuple(state.blocks[state.blocks_sent : needed])  # none where rejected drafts' blocks were sent
        state.blocks_sent = max(state.blocks_sent, needed)
        state.computed = stop
        state.drafted = len(draft)
        state.in_flight = True
        tokens.extend(state.tokens(start, count))
        tokens.extend(draft)
        if not state.announced:
            new.append(state.announcement(self.announce_prompts))
            state.announced = True
        return Row(state.request_id, start, count + len(draft), growth, emit=emit, draft=draft)

    def _drafts(self, state: RequestState, room: int) -> tuple[int, ...]:
        """The proposed drafts that fit: in the batch's token budget, in the request's KV
        blocks, and short of its last output token (the bonus sample may be that one)."""
        left = state.sampling.max_tokens - len(state.output) - 1
        capacity = len(state.blocks) * self.block_size - state.length
        draft = tuple(state.draft[: max(0, min(room, left, capacity))])
        state.draft = []
        return draft

    # -- closing the ring ---------------------------------------------------------
    def complete(self, result: BatchResult) -> list[Emitted]:
        """Apply the tail's sampled tokens for a batch; return what clients should see."""
        members = self.inflight.pop(result.batch_id, None)
        if members is None:
            raise BatchError(f"result for batch {result.batch_id}, which is not in flight")
        sampled: dict[int, list[SampledToken]] = {}
        for tok in result.tokens:
            sampled.setdefault(tok.request_id, []).append(tok)
        wrong = set(sampled).difference(members) | {
            rid for rid, got in sampled.items() if rid in members and len(got) > 1 + self.running[rid].drafted
        }
        if wrong:
            self.inflight[result.batch_id] = members
            raise BatchError(
                f"batch {result.batch_id}: tokens for requests not in it or past their drafts: {sorted(wrong)}"
            )
        events: list[Emitted] = []
        for rid in members:
            state = self.running[rid]
            got = sampled.pop(rid, [])
            if self.speculation is not None:
                self.speculation.verified(rid, state.drafted, max(len(got) - 1, 0))
            state.roll_back(0 if state.cancelled else max(len(got) - 1, 0))
            if state.cancelled:
                self.cache.register_computed(state)
                self._retire(state)
                events.append(Emitted(rid, None, len(state.output), "cancelled"))
                continue
            finished = False
            for token in got:
                state.output.append(token.token_id)
                events.append(Emitted(rid, token.token_id, len(state.output) - 1, token.finish))
                if finished := token.finish is not None:
                    break
            self.cache.register_computed(state)  # after the tokens: confirmed drafts' blocks are keyed by them
            if finished:
                self._retire(state)
        return events

    # -- hand-off between pools (disaggregated plans) ---------------------------------
    def park(self, request_id: int) -> RequestState:
        """Stop scheduling a running request (its prompt is done; its KV moves to the
        decode pool); it keeps its blocks until ``retire``."""
        state = self.running[request_id]
        state.parked = True
        return state

    def retire(self, request_id: int) -> RequestState | None:
        """End a running request: free its blocks, release its KV on every stage."""
        state = self.running.get(request_id)
        if state is not None:
            self._retire(state)
        return state

    def reserve(
        self,
        request_id: int,
        prompt_len: int,
        output: list[int],
        sampling: SamplingParams,
        seed: int,
        context: tuple[int, ...] = (),
    ) -> list[int] | None:
        """Take in a request whose prompt KV is computed elsewhere: reserve its blocks and
        park it (``unpark`` once every stage holds the KV). None when the cache is full.
        ``context``: the prompt's ids where its sampling reads them (not its KV's)."""
        if request_id in self.running or request_id in self.waiting:
            raise RequestError("invalid_request", f"request id {request_id} is already in use")
        total = min(prompt_len + sampling.max_tokens, self.max_seq_len)
        need = -(-total // self.block_size)
        blocks = self.cache.take([], need)
        if blocks is None:
            return None
        state = RequestState(
            request_id, [], sampling, seed, need, prompt_len, output=list(output), blocks=blocks, context=context
        )
        state.blocks_sent = need  # the placement gave every stage the whole table
        state.computed = prompt_len
        state.parked = True
        self.running[request_id] = state
        self.held[state.client] = self.held.get(state.client, 0) + need
        return blocks

    def unpark(self, request_id: int) -> None:
        self.running[request_id].parked = False

    def _retire(self, state: RequestState) -> None:
        self.running.pop(state.request_id, None)
        if self.speculation is not None:
            self.speculation.forget(state.request_id)
        self.cache.release(state.blocks)
        left = self.held.get(state.client, 0) - len(state.blocks)
        if left > 0:
            self.held[state.client] = left
        else:
            self.held.pop(state.client, None)
        state.blocks = []
        if state.announced:
            self._release.append(state.request_id)
