"""Busy / starved / blocked shares: one definition for stats, top and bench."""

import pytest

from kvasir.bench.plans import pool_fractions
from kvasir.wire.shares import Shares, by_pool, stage_shares, total
from kvasir.wire.stats import StageStats


def report(wall, busy, starved, blocked, pool=""):
    return StageStats(0, (0, 1), 1, wall, busy, starved, blocked, 0, 0, 0, pool=pool)


def test_a_stage_since_start_and_over_a_window():
    early, late = report(10.0, 4.0, 5.0, 1.0), report(30.0, 16.0, 9.0, 5.0)
    assert stage_shares(early).busy == pytest.approx(0.4)
    window = stage_shares(late, early)
    assert window == Shares(20.0, 12.0, 4.0, 4.0)
    assert (window.busy, window.starved, window.blocked) == pytest.approx((0.6, 0.2, 0.2))


def test_no_wall_time_has_no_shares():
    assert stage_shares(report(0.0, 0.0, 0.0, 0.0)).fraction("busy") == 0.0
    assert total([]).busy == 0.0


def test_a_pool_is_weighted_by_seconds_not_the_mean_of_its_stages():
    """A stage busy for all of 10 s and one idle for 30 s: the pool was busy a quarter of
    its stages' time (the mean of the two fractions would say half)."""
    pool = total([stage_shares(report(10.0, 10.0, 0.0, 0.0)), stage_shares(report(30.0, 0.0, 30.0, 0.0))])
    assert pool.busy == pytest.approx(0.25) and pool.starved == pytest.approx(0.75)


def test_pools_keep_their_first_seen_order():
    stages = [("prefill", Shares(1, 1, 0, 0)), ("decode", Shares(1, 0, 1, 0)), ("prefill", Shares(1, 0, 0, 1))]
    pools = by_pool(stages)
    assert list(pools) == ["prefill", "decode"]
    assert pools["prefill"] == Shares(2, 1, 0, 1)


def test_bench_pools_use_the_same_definition():
    stages = [
        {"pool": "", "window_s": 10.0, "busy": 1.0, "starved": 0.0, "blocked": 0.0},
        {"pool": "", "window_s": 30.0, "busy": 0.0, "starved": 1.0, "blocked": 0.0},
    ]
    assert pool_fractions(stages) == {"ring": pytest.approx({"busy": 0.25, "starved": 0.75, "blocked": 0.0})}
