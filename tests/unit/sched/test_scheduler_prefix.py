"""The scheduler with the prefix cache: what a request reuses, what it computes, and
that the blocks' holders stay right through completion, cancellation and eviction."""

from __future__ import annotations

from kvasir.sched.scheduler import Scheduler
from kvasir.wire.batch import SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from tests.support.models import make_plan

VOCAB, BLOCK = 100, 4


def scheduler(**kw) -> Scheduler:
    kw.setdefault("inflight", 1)
    return Scheduler(make_plan("unused", [(0, 1), (1, 2)], block_size=BLOCK, **kw), VOCAB)


def run(s: Scheduler):
    """Build the next batch and complete it: token 7 for every emitting row, "length" on
    a request's last, as the tail would."""
    batch = s.next_batch()
    assert batch is not None
    rows = batch.descriptor.rows
    states = {r.request_id: s.running[r.request_id] for r in rows}
    last = {rid for rid, st in states.items() if len(st.output) + 1 >= st.sampling.max_tokens}
    tokens = tuple(SampledToken(r.request_id, 7, 0, "length" if r.request_id in last else None) for r in rows if r.emit)
    s.complete(BatchResult(batch.descriptor.batch_id, tokens))
    return rows


def serve(s: Scheduler, prompt: list[int], max_tokens: int = 1) -> list:
    """Submit one request and run it to its end; the rows of every batch it was in."""
    s.submit(prompt, SamplingParams(max_tokens=max_tokens))
    seen = []
    while not s.idle:
        seen.extend(run(s))
    return seen


def test_a_repeated_prompt_computes_only_what_is_not_cached():
    s = scheduler()
    shared = [5 + i for i in range(10)]  # two full blocks and two tokens
    serve(s, shared + [50, 51])
    rows = serve(s, shared + [60, 61, 62])
    first = rows[0]
    assert first.start == 8 and first.num_tokens == 5  # blocks 0 and 1 reused
    assert s.cache.hit_tokens == 8 and s.cache.queries == 2


def test_the_last_prompt_token_is_always_computed():
    s = scheduler()
    prompt = [5 + i for i in range(8)]  # exactly two blocks
    serve(s, prompt, max_tokens=3)
    rows = serve(s, prompt)
    assert (rows[0].start, rows[0].num_tokens) == (4, 4)  # one block reused, the last one computed
    rows = serve(s, prompt + [40])
    assert (rows[0].start, rows[0].num_tokens) == (8, 1)


def test_generated_tokens_are_cached_for_the_next_turn():
    s = scheduler()
    question = [5, 6, 7, 8, 9, 10]
    serve(s, question, max_tokens=5)  # output 7 7 7 7 7: positions 6..10, 6..9 computed
    rows = serve(s, question + [7, 7, 7, 7, 7, 20])
    assert rows[0].start == 8  # the first two blocks, the second holding two generated tokens


def test_prompt_logprobs_and_a_disabled_cache_reuse_nothing():
    s = scheduler()
    prompt = [5 + i for i in range(9)]
    serve(s, prompt)
    s.submit(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert run(s)[0].start == 0
    off = scheduler(prefix_cache=False)
    serve(off, prompt)
    assert serve(off, prompt)[0].start == 0 and off.cache.cached_blocks == 0


def test_holders_stay_right_when_requests_share_and_are_cancelled():
    s = scheduler(inflight=2, num_blocks=12, max_seq_len=48)
    shared = [5 + i for i in range(8)]
    serve(s, shared + [1])
    ids = [s.submit(shared + [n], SamplingParams(max_tokens=20)) for n in (2, 3)]
    run(s)
    for rid in ids:
        s.cancel(rid)
    while not s.idle:
        run(s)
    assert s.cache.available == 12  # every block free or idle again
    rows = serve(s, shared + [4])
    assert rows[0].start == 8


def test_eviction_under_pressure_still_serves_every_request():
    s = scheduler(num_blocks=8, max_seq_len=32)
    for n in range(6):  # each needs 3 blocks; caching them all would need 18
        prompt = [10 + n] * 9
        serve(s, prompt)
        assert serve(s, prompt)[0].start == 8  # its own prefix, just cached, is reused
    assert s.cache.evicted > 0 and s.cache.available == 8


def test_requests_share_blocks_only_within_their_namespace_root():
    from kvasir.sched.prefix import namespace_root

    s = scheduler()
    mine, theirs = namespace_root("key:mine", None), namespace_root("key:theirs", None)
    question = [5 + i for i in range(10)]

    def first_row(prompt: list[int], root: bytes, max_tokens: int = 1):
        s.submit(prompt, SamplingParams(max_tokens=max_tokens), cache_root=root)
        rows = []
        while not s.idle:
            rows.extend(run(s))
        return rows[0]

    assert first_row(question, mine, max_tokens=5).start == 0  # output 7 7 7 7 7, cached under "mine"
    assert first_row(question + [60], theirs).start == 0  # another tenant's guess: nothing reused
    assert first_row(question + [60], b"").start == 0  # nor by a request of the shared (empty) root
    assert first_row(question + [60], mine).start == 8  # the same tenant: its two full blocks
    assert first_row(question + [7, 7, 7, 7, 20], mine).start == 12  # its generated tokens too
    assert first_row(question + [7, 7, 7, 7, 20], theirs).start == 8  # what "theirs" computed itself
