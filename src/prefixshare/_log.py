"""Structured logging: one structlog logger per module, bound context instead of formatted strings.

Library code calls :func:`get_logger` and binds context (``policy``, ``server``, ``fingerprint``...). As
structlog advises for libraries, nothing here configures structlog on import or on a logger's creation:
applications keep full control over rendering. :func:`configure` is the opt-in helper the CLI, the demo and
the benchmark's replicas call (console or JSON lines on stderr); code that runs in processes prefixshare's
connectors and server plugins are loaded into calls :func:`configure_from_environment`, which follows what
``configure`` exported in the process that started them (warnings and errors on stderr by default) and
leaves a structlog configuration already in place alone.
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
    # A lazy proxy: it picks up the configuration in force when it first logs, even when created at import time.
    return structlog.get_logger(name, **context)


def configure_from_environment() -> None:
    """In an engine or server process prefixshare's code is loaded into (schedulers, workers, the MP server):
    log as the process that started it was configured (``PREFIXSHARE_LOG_LEVEL``/``PREFIXSHARE_LOG_JSON``;
    warnings and errors on stderr when unset), unless structlog is configured already."""
    if not structlog.is_configured():
        configure(level=os.environ.get(ENV_LEVEL, "WARNING"), json=os.environ.get(ENV_JSON) == "1")


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
