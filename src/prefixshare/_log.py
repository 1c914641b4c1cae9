"""Structured logging: one structlog logger per module, bound context instead of formatted strings.

Library code calls :func:`get_logger` and binds context (``policy``, ``server``, ``fingerprint``...).
Applications keep full control over rendering; :func:`configure` is an opt-in helper for the CLI and
the demo (console or JSON lines on stderr).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

ENV_LEVEL = "PREFIXSHARE_LOG_LEVEL"
ENV_JSON = "PREFIXSHARE_LOG_JSON"


def get_logger(name: str, **context: Any) -> structlog.stdlib.BoundLogger:
    if not structlog.is_configured():
        # A library stays quiet unless asked: warnings and errors on stderr until configure() is called.
        # Engine processes we never configure (schedulers, workers) follow the settings configure() left
        # in the environment of the process that started them.
        configure(level=os.environ.get(ENV_LEVEL, "WARNING"), json=os.environ.get(ENV_JSON) == "1")
    # A lazy proxy: it picks up configure() even when created at import time.
    return structlog.get_logger(name, **context)


def configure(level: str = "INFO", json: bool = False) -> None:
    """Route structlog output to stderr, as console text or one JSON object per line.

    The choice is also exported (``PREFIXSHARE_LOG_LEVEL``, ``PREFIXSHARE_LOG_JSON``) so that engine
    processes started afterwards log the same way.
    """
    os.environ[ENV_LEVEL] = level.upper()
    os.environ[ENV_JSON] = "1" if json else "0"
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # resolve sys.stderr per logger, so redirected streams (tests, daemons) are honoured
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
