"""kvasir top's frames, drawn from stats snapshots (the live command is tested in
tests/integration/test_stats.py)."""

from __future__ import annotations

import msgspec

from kvasir.cli.top import bar, frame
from kvasir.wire.client import DaemonStats
from kvasir.wire.stats import GpuMemory, HeadQueue, KvUse, PrefixCounters, StageStats


def stage(index, layers, wall_s, busy_s, batches, **kw) -> StageStats:
    values = dict(
        pid=100 + index,
        starved_s=0.0,
        blocked_s=0.0,
        rows=0,
        tokens=batches * 4,
        kv=KvUse(requests=0, blocks=7),
    )
    values.update(kw)
    return StageStats(index=index, layers=layers, wall_s=wall_s, busy_s=busy_s, batches=batches, **values)


def snapshot(uptime_s, stages, tokens_out) -> DaemonStats:
    return DaemonStats(
        uptime_s=uptime_s,
        requests=5,
        in_flight=3,
        tokens_out=tokens_out,
        waiting_limit=64,
        vocab_size=100,
        max_seq_len=256,
        stages=stages,
    )


def test_bar_shares():
    assert bar(0.5, 0.25, 0.25, width=8) == "####--xx"
    assert bar(0.0, 0.0, 0.0, width=4) == "    "
    assert len(bar(0.34, 0.33, 0.34, width=10)) == 10


def test_a_cpu_ring_frame_shows_the_head_and_each_stages_shares():
    before = snapshot(10.0, [stage(0, (0, 15), 9.0, 4.0, 10), stage(1, (15, 30), 9.0, 3.0, 10)], 100)
    after = snapshot(
        12.0,
        [stage(0, (0, 15), 11.0, 5.0, 30, head=HeadQueue(inflight=2, waiting=4)), stage(1, (15, 30), 11.0, 3.5, 30)],
        140,
    )
    lines = frame(before, after)
    assert "queued 4   batches in flight 2" in lines[0] and "20.0 tokens/s out" in lines[0]
    assert lines[1].startswith("stage  layers") and "device" not in lines[1] and "pool" not in lines[1]
    assert "  0-15  " in lines[2] and " 50% " in lines[2] and "10.0" in lines[2]  # 1 s busy of 2; 20 batches in 2 s
    assert " 25% " in lines[3]
    assert len(lines) == 4


def test_gpu_stages_show_their_device_and_memory_and_a_restarted_stage_waits():
    before = snapshot(
        10.0,
        [
            stage(0, (0, 10), 9.0, 4.0, 10, device="cuda:0"),
            stage(1, (10, 20), 9.0, 3.0, 10, device="cuda:1"),
            stage(2, (20, 30), 9.0, 3.0, 10),
        ],
        0,
    )
    after = snapshot(
        12.0,
        [
            stage(0, (0, 10), 11.0, 5.0, 30, device="cuda:0", gpu=GpuMemory(3 * 2**29, 2**30)),
            stage(
                1, (10, 20), 1.0, 0.5, 2, pid=999, device="cuda:1", gpu=GpuMemory(2**30, 2**30)
            ),  # a new process since the last snapshot
            stage(2, (20, 30), 11.0, 3.5, 30),
        ],
        0,
    )
    lines = frame(before, after)
    assert lines[1].endswith("device   GPU memory")
    assert lines[2].endswith("cuda:0     1.50 GiB")
    assert "(waiting for the stage's next report)" in lines[3] and lines[3].endswith("cuda:1     1.00 GiB")
    assert len(lines[3]) == len(lines[2])  # the device column lines up whether or not the stage has reported
    assert lines[4].endswith("7") and "cuda" not in lines[4]  # a CPU stage of the same plan: no device column


def test_a_disaggregated_frame_names_each_pool_and_its_head():
    pools = [("prefill", (0, 15)), ("prefill", (15, 30)), ("decode", (0, 17)), ("decode", (17, 30))]

    def stages(wall, **head):
        return [
            stage(k, layers, wall, 1.0, 5, pool=pool, **(head.get(pool, {}) if k in (0, 2) else {}))
            for k, (pool, layers) in enumerate(pools)
        ]

    after = snapshot(12.0, stages(11.0, prefill=dict(head=HeadQueue(1, 6, 2)), decode=dict(head=HeadQueue(2, 3))), 50)
    lines = frame(snapshot(10.0, stages(9.0), 10), after)
    assert "prefill: queued 6, batches in flight 1, handing off 2" in lines[0]
    assert "decode: queued 3, batches in flight 2" in lines[0]
    assert lines[1].startswith("pool     stage")
    assert [line.split()[0] for line in lines[2:]] == ["prefill", "prefill", "decode", "decode"]


def test_a_frame_ends_with_the_prefix_cache_once_it_was_used():
    from kvasir.wire.client import PrefixCacheStats

    before = snapshot(10.0, [stage(0, (0, 15), 9.0, 4.0, 10), stage(1, (15, 30), 9.0, 3.0, 10)], 100)
    head = stage(0, (0, 15), 11.0, 5.0, 30, prefix=PrefixCounters(queries=4, prompt_tokens=400, hit_tokens=300))
    stages = [head, stage(1, (15, 30), 11.0, 3.5, 30)]
    used = msgspec.structs.replace(snapshot(12.0, stages, 140), prefix_cache=PrefixCacheStats.of(stages))
    assert frame(before, used)[-1] == (
        "prefix cache: 4 prompts looked up, 300 of 400 prompt tokens reused (75%); 0 blocks cached, 0 evicted"
    )
    unused = msgspec.structs.replace(snapshot(12.0, stages[1:], 140), prefix_cache=PrefixCacheStats.of(stages[1:]))
    assert not frame(before, unused)[-1].startswith("prefix cache")


def test_a_fleets_instances_get_a_line_each():
    from kvasir.wire.fleet import InstanceStats

    def fleet(uptime_s, routed):
        instances = [
            InstanceStats(name="a", pool="", state="serving", stages=[0, 1], requests=3, routed=routed, backlog=40,
                          prefix=PrefixCounters(prompt_tokens=100, hit_tokens=75, cached_blocks=12)),
            InstanceStats(name="b", pool="", state="restarting", stages=[2, 3], restarts=1),
        ]  # fmt: skip
        stages = [stage(k, (k, k + 1), uptime_s, uptime_s / 2, 10) for k in range(4)]
        return msgspec.structs.replace(snapshot(uptime_s, stages, 0), instances=instances)

    lines = frame(fleet(10.0, 10), fleet(12.0, 30))
    assert lines[-2] == (
        "instance a: stages 0-1, 3 requests, 10.0 routed/s, 40 prompt tokens queued, 12 blocks cached, hit 75%"
    )
    assert (
        lines[-1] == "instance b RESTARTING: stages 2-3, 0 requests, 0.0 routed/s, 0 prompt tokens queued, restarts 1"
    )
