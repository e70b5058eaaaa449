"""The process's descriptor limit: raised to what the system allows, checked against need.

systemd (and most shells) start a process with a soft limit of 1,024 descriptors. An
HTTP front that holds ``http.max_connections`` connections needs that many plus what its
ZeroMQ sockets and files take; the soft limit is raised to the hard limit at start (the
units set ``LimitNOFILE``), and a plan that needs more than that is refused up front.
"""

from __future__ import annotations

import resource

FD_RESERVE = 256  # descriptors a process needs besides its connections: sockets, files, pipes


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # the kernel's own ceiling (fs.nr_open) is lower: keep what there is
    return soft
