"""Whether a process still runs (for files named after the process that made them)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while ``pid`` names a process, this user's or another's (zombies included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
