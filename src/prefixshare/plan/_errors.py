"""The one exception the plan capability raises on purpose."""

from __future__ import annotations

from prefixshare.errors import PrefixShareError


class PlanError(PrefixShareError, ValueError):
    """Bad planning input: an unknown shape, a config missing a key, a bad link or dtype string.

    It is a :class:`ValueError` so plain Python callers can catch it generically, and a
    :class:`~prefixshare.errors.PrefixShareError` so the CLI prints it as one line and exits 2.
    """
