"""``kvasir bench compare | plans | pool``: the same jobs on several contenders,
alternating, with ratios (each contender's daemon started for its run)."""

from __future__ import annotations

from pathlib import Path

import click

from kvasir.cli.bench.options import positive, reporting, slo_options, target_options, workload_options
from kvasir.cli.bench.output import PLOT, finish


@click.command()
@click.option("--concurrency", type=int, default=32, show_default=True, help="Requests kept in flight.")
@click.option(
    "--contenders",
    default="ring,drained,hf-static,hf-continuous",
    show_default=True,
    help="Which contenders, comma-separated.",
)
@click.option("--rounds", type=int, default=1, show_default=True, help="Alternating rounds.")
@click.option(
    "--llama-server",
    "llama_server",
    type=click.Path(dir_okay=False),
    default=None,
    help="The llama-server binary for the llama.cpp contender (default: $KVASIR_LLAMA_SERVER, else the one "
    "scripts/llama-server builds, else llama-server on PATH).",
)
@click.option(
    "--door",
    type=click.Choice(["zeromq", "http"]),
    default=None,
    help="How the rings are driven: the ZeroMQ client, or a loopback OpenAI HTTP front added to their plans "
    "(default: http when llama.cpp is a contender, else zeromq).",
)
@PLOT
@slo_options()
@workload_options()
@target_options()
@reporting
def compare(*, target, workload, slo, concurrency, contenders, rounds, llama_server, door, plot_dir):
    """Run the workload on the ring (--plan, else the default plan), the drained ring
    (inflight = 1), transformers generate (static batches) and generate_batch, alternating,
    with exact output lengths and the same threads; print the ratios.

    Contender llama.cpp (not run unless named) is llama.cpp's own llama-server on the GGUF
    file the plan's model comes from, with -np = --concurrency slots and the plan's
    threads; with it the rings are driven through a loopback OpenAI HTTP front, as it is
    (--door http).

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments.
    """
    from kvasir.bench.compare import CONTENDERS, RING_KINDS
    from kvasir.bench.modes import compare_mode

    positive("--concurrency", concurrency)
    positive("--rounds", rounds)
    names = tuple(name.strip() for name in contenders.split(",") if name.strip())
    unknown = [name for name in names if name not in CONTENDERS]
    if unknown or not names:
        raise click.UsageError(
            f"--contenders: {', '.join(unknown) or 'none given'}; choose among {', '.join(CONTENDERS)}"
        )
    if door == "zeromq" and "llama.cpp" in names:
        raise click.UsageError("llama.cpp is measured through its HTTP server: --door zeromq cannot drive it")
    if workload.lengths[0].turns > 1 and not set(names) <= set(RING_KINDS):
        raise click.UsageError(
            "--turns compares rings only: give --contenders ring,drained (the transformers baselines and "
            "llama.cpp are not sent conversations)"
        )
    report, pictures = compare_mode(
        target,
        workload,
        concurrency=concurrency,
        contenders=names,
        rounds=rounds,
        slo=slo,
        plot=bool(plot_dir),
        llama_server=llama_server,
        door=door,
    )
    finish(target, report, pictures, plot_dir)


@click.command()
@click.argument("plans", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests kept in flight (default 32).")
@click.option("--rate", type=float, default=None, help="Open loop: requests per second; with --sweep the first rate.")
@click.option(
    "--sweep", "steps", type=int, default=None, help="Search each plan's goodput with this many bisection steps."
)
@click.option("--rounds", type=int, default=1, show_default=True, help="Alternating rounds (not with --sweep).")
@slo_options()
@workload_options()
@target_options(plan=False)
@reporting
def plans(*, target, workload, slo, plans, concurrency, rate, steps, rounds):
    """Run PLANS (two or more plans of one model, e.g. colocated and disaggregated) on the
    same jobs and cores, one daemon at a time, with exact output lengths; report TTFT,
    ITL, SLO attainment (goodput with --sweep), pool use and hand-off cost, and the second
    plan's figures over the first's.

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments.
    """
    from kvasir.bench.modes import plans_mode

    if len(plans) < 2:
        raise click.UsageError("give two plans or more to set side by side")
    if concurrency is not None and (rate is not None or steps is not None):
        raise click.UsageError("give --concurrency (closed loop) or --rate / --sweep (open loop), not both")
    positive("--concurrency", concurrency)
    positive("--rate", rate)
    positive("--rounds", rounds)
    if steps is not None and (steps < 0 or slo is None):
        raise click.UsageError("--sweep takes steps >= 0 and needs --slo-ttft and --slo-tpot")
    sweep = (rate or 1.0, steps) if steps is not None else None
    # a sweep's first rate (the sweep sets each run's own), an open loop's rate, or a closed loop
    rate = sweep[0] if sweep is not None else rate
    load = {"rate": rate} if rate is not None else {"concurrency": concurrency or 32}
    report = plans_mode([Path(p) for p in plans], workload, load, rounds=rounds, slo=slo, sweep=sweep, say=target.say)
    finish(target, report)


@click.command()
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False, exists=True),
    required=True,
    help="A plan with [kv_pool] and one instance (its sizes; the bench makes its own tiers).",
)
@click.option("--prompt-len", type=int, default=2000, show_default=True, help="Tokens of each measured prompt.")
@click.option("--rounds", type=int, default=2, show_default=True, help="Measured prompts per daemon.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the random prompts.")
@target_options(plan=False)
@reporting
def pool(*, target, plan_path, prompt_len, rounds, seed):
    """Time to first token of a prompt whose prefix was evicted from the instance's cache,
    against its cold start, with the KV pool off, in host memory only and on disk only
    (three daemons in turn, each with ratios of its own), and after a restart (disk).

    Exit code: 0 done, 1 a daemon it started failed, 2 bad arguments.
    """
    from kvasir.bench.pool import run_pool
    from kvasir.bench.report import print_pool

    positive("--prompt-len", prompt_len)
    positive("--rounds", rounds)
    report = run_pool(Path(plan_path), prompt_len=prompt_len, rounds=rounds, seed=seed, say=target.say)
    finish(target, {"pool": report}, printer=print_pool)
