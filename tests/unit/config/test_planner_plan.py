"""The plan's [planner] section: which instances may move, their cache and widths in each
pool, and what the section refuses (kvasir/config/roles.py)."""

from __future__ import annotations

import pytest

from kvasir.config.plan import parse_plan, plan_toml
from kvasir.config.roles import widest
from kvasir.errors import PlanError

POOLS = (
    "[prefill.batch]\nmax_rows = 4\nmax_tokens = 256\n[prefill.kv]\nnum_blocks = 256\n"
    "[decode.batch]\nmax_rows = 16\nmax_tokens = 16\ninflight = 4\n[decode.kv]\nnum_blocks = 512\n"
    '[[prefill.instances]]\nname = "p"\n[[prefill.instances.stages]]\nlayers = [0, 10]\n'
    "[[prefill.instances.stages]]\nlayers = [10, 30]\n"
    '[[decode.instances]]\nname = "d"\n[[decode.instances.stages]]\nlayers = [0, 10]\n'
    "[[decode.instances.stages]]\nlayers = [10, 30]\n"
)


def test_movable_instances_keep_the_larger_cache_and_their_pools_widths():
    plan = parse_plan(f"[planner]\n{POOLS}")
    rings = {ring.name: ring for ring in plan.rings()}
    assert {n: (r.pool, r.movable, r.plan.kv.num_blocks, r.plan.batch.max_tokens) for n, r in rings.items()} == {
        "p": ("prefill", True, 512, 256),
        "d": ("decode", True, 512, 16),
    }
    assert (widest(plan).max_rows, widest(plan).max_tokens, widest(plan).inflight) == (16, 256, 4)
    assert parse_plan(plan_toml(plan)) == plan


def test_the_planners_targets_round_trip():
    plan = parse_plan(f"[planner]\nenabled = true\nttft_s = 1.5\nitl_s = 0.05\npercentile = 99\n{POOLS}")
    assert plan.planner is not None and (plan.planner.enabled, plan.planner.ttft_s, plan.planner.percentile) == (
        True,
        1.5,
        99.0,
    )
    assert parse_plan(plan_toml(plan)) == plan


def test_without_planner_the_pools_are_fixed():
    rings = parse_plan(POOLS).rings()
    assert [(r.movable, r.plan.kv.num_blocks) for r in rings] == [(False, 256), (False, 512)]
    assert "no [planner] section" in rings[0].fixed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[planner]\n[[stages]]\nlayers = [0, 10]\n[[stages]]\nlayers = [10, 30]\n", "disaggregated plan's pools"),
        (f"[planner]\nitl_s = 0\n{POOLS}", "planner.itl_s must be a positive number of seconds"),
        (f"[planner]\ncooldown_s = -1.0\n{POOLS}", "planner.cooldown_s must be >= 0"),
        (f"[planner]\npercentile = 100.5\n{POOLS}", "planner.percentile must be in"),
        (f"[planner]\npatience = 0\n{POOLS}", "planner.patience must be 1 to 1000"),
        (f"[planner]\nheadroom = 1.5\n{POOLS}", "planner.headroom must be in"),
        (f"[planner]\nmin_decode = 0\n{POOLS}", "planner.min_decode must be >= 1"),
        (f"[planner]\nmin_prefill = 2\n{POOLS}", "planner.min_prefill = 2, but the plan starts 1 prefill"),
        (f"[planner]\nspeed = 1\n{POOLS}", "planner.speed: unknown key"),
        (
            f"[planner]\n{POOLS}".replace("[decode.kv]\n", "[decode.kv]\nblock_size = 8\n"),
            "prefill.kv.block_size = 16 and decode.kv.block_size = 8 differ",
        ),
    ],
)
def test_the_section_refuses_what_it_cannot_do(text, says):
    with pytest.raises(PlanError, match=says):
        parse_plan(text)
