"""The planner's policy (kvasir/bridge/planner.py): which pool misses its target, whether the
other can spare an instance, when a busy pool gets one while both meet their targets, and
what keeps it from flapping."""

from __future__ import annotations

from kvasir.bridge.planner import Member, Planner, StageBusy, percentile
from kvasir.config.roles import PlannerSpec
from kvasir.wire.stats import StageStats

SPEC = PlannerSpec(enabled=True, ttft_s=1.0, itl_s=0.1, percentile=90, patience=2, headroom=0.8, cooldown_s=30)


def fleet(prefill: int = 2, decode: int = 2, busy: tuple[float | None, float | None] = (0.4, 0.2)) -> dict:
    """Instances with their requests, each pool's busy share as ``busy`` (prefill, decode)."""
    return {
        "prefill": [Member(f"p{i}", requests=i, movable=True, busy=busy[0]) for i in range(prefill)],
        "decode": [Member(f"d{i}", requests=3 - i, movable=True, busy=busy[1]) for i in range(decode)],
    }


def interval(planner: Planner, ttft: list[float], gaps: list[float], now: float, waiting=(), members=None):
    for value in ttft:
        planner.samples.first_token(value)
    for value in gaps:
        planner.samples.gap(value)
    return planner.decide(list(waiting), members or fleet(), False, now)


def test_percentile_is_the_nearest_rank():
    assert percentile([], 90) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(range(1, 101), 90) == 90
    assert percentile([5.0], 100) == 5.0


def test_a_pool_missing_for_patience_intervals_gets_the_least_busy_instance_of_the_other():
    planner = Planner(SPEC)
    first = interval(planner, [2.0] * 10, [0.02] * 50, now=10)  # prefill at 2x, decode at 0.2x
    assert first.action == "hold" and "prefill pool misses its target (2.00 of it)" in first.reason
    assert "1 of 2 intervals" in first.reason and (first.ttft_s, first.itl_s) == (2.0, 0.02)
    second = interval(planner, [2.0] * 10, [0.02] * 50, now=20)
    assert (second.action, second.instance, second.to) == ("move", "d1", "prefill")  # d1 has fewest requests
    assert "decode pool has slack (0.40 busy with one fewer)" in second.reason
    assert (second.prefill_busy, second.decode_busy) == (0.4, 0.2)
    assert planner.decisions == {"hold": 1, "move": 1}
    stats = planner.stats(now=25)
    assert stats.last_move is not None and stats.last_move.seconds_ago == 5 and stats.last_move.instance == "d1"


def test_a_broken_streak_starts_again():
    planner = Planner(SPEC)
    interval(planner, [2.0], [0.02], now=10)
    assert interval(planner, [0.5], [0.02], now=20).reason == "both pools meet their targets"
    assert "1 of 2" in interval(planner, [2.0], [0.02], now=30).reason


def test_prompts_still_waiting_count_at_their_age():
    """No first token came in the interval, but prompts wait: the prefill pool misses."""
    planner = Planner(SPEC)
    decision = interval(planner, [], [], now=10, waiting=[4.0, 3.0])
    assert decision.ttft_s == 4.0 and "prefill pool misses" in decision.reason


def test_no_move_without_slack_or_below_the_minimum():
    planner = Planner(SPEC)
    busy = interval(planner, [2.0], [0.05], now=10, members=fleet(busy=(1.0, 0.5)))  # decode one fewer: 1.0
    assert busy.action == "hold" and "decode pool has no slack" in busy.reason and "busy 1.00" in busy.reason
    unmeasured = interval(planner, [2.0], [0.05], now=15, members=fleet(busy=(1.0, None)))
    assert "the decode pool's stages have not reported how busy they are" in unmeasured.reason
    alone = interval(planner, [2.0], [0.01], now=20, members=fleet(prefill=3, decode=1))
    assert "decode pool is at planner.min_decode = 1" in alone.reason
    both = interval(planner, [2.0], [0.5], now=30)
    assert both.reason == "both pools miss their targets: neither has an instance to spare"


def test_the_decode_pool_missing_takes_a_prefill_instance():
    planner = Planner(PlannerSpec(enabled=True, patience=1, itl_s=0.1, ttft_s=1.0))
    decision = interval(planner, [0.1], [0.3], now=10, members=fleet(prefill=3, decode=1, busy=(0.3, 1.0)))
    assert (decision.action, decision.instance, decision.to) == ("move", "p0", "decode")
    assert "prefill pool has slack (0.45 busy with one fewer)" in decision.reason


def test_fixed_instances_do_not_move():
    planner = Planner(PlannerSpec(enabled=True, patience=1, itl_s=0.1, ttft_s=1.0))
    members = fleet()
    members["decode"] = [m._replace(movable=False) for m in members["decode"]]
    decision = interval(planner, [2.0], [0.01], now=10, members=members)
    assert decision.action == "hold" and "no decode instance is movable" in decision.reason


def test_a_move_under_way_and_the_cooldown_after_hold():
    planner = Planner(PlannerSpec(enabled=True, patience=1, cooldown_s=30, itl_s=0.1, ttft_s=1.0))
    planner.samples.first_token(2.0)
    assert planner.decide([], fleet(), True, 10).reason == "a move is under way"
    planner.moved(now=12)
    cooling = interval(planner, [2.0], [0.01], now=20)
    assert cooling.action == "hold" and "cooling down (22 s left)" in cooling.reason
    assert interval(planner, [2.0], [0.01], now=43).action == "move"


def test_each_interval_samples_afresh():
    planner = Planner(SPEC)
    interval(planner, [2.0] * 5, [0.02], now=10)
    quiet = planner.decide([], fleet(), False, 20)
    assert (quiet.ttft_s, quiet.itl_s) == (None, None) and quiet.reason == "both pools meet their targets"


def test_while_both_meet_their_targets_the_busy_pool_gets_an_instance_the_other_spares():
    planner = Planner(SPEC)
    members = fleet(prefill=3, decode=1, busy=(0.2, 0.95))  # short prompts, long answers: decode works
    first = interval(planner, [0.3], [0.05], now=10, members=members)
    assert first.action == "hold" and "1 of 2 intervals" in first.reason
    assert "both pools meet their targets, but the decode pool is busy (0.95 of the time)" in first.reason
    second = interval(planner, [0.3], [0.05], now=20, members=members)
    assert (second.action, second.instance, second.to) == ("move", "p0", "decode")
    assert "prefill pool has slack (0.30 busy with one fewer)" in second.reason


def test_a_move_that_would_not_even_the_pools_out_is_not_made():
    """After a move the readings that made it cannot ask for it back: the giver one fewer
    must stay less busy than the busy pool one more."""
    planner = Planner(PlannerSpec(enabled=True, patience=1, itl_s=0.1, ttft_s=1.0))
    close = interval(planner, [0.3], [0.05], now=10, members=fleet(busy=(0.39, 0.85)))
    assert close.action == "hold" and "would be as busy as the decode pool one more" in close.reason
    assert "(0.78)" in close.reason and "(0.57)" in close.reason
    idle = interval(planner, [0.3], [0.05], now=20, members=fleet(busy=(0.1, 0.45)))
    assert idle.action == "hold" and idle.reason == "both pools meet their targets"  # busy under half the time
    unmeasured = interval(planner, [0.3], [0.05], now=30, members=fleet(busy=(None, 0.95)))
    assert unmeasured.reason == "both pools meet their targets"
    balanced = interval(planner, [0.3], [0.05], now=40, members=fleet(prefill=1, decode=3, busy=(0.3, 0.9)))
    assert "prefill pool is at planner.min_prefill = 1" in balanced.reason
    half = interval(planner, [0.3], [0.05], now=50, members=fleet(busy=(0.6, 0.1)))  # 0.2 one fewer < 0.4 one more
    assert (half.action, half.to) == ("move", "prefill") and "prefill pool is busy (0.60 of the time)" in half.reason


def stage(index: int, pid: int, busy_s: float, wall_s: float) -> StageStats:
    return StageStats(
        index=index, layers=(0, 1), pid=pid, wall_s=wall_s, busy_s=busy_s, starved_s=0, blocked_s=0,
        batches=0, rows=0, tokens=0,
    )  # fmt: skip


def test_a_stages_busy_share_is_measured_between_two_readings_of_the_same_process():
    busy = StageBusy()
    assert busy.shares({0: stage(0, 7, 1.0, 10.0), 1: stage(1, 8, 0.0, 10.0)}) == {}  # first sight: no share
    assert busy.shares({0: stage(0, 7, 4.0, 14.0), 1: stage(1, 8, 1.0, 14.0)}) == {0: 0.75, 1: 0.25}
    assert busy.shares({0: stage(0, 7, 4.0, 14.0), 1: stage(1, 9, 0.5, 1.0)}) == {}  # no report since; new pid
    assert busy.shares({0: stage(0, 7, 6.0, 16.0), 1: stage(1, 9, 1.5, 3.0)}) == {0: 1.0, 1: 0.5}
