"""``kvasir bench``: load a running daemon and report throughput, latency and stage use."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click
import msgspec

from kvasir.errors import KvasirError
from kvasir.transport import default_runtime_dir


@click.command()
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests kept in flight.")
@click.option("--rate", type=float, default=None, help="Open loop: requests per second (Poisson, seeded).")
@click.option("--requests", "count", type=int, default=64, show_default=True, help="Measured requests.")
@click.option("--warmup", type=int, default=8, show_default=True, help="Requests run first and left out of the figures.")
@click.option("--prompt-len", default="128", show_default=True, help="Prompt tokens: N or LOW:HIGH (uniform).")
@click.option("--output-len", default="64", show_default=True, help="Output tokens: N or LOW:HIGH (uniform).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help='JSONL file, one {"prompt": ...} or {"token_ids": [...]} per line (instead of random ids).')
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--slo-ttft", type=float, default=None, help="Target time to first token, seconds.")
@click.option("--slo-tpot", type=float, default=None, help="Target time per output token, seconds.")
@click.option("--submit-only", is_flag=True,
              help="Measure submission line rate: --requests one-token requests as fast as one client can.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--runtime-dir", type=click.Path(file_okay=False), default=None,
              help="The daemon's runtime dir (default as for every command).")
def bench(concurrency, rate, count, warmup, prompt_len, output_len, prompts_file, seed, slo_ttft, slo_tpot,
          submit_only, as_json, runtime_dir):
    """Load a running daemon and report requests/s, tokens/s, TTFT / ITL / end-to-end
    latency percentiles, SLO attainment and each stage's busy/starved/blocked share.

    Exit code: 0 done, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.metrics import summarise
    from kvasir.bench.runner import run_load, stage_fractions
    from kvasir.bench.runner import submit_only as line_rate
    from kvasir.bench.workload import LengthSpec, file_jobs, synthetic_jobs
    from kvasir.client import AsyncClient, NoDaemon

    if concurrency is None and rate is None:
        concurrency = 32
    if concurrency is not None and rate is not None:
        raise click.UsageError("give --concurrency or --rate, not both")
    if (slo_ttft is None) != (slo_tpot is None):
        raise click.UsageError("give both --slo-ttft and --slo-tpot, or neither")
    if count < 1 or warmup < 0 or (concurrency is not None and concurrency < 1) or (rate is not None and rate <= 0):
        raise click.UsageError("--requests, --concurrency and --rate must be positive, --warmup >= 0")
    try:
        outputs = LengthSpec.parse(output_len)
        prompts = LengthSpec.parse(prompt_len)
    except KvasirError as exc:
        raise click.UsageError(str(exc)) from None

    async def main():
        rt = Path(runtime_dir) if runtime_dir else default_runtime_dir()
        async with await AsyncClient.connect(rt) as client:
            if submit_only:
                return await line_rate(client, count)
            info = await client.stats()
            total = count + warmup
            if prompts_file:
                jobs = file_jobs(Path(prompts_file), total, outputs, seed)
            else:
                jobs = synthetic_jobs(total, prompts, outputs, info.vocab_size, seed)
            return await run_load(client, jobs, warmup=warmup, concurrency=concurrency, rate=rate, seed=seed)

    try:
        result = asyncio.run(main())
    except NoDaemon as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    except KvasirError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if submit_only:
        if as_json:
            click.echo(json.dumps(result))
        else:
            click.echo(
                f"submitted {result['submitted']}: accepted {result['accepted']}, overloaded {result['overloaded']}, "
                f"lost {result['lost']}; {result['sent_per_s']:.0f} sent/s, {result['accepted_per_s']:.0f} accepted/s"
            )
        return
    slo = (slo_ttft, slo_tpot) if slo_ttft is not None else None
    summary = summarise(result.records, result.duration_s, slo)
    report = {
        "mode": {"concurrency": concurrency} if concurrency is not None else {"rate": rate},
        "workload": {"requests": count, "warmup": warmup, "prompt_len": prompt_len, "output_len": output_len, "seed": seed},
        "summary": msgspec.to_builtins(summary.__dict__ | {"ttft": summary.ttft.__dict__, "itl": summary.itl.__dict__, "e2e": summary.e2e.__dict__}),
        "stages": stage_fractions(result.stats_before, result.stats_after),
    }
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print(report)


def _print(report: dict) -> None:
    s = report["summary"]
    click.echo(f"requests {s['requests']} ok, {s['errors']} failed, in {s['duration_s']:.2f} s")
    click.echo(f"throughput  {s['requests_per_s']:.2f} requests/s, {s['output_tokens_per_s']:.1f} output tokens/s")
    for name in ("ttft", "itl", "e2e"):
        d = s[name]
        click.echo(f"{name:<5} ms    p50 {d['p50'] * 1e3:8.1f}  p90 {d['p90'] * 1e3:8.1f}  p99 {d['p99'] * 1e3:8.1f}")
    if s["slo_attainment"] is not None:
        click.echo(f"SLO attainment {s['slo_attainment']:.1%}")
    for st in report["stages"]:
        click.echo(
            f"stage {st['index']}  busy {st['busy']:.0%}  starved {st['starved']:.0%}  blocked {st['blocked']:.0%}  "
            f"{st['batches_per_s']:.1f} batches/s  {st['rows_per_batch']:.1f} rows, {st['tokens_per_batch']:.1f} tokens per batch"
        )
