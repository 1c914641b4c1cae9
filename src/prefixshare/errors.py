"""Exceptions raised by prefixshare.

Every user-facing error carries enough context to act on: *what* was wrong, *where* (a field path, a
server, a file) and *how to fix it*. The CLI prints these without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class PrefixShareError(Exception):
    """Base class of every error prefixshare raises on purpose."""


@dataclass(frozen=True)
class FieldProblem:
    """One invalid setting: ``loc`` is a dotted path such as ``l2[1].base_path``."""

    loc: str
    value: object
    message: str
    fix: str = ""

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f"{self.value!r} "
        text = f"{self.loc}: {shown}{self.message}"
        return f"{text}; {self.fix}" if self.fix else text


_MISSING = object()


class PolicyError(PrefixShareError, ValueError):
    """A policy (YAML or keyword construction) is invalid. ``problems`` lists every bad field."""

    def __init__(self, problems: Iterable[FieldProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid policy{f' in {source}' if source else ''}"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}")


class MissingExtraError(PrefixShareError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""

    def __init__(self, what: str, module: str, extra: str) -> None:
        self.what, self.module, self.extra = what, module, extra
        super().__init__(
            f"{what} needs the Python module {module!r}, which is not installed; "
            f"install it with: pip install 'prefixshare[{extra}]'"
        )


class NativeLibraryError(PrefixShareError, ImportError):
    """An installed optional dependency cannot load its native library on this host; the message names the
    library and how to install it."""


class ServerError(PrefixShareError, RuntimeError):
    """The LMCache MP server could not be started, reached or stopped."""


class FingerprintError(PrefixShareError, ValueError):
    """A fingerprint could not be computed (missing or unreadable model files, bad options)."""


class IncompatibleError(PrefixShareError):
    """Two fingerprints differ: KV written under one cannot be used under the other."""

    def __init__(self, differences: Iterable[str]) -> None:
        self.differences = list(differences)
        super().__init__("incompatible: " + "; ".join(self.differences))


__all__ = [
    "FieldProblem",
    "FingerprintError",
    "IncompatibleError",
    "MissingExtraError",
    "NativeLibraryError",
    "PolicyError",
    "PrefixShareError",
    "ServerError",
]
