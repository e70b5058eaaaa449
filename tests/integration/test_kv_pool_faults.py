"""The KV pool under storage faults, in real daemons: a full disk under ``disk_dir``, a
full /dev/shm under the memory tier, files damaged between two runs (garbage, a
directory in a file's place), a ``disk_dir`` squatted by another user, and two
instances writing one host's folders: every request finishes exactly as Hugging Face
``generate`` says, no stage restarts, the fault is counted, and everything the pool
wrote is open to nobody else."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from kvasir.wire.pool_stats import KvPoolStats
from tests.integration.test_kv_pool import BLOCK, BUDGET, SPLITS, VOCAB, one, pooled
from tests.support.daemon import kvasir_stats
from tests.support.models import hf_greedy, random_prompts, reference_model

NOBODY = 65534
SHM_SIZE = 192 * 1024  # the memory tier's /dev/shm in its own mount namespace: the ring's segments and a few slices


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs of a given size (a full disk, as a writer meets it); unmounted after."""
    mounted: list[Path] = []

    def mount(path: Path, size: int) -> Path:
        path.mkdir(parents=True)
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)])
        if made.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def serving(start_daemon, model_path, tiers: str, **plan):
    """A ready daemon whose 20 KV blocks hold one request of 48 tokens and a little more
    (as tests/integration/test_kv_pool.py's), with the pool's ``tiers``; its stages' pids."""
    kw = dict(block_size=BLOCK, num_blocks=20, max_seq_len=48, max_tokens=8, kv_pool=tiers)
    daemon = start_daemon(model_path, SPLITS, **kw, **plan).wait_ready()
    return daemon, daemon.child_pids()


def run_workload(daemon, model_path) -> list[list[int]]:
    """A base prompt, three that evict its blocks (written down), the base again: each
    request's output checked against generate. The prompts."""
    model = reference_model(model_path)
    prompts = random_prompts(VOCAB, [30, 33, 35, 31], seed=41)
    for prompt in [*prompts, prompts[0]]:
        assert one(daemon, prompt).token_ids == hf_greedy(model, prompt, BUDGET)
    return prompts


def faults(daemon, tier: str, op: str, reason: str | None = None, timeout_s: float = 30.0) -> KvPoolStats:
    """The pool's figures once the stages report a fault of ``tier`` and ``op`` (and ``reason``)."""
    deadline = time.monotonic() + timeout_s
    with daemon.client() as client:
        while True:
            pool = client.stats().kv_pool
            assert pool is not None
            if any(f.tier == tier and f.op == op and reason in (None, f.reason) for f in pool.faults):
                return pool
            assert time.monotonic() < deadline, pool
            time.sleep(0.2)


def no_restarts(daemon, pids: list[int]) -> None:
    with daemon.client() as client:
        stats = client.stats()
    assert stats.restarts == 0 and [s.pid for s in stats.stages] == pids, stats.last_failure


def private(root: Path) -> list[str]:
    """Every file and folder under ``root`` (itself included) open to group or others."""
    paths = [root, *root.rglob("*")]
    return [f"{p} {stat.S_IMODE(p.lstat().st_mode):04o}" for p in paths if p.lstat().st_mode & 0o077]


def test_a_full_disk_under_disk_dir_costs_cache_hits_never_a_request(tiny_models, start_daemon, tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "full", 40 * 1024)  # a few pages: the secret, two ledgers, a slice or two
    daemon, pids = serving(start_daemon, tiny_models["llama"], f'disk_dir = "{disk / "kv"}"\ndisk_bytes = {4 << 20}')
    run_workload(daemon, tiny_models["llama"])
    pool = faults(daemon, "disk", "write")
    assert {(f.tier, f.op, f.reason) for f in pool.faults} >= {("disk", "write", "ENOSPC")}, pool
    no_restarts(daemon, pids)
    assert "kv pool faults: disk write ENOSPC" in kvasir_stats(daemon.runtime_dir).stdout
    assert not private(disk / "kv")


def test_a_full_dev_shm_under_the_memory_tier_costs_cache_hits_never_a_request(tiny_models, start_daemon):
    """The daemon in a mount namespace of its own whose /dev/shm is a small tmpfs: its
    segments are allocated whole at start, and the memory tier fills the rest."""
    mount = f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"'
    wrap = ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh")
    if subprocess.run([*wrap, "true"]).returncode != 0:
        pytest.skip("cannot make a mount namespace here")
    daemon, pids = serving(start_daemon, tiny_models["llama"], f"host_bytes = {SHM_SIZE}", wrap=wrap)
    for seed in (41, 42, 43):  # enough slices to fill what the segments left
        model = reference_model(tiny_models["llama"])
        for prompt in random_prompts(VOCAB, [30, 33, 35, 31], seed=seed):
            assert one(daemon, prompt).token_ids == hf_greedy(model, prompt, BUDGET)
    pool = faults(daemon, "host", "write")
    assert ("host", "write", "ENOSPC") in {(f.tier, f.op, f.reason) for f in pool.faults}, pool
    no_restarts(daemon, pids)


def test_files_damaged_between_two_runs_are_misses(tiny_models, start_daemon, tmp_path):
    tiers = f'disk_dir = "{tmp_path / "kvdisk"}"\ndisk_bytes = {4 << 20}'
    daemon, _ = serving(start_daemon, tiny_models["llama"], tiers)
    run_workload(daemon, tiny_models["llama"])
    pooled(daemon, blocks=7)
    daemon.stop()
    files = sorted((tmp_path / "kvdisk").glob("*/*/*.kv"))
    assert len(files) >= 8 and not private(tmp_path / "kvdisk")
    for path in files[:3]:
        path.write_bytes(os.urandom(path.stat().st_size))  # overwritten with garbage, same size
    files[3].unlink()
    files[3].mkdir()  # a directory in a slice's place
    files[4].write_bytes(b"short")  # another size than any slice

    again, pids = serving(start_daemon, tiny_models["llama"], tiers, name="rt2")
    for prompt in run_workload(again, tiny_models["llama"]):  # every block of every prompt read back or computed
        assert one(again, prompt).token_ids == hf_greedy(reference_model(tiny_models["llama"]), prompt, BUDGET)
    no_restarts(again, pids)
    assert (
        pooled(again, unusable=1).unusable >= 1
    )  # garbage read back: the checksum refuses it (which blocks are asked varies)
    faults(again, "disk", "read", "size")  # the short file, counted by the stage that read it (with its next report)


def test_a_squatted_disk_dir_is_refused_by_name_and_the_daemon_serves_without_it(tiny_models, start_daemon, tmp_path):
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)
    os.chown(squatted, NOBODY, NOBODY)  # another local user made it first
    tiers = f'host_bytes = {1 << 20}\ndisk_dir = "{squatted}"\ndisk_bytes = {4 << 20}'
    daemon, pids = serving(start_daemon, tiny_models["llama"], tiers)
    run_workload(daemon, tiny_models["llama"])
    pool = pooled(daemon, tokens=28)
    assert [s.source for s in pool.sources] == ["host memory"]  # the memory tier serves
    assert {(t.stage, t.tier, t.state) for t in pool.tiers} == {
        (0, "disk", "refused"),
        (1, "disk", "refused"),
    }
    assert all(str(squatted) in t.reason or str(squatted) in t.path for t in pool.tiers)
    assert list(squatted.iterdir()) == []  # nothing written into it
    assert "stage 0's disk tier refused" in kvasir_stats(daemon.runtime_dir).stdout
    assert "kv pool tier refused; serving without it" in daemon.log()
    no_restarts(daemon, pids)
    [shm] = Path("/dev/shm").glob(f"kvasir-{daemon.process.pid}-*-kvpool")
    assert not private(shm)


def test_two_instances_writing_one_hosts_folders_keep_its_budget(tiny_models, start_daemon, tmp_path):
    budget = 48 * 1024
    tiers = f'host_bytes = {2 * budget}\ndisk_dir = "{tmp_path / "kvdisk"}"\ndisk_bytes = {2 * budget}'
    daemon = start_daemon(
        tiny_models["llama"],
        {"a": SPLITS, "b": SPLITS},
        route="round_robin",
        block_size=BLOCK,
        num_blocks=20,
        max_seq_len=48,
        max_tokens=8,
        kv_pool=tiers,
    ).wait_ready()
    pids = daemon.child_pids()
    model = reference_model(tiny_models["llama"])
    for seed in (61, 62):
        for prompt in random_prompts(VOCAB, [30, 33, 35, 31, 34, 32], seed=seed):
            expected = hf_greedy(model, prompt, BUDGET)
            for _ in "ab":  # round robin: each prompt on both instances, whose stages write the same keys
                assert one(daemon, prompt).token_ids == expected
    no_restarts(daemon, pids)
    pooled(daemon, blocks=7)
    daemon.stop()
    folders = [p for p in (tmp_path / "kvdisk").glob("*/*") if p.is_dir()]
    assert len(folders) == 2 and not private(tmp_path / "kvdisk")  # stages 0 and 2 share one, 1 and 3 the other
    for folder in folders:  # each folder's budget: its two stages' shares of the host's tier
        sizes = [p.stat().st_size for p in folder.glob("*.kv")]
        assert budget - 2 * max(sizes) < sum(sizes) <= budget, (folder, len(sizes), sum(sizes))
