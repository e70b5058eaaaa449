"""SIGTERM and SIGINT handed to one handler for the length of a block, then given back."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def on_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Call ``handler`` on SIGTERM or SIGINT inside the block; the previous handlers after."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
