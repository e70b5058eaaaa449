"""``kvasir bench load | sweep | submit | failover | isolation | doors``: runs against one daemon (the
one at --runtime-dir, or one started from --plan for the run)."""

from __future__ import annotations

import click

from kvasir.cli.bench.options import positive, reporting, slo_options, target_options, workload_options
from kvasir.cli.bench.output import PLOT, finish


@click.command()
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests kept in flight (default 32).")
@click.option("--rate", type=float, default=None, help="Open loop: requests per second (Poisson, seeded).")
@PLOT
@slo_options()
@workload_options()
@target_options()
@reporting
def load(*, target, workload, slo, concurrency, rate, plot_dir):
    """Load a daemon and report requests/s, tokens/s, TTFT / ITL / end-to-end latency
    percentiles, SLO attainment and each stage's busy/starved/blocked share.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.modes import load_mode

    if concurrency is not None and rate is not None:
        raise click.UsageError("give --concurrency (closed loop) or --rate (open loop), not both")
    positive("--concurrency", concurrency)
    positive("--rate", rate)
    if rate is None and concurrency is None:
        concurrency = 32
    report, pictures = load_mode(target, workload, concurrency=concurrency, rate=rate, slo=slo, plot=bool(plot_dir))
    finish(target, report, pictures, plot_dir)


@click.command()
@click.option("--rate", type=float, default=1.0, show_default=True, help="The first rate, requests/s.")
@click.option("--steps", type=int, default=3, show_default=True, help="Bisection steps after the doubling.")
@PLOT
@slo_options(required=True)
@workload_options()
@target_options()
@reporting
def sweep(*, target, workload, slo, rate, steps, plot_dir):
    """Search the goodput: open-loop runs from --rate, doubling while --slo-attain of the
    requests meet both SLO targets, then bisecting; report every rate and the best.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.modes import sweep_mode

    positive("--rate", rate)
    if steps < 0:
        raise click.UsageError("--steps must be >= 0")
    report, pictures = sweep_mode(target, workload, rate=rate, steps=steps, slo=slo, plot=bool(plot_dir))
    finish(target, report, pictures, plot_dir)


@click.command()
@click.option("--requests", "count", type=int, default=64, show_default=True, help="One-token requests to submit.")
@target_options()
@reporting
def submit(*, target, count):
    """Measure the submission line rate: --requests one-token requests as fast as one
    client can, counting each accepted, overloaded or lost.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.modes import submit_mode

    positive("--requests", count)
    finish(target, submit_mode(target, count))


@click.command()
@click.option("--concurrency", type=int, default=32, show_default=True, help="Requests in flight when a stage dies.")
@click.option("--rounds", type=int, default=1, show_default=True, help="Stages killed, one per round.")
@workload_options(counts=False, turns=False)
@target_options()
@reporting
def failover(*, target, workload, concurrency, rounds):
    """Kill a stage (SIGKILL) under --concurrency requests, --rounds times, and time how long
    until every client is told and until the daemon serves again (the daemon must run on
    this host).

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.failover import print_failover
    from kvasir.bench.modes import failover_mode

    positive("--concurrency", concurrency)
    positive("--rounds", rounds)
    report = failover_mode(target, workload, concurrency=concurrency, rounds=rounds)
    finish(target, report, printer=lambda r, echo: print_failover(r["failover"], echo))


@click.command()
@click.option("--concurrency", type=int, default=16, show_default=True, help="Requests kept in flight throughout.")
@workload_options(turns=False)
@target_options()
@reporting
def isolation(*, target, workload, concurrency):
    """In a fleet (a plan with two or more instances): kill the first instance's tail
    (SIGKILL) under a steady closed loop of --concurrency requests and report output
    tokens/s before the kill and during that instance's restart, the restart's length and
    how the requests ended on each instance (the daemon must run on this host). The load
    cycles through the --requests jobs and runs until the restart is over and as long again.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.isolation import print_isolation
    from kvasir.bench.modes import isolation_mode

    positive("--concurrency", concurrency)
    report = isolation_mode(target, workload, concurrency=concurrency)
    finish(target, report, printer=lambda r, echo: print_isolation(r["isolation"], echo))


@click.command()
@click.argument("url")
@click.option("--api-key", default=None, help="The front's bearer key (http.api_keys).")
@click.option("--concurrency", type=int, default=32, show_default=True, help="Requests kept in flight.")
@click.option("--rounds", type=int, default=1, show_default=True, help="Alternating rounds of both doors.")
@workload_options(turns=False)
@target_options()
@reporting
def doors(*, target, workload, url, api_key, concurrency, rounds):
    """Run the workload through the daemon's ZeroMQ client and its HTTP front at URL (e.g.
    http://127.0.0.1:8000), alternating for --rounds (closed loop), and print the ratio.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments, 3 no daemon answers.
    """
    from kvasir.bench.doors import Door, print_doors
    from kvasir.bench.modes import doors_mode

    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"{url}: give the front's URL, e.g. http://127.0.0.1:8000")
    positive("--concurrency", concurrency)
    positive("--rounds", rounds)
    report = doors_mode(target, workload, Door(url.rstrip("/"), api_key), concurrency=concurrency, rounds=rounds)
    finish(target, report, printer=print_doors)
