"""The heads' hand-off states, driven message by message through fake channels: a
request handed from the prefill pool to the decode pool is placed, copied, adopted,
dropped, cancelled or timed out, and each side frees exactly what it holds."""

from __future__ import annotations

import pytest

from kvasir.sched.scheduler import Scheduler
from kvasir.stage.decode_head import DecodeHeadIntake
from kvasir.stage.heads import PrefillHeadIntake
from kvasir.wire.batch import SampledToken, SamplingParams
from kvasir.wire.bridge import HandoffReport, RequestEnded
from kvasir.wire.head import Adopted, BatchResult, CancelRequest, Handoff, KvDrop, KvHeld, KvPlaced
from kvasir.wire.kv import Placement
from tests.support.channels import FakeChannel
from tests.support.models import make_plan

SAMPLING = SamplingParams(max_tokens=40)  # with a ten-token prompt: 13 blocks of 4


def plan():
    return make_plan("unused", [(0, 1), (1, 2)], block_size=4, num_blocks=20, max_tokens=32, max_seq_len=80)


@pytest.fixture
def decode():
    """A decode head with two decode stages: (intake, channels by name)."""
    ch = {name: FakeChannel() for name in ("inbox", "bridge", "prefill", "stage0", "stage1")}
    intake = DecodeHeadIntake(
        Scheduler(plan(), 100), ch["inbox"], ch["bridge"], {0: ch["prefill"]}, [ch["stage0"], ch["stage1"]]
    )
    return intake, ch


def handoff(rid, prompt_len=10):
    return Handoff(rid, prompt_len, 7, SAMPLING, 1, 0)


def deliver(intake, channel, *messages):
    channel.queue(*messages)
    intake.receive()


def test_a_handed_off_request_is_placed_copied_and_adopted(decode):
    intake, ch = decode
    deliver(intake, ch["inbox"], handoff(5))
    [placed] = ch["stage0"].take()
    assert isinstance(placed, Placement) and placed.request_id == 5 and len(placed.blocks) == 13  # 10 + 40 tokens
    assert ch["stage1"].take() == [placed] and ch["prefill"].take() == [KvPlaced(5)]
    assert intake.scheduler.next_batch() is None  # parked until every decode stage holds its part
    deliver(intake, ch["inbox"], KvHeld(5, 0, 100, 10, 1000))
    assert ch["prefill"].take() == []  # one stage of two
    deliver(intake, ch["inbox"], KvHeld(5, 1, 50, 30, 2000))
    assert ch["prefill"].take() == [Adopted(5)]
    [report] = ch["bridge"].take()
    assert isinstance(report, HandoffReport) and report.nbytes == 150 and report.copy_s == pytest.approx(30e-9)
    row = intake.scheduler.next_batch().descriptor.rows[0]
    assert (row.request_id, row.start, row.num_tokens) == (5, 10, 1)


def test_a_full_decode_pool_keeps_the_hand_off_waiting_until_blocks_free(decode):
    intake, ch = decode
    deliver(intake, ch["inbox"], handoff(1), handoff(2))  # 13 blocks each, 20 in the cache
    assert ch["prefill"].take() == [KvPlaced(1)]  # the second waits: back-pressure, no lease yet
    deliver(intake, ch["inbox"], CancelRequest(1))
    assert ch["prefill"].take() == [Adopted(1), KvPlaced(2)]  # the prefill pool frees 1; 2 goes in
    assert RequestEnded(1, "cancelled") in ch["bridge"].take()


def test_a_cancel_that_overtakes_the_hand_off_drops_it_on_arrival(decode):
    intake, ch = decode
    deliver(intake, ch["inbox"], CancelRequest(3))
    assert ch["stage0"].take() == [Placement(3, ())]  # its parts may be at the stages already
    deliver(intake, ch["inbox"], handoff(3))
    assert ch["stage0"].take() == [Placement(3, ())] and ch["prefill"].take() == [Adopted(3)]
    assert intake.scheduler.cache.available == 20 and not intake.pending and not intake.placed


def test_a_drop_while_copying_frees_the_decode_blocks_and_late_copies_are_ignored(decode):
    intake, ch = decode
    deliver(intake, ch["inbox"], handoff(4))
    ch["prefill"].take()
    deliver(intake, ch["inbox"], KvHeld(4, 0, 1, 1, 1), KvDrop(4))
    assert ch["prefill"].take() == [Adopted(4)] and intake.scheduler.cache.available == 20
    deliver(intake, ch["inbox"], KvHeld(4, 1, 1, 1, 1))  # the other stage's copy, too late
    assert ch["prefill"].take() == [] and ch["inbox"].dropped == []
    assert ch["bridge"].take() == []  # the prefill pool told the bridge how it ended: one word only


def test_a_drop_says_nothing_to_the_bridge_wherever_the_request_is(decode):
    """KvDrop comes from the prefill head, which reports the end itself (a finish at the
    first token, a lease run out); a cancelled from here could overtake that report."""
    intake, ch = decode
    deliver(intake, ch["inbox"], KvDrop(1), handoff(1))  # the drop overtook the hand-off
    deliver(intake, ch["inbox"], handoff(2))
    deliver(intake, ch["inbox"], KvHeld(2, 0, 1, 1, 1), KvHeld(2, 1, 1, 1, 1))  # adopted
    batch = intake.scheduler.next_batch()
    deliver(intake, ch["inbox"], KvDrop(2))  # while its decode step is in flight
    deliver(intake, ch["inbox"], BatchResult(batch.descriptor.batch_id, (SampledToken(2, 9, 1, None),)))
    assert [m for m in ch["bridge"].take() if isinstance(m, RequestEnded)] == []
    assert intake.scheduler.idle and intake.scheduler.cache.available == 20
    deliver(intake, ch["inbox"], handoff(3), CancelRequest(3))  # a client's cancel is still reported
    assert ch["bridge"].take() == [RequestEnded(3, "cancelled")]


@pytest.fixture
def prefill():
    """A prefill head with one request whose prompt has run: (intake, channels, rid)."""
    ch = {name: FakeChannel() for name in ("inbox", "bridge", "decode")}
    intake = PrefillHeadIntake(
        Scheduler(plan(), 100, reserve_output=False), ch["inbox"], ch["bridge"], {2: ch["decode"]}, 5.0
    )
    rid = intake.scheduler.submit(list(range(3, 13)), SAMPLING)
    batch = intake.scheduler.next_batch()
    result = BatchResult(batch.descriptor.batch_id, (SampledToken(rid, 7, 0, None),))
    return intake, ch, rid, result


def test_the_prefill_head_parks_the_request_until_adopted(prefill):
    intake, ch, rid, result = prefill
    deliver(intake, ch["inbox"], result)
    assert intake.handed == {rid} and intake.scheduler.cache.available == 20 - 3  # its prompt's blocks held
    assert intake.queue().handing_off == 1
    deliver(intake, ch["inbox"], KvPlaced(rid), Adopted(rid))
    assert intake.handed == set() and intake.scheduler.cache.available == 20


def test_an_adoption_that_overtakes_the_result_frees_the_blocks_at_once(prefill):
    intake, ch, rid, result = prefill
    deliver(intake, ch["inbox"], KvPlaced(rid), Adopted(rid))
    assert intake.handed == set()
    deliver(intake, ch["inbox"], result)
    assert intake.handed == set() and intake.scheduler.cache.available == 20


def test_a_lost_confirmation_fails_the_request_when_its_lease_runs_out(prefill):
    intake, ch, rid, result = prefill
    deliver(intake, ch["inbox"], result, KvPlaced(rid))
    intake.leases[rid] -= intake.lease_s  # placed one lease ago
    intake.receive()
    assert ch["decode"].take() == [KvDrop(rid)]  # the decode head drops it without a word
    [ended] = ch["bridge"].take()
    assert ended.code == "stage_failed" and "within 5 s" in ended.message
    assert intake.handed == set() and intake.scheduler.cache.available == 20


def test_waiting_for_decode_blocks_is_not_timed(prefill):
    intake, ch, rid, result = prefill
    deliver(intake, ch["inbox"], result)  # handed off, never placed: no lease runs
    assert rid not in intake.leases and intake.handed == {rid}


def test_a_cancel_for_a_handed_off_request_goes_to_the_decode_head(prefill):
    intake, ch, rid, result = prefill
    deliver(intake, ch["inbox"], result, CancelRequest(rid))
    assert ch["decode"].take() == [CancelRequest(rid)]
