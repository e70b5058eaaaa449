"""``kvasir bench pool``'s set-up (kvasir/bench/pool.py): the three plans it runs and
prompts that push a measured prompt out of the cache."""

from __future__ import annotations

import pytest

from kvasir.bench.pool import prompts, variants
from kvasir.config.plan import load_plan, parse_plan
from kvasir.errors import KvasirError

PLAN = parse_plan(
    "[model]\nmax_seq_len = 64\n[kv]\nblock_size = 4\nnum_blocks = 40\n[kv_pool]\nhost_bytes = 1000\n"
    "[[stages]]\nlayers = [0, 10]\n[[stages]]\nlayers = [10, 30]\n"
)


def test_the_plan_is_run_without_a_pool_in_host_memory_and_on_a_fresh_disk(tmp_path):
    paths = variants(PLAN, tmp_path)
    plans = {name: load_plan(path) for name, path in paths.items()}
    assert plans["off"].kv_pool is None
    host, disk = plans["host"].kv_pool, plans["disk"].kv_pool
    assert host is not None and (host.host_bytes, host.disk_bytes) == (1000, 0)
    assert disk is not None and (disk.host_bytes, disk.disk_bytes, disk.disk_dir) == (0, 1000, str(tmp_path / "disk"))
    assert all(plan.stages == PLAN.stages and plan.kv == PLAN.kv for plan in plans.values())
    with pytest.raises(KvasirError, match=r"a plan with \[kv_pool\]"):
        variants(parse_plan("[[stages]]\nlayers = [0, 10]\n[[stages]]\nlayers = [10, 30]\n"), tmp_path)


def test_the_fillers_hold_more_tokens_than_the_cache():
    measured, fillers = prompts(100, PLAN, prompt_len=50, rounds=3, seed=1)
    assert [len(p) for p in measured] == [50, 50, 50] and len({tuple(p) for p in measured}) == 3
    assert sum(len(f) for f in fillers) > 40 * 4 and all(len(f) < 64 for f in fillers)
    assert prompts(100, PLAN, prompt_len=50, rounds=3, seed=1) == (measured, fillers)  # seeded
    with pytest.raises(KvasirError, match="--prompt-len must be below"):
        prompts(100, PLAN, prompt_len=64, rounds=1, seed=1)
