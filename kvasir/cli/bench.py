"""``kvasir bench``: load a daemon and report throughput, latency, goodput and stage use."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

import click

from kvasir.bench.failover import print_failover
from kvasir.bench.modes import against_daemon, compare_mode, driven_daemon, failover_mode, plans_mode
from kvasir.errors import KvasirError


@click.command()
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests kept in flight (default 32).")
@click.option("--rate", type=float, default=None, help="Open loop: requests per second (Poisson, seeded).")
@click.option("--requests", "count", type=int, default=64, show_default=True, help="Measured requests (per rate).")
@click.option(
    "--warmup", type=int, default=8, show_default=True, help="Requests run first and left out of the figures."
)
@click.option(
    "--prompt-len",
    default="128",
    show_default=True,
    help="Prompt tokens: N, LOW:HIGH (uniform), N,N,... (drawn from the list: 1000,40,40,40 mixes long "
    "prompts into chats) or lognormal:MEDIAN:SIGMA:LOW:HIGH (heavy-tailed like chat traffic, e.g. "
    "lognormal:96:0.9:8:1024); shared:N+SPEC starts every prompt with the same N tokens (a system "
    "prompt: shared:1000+40).",
)
@click.option(
    "--output-len",
    default="64",
    show_default=True,
    help="Output tokens: N, LOW:HIGH, N,N,... or lognormal:MEDIAN:SIGMA:LOW:HIGH.",
)
@click.option(
    "--turns",
    type=int,
    default=1,
    show_default=True,
    help="Multi-turn conversations of N turns: each later turn resends the conversation so far (earlier "
    "prompts and replies) and adds --prompt-len new tokens; a closed loop keeps conversations in flight, "
    "an open loop starts --rate conversations a second. --requests and --warmup count turns.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help='JSONL file, one {"prompt": ...} or {"token_ids": [...]} per line (instead of random ids).',
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Every request produces exactly its output length.")
@click.option("--slo-ttft", type=float, default=None, help="Target time to first token, seconds.")
@click.option("--slo-tpot", type=float, default=None, help="Target time per output token, seconds.")
@click.option(
    "--slo-attain",
    type=float,
    default=0.9,
    show_default=True,
    help="Share of requests that must meet both targets for a rate to count as goodput.",
)
@click.option(
    "--rate-sweep",
    is_flag=True,
    help="Search the goodput: open-loop runs from --rate (default 1), doubling, then bisecting.",
)
@click.option("--sweep-steps", type=int, default=3, show_default=True, help="Bisection steps of --rate-sweep.")
@click.option(
    "--plan",
    "plan_paths",
    type=click.Path(dir_okay=False, exists=True),
    multiple=True,
    help="Start a daemon from this plan for the run (private runtime dir) and stop it after. "
    "Twice with --compare: the two plans side by side.",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Run the workload on the ring, the drained ring (inflight = 1), transformers generate "
    "(static batches) and generate_batch, alternating; print ratios. Uses --plan (default plan if absent). "
    "With two --plan: both plans (e.g. colocated and disaggregated) on the same jobs and cores, with "
    "TTFT, ITL, SLO attainment (goodput with --rate-sweep), pool use and hand-off cost.",
)
@click.option(
    "--contenders",
    default="ring,drained,hf-static,hf-continuous",
    show_default=True,
    help="With --compare: which contenders, comma-separated.",
)
@click.option(
    "--rounds",
    type=int,
    default=1,
    show_default=True,
    help="With --compare: alternating rounds. With --failover: stages killed, one per round.",
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write timeline.png, stages.png and latency.png into this folder.",
)
@click.option("--hop", is_flag=True, help="Measure one stage-to-stage hand-off next to memcpy and ZMQ round trips.")
@click.option(
    "--hop-device",
    default="cpu",
    show_default=True,
    help="With --hop: 'cpu' (shared-memory slots) or 'cuda:N' (both processes on that GPU, CUDA IPC slots).",
)
@click.option(
    "--hop-link",
    type=click.Choice(["local", "tcp"]),
    default="local",
    show_default=True,
    help="With --hop: 'tcp' measures the edge between two hosts (boundary as a frame after its "
    "descriptor, CURVE) over loopback TCP; cpu only.",
)
@click.option(
    "--roofline",
    is_flag=True,
    help="Measure this machine's limits: memory bandwidth (copy, triad) and float32 matrix-product "
    "GFLOP/s at the model's shapes (--plan's model, else the default), with 1 and 2 threads.",
)
@click.option(
    "--submit-only",
    is_flag=True,
    help="Measure submission line rate: --requests one-token requests as fast as one client can.",
)
@click.option(
    "--failover",
    is_flag=True,
    help="Kill a stage (SIGKILL) under --concurrency requests, --rounds times, and time how long until "
    "every client is told and until the daemon serves again (the daemon must run on this host).",
)
@click.option(
    "--doors",
    "doors_url",
    default=None,
    metavar="URL",
    help="Run the workload through the daemon's ZeroMQ client and its HTTP front at URL (e.g. "
    "http://127.0.0.1:8000), alternating for --rounds, and print the ratio (--concurrency, closed loop).",
)
@click.option("--api-key", default=None, help="With --doors: the front's bearer key (http.api_keys).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The daemon's runtime dir (default as for every command; ignored with --plan).",
)
def bench(
    concurrency,
    rate,
    count,
    warmup,
    prompt_len,
    output_len,
    turns,
    prompts_file,
    seed,
    ignore_eos,
    slo_ttft,
    slo_tpot,
    slo_attain,
    rate_sweep,
    sweep_steps,
    plan_paths,
    compare,
    contenders,
    rounds,
    plot_dir,
    hop,
    roofline,
    hop_device,
    hop_link,
    submit_only,
    failover,
    doors_url,
    api_key,
    as_json,
    runtime_dir,
):
    """Load a daemon and report requests/s, tokens/s, TTFT / ITL / end-to-end latency
    percentiles, goodput under SLOs and each stage's busy/starved/blocked share.

    Drives the daemon at --runtime-dir, or one started from --plan. --compare runs the
    same workload on the ring and its baselines; --hop measures the hand-off alone.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.workload import LengthSpec
    from kvasir.client import NoDaemon

    # SIGTERM unwinds like Ctrl-C, so a daemon this run started is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if concurrency is not None and rate is not None:
        raise click.UsageError("give --concurrency or --rate, not both")
    if len(plan_paths) > 2 or (len(plan_paths) == 2 and not compare):
        raise click.UsageError("--plan twice goes with --compare (two plans side by side); at most two plans")
    two_plans = len(plan_paths) == 2
    plan_path = plan_paths[0] if plan_paths else None
    if two_plans and (submit_only or hop or failover or plot_dir is not None):
        raise click.UsageError("two plans compare load runs: no --submit-only, --hop, --failover or --plot")
    if compare and not two_plans and (rate is not None or rate_sweep or submit_only):
        raise click.UsageError(
            "--compare runs a closed loop: give --concurrency, not --rate, --rate-sweep or --submit-only"
        )
    if rate_sweep and concurrency is not None:
        raise click.UsageError("--rate-sweep runs open loop: give --rate (its first rate), not --concurrency")
    if (slo_ttft is None) != (slo_tpot is None):
        raise click.UsageError("give both --slo-ttft and --slo-tpot, or neither")
    if plot_dir is not None and (submit_only or hop or failover):
        raise click.UsageError("--plot draws load runs: it does not go with --submit-only, --hop or --failover")
    if failover and (compare or rate is not None or rate_sweep or submit_only or hop):
        raise click.UsageError("--failover runs a closed loop on its own: give --concurrency and --rounds only")
    if rate_sweep and slo_ttft is None:
        raise click.UsageError("--rate-sweep needs --slo-ttft and --slo-tpot")
    if count < 1 or warmup < 0 or (concurrency is not None and concurrency < 1) or (rate is not None and rate <= 0):
        raise click.UsageError("--requests, --concurrency and --rate must be positive, --warmup >= 0")
    if rounds < 1 or sweep_steps < 0 or not 0 < slo_attain <= 1:
        raise click.UsageError("--rounds must be >= 1, --sweep-steps >= 0, --slo-attain in (0, 1]")
    if concurrency is None and rate is None and not rate_sweep:
        concurrency = 32
    if rate_sweep and rate is None:
        rate = 1.0
    try:
        lengths = (LengthSpec.parse(prompt_len), LengthSpec.parse(output_len))
    except KvasirError as exc:
        raise click.UsageError(str(exc)) from None
    if lengths[1].shared:
        raise click.UsageError("--output-len takes no shared: prefix (that is for prompts)")
    lengths = (replace(lengths[0], turns=_turns(turns, count, warmup)), lengths[1])
    if turns > 1 and (prompts_file or doors_url or failover or submit_only or hop or roofline):
        raise click.UsageError(
            "--turns sends random-id conversations on load runs: not with --prompts, --doors, "
            "--failover, --submit-only, --hop or --roofline"
        )
    if turns > 1 and compare and not two_plans and not _rings_only(contenders):
        raise click.UsageError(
            "--turns compares rings only: add --contenders ring,drained (the transformers "
            "baselines do not hold conversations)"
        )
    slo = (slo_ttft, slo_tpot) if slo_ttft is not None else None
    say = _progress_line if not as_json else (lambda line: None)
    try:
        if roofline:
            _roofline(plan_path, as_json)
            return
        if hop:
            from kvasir.bench.hop import hop_report, print_hop

            if hop_link == "tcp" and hop_device != "cpu":
                raise click.UsageError("--hop-link tcp measures a cpu edge: leave out --hop-device")
            report = hop_report(device=_hop_device(hop_device), link=hop_link)
            click.echo(json.dumps(report)) if as_json else print_hop(report, click.echo)
            return
        if doors_url is not None:
            from kvasir.bench.doors import print_doors
            from kvasir.bench.modes import doors_mode
            from kvasir.bench.workload import Workload

            door = _door(doors_url, api_key)
            workload = Workload(count, warmup, lengths, prompts_file, seed, ignore_eos)
            with driven_daemon(plan_path, runtime_dir) as rt:
                report = doors_mode(rt, door, concurrency or 32, workload, rounds, say)
            click.echo(json.dumps(report)) if as_json else print_doors(report, click.echo)
            return
        if failover:
            report = failover_mode(plan_path, runtime_dir, concurrency, rounds, lengths, prompts_file, seed, say)
            if as_json:
                click.echo(json.dumps(report))
            else:
                print_failover(report["failover"], click.echo)
            return
        if two_plans:
            report, pictures = (
                plans_mode(
                    plan_paths,
                    concurrency,
                    rate,
                    count,
                    warmup,
                    lengths,
                    prompts_file,
                    seed,
                    rounds,
                    slo,
                    slo_attain,
                    (rate, sweep_steps) if rate_sweep else None,
                    say,
                ),
                [],
            )
        elif compare:
            report, pictures = compare_mode(
                plan_path,
                concurrency or 32,
                count,
                warmup,
                lengths,
                prompts_file,
                seed,
                contenders,
                rounds,
                slo,
                plot_dir,
                say,
            )
        else:
            with driven_daemon(plan_path, runtime_dir) as rt:
                report, pictures = against_daemon(
                    rt,
                    concurrency,
                    rate,
                    count,
                    warmup,
                    lengths,
                    prompts_file,
                    seed,
                    ignore_eos,
                    slo,
                    slo_attain,
                    rate_sweep,
                    sweep_steps,
                    submit_only,
                    plot_dir,
                    say,
                )
        if plot_dir is not None:
            from kvasir.bench.plot import plot_run

            if not pictures:
                raise KvasirError("--plot: no ring run to draw (add ring or drained to --contenders)")

            report["plots"] = [str(p) for p in plot_run(pictures, Path(plot_dir))]
    except NoDaemon as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    except KvasirError as exc:
        from kvasir.bench.daemon import BenchDaemonError

        click.echo(f"error: {exc}", err=True)
        sys.exit(1 if isinstance(exc, BenchDaemonError) else 2)
    if as_json:
        click.echo(json.dumps(report))
        return
    from kvasir.bench.report import print_report

    print_report(report, click.echo)


def _turns(turns: int, count: int, warmup: int) -> int:
    if turns < 1 or count % turns or warmup % turns:
        raise click.UsageError("--turns must be >= 1 and divide --requests and --warmup (whole conversations)")
    return turns


def _rings_only(contenders: str) -> bool:
    from kvasir.bench.compare import RING_KINDS

    return all(name.strip() in RING_KINDS for name in contenders.split(",") if name.strip())


def _roofline(plan_path: str | None, as_json: bool) -> None:
    from kvasir.bench.roofline import print_roofline, roofline_report
    from kvasir.config.plan import default_plan_path
    from kvasir.daemon.resolve import resolve_plan

    _, source = resolve_plan(Path(plan_path) if plan_path is not None else default_plan_path())
    report = roofline_report(source)
    click.echo(json.dumps(report)) if as_json else print_roofline(report, click.echo)


def _door(url: str, api_key: str | None):
    from kvasir.bench.doors import Door

    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--doors {url}: give the front's URL, e.g. http://127.0.0.1:8000")
    return Door(url.rstrip("/"), api_key)


def _progress_line(line: str) -> None:
    click.echo(line, err=True)


def _hop_device(device: str) -> str:
    """--hop-device checked: "cpu", or a CUDA device that is here."""
    if device == "cpu":
        return device
    import re

    import torch

    from kvasir.config.devices import cuda_ordinal

    if not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise click.BadParameter(f"{device!r} is not 'cpu' or 'cuda:N'", param_hint="--hop-device")
    if not torch.cuda.is_available():
        raise click.BadParameter(f"{device}: CUDA is not available here", param_hint="--hop-device")
    ordinal = cuda_ordinal(device) or 0  # the pattern above: cuda or cuda:N
    if ordinal >= torch.cuda.device_count():
        raise click.BadParameter(
            f"{device}: this machine has {torch.cuda.device_count()} CUDA devices", param_hint="--hop-device"
        )
    return f"cuda:{ordinal}"
