"""Hosts on one machine, for tests and benchmarks: Linux network namespaces joined by
veth pairs to a bridge.

Every test network lives entirely in namespaces it made: a "switch" namespace holding a
bridge, and one namespace per host whose veth end carries a private address
(10.X.0.N/24, X from the maker's pid so two runs do not collide in name). Nothing is
added to the machine's own namespace. ``Network.close`` deletes every namespace it
made (their interfaces go with them); ``link_down`` / ``link_up`` cut and restore one
host's cable; ``shape`` rate-limits it with ``tc qdisc ... tbf``.

Needs root and iproute2: ``netns_unavailable()`` says why not, for a skip reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"kvprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', b'').decode(errors='replace').strip() or exc}"
    _ip("netns", "delete", probe)
    return None


@dataclass
class Network:
    """``hosts`` namespaces on one bridge; ``address(name)`` is a host's private address."""

    names: list[str]
    tag: str = field(default_factory=lambda: f"kv{os.getpid() % 100000}")
    made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.subnet = f"10.{os.getpid() % 200 + 20}.0"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def _cable(self, name: str) -> str:
        return f"{self.tag}s{self.names.index(name)}"  # the switch's end of the host's veth

    def _build(self) -> None:
        switch = self.namespace("switch")
        _ip("netns", "add", switch)
        self.made.append(switch)
        _ip("link", "add", "br0", "type", "bridge", netns=switch)
        _ip("link", "set", "br0", "up", netns=switch)
        for name in self.names:
            ns = self.namespace(name)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", self._cable(name), "netns", switch, netns=ns)
            _ip("addr", "add", f"{self.address(name)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", self._cable(name), "master", "br0", netns=switch)
            _ip("link", "set", self._cable(name), "up", netns=switch)

    def run(self, name: str, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` inside host ``name``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *command], **kwargs)

    def link_down(self, name: str) -> None:
        _ip("link", "set", self._cable(name), "down", netns=self.namespace("switch"))

    def link_up(self, name: str) -> None:
        _ip("link", "set", self._cable(name), "up", netns=self.namespace("switch"))

    def shape(self, name: str, rate: str) -> None:
        """Limit what host ``name`` sends to ``rate`` (e.g. "1gbit") with a token bucket."""
        _ip("link", "set", "eth0", "up", netns=self.namespace(name))
        subprocess.run(
            ["ip", "netns", "exec", self.namespace(name), "tc", "qdisc", "replace", "dev", "eth0", "root",
             "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def unshape(self, name: str) -> None:
        """Remove host ``name``'s rate limit (none there: nothing to do)."""
        subprocess.run(
            ["ip", "netns", "exec", self.namespace(name), "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True, timeout=30,
        )  # fmt: skip

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self.made.clear()
