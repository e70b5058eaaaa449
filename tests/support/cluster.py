"""A daemon across hosts for tests: ``kvasird start`` in the leader's namespace and
``kvasird join`` in each follower's (tests/support/netns.py), with their logs."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from click.testing import CliRunner

from kvasir.bench.daemon import stop_gracefully, wait_serving
from kvasir.bench.netns import Network
from kvasir.cli.main import kvasir
from kvasir.client import Client
from tests.support.daemon import BIN


def hosts_table(network: Network, leader: str = "a", silence_s: float | None = None, standby: tuple = ()) -> str:
    """[cluster] and [hosts.NAME] for every host of ``network`` (keys in keys/);
    ``silence_s``: cluster.host_silence_s; ``standby``: the standby hosts."""
    text = f'[cluster]\nleader = "{leader}"\nkeys = "keys"\n'
    if silence_s is not None:
        text += f"host_silence_s = {silence_s}\n"
    return text + "".join(
        f'[hosts.{name}]\naddress = "{network.address(name)}"\n' + ("standby = true\n" if name in standby else "")
        for name in network.names
    )


class HostedDaemon:
    """The leader and its followers; every process in its own session (a follower killed
    with its workers is one killpg)."""

    def __init__(
        self, network: Network, folder: Path, plan_text: str, stages: int, leader: str = "a", later: tuple = ()
    ) -> None:
        """``later``: hosts whose kvasird join the test starts itself (standby hosts)."""
        self.network, self.folder, self.stages, self.leader = network, folder, stages, leader
        result = CliRunner().invoke(
            kvasir, ["keys", "generate", str(folder / "keys"), *[f"--host={name}" for name in network.names]]
        )
        if result.exit_code != 0:
            raise RuntimeError(result.output)
        self.plan = folder / "plan.toml"
        self.plan.write_text(plan_text)
        self.runtime_dir = folder / f"rt-{leader}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()  # killed by the test (and not started again)
        self.start(leader)
        for name in network.names:
            if name != leader and name not in later:
                self.start(name)

    def start(self, host: str) -> subprocess.Popen:
        verb = ["start"] if host == self.leader else ["join", "--host", host]
        command = [
            str(BIN / "kvasird"),
            *verb,
            "--plan",
            str(self.plan),
            "--runtime-dir",
            str(self.folder / f"rt-{host}"),
        ]
        log = open(self.folder / f"{host}.log", "ab")
        process = self.network.run(host, command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes[host] = process
        self.killed.discard(host)
        return process

    def log(self) -> str:
        return "\n".join(
            f"--- {host} ---\n" + (self.folder / f"{host}.log").read_text(errors="replace")[-6000:]
            for host in self.processes
        )

    def wait_ready(self, timeout_s: float = 240.0) -> HostedDaemon:
        wait_serving(self.processes[self.leader], self.runtime_dir, self.stages, timeout_s, self.log)
        return self

    def stats(self):
        with Client(self.runtime_dir) as client:
            return client.stats()

    def kill_host(self, host: str) -> None:
        """SIGKILL the host's kvasird and every process it started."""
        os.killpg(self.processes[host].pid, signal.SIGKILL)
        self.processes[host].wait(timeout=30)
        self.killed.add(host)

    def stop(self) -> dict[str, int]:
        """SIGTERM every host's kvasird (the leader first); the exit statuses of those the
        test did not kill."""
        order = sorted(self.processes, key=lambda host: host != self.leader)
        codes = {host: stop_gracefully(self.processes[host], 60) for host in order}
        codes = {host: code for host, code in codes.items() if host not in self.killed}
        for process in self.processes.values():  # anything left in their sessions
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return codes
