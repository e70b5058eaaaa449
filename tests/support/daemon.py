"""Starting and stopping real kvasird processes for integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvasir.bench.daemon import free_ports, stop_gracefully, wait_serving
from kvasir.client import Client
from tests.support.models import shard_tables

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A local TCP port nothing listens on, below the ephemeral range (see free_ports)."""
    return free_ports(1)[0]


def stage_count(splits) -> int:
    return sum(len(split) for split in splits.values()) if isinstance(splits, dict) else len(splits)


def write_plan(path: Path, source: Path, splits, **kw) -> Path:
    values = dict(
        max_seq_len=256, max_rows=8, max_tokens=32, inflight=3, block_size=4, num_blocks=600, max_waiting=1024
    )
    values["max_per_client"] = kw.get("max_waiting", 1024)
    values.update(kw)
    supervise = "".join(
        f"{key} = {kw[key]}\n" for key in ("max_restarts", "restart_window_s", "heartbeat_timeout_s") if key in kw
    )
    stages = _rings(splits, kw)
    if "lease_s" in kw:
        stages = f"[handoff]\nlease_s = {kw['lease_s']}\n" + stages
    for pool in ("prefill", "decode"):  # a pool's own cache size: prefill_blocks = N, decode_blocks = N
        if f"{pool}_blocks" in kw:
            stages = f"[{pool}.kv]\nblock_size = {values['block_size']}\nnum_blocks = {kw[pool + '_blocks']}\n" + stages
    path.write_text(
        f'[model]\nsource = "{source}"\nmax_seq_len = {values["max_seq_len"]}\ndtype = "{kw.get("dtype", "float32")}"\n'
        + (f'weights = "{kw["weights"]}"\n' if "weights" in kw else "")
        + f"[batch]\nmax_rows = {values['max_rows']}\nmax_tokens = {values['max_tokens']}\ninflight = {values['inflight']}\n"
        f"[kv]\nblock_size = {values['block_size']}\nnum_blocks = {values['num_blocks']}\n"
        + ("prefix_cache = false\n" if kw.get("prefix_cache") is False else "")
        + (f'prefix_share = "{kw["prefix_share"]}"\n' if "prefix_share" in kw else "")
        + f"[bridge]\nmax_waiting = {values['max_waiting']}\nmax_per_client = {values['max_per_client']}\n"
        + "".join(
            f"{key} = {kw[key]}\n"
            for key in ("max_client_queue", "max_client_bytes", "max_tokens_per_request")
            if key in kw
        )
        + ("tcp_allow_local_unauthenticated = true\n" if kw.get("tcp_allow_local_unauthenticated") else "")
        + "".join(f'{key} = "{kw[key]}"\n' for key in ("tcp", "server_key", "client_keys") if key in kw)
        + f"[supervise]\n{supervise}"
        + (f'[route]\npolicy = "{kw["route"]}"\n' if "route" in kw else "")
        + _http_table(kw.get("http"))
        + (f"[kv_pool]\n{kw['kv_pool']}\n" if "kv_pool" in kw else "")  # the table's lines, as TOML
        + (f"[speculative]\n{kw['speculative']}\n" if "speculative" in kw else "")  # likewise
        + (f"[planner]\n{kw['planner']}\n" if "planner" in kw else "")  # likewise
        + stages
    )
    return path


def _rings(splits, kw) -> str:
    """The stage tables: ``splits`` a list of layer ranges (one ring), or a dict of them by
    ring: "prefill" and "decode" (each pool one ring), "prefill.NAME" and "decode.NAME" (a
    pool's instances), any other key an instance of a colocated plan."""
    rings = splits.items() if isinstance(splits, dict) else [("", splits)]
    text = ""
    for ring, split in rings:
        pool, _, name = ring.partition(".") if ring.startswith(("prefill.", "decode.")) else ("", "", ring)
        if ring in ("prefill", "decode"):
            pool, name = ring, ""
        table = f"{pool + '.' if pool else ''}{'instances.' if name else ''}stages"
        if name:
            text += f'[[{table.removesuffix(".stages")}]]\nname = "{name}"\n'
        text += "".join(
            f"[[{table}]]\nlayers = [{a}, {b}]\n" + _stage_keys(kw, i, table) for i, (a, b) in enumerate(split)
        )
    return text


def _http_table(http: dict | None) -> str:
    """``[http]`` from http = {"listen": "127.0.0.1:PORT", ...} (None: no HTTP front)."""
    if http is None:
        return ""
    return "[http]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in http.items())


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _stage_keys(kw, i: int, table: str = "stages") -> str:
    """A stage's device and edge kind from devices = [...] / edges = [...] (None: the default),
    its expert shards from experts = {stage index: [ranges]}."""
    keys = ""
    for key, plural in (("device", "devices"), ("edge", "edges")):
        values = kw.get(plural)
        if values is not None and values[i] is not None:
            keys += f'{key} = "{values[i]}"\n'
    return keys + shard_tables(kw.get("experts", {}).get(i, ()), table)


class Daemon:
    """One ``kvasird start`` process with its own runtime dir."""

    def __init__(
        self, plan: Path, runtime_dir: Path, stages: int, drain_timeout: float = 30.0, wrap: tuple[str, ...] = ()
    ) -> None:
        self.plan = plan
        self.runtime_dir = runtime_dir
        self.stages = stages
        self.log_path = runtime_dir.parent / f"{runtime_dir.name}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(  # ``wrap``: a command that execs the rest (same pid), e.g. unshare
            [
                *wrap,
                str(BIN / "kvasird"),
                "start",
                "--plan",
                str(plan),
                "--runtime-dir",
                str(runtime_dir),
                "--drain-timeout",
                str(drain_timeout),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 180.0) -> Daemon:
        wait_serving(self.process, self.runtime_dir, self.stages, timeout_s, self.log)
        return self

    def client(self) -> Client:
        return Client(self.runtime_dir)

    def child_pids(self) -> list[int]:
        with Client(self.runtime_dir) as client:
            return [s.pid for s in client.stats().stages]

    def stop(self, timeout_s: float = 60.0) -> int:
        code = stop_gracefully(self.process, timeout_s)
        self._log.close()
        return code


@contextmanager
def serving(plan: Path, runtime_dir: Path, splits, port: int) -> Iterator[Daemon]:
    """A daemon for a module's tests, ready, with its HTTP front's ``port``; stopped
    cleanly (exit 0) after them."""
    daemon = Daemon(plan, runtime_dir, stage_count(splits))
    daemon.port = port  # type: ignore[attr-defined]
    try:
        yield daemon.wait_ready()
    finally:
        assert daemon.stop() == 0, daemon.log()[-5_000:]


@contextmanager
def serving_daemon(root: Path, source, splits, **plan_values) -> Iterator[Daemon]:
    """A ready daemon on a plan written into ``root`` (``write_plan``'s values), for the
    tests of a module or of the run that share it; stopped cleanly (exit 0) after them."""
    plan = write_plan(root / "plan.toml", source, splits, **plan_values)
    daemon = Daemon(plan, root / "rt", stage_count(splits))
    try:
        yield daemon.wait_ready()
    finally:
        assert daemon.stop() == 0, daemon.log()[-5_000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (it no longer runs either way)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class TailReader:
    """``kvasir tail --json`` in a subprocess, its lines read on a thread."""

    def __init__(self, runtime_dir: Path, *args: str) -> None:
        import json
        import queue
        import threading

        self._json = json
        self.lines: queue.Queue = queue.Queue()
        self.process = subprocess.Popen(
            [str(BIN / "kvasir"), "tail", "--json", "--runtime-dir", str(runtime_dir), *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(self._json.loads(line))

    def next(self, timeout_s: float = 30.0) -> dict:
        return self.lines.get(timeout=timeout_s)

    def wait_attached(self, runtime_dir: Path, timeout_s: float = 60.0) -> None:
        """Send one-token requests until the tail shows one (PUB/SUB joins late)."""
        deadline = time.monotonic() + timeout_s
        with Client(runtime_dir) as client:
            while time.monotonic() < deadline:
                final = client.generate(token_ids=[5], max_tokens=1, temperature=0)
                try:
                    while True:
                        event = self.next(timeout_s=1.0)
                        if event["request_id"] == final.request_id:
                            return
                except Exception:
                    continue
        raise RuntimeError("kvasir tail never attached")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def settled(runtime_dir, timeout_s: float = 30.0, pool: str | None = None):
    """Stats once no request is in the daemon, every worker has reported since (the stages
    free released blocks with the next descriptor, and report twice a second) and no
    stage holds a block; after ``timeout_s``, the stats as they are. With ``pool``, only
    that pool's workers count (a test that stopped a worker of the other pool)."""
    deadline = time.monotonic() + timeout_s
    idle_at: dict[int, float] | None = None  # each worker's clock in the first report seen with nothing in flight
    while True:
        with Client(runtime_dir) as client:
            stats = client.stats()
        workers = [w for w in (*stats.stages, *stats.shards) if pool is None or w.pool == pool]
        clocks = {worker.pid: worker.wall_s for worker in workers}  # by pid: a restarted worker's clock starts again
        if idle_at is None and stats.in_flight == 0:
            idle_at = clocks
        reported = idle_at is not None and all(wall > idle_at.get(pid, -1.0) for pid, wall in clocks.items())
        stages = [s for s in stats.stages if pool is None or s.pool == pool]
        if reported and all(s.kv.blocks == 0 for s in stages) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def kvasir_stats(runtime_dir, *args: str) -> subprocess.CompletedProcess:
    """``kvasir stats [ARGS]`` against the daemon at ``runtime_dir``, its output as text."""
    return subprocess.run(
        [str(BIN / "kvasir"), "stats", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
