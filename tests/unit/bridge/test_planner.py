"""The planner's policy (kvasir/bridge/planner.py): which pool misses its target, whether the
other can spare an instance, and what keeps it from flapping."""

from __future__ import annotations

from kvasir.bridge.planner import Member, Planner, percentile
from kvasir.config.roles import PlannerSpec

SPEC = PlannerSpec(enabled=True, ttft_s=1.0, itl_s=0.1, percentile=90, patience=2, headroom=0.8, cooldown_s=30)


def fleet(prefill: int = 2, decode: int = 2) -> dict:
    return {
        "prefill": [Member(f"p{i}", requests=i, movable=True) for i in range(prefill)],
        "decode": [Member(f"d{i}", requests=3 - i, movable=True) for i in range(decode)],
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
    assert "decode pool has slack (0.40 with one fewer)" in second.reason
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
    busy = interval(planner, [2.0], [0.05], now=10)  # decode at 0.5, one fewer: 1.0 > 0.8
    assert busy.action == "hold" and "decode pool has no slack" in busy.reason and "1.00" in busy.reason
    alone = interval(planner, [2.0], [0.01], now=20, members=fleet(prefill=3, decode=1))
    assert "decode pool is at planner.min_decode = 1" in alone.reason
    both = interval(planner, [2.0], [0.5], now=30)
    assert both.reason == "both pools miss their targets: neither has an instance to spare"


def test_the_decode_pool_missing_takes_a_prefill_instance():
    planner = Planner(PlannerSpec(enabled=True, patience=1, itl_s=0.1, ttft_s=1.0))
    decision = interval(planner, [0.1], [0.3], now=10, members=fleet(prefill=3, decode=1))
    assert (decision.action, decision.instance, decision.to) == ("move", "p0", "decode")


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
