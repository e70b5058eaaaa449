"""A daemon's processes as /proc shows them: the launcher's children, and which is the bridge."""

from __future__ import annotations

from pathlib import Path


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def comm(pid: int) -> str:
    """The process's name (a worker forked from the zygote is named for what it is)."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def bridge_of(launcher: int, stage_pids) -> int:
    """The launcher's bridge: forked from the zygote and named so, or (the zygote gone) the
    fresh interpreter that is no stage."""
    return next(
        pid
        for pid in children_of(launcher)
        if pid not in stage_pids and (comm(pid) == "bridge" or "kvasir.daemon.worker" in cmdline(pid))
    )
