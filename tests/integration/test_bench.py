"""A short real bench run against a tiny daemon: the report's schema and its figures."""

from __future__ import annotations

import json
import subprocess

from daemon import BIN


def bench(runtime_dir, *args):
    return subprocess.run(
        [str(BIN / "kvasir"), "bench", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=300,
    )


def test_bench_closed_and_open_loop_report(tiny_models, start_daemon, tmp_path):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_rows=8, max_tokens=64).wait_ready()
    closed = bench(daemon.runtime_dir, "--requests", "24", "--warmup", "4", "--concurrency", "8",
                   "--prompt-len", "8:24", "--output-len", "6", "--slo-ttft", "5", "--slo-tpot", "1", "--json")
    assert closed.returncode == 0, closed.stderr
    report = json.loads(closed.stdout)
    assert set(report) == {"mode", "workload", "summary", "stages"}
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
    opened = bench(daemon.runtime_dir, "--requests", "10", "--warmup", "0", "--rate", "50", "--prompts", str(prompts))
    assert opened.returncode == 0, opened.stderr
    assert "requests 10 ok, 0 failed" in opened.stdout and "stage 1" in opened.stdout
    bad = bench(daemon.runtime_dir, "--rate", "5", "--concurrency", "3")
    assert bad.returncode == 2
    assert bench(tmp_path / "nobody", "--requests", "1").returncode == 3


def test_submit_only_counts_every_reply_and_respects_the_queue_bound(tiny_models, start_daemon):
    # 6000 submissions, up to 2000 in the daemon: several thousand events queue for one
    # client, more than ZMQ's default queue of 1000 (which a ROUTER would silently drop)
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], max_waiting=2000).wait_ready()
    run = bench(daemon.runtime_dir, "--submit-only", "--requests", "6000", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["submitted"] == 6000 and result["lost"] == 0
    assert result["accepted"] + result["overloaded"] == 6000
    assert result["accepted"] >= 2000 and result["overloaded"] > 0  # beyond the bound: overloaded at once
    assert result["accepted_per_s"] > 0
