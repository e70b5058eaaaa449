"""``kvasir bench`` reports as terminal text (the same dicts ``--json`` prints)."""

from __future__ import annotations

from collections.abc import Callable

from kvasir.units import MIB

Echo = Callable[[str], None]

NAMES = {
    "ring": "(a) in-flight ring",
    "drained": "(b) drained ring, inflight = 1",
    "hf-static": "(c) transformers generate, static batches",
    "hf-continuous": "(d) transformers generate_batch",
    "llama.cpp": "(e) llama.cpp llama-server, same GGUF",
}


def print_report(report: dict, echo: Echo) -> None:
    if "submit_only" in report:
        r = report["submit_only"]
        echo(
            f"submitted {r['submitted']}: accepted {r['accepted']}, overloaded {r['overloaded']}, lost {r['lost']}; "
            f"{r['sent_per_s']:.0f} sent/s, {r['accepted_per_s']:.0f} accepted/s"
        )
    elif "compare" in report:
        print_compare(report["compare"], echo)
    elif "plans" in report:
        print_plans(report["plans"], echo)
    elif "sweep" in report:
        for point in report["sweep"]:
            s = point["summary"]
            echo(
                f"rate {point['rate']:8.3g} req/s  attainment {point['attainment']:6.1%}  "
                f"{s['output_tokens_per_s']:8.1f} tok/s  TTFT p90 {s['ttft']['p90'] * 1e3:8.1f} ms  "
                f"ITL p90 {s['itl']['p90'] * 1e3:7.1f} ms"
            )
        slo = report["slo"]
        echo(
            f"goodput {report['goodput']:.3g} requests/s (>= {slo['attain']:.0%} within TTFT {slo['ttft_s']} s "
            f"and TPOT {slo['tpot_s']} s)"
        )
    else:
        print_run(report, echo)
    for path in report.get("plots", ()):
        echo(f"wrote {path}")


def print_run(report: dict, echo: Echo) -> None:
    s = report["summary"]
    echo(f"requests {s['requests']} ok, {s['errors']} failed, in {s['duration_s']:.2f} s")
    echo(f"throughput  {s['requests_per_s']:.2f} requests/s, {s['output_tokens_per_s']:.1f} output tokens/s")
    for name in ("ttft", "itl", "e2e"):
        d = s[name]
        echo(f"{name:<5} ms    p50 {d['p50'] * 1e3:8.1f}  p90 {d['p90'] * 1e3:8.1f}  p99 {d['p99'] * 1e3:8.1f}")
    if s["slo_attainment"] is not None:
        echo(f"SLO attainment {s['slo_attainment']:.1%}")
    if s["cached_tokens"]:
        echo(prefix_line(s))
    if s.get("drafts"):
        echo(drafts_line(s))
    if "handoff" in report:
        print_handoff(report["handoff"], echo)
    print_instances(report.get("instances", {}), echo)
    print_stages(report["stages"], echo, shards=report.get("shards", ()))


def print_handoff(h: dict, echo: Echo, indent: str = "") -> None:
    echo(
        f"{indent}hand-off: {h['kv_bytes_mean'] / MIB:.2f} MiB of KV per request, p50 {h['seconds']['p50'] * 1e3:.1f} ms "
        f"p99 {h['seconds']['p99'] * 1e3:.1f} ms, copies at {h['copy_gibps']:.2f} GiB/s; first-to-second token "
        f"p50 {h['second_token_gap']['p50'] * 1e3:.0f} ms p99 {h['second_token_gap']['p99'] * 1e3:.0f} ms"
    )


def print_stages(stages: list[dict], echo: Echo, indent: str = "", shards=()) -> None:
    for st in stages:
        echo(
            f"{indent}stage {st['index']}  busy {st['busy']:.0%}  starved {st['starved']:.0%}  blocked {st['blocked']:.0%}  "
            f"hop {st['hop_of_busy']:.2%} of busy  {st['batches_per_s']:.1f} batches/s  "
            f"{st['rows_per_batch']:.1f} rows, {st['tokens_per_batch']:.1f} tokens per batch"
            + (f"  {st['gflop_s']:.0f} GFLOP/s, {st['weight_gb_s']:.1f} GB/s of weights" if "gflop_s" in st else "")
        )
        if "expert_imbalance" in st:
            echo(
                f"{indent}  experts: busiest {st['expert_imbalance']:.2f}x the mean; "
                f"dispatch and combine {st['dispatch_of_busy']:.0%} of busy"
            )
    for sh in shards:
        echo(
            f"{indent}shard {sh['number']} (stage {sh['stage']}, experts [{sh['experts'][0]}, {sh['experts'][1]}))  "
            f"busy {sh['busy']:.0%}  starved {sh['starved']:.0%}  blocked {sh['blocked']:.0%}  "
            f"{sh['dispatches_per_s']:.1f} dispatches/s  {sh['tokens']} tokens routed"
        )


def print_instances(instances: dict, echo: Echo, indent: str = "") -> None:
    """A fleet's figures per instance (kvasir/bench/runner.py instance_figures)."""
    for name, i in instances.items():
        echo(
            f"{indent}instance {name}: {i['requests']} requests, {i['output_tokens_per_s']:.1f} output tokens/s, "
            f"TTFT p50 {i['ttft_p50'] * 1e3:.1f} ms p99 {i['ttft_p99'] * 1e3:.1f} ms, "
            f"prefix hit rate {i['prefix_hit_rate']:.1%}"
        )


def drafts_line(s: dict, indent: str = "") -> str:
    """Speculative decoding over a run's requests (those drafted for), and their mean ITL."""
    d = s["drafts"]
    return (
        f"{indent}drafts: {d['accepted']} of {d['drafted']} confirmed ({d['acceptance']:.0%}) for {d['requests']} "
        f"requests, {d['tokens_per_pass']:.2f} tokens per pass; ITL mean {s['itl']['mean'] * 1e3:.1f} ms "
        "(drafts' tokens arrive together: p50 means little)"
    )


def prefix_line(s: dict, indent: str = "") -> str:
    return (
        f"{indent}prefix cache: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens reused "
        f"(hit rate {s['prefix_hit_rate']:.1%})"
    )


def prompt_words(workload: dict) -> str:
    """ "prompt SPEC", and for conversations how many turns and that history is resent."""
    words = f"prompt {workload.get('prompt_len')}"
    turns = workload.get("turns", 1)
    return words if turns == 1 else f"{words} a turn ({turns}-turn conversations resending their history)"


def print_compare(report: dict, echo: Echo) -> None:
    w = report["workload"]
    echo(
        f"plan {report['plan']}: {w['requests']} requests (+{w['warmup']} warm-up), concurrency {w['concurrency']}, "
        f"{prompt_words(w)}, output {w.get('output_len')} tokens; {report['threads']} torch threads "
        f"per contender; {report['rounds']} round(s), alternating"
    )
    if "served" in report:
        echo(f"the ring serves {report['served']['dtype']} weights {report['served']['weights']}")
    for name, entry in report["contenders"].items():
        rounds = ", ".join(f"{v:.1f}" for v in entry["output_tokens_per_s"])
        echo(
            f"{NAMES.get(name, name):<45} {entry['mean_output_tokens_per_s']:8.1f} output tokens/s  (rounds: {rounds})"
        )
        if "summary" in entry:
            s = entry["summary"]
            itl_rounds = ", ".join(f"{v * 1e3:.1f}" for v in entry.get("itl_p50_s", ()))
            echo(
                f"    TTFT p50 {s['ttft']['p50'] * 1e3:.0f} ms p99 {s['ttft']['p99'] * 1e3:.0f} ms; "
                f"ITL p50 {s['itl']['p50'] * 1e3:.1f} ms p99 {s['itl']['p99'] * 1e3:.0f} ms (p50 by round: {itl_rounds})"
            )
            if s["cached_tokens"]:
                echo(prefix_line(s, "    "))
            if s.get("drafts"):
                echo(drafts_line(s, "    "))
            if entry.get("door") == "http":
                echo("    through its OpenAI HTTP front (streamed /v1/completions)")
            if "served" in entry:
                v = entry["served"]
                echo(f"    {v['gguf']}, {v['threads']} threads, {v['slots']} slots of {v['slot_context']} tokens")
            if "stages" in entry:
                print_stages(entry["stages"], echo, indent="    ", shards=entry.get("shards", ()))
    for name, value in report["ratios"].items():
        echo(f"ratio {name:<22} {value:.2f}x")


def print_plans(report: dict, echo: Echo) -> None:
    w = report["workload"]
    load = f"concurrency {w['concurrency']}" if "concurrency" in w else f"rate {w['rate']:g} req/s"
    echo(
        f"{w['requests']} requests (+{w['warmup']} warm-up), {load}, {prompt_words(w)}, output "
        f"{w['output_len']} tokens; {report['rounds']} round(s), alternating"
    )
    slo = report.get("slo")
    for name, entry in report["contenders"].items():
        s = entry["summary"]
        kind = "disaggregated" if entry["disaggregated"] else "colocated"
        echo(
            f"{name} ({kind}): {s['output_tokens_per_s']:.1f} output tokens/s, {s['requests_per_s']:.2f} requests/s, "
            f"{s['errors']} failed"
        )
        echo(
            f"    TTFT p50 {s['ttft']['p50'] * 1e3:.0f} ms p99 {s['ttft']['p99'] * 1e3:.0f} ms; "
            f"ITL p50 {s['itl']['p50'] * 1e3:.0f} ms p99 {s['itl']['p99'] * 1e3:.0f} ms"
        )
        if slo is not None:
            line = f"    SLO (TTFT {slo['ttft_s']} s, TPOT {slo['tpot_s']} s) met by {s['slo_attainment']:.1%}"
            if "goodput" in entry:
                line += f"; goodput {entry['goodput']:.3g} requests/s (>= {slo['attain']:.0%}; figures above at {entry['shown_rate']:.3g})"
            echo(line)
        echo(prefix_line(s, "    "))
        if s.get("drafts"):
            echo(drafts_line(s, "    "))
        print_instances(entry.get("instances", {}), echo, "    ")
        if entry["handoff"] is not None:
            print_handoff(entry["handoff"], echo, "    ")
        for pool, f in entry["pools"].items():
            echo(f"    {pool:<8} busy {f['busy']:.0%}  starved {f['starved']:.0%}  blocked {f['blocked']:.0%}")
    for name, value in report["ratios"].items():
        echo(f"ratio {name:<36} {value:.2f}x")


def print_pool(report: dict, echo: Echo) -> None:
    """``kvasir bench pool``: per variant, the evicted prefix's TTFT over its cold start."""
    r = report["pool"]
    echo(
        f"KV pool: a {r['prompt_len']}-token prompt, evicted from the instance's cache, asked again ({r['rounds']} rounds)"
    )
    for name, v in r["variants"].items():
        tiers = v["evicted_cached"][-1]
        line = (
            f"  pool {name:4}  cold TTFT {v['cold_ttft_s']:7.3f} s  evicted {v['evicted_ttft_s']:7.3f} s  "
            f"ratio {v['ratio']:5.2f}x  cached {tiers['cached_tokens']} (host {tiers['host_tokens']}, "
            f"disk {tiers['disk_tokens']})"
        )
        if "load_gib_s" in v:
            line += f"  read back at {v['load_gib_s']:.2f} GiB/s"
        echo(line)
        if "restart_ttft_s" in v:
            cached = ", ".join(f"{sample['disk_tokens']}/{sample['cached_tokens']}" for sample in v["restart"])
            echo(
                f"             after a restart {v['restart_ttft_s']:7.3f} s  ratio {v['restart_ratio']:5.2f}x  "
                f"read from disk / cached per prompt: {cached}"
            )


def print_quality(report: dict, echo: Echo) -> None:
    """``kvasir bench quality``: both perplexities, the agreement, the verdicts."""
    t, ours, ref, agreed, checks = (report[k] for k in ("text", "ours", "reference", "agreement", "checks"))
    served = report["served"]
    echo(
        f"text: {t['source']}, {t['chars']} characters, {t['tokens']} tokens (sha256 {t['sha256'][:12]}); "
        f"{report['chunks']} chunks of {report['n_ctx']}, {ours['scored_tokens']} tokens scored"
    )
    echo(f"plan {report['plan']} ({served['dtype']}, weights {served['weights']}): perplexity {ours['ppl']:.4f}")
    name = ref["gguf"] if ref["kind"] == "llama.cpp" else ref["plan"]
    echo(f"reference {ref['kind']} {name}: perplexity {ref['ppl']:.4f}")
    margins = report["margins"]
    verdict = "ok" if checks["ppl_within_margin"] else "OUT OF MARGIN"
    echo(f"perplexity ratio {checks['ppl_ratio']:.4f} (within {margins['ppl']:.1%}: {verdict})")
    verdict = "ok" if checks["agreement_enough"] else "TOO LOW"
    echo(
        f"top-1 agreement {agreed['top1_agreement']:.1%} of {agreed['positions']} greedy tokens "
        f"(at least {margins['top1']:.0%}: {verdict})"
    )
