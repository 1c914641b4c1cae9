"""Metrics hooks called by the connectors' runtime (engine processes) and by warm.

The functions here are the stable interface; their bodies record Prometheus metrics when metrics are
enabled and do nothing otherwise (cheap enough for the request path).
"""

from __future__ import annotations

from typing import Any


def lookup(engine: str, seconds: float, hit_tokens: int) -> None:
    """One store lookup finished (hit_tokens = tokens the engine will load)."""


def load(engine: str, seconds: float, tokens: int, nbytes: int) -> None:
    """One load from the store into the engine's KV cache finished."""


def admission(engine: str, admitted: bool, reason: str) -> None:
    """An admission decision (reason: the deciding rule's name, e.g. 'min_tokens')."""


def fallback(engine: str, reason: str) -> None:
    """A load was abandoned and the engine recomputed (reason: lookup_timeout, load_failed...)."""


def stored(engine: str, tokens: int, nbytes: int) -> None:
    """KV of a finished request was handed to the store."""


def warm_progress(documents: int, tokens: int, nbytes: int, **fields: Any) -> None:
    """Warm progress (cumulative)."""
