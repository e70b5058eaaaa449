from __future__ import annotations

import math
import random

import pytest

from kvasir.bench.metrics import RequestRecord, attainment, goodput, percentile, summarise


def test_percentile_matches_linear_interpolation():
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 0) == 15 and percentile(values, 100) == 50
    assert percentile(values, 50) == 35
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)
    shuffled = list(range(1000))
    random.Random(3).shuffle(shuffled)
    assert percentile(shuffled, 90) == pytest.approx(899.1)


def record(ttft, gaps, ok=True):
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(0.0, ttft, tuple(times), len(times), ok)


def test_record_latencies():
    r = record(0.5, [0.1, 0.2, 0.3])
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(1.1)
    assert record(0.4, []).tpot_s == 0.0


def test_attainment_needs_both_targets_and_success():
    records = [
        record(0.1, [0.01] * 5),  # meets both
        record(0.9, [0.01] * 5),  # TTFT too slow
        record(0.1, [0.09] * 5),  # TPOT too slow
        record(0.1, [0.01] * 5, ok=False),  # failed
    ]
    assert attainment(records, slo_ttft_s=0.5, slo_tpot_s=0.05) == 0.25
    assert attainment([], 1, 1) == 0.0


def test_goodput_search_on_a_known_curve():
    # attainment falls as the rate passes the knee at 6 requests/s
    curve = [(1, 1.0), (2, 0.99), (4, 0.95), (6, 0.91), (8, 0.7), (10, 0.2), (12, 0.95)]
    assert goodput(curve, attain=0.9) == 6
    assert goodput(curve, attain=0.96) == 2
    assert goodput(curve, attain=0.999) == 1
    assert goodput([(1, 0.5)], attain=0.9) == 0.0
    # synthetic latencies: requests at rate r wait r * 20 ms for their first token
    points = []
    for rate in (1, 2, 3, 4, 5, 6):
        records = [record(rate * 0.02 + i * 0.001, [0.01] * 4) for i in range(100)]
        points.append((rate, attainment(records, slo_ttft_s=0.1, slo_tpot_s=0.02)))
    # at rate 4: TTFT 0.08..0.179 s, 21 of 100 within 0.1 s; at rate 3: 0.06..0.159 s, 41 of 100
    assert points[2][1] == pytest.approx(0.41) and points[3][1] == pytest.approx(0.21)
    assert goodput(points, attain=0.4) == 3


def test_summary():
    records = [record(0.2, [0.05] * 9), record(0.4, [0.05] * 9), record(1.0, [], ok=False)]
    s = summarise(records, duration_s=2.0, slo=(0.3, 0.1))
    assert s.requests == 2 and s.errors == 1
    assert s.output_tokens_per_s == pytest.approx(10.0)
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.ttft.p50 == pytest.approx(0.3) and s.itl.count == 18
    assert s.slo_attainment == pytest.approx(1 / 3)


def test_length_specs_and_jobs(tmp_path):
    import random

    from kvasir.bench.workload import LengthSpec, WorkloadError, file_jobs, synthetic_jobs

    assert LengthSpec.parse("128") == LengthSpec(128, 128)
    spec = LengthSpec.parse("4:9")
    assert {spec.draw(random.Random(i)) for i in range(200)} == set(range(4, 10))
    for bad in ("0", "9:4", "x", "3:y"):
        with pytest.raises(WorkloadError):
            LengthSpec.parse(bad)
    jobs = synthetic_jobs(5, LengthSpec(3, 3), LengthSpec(7, 7), vocab_size=50, seed=1)
    assert jobs == synthetic_jobs(5, LengthSpec(3, 3), LengthSpec(7, 7), vocab_size=50, seed=1)
    assert all(len(j.token_ids) == 3 and j.max_tokens == 7 and all(3 <= t < 50 for t in j.token_ids) for j in jobs)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"token_ids": [1, 2], "max_tokens": 4}\n')
    cycled = file_jobs(path, 3, LengthSpec(9, 9), seed=0)
    assert [(j.text, j.token_ids, j.max_tokens) for j in cycled] == [
        ("hi", None, 9),
        (None, [1, 2], 4),
        ("hi", None, 9),
    ]
    path.write_text("[1]\n")
    with pytest.raises(WorkloadError, match="needs"):
        file_jobs(path, 1, LengthSpec(1, 1), seed=0)


def test_lognormal_lengths_have_a_heavy_tail_within_their_bounds():
    import random
    import statistics

    from kvasir.bench.workload import LengthSpec, WorkloadError

    spec = LengthSpec.parse("lognormal:96:0.9:8:1024")
    assert str(spec) == "lognormal:96:0.9:8:1024"
    rng = random.Random(3)
    draws = [spec.draw(rng) for _ in range(4000)]
    assert min(draws) >= 8 and max(draws) <= 1024
    assert 85 <= statistics.median(draws) <= 107
    assert statistics.mean(draws) > 1.3 * statistics.median(draws)  # the tail pulls the mean up
    assert sum(d > 500 for d in draws) > 20  # a few long ones, as in chat traffic
    assert LengthSpec.parse("lognormal:5:0:1:9").draw(rng) == 5  # sigma 0: always the median
    rerun = random.Random(3)
    assert [spec.draw(rerun) for _ in range(4000)] == draws  # seeded
    for bad in (
        "lognormal:96:0.9:8",
        "lognormal:x:1:1:9",
        "lognormal:96:-1:8:1024",
        "lognormal:4:1:8:1024",
        "lognormal:96:0.9:8:1024:5",
        "lognormal:nan:1:1:9",
        "lognormal:96:11:8:1024",
    ):
        with pytest.raises(WorkloadError, match="lognormal"):
            LengthSpec.parse(bad)


def test_goodput_search_finds_a_known_knee():
    from kvasir.bench.metrics import search_goodput

    # every request meets its targets up to 6.3 requests/s, half of them beyond
    measured = []

    def measure(rate):
        measured.append(rate)
        return 1.0 if rate <= 6.3 else 0.5

    best, points = search_goodput(measure, attain=0.9, start=1.0, steps=3)
    assert measured == [1.0, 2.0, 4.0, 8.0, 6.0, 7.0, 6.5]
    assert best == 6.0 and points[-1] == (6.5, 0.5)
    # starting above the knee: halve first, then bisect
    best, points = search_goodput(measure, attain=0.9, start=20.0, steps=4)
    assert [r for r, _ in points][:3] == [20.0, 10.0, 5.0]
    assert 5.0 < best <= 6.3 and best == max(r for r, a in points if a >= 0.9)
    # nothing passes: goodput 0 after the allowed halvings
    best, points = search_goodput(lambda rate: 0.0, attain=0.9, start=1.0, max_moves=3)
    assert best == 0.0 and [r for r, _ in points] == [1.0, 0.5, 0.25, 0.125]


def test_shared_prefix_prompts_begin_alike_and_count_their_cache_hits():
    from kvasir.bench.workload import LengthSpec, WorkloadError, synthetic_jobs

    spec = LengthSpec.parse("shared:10+3:5")
    assert spec.shared == 10 and (spec.low, spec.high) == (3, 5) and str(spec) == "shared:10+3:5"
    assert LengthSpec.parse(str(spec)) == spec
    jobs = synthetic_jobs(6, spec, LengthSpec(2, 2), vocab_size=50, seed=4)
    heads = {tuple(job.token_ids[:10]) for job in jobs if job.token_ids}
    assert len(heads) == 1 and all(13 <= len(job.token_ids or []) <= 15 for job in jobs)
    assert len({tuple(job.token_ids or []) for job in jobs}) > 1
    assert synthetic_jobs(3, LengthSpec(3, 3), LengthSpec(7, 7), 50, 1) == synthetic_jobs(
        3, LengthSpec.parse("3"), LengthSpec(7, 7), 50, 1
    )  # no prefix: the same draws as before
    tenants = LengthSpec.parse("shared:10x3+2")
    assert (tenants.shared, tenants.tenants, str(tenants)) == (10, 3, "shared:10x3+2")
    heads = [tuple(job.token_ids[:10]) for job in synthetic_jobs(40, tenants, LengthSpec(2, 2), 50, 4) if job.token_ids]
    assert len(set(heads)) == 3  # three tenants' system prompts, each conversation one of them
    for bad in ("shared:0+4", "shared:x+4", "shared:4", "shared:4+shared:2+3", "shared:4x0+2", "shared:4x+2"):
        with pytest.raises(WorkloadError):
            LengthSpec.parse(bad)
    records = [
        RequestRecord(0.0, 0.1, (0.1,), 1, True, None, 40, 32),
        RequestRecord(0.0, 0.1, (0.1,), 1, True, None, 40, 0),
    ]
    s = summarise(records, duration_s=1.0)
    assert (s.prompt_tokens, s.cached_tokens, s.prefix_hit_rate) == (80, 32, 0.4)


def test_a_sampled_workload_seeds_each_job_the_same_way_every_time():
    from kvasir.bench.workload import LengthSpec, Workload

    lengths = (LengthSpec.parse("8"), LengthSpec.parse("4"))
    sampled = Workload(5, 1, lengths, seed=3, temperature=0.8)
    jobs = sampled.jobs(100)
    assert [j.seed for j in jobs] == [j.seed for j in sampled.jobs(100)]  # every plan and round: the same tokens
    assert len({j.seed for j in jobs}) == 6 and {j.temperature for j in jobs} == {0.8}
    assert all(j.seed is None and j.temperature == 0 for j in Workload(5, 1, lengths).jobs(100))  # greedy
    assert sampled.report()["temperature"] == 0.8


def test_draft_figures_cover_only_the_requests_drafted_for():
    plain = RequestRecord(0.0, 0.1, (0.1, 0.2, 0.3), 3)
    drafted = RequestRecord(0.0, 0.1, (0.1, 0.1, 0.1, 0.2), 4, drafts=(2, 5, 3))
    summary = summarise([plain, drafted], 1.0)
    assert summary.drafts == {"requests": 1, "drafted": 5, "accepted": 3, "acceptance": 0.6, "tokens_per_pass": 2.0}
    assert summarise([plain], 1.0).drafts is None
