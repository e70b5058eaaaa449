"""structlog set-up for every Kvasir process: one line per event on stderr."""

from __future__ import annotations

import logging
import sys

import structlog

Logger = structlog.typing.FilteringBoundLogger  # what setup_logging returns


def setup_logging(level: str = "info", **context: object) -> Logger:
    """Configure structlog for this process and return a logger bound to ``context``."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(**context)
