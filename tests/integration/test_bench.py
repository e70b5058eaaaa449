"""A short real bench run against a tiny daemon: the report's schema and its figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.daemon import BIN, serving_daemon, write_plan


def bench(runtime_dir, mode, *args):
    return subprocess.run(
        [str(BIN / "kvasir"), "bench", mode, *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_closed_and_open_loop_report(shared_daemon, tmp_path):
    daemon = shared_daemon  # two stages, max_rows 8, max_tokens 64
    closed = bench(
        daemon.runtime_dir,
        "load",
        "--requests",
        "24",
        "--warmup",
        "4",
        "--concurrency",
        "8",
        "--prompt-len",
        "8:24",
        "--output-len",
        "6",
        "--slo-ttft",
        "5",
        "--slo-tpot",
        "1",
        "--json",
    )
    assert closed.returncode == 0, closed.stderr
    report = json.loads(closed.stdout)
    assert set(report) == {"mode", "workload", "summary", "stages", "slo"}
    assert report["slo"] == {"ttft_s": 5, "tpot_s": 1, "attain": 0.9}
    summary = report["summary"]
    assert summary["requests"] == 24 and summary["errors"] == 0
    assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0
    for name in ("ttft", "itl", "e2e"):
        d = summary[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"]
    assert summary["ttft"]["count"] == 24
    assert summary["slo_attainment"] == 1.0  # targets generous enough for any machine
    assert [s["index"] for s in report["stages"]] == [0, 1]
    assert all(0 <= s["busy"] <= 1 and s["batches_per_s"] > 0 for s in report["stages"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"token_ids": [5, 6, 7]}\n{"token_ids": [9, 10], "max_tokens": 3}\n')
    opened = bench(
        daemon.runtime_dir, "load", "--requests", "10", "--warmup", "0", "--rate", "50", "--prompts", str(prompts)
    )
    assert opened.returncode == 0, opened.stderr
    assert "requests 10 ok, 0 failed" in opened.stdout and "stage 1" in opened.stdout
    bad = bench(daemon.runtime_dir, "load", "--rate", "5", "--concurrency", "3")
    assert bad.returncode == 2 and "not both" in bad.stderr
    assert bench(tmp_path / "nobody", "load", "--requests", "1").returncode == 3
    moved = subprocess.run([str(BIN / "kvasir"), "bench", "--submit-only"], capture_output=True, text=True, timeout=60)
    assert moved.returncode == 2 and "kvasir bench submit" in moved.stderr  # the old flags say where they went


def test_multi_turn_conversations_resend_their_history_and_report_the_hits(shared_daemon, tmp_path):
    args = ("--concurrency", "2", "--prompt-len", "shared:12+5", "--output-len", "4", "--ignore-eos", "--json")
    run = bench(shared_daemon.runtime_dir, "load", "--turns", "3", "--requests", "6", "--warmup", "3", *args)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["workload"]["turns"] == 3 and report["workload"]["prompt_len"] == "shared:12+5"
    s = report["summary"]
    assert s["requests"] == 6 and s["errors"] == 0 and s["output_tokens"] == 24
    # each conversation: prompts of 17, 26 (17 + 4 replied + 5 new) and 35 tokens; reused:
    # the system prompt's 3 blocks (the warm-up conversation wrote them), then every block
    # the turn before wrote in full (20, then 28 tokens; 4-token blocks)
    assert (s["prompt_tokens"], s["cached_tokens"]) == (2 * (17 + 26 + 35), 2 * (12 + 20 + 28))
    for wrong in (
        ("load", "--turns", "3", "--requests", "5"),  # not whole conversations
        ("load", "--turns", "3", "--requests", "6", "--warmup", "2"),
        ("load", "--turns", "0"),
        ("compare", "--turns", "2", "--warmup", "2"),  # the transformers baselines hold no conversations
        ("submit", "--turns", "2"),
    ):
        bad = bench(tmp_path / "nobody", *wrong)
        assert bad.returncode == 2 and "--turns" in bad.stderr, (wrong, bad.stderr)


@pytest.fixture(scope="module")
def llama_2000(tiny_models, tmp_path_factory):
    """The Llama's two stages taking up to 2000 requests, for the submission test and then
    the failover's (which counts the restarts it makes)."""
    with serving_daemon(
        tmp_path_factory.mktemp("bench"), tiny_models["llama"], [(0, 3), (3, 6)], max_waiting=2000
    ) as daemon:
        yield daemon


def test_submit_only_counts_every_reply_and_respects_the_queue_bound(llama_2000):
    # 6000 submissions, up to 2000 in the daemon: several thousand events queue for one
    # client, more than ZMQ's default queue of 1000 (which a ROUTER would silently drop)
    run = bench(llama_2000.runtime_dir, "submit", "--requests", "6000", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)["submit_only"]
    assert result["submitted"] == 6000 and result["lost"] == 0
    assert result["accepted"] + result["overloaded"] == 6000
    assert result["accepted"] >= 2000 and result["overloaded"] > 0  # beyond the bound: overloaded at once
    assert result["accepted_per_s"] > 0


PNG = b"\x89PNG\r\n\x1a\n"


def valid_png(path):
    from PIL import Image

    assert path.read_bytes().startswith(PNG)
    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 200 and image.size[1] > 100


def test_compare_runs_the_rings_and_a_baseline_with_exact_lengths_and_plots(tiny_models, tmp_path):
    # transformers' generate_batch, the fourth default contender, spends half a minute here
    # filling a cache sized to the machine's memory: tests/unit/bench/test_bench_baselines.py
    # runs it on a small cache, and the compares on docs/bench/ run it whole
    plan = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)], max_rows=8, max_tokens=64)
    run = subprocess.run(
        [
            str(BIN / "kvasir"),
            "bench",
            "compare",
            "--plan",
            str(plan),
            "--contenders",
            "ring,drained,hf-static",
            "--requests",
            "12",
            "--warmup",
            "2",
            "--concurrency",
            "4",
            "--prompt-len",
            "4:12",
            "--output-len",
            "5",
            "--plot",
            str(tmp_path / "pics"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    compare = report["compare"]
    assert set(compare["contenders"]) == {"ring", "drained", "hf-static"}
    assert set(compare["ratios"]) == {"ring/drained", "ring/drained ITL p50", "ring/hf-static"}
    assert compare["threads"] == 2 and compare["workload"]["requests"] == 12
    for name, entry in compare["contenders"].items():
        assert len(entry["output_tokens_per_s"]) == 1 and entry["mean_output_tokens_per_s"] > 0, name
    for name in ("ring", "drained"):
        summary = compare["contenders"][name]["summary"]
        # EOS ignored: every request produced exactly its 5 tokens, like the baselines
        assert summary["requests"] == 12 and summary["errors"] == 0 and summary["output_tokens"] == 60
        assert [s["index"] for s in compare["contenders"][name]["stages"]] == [0, 1]
    ring = compare["contenders"]["ring"]["mean_output_tokens_per_s"]
    assert compare["ratios"]["ring/drained"] == ring / compare["contenders"]["drained"]["mean_output_tokens_per_s"]
    itl = [compare["contenders"][name]["itl_p50_s"] for name in ("ring", "drained")]
    assert compare["ratios"]["ring/drained ITL p50"] == itl[0][0] / itl[1][0]  # one round each
    assert sorted(Path(p).name for p in report["plots"]) == ["latency.png", "stages.png", "timeline.png"]
    for path in report["plots"]:
        valid_png(Path(path))
    assert not list(tmp_path.glob("run")), "the compare's daemons live in their own temp dirs"


def test_timeline_spans_follow_one_batch_plan(tiny_models, start_daemon):
    import asyncio

    from kvasir.client import AsyncClient

    daemon = start_daemon(tiny_models["llama"], [(0, 2), (2, 4), (4, 6)], max_rows=8, max_tokens=64).wait_ready()

    async def main():
        async with await AsyncClient.connect(daemon.runtime_dir) as client:
            streams = [await client.submit(token_ids=[5 + i, 6, 7], max_tokens=6, temperature=0) for i in range(10)]
            for stream in streams:
                await stream.result()
            await asyncio.sleep(1.2)  # stages report every 0.5 s
            return await client.stats(timeline=True), await client.stats()

    with_timeline, plain = asyncio.run(main())
    assert plain.timeline == [] and len(with_timeline.timeline) == 3
    lanes = with_timeline.timeline
    for lane in lanes:
        assert lane and all(s.start_ns <= s.end_ns for s in lane)
        assert all(a.end_ns <= b.start_ns for a, b in zip(lane, lane[1:]))  # one batch at a time per stage
        assert sum(s.prefill_tokens + s.decode_tokens for s in lane) == sum(
            st.tokens for st in with_timeline.stages if st.index == lanes.index(lane)
        )
    # every stage ran the same batches in the same order, each starting after its upstream
    # stage started it (its end may come after the downstream's: it is taken once the
    # descriptor has gone, and a tiny batch downstream can be done by then)
    assert [s.batch_id for s in lanes[0]] == [s.batch_id for s in lanes[1]] == [s.batch_id for s in lanes[2]]
    for up, down in zip(lanes, lanes[1:]):
        assert all(a.start_ns <= b.start_ns for a, b in zip(up, down))
    assert sum(s.decode_tokens for s in lanes[0]) == 10 * 5  # tokens after each request's first


def test_rate_sweep_with_its_own_daemon_and_hop(tiny_models, tmp_path):
    plan = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    sweep = subprocess.run(
        [
            str(BIN / "kvasir"),
            "bench",
            "sweep",
            "--plan",
            str(plan),
            "--rate",
            "20",
            "--steps",
            "1",
            "--requests",
            "6",
            "--warmup",
            "0",
            "--prompt-len",
            "4",
            "--output-len",
            "3",
            "--slo-ttft",
            "60",
            "--slo-tpot",
            "60",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stderr
    report = json.loads(sweep.stdout)
    rates = [point["rate"] for point in report["sweep"]]
    assert rates == [20 * 2**i for i in range(len(rates))] and len(rates) == 9  # never fails: 8 doublings
    assert report["goodput"] == rates[-1]
    assert all(point["attainment"] == 1.0 and point["summary"]["requests"] == 6 for point in report["sweep"])
    quick = ("--iterations", "40", "--json")  # the figures themselves: docs/bench/ring.md
    hop = subprocess.run([str(BIN / "kvasir"), "bench", "hop", *quick], capture_output=True, text=True, timeout=300)
    assert hop.returncode == 0, hop.stderr
    report = json.loads(hop.stdout)
    sizes = report["sizes"]
    assert (report["kind"], report["device"], report["iterations"]) == ("shm", "cpu", 40)
    assert [s["tokens"] for s in sizes] == [1, 16, 128, 512]
    assert all(s["hop_us"] > 0 and s["zmq_rtt_us"] > 0 and s["memcpy_gibps"] > 0 for s in sizes)
    assert not list(Path("/dev/shm").glob("kvasir-*-hop"))
    tcp = subprocess.run(
        [str(BIN / "kvasir"), "bench", "hop", "--link", "tcp", *quick],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tcp.returncode == 0, tcp.stderr
    report = json.loads(tcp.stdout)
    assert (report["kind"], report["link"]) == ("tcp", "tcp") and [s["tokens"] for s in report["sizes"]] == [
        1,
        16,
        128,
        512,
    ]
    assert all(s["hop_us"] > 0 and s["zmq_rtt_us"] > 0 for s in report["sizes"])
    refused = subprocess.run(
        [str(BIN / "kvasir"), "bench", "hop", "--link", "tcp", "--device", "cuda:0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "--link tcp measures a cpu edge" in refused.stderr
    for device, why in (("gpu", "is not 'cpu' or 'cuda:N'"), ("cuda:99", "cuda:99: ")):  # cuda:99 is never here
        bad = subprocess.run(
            [str(BIN / "kvasir"), "bench", "hop", "--device", device], capture_output=True, text=True, timeout=120
        )
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr


def test_failover_kills_each_stage_in_turn_and_times_the_recovery(llama_2000):
    from kvasir.client import Client

    daemon = llama_2000
    with Client(daemon.runtime_dir) as client:
        restarts = client.stats().restarts
    before = set(daemon.child_pids())
    run = bench(
        daemon.runtime_dir,
        "failover",
        "--rounds",
        "2",
        "--concurrency",
        "8",
        "--prompt-len",
        "8",
        "--output-len",
        "100",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)["failover"]
    assert [r["stage"] for r in report["rounds"]] == [0, 1]
    for r in report["rounds"]:
        assert sum(r["outcomes"].values()) == 8 and set(r["outcomes"]) <= {"finished", "stage_failed"}
        assert r["outcomes"].get("stage_failed", 0) > 0
        assert 0 < r["told_s"] < r["serving_again_s"]
    assert report["serving_again_s"]["max"] == max(r["serving_again_s"] for r in report["rounds"])
    with Client(daemon.runtime_dir) as client:
        stats = client.stats()
    assert stats.restarts == restarts + 2 and not {s.pid for s in stats.stages} & before
    from kvasir.bench.failover import print_failover

    lines = []
    print_failover(report, lines.append)
    assert len(lines) == 5 and lines[-2].startswith("failure -> every client told: median")


def test_compare_two_plans_colocated_and_disaggregated(tiny_models, tmp_path):
    colocated = write_plan(tmp_path / "colocated.toml", tiny_models["llama"], [(0, 3), (3, 6)], max_tokens=64)
    disagg = write_plan(
        tmp_path / "disagg.toml",
        tiny_models["llama"],
        {"prefill": [(0, 2), (2, 6)], "decode": [(0, 4), (4, 6)]},
        max_tokens=64,
    )
    run = subprocess.run(
        [
            str(BIN / "kvasir"),
            "bench",
            "plans",
            str(colocated),
            str(disagg),
            "--requests",
            "12",
            "--warmup",
            "2",
            "--concurrency",
            "4",
            "--prompt-len",
            "60,8,8",
            "--output-len",
            "6",
            "--slo-ttft",
            "60",
            "--slo-tpot",
            "60",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    plans = json.loads(run.stdout)["plans"]
    assert list(plans["contenders"]) == ["colocated", "disagg"]
    for name, entry in plans["contenders"].items():
        summary = entry["summary"]
        assert summary["requests"] == 12 and summary["errors"] == 0 and summary["output_tokens"] == 72, name
        assert summary["slo_attainment"] == 1.0 and summary["itl"]["p99"] >= summary["itl"]["p50"] > 0
    colo, dis = plans["contenders"]["colocated"], plans["contenders"]["disagg"]
    assert colo["handoff"] is None and not colo["disaggregated"] and set(colo["pools"]) == {"ring"}
    assert dis["disaggregated"] and set(dis["pools"]) == {"prefill", "decode"}
    handoff = dis["handoff"]
    assert handoff["requests"] == 12 and handoff["kv_bytes_mean"] > 0 and handoff["copy_gibps"] > 0
    assert handoff["second_token_gap"]["p50"] > 0
    assert [s["pool"] for s in dis["stages"]] == ["prefill", "prefill", "decode", "decode"]
    assert "disagg/colocated output tokens/s" in plans["ratios"]
    assert plans["workload"]["prompt_len"] == "60,8,8"


def test_isolation_kills_one_instance_and_the_other_serves_on(tiny_models, start_daemon):
    fleet = {"a": [(0, 3), (3, 6)], "b": [(0, 2), (2, 6)]}
    daemon = start_daemon(tiny_models["llama"], fleet, name="isolation", route="round_robin").wait_ready()
    run = bench(
        daemon.runtime_dir,
        "isolation",
        "--requests",
        "40",
        "--concurrency",
        "8",
        "--prompt-len",
        "8",
        "--output-len",
        "24",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)["isolation"]
    assert report["victim"] == {"instance": "a", "stage": 1}
    assert report["failed"] > 0 and report["finished"]["b"] > 0 and report["restart_s"] > 0
    assert report["tokens_per_s_during"] > 0 and report["tokens_per_s_before"] > 0  # b served all along
    assert report["tokens_per_s_after"] > 0
    assert report["finished"].get("a", 0) > 0  # a served again before the load ended
    from kvasir.bench.isolation import print_isolation

    lines: list[str] = []
    print_isolation(report, lines.append)
    assert lines[0].startswith("killed stage 1 of instance a; it served again after") and len(lines) == 3
