"""Shared CLI plumbing: error handling without tracebacks, ``--json`` output, exit codes.

Exit codes: 0 ok, 1 a check failed (e.g. fingerprints differ, verdict negative), 2 bad input
(invalid policy, missing file, bad option), 3 a runtime failure (server did not start...).
"""

from __future__ import annotations

import enum
import functools
import json as _json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from prefixshare.errors import PolicyError, PrefixShareError, ServerError

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_RUNTIME = 0, 1, 2, 3

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # Python 3.10: the same behaviour for option choices (str() is the value)

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

JSON_OPTION = typer.Option(False, "--json", help="Print machine-readable JSON on stdout.")


def human_size(n: float) -> str:
    """Bytes for people: ``512 B``, ``1.5 MiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def emit_json(obj: Any) -> None:
    """Write one JSON document to stdout (no rich markup, no wrapping)."""
    sys.stdout.write(_json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def handles_errors(fn: F) -> F:
    """Turn prefixshare's own errors into one clear message and a meaningful exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = "--debug" in sys.argv
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except PolicyError as exc:
            if debug:
                raise
            raise fail(str(exc), EXIT_BAD_INPUT) from None
        except ServerError as exc:
            if debug:
                raise
            raise fail(str(exc), EXIT_RUNTIME) from None
        except (PrefixShareError, FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            if debug:
                raise
            raise fail(str(exc), EXIT_BAD_INPUT) from None

    return wrapper  # type: ignore[return-value]
