"""The environment of the daemon's processes: ``worker_env`` (huge pages, OpenMP's spin),
which ``kvasird`` takes on before anything else (``exec_in_worker_env``), so that the zygote
forked from it and every worker forked from the zygote have it too: glibc reads its
tunables when a program starts and libgomp its settings when torch loads it, so a fork
keeps whatever its parent started with. Nothing here imports more than the standard library:
it runs before the launcher's imports."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
# How long (busy-wait iterations) an OpenMP worker thread waits for torch's next parallel
# region before it sleeps. GNU OpenMP's default (300,000) keeps it spinning for several
# milliseconds after a stage's last product: it then takes a core from the next stage,
# which is what a batch alone in the ring runs on (``solo_threads``, kvasir/model/pinning.py).
# 3,000 still covers the gaps between one batch's products (docs/bench/latency.md).
OPENMP_SPIN = "3000"


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: ``environ`` with glibc's allocator asked to back its large
    blocks (weights, KV cache) with transparent huge pages, unless ``GLIBC_TUNABLES``
    already says what to do about them (``glibc.malloc.hugetlb=0`` turns it off).

    A stage reads every weight once per batch; with 4 KiB pages the CPU's prefetchers stop
    at each page edge, with 2 MiB pages they stream on (docs/bench/targets.md: the fixed workload
    4-6 % faster on the development machine). glibc before 2.35 and kernels with THP off
    ignore the request.

    OpenMP's worker threads wait ``OPENMP_SPIN`` busy iterations, unless
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already says how they wait."""
    env = dict(environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    tunables = [part for part in env.get("GLIBC_TUNABLES", "").split(":") if part]
    if not any(part.split("=", 1)[0] == HUGE_PAGES_TUNABLE for part in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{HUGE_PAGES_TUNABLE}=1"])
    return env


def exec_in_worker_env(warn) -> None:
    """Run this program again, as the same process with the same arguments, in
    ``worker_env`` where the environment lacks any of it; ``warn(text)`` if it cannot be
    (this process then goes on as it is, its workers without huge pages). Call it first,
    before torch is imported: nothing done before it survives."""
    env = worker_env(os.environ)
    if env == dict(os.environ):
        return
    script = sys.argv[0]
    if os.path.isfile(script) and os.access(script, os.X_OK):  # kvasird, the console script: its name kept
        program, argv = script, sys.argv
    else:  # python -m ...: the interpreter's own command line
        program, argv = sys.executable, [sys.executable, *sys.orig_argv[1:]]
    try:
        os.execve(program, argv, env)
    except OSError as exc:
        warn(f"cannot run again in the workers' environment ({exc}): its workers start without its settings")
