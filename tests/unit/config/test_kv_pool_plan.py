"""The plan's [kv_pool] section: what it refuses, and each stage's share of a host's tiers."""

from __future__ import annotations

import pytest

from kvasir.config.kvpool import tier_shares
from kvasir.config.plan import parse_plan, plan_toml
from kvasir.errors import PlanError

STAGES = "[[stages]]\nlayers = [0, 10]\n[[stages]]\nlayers = [10, 30]\n"
DISK = 'disk_dir = "/var/cache/kvasir"\ndisk_bytes = 1000'


def plan(pool: str, extra: str = ""):
    return parse_plan(f"[kv_pool]\n{pool}\n{extra}{STAGES}")


@pytest.mark.parametrize(
    ("pool", "says"),
    [
        ("", r"\[kv_pool\] has no tier"),
        ("host_bytes = -1", "kv_pool.host_bytes must be >= 0"),
        ('disk_dir = "/var/kv"', "kv_pool.disk_dir and kv_pool.disk_bytes go together"),
        ("disk_bytes = 100", "kv_pool.disk_dir and kv_pool.disk_bytes go together"),
        ('disk_dir = "kv"\ndisk_bytes = 100', "must be an absolute path"),
        (f"{DISK}\nload_timeout_s = 0", r"kv_pool.load_timeout_s must be in \(0, 600\]"),
        (f"{DISK}\nload_timeout_s = nan", "kv_pool.load_timeout_s"),
        ("host_bytes = 10\nshelf = 1", "kv_pool.shelf: unknown key"),
    ],
)
def test_refusals_name_the_key(pool, says):
    with pytest.raises(PlanError, match=says):
        plan(pool)


def test_the_pool_needs_the_prefix_cache_and_a_colocated_plan():
    with pytest.raises(PlanError, match="needs kv.prefix_cache = true"):
        plan(DISK, "[kv]\nprefix_cache = false\n")
    pools = "".join(
        f"[[{pool}.stages]]\nlayers = [0, 10]\n[[{pool}.stages]]\nlayers = [10, 30]\n" for pool in ("prefill", "decode")
    )
    with pytest.raises(PlanError, match="not served with \\[prefill\\] and \\[decode\\] pools yet"):
        parse_plan(f"[kv_pool]\n{DISK}\n{pools}")


def test_a_valid_pool_reads_back_and_each_stage_gets_its_layers_share():
    spec = plan(f"host_bytes = 300\n{DISK}").kv_pool
    assert spec is not None and (spec.host_bytes, spec.disk_bytes, spec.load_timeout_s) == (300, 1000, 10.0)
    whole = plan(f"host_bytes = 300\n{DISK}")
    assert parse_plan(plan_toml(whole)) == whole
    assert parse_plan(STAGES).kv_pool is None  # no [kv_pool], no pool
    # hosts a and b: a's stages share a's bytes by their layers, b's one stage has b's all
    assert tier_shares(300, [("a", (0, 10)), ("a", (10, 30)), ("b", (0, 30))]) == [100, 200, 300]
    assert tier_shares(0, [("", (0, 30))]) == [0]
