"""The bridge's view of the KV pool (kvasir/bridge/pool.py): what each instance can read
back of a prompt, from its stages' events, including those that came before it served."""

from __future__ import annotations

from kvasir.bridge.pool import PoolView
from kvasir.config.plan import parse_plan
from kvasir.sched.prefix import block_keys
from kvasir.wire.bridge import PoolEvents

BLOCK = 4
PLAN = parse_plan(
    f"[kv]\nblock_size = {BLOCK}\n[kv_pool]\nhost_bytes = 1000\n"
    '[[instances]]\nname = "a"\n[[instances.stages]]\nlayers = [0, 3]\n[[instances.stages]]\nlayers = [3, 6]\n'
    '[[instances]]\nname = "b"\n[[instances.stages]]\nlayers = [0, 2]\n[[instances.stages]]\nlayers = [2, 6]\n'
)
PROMPT = list(range(10, 31))  # 5 full blocks before its last token
KEYS = block_keys(PROMPT, BLOCK, 5, b"root")


def test_an_instance_reads_back_only_blocks_all_its_stages_hold():
    view = PoolView(PLAN)
    view.note(PoolEvents(0, 100, "host", tuple(KEYS[:3]), reset=True), current=True)
    assert view.pooled("a", PROMPT, b"root").blocks == 0  # stage 1 holds nothing yet
    view.note(PoolEvents(1, 101, "disk", tuple(KEYS[:2]) + (KEYS[4],)), current=True)
    assert (
        view.pooled("a", PROMPT, b"root").blocks == 2 and view.pooled("a", PROMPT, b"other").blocks == 0
    )  # another namespace
    assert view.pooled("b", PROMPT, b"root").blocks == 0  # other layer ranges: other slices
    view.note(PoolEvents(1, 101, "disk", removed=(KEYS[0],)), current=True)
    assert view.pooled("a", PROMPT, b"root").blocks == 0
    view.note(PoolEvents(0, 100, "host", (KEYS[0],), reset=True), current=True)  # a snapshot replaces the rest
    view.note(PoolEvents(1, 101, "disk", (KEYS[0], KEYS[1])), current=True)
    assert view.pooled("a", PROMPT, b"root").blocks == 1
    view.forget_hosts([""])  # the (only) host is gone, and its tiers with it
    assert view.pooled("a", PROMPT, b"root").blocks == 0 and len(view.index) == 0


def test_events_before_an_instance_serves_count_once_it_serves_with_those_processes():
    view = PoolView(PLAN)
    view.note(PoolEvents(2, 200, "disk", (KEYS[0],), reset=True), current=False)  # instance b, starting
    view.note(PoolEvents(2, 200, "disk", tuple(KEYS[:2]), reset=True), current=False)  # a snapshot: the last counts
    view.note(PoolEvents(3, 999, "disk", tuple(KEYS), reset=True), current=False)  # a process replaced since
    view.note(PoolEvents(3, 201, "disk", (KEYS[0],), reset=True), current=False)
    view.note(PoolEvents(3, 201, "disk", (KEYS[1], KEYS[2])), current=False)
    view.note(PoolEvents(7, 300, "disk", tuple(KEYS)), current=True)  # no such stage: dropped
    assert view.pooled("b", PROMPT, b"root").blocks == 0
    view.serve([200, 201])
    assert view.pooled("b", PROMPT, b"root").blocks == 2


def test_the_index_is_sized_to_the_blocks_every_hosts_tiers_hold():
    # one host: 1000 bytes of tiers over blocks of 4 tokens x 10 bytes, besides 4 keys per KV block
    blocks = sum(ring.plan.kv.num_blocks for ring in PLAN.rings())
    assert PoolView(PLAN, kv_bytes_per_token=10).index.max_keys == 4 * blocks + 1000 // 40
    assert PoolView(PLAN).index.max_keys == 4 * blocks + (1 << 18)  # the KV size unknown: a fixed share
