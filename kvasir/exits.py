"""Leaving a process whose work is done, without the interpreter's teardown.

A stage, shard, bridge, front or launcher that has closed everything it opened would
spend one to two seconds more in the interpreter's finalisation (freeing torch's and
transformers' module state object by object) before its parent saw it exit: a daemon's
stop and every restart waited on that. ``leave`` waits for the threads a normal exit
waits for, flushes the logs and the standard streams, and ends the process at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Exit with ``code`` now, as a normal exit would once its threads are done."""
    here = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not here and not thread.daemon:
            thread.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say on it
            pass
    os._exit(code)


def exit_code(stop: SystemExit) -> int:
    """The status a ``SystemExit`` would leave with (a message is printed, and is 1)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1
