"""Canonical JSON and hashing helpers shared by the fingerprint modules.

Everything that feeds a digest goes through :func:`canonical_json`, so a digest depends only on the
*values* being hashed: never on dict ordering, ``PYTHONHASHSEED``, tuple-vs-list, or how a float
happens to be spelled (``10000`` and ``10000.0`` hash the same).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import blake3

#: Number of hex characters kept from a blake3 digest (128 bits): plenty to tell fingerprints apart.
DIGEST_HEX_CHARS = 32


def normalise(value: Any) -> Any:
    """Return a JSON-ready copy of ``value`` with a single spelling for every value.

    * mappings: keys must be strings (they are sorted when serialised);
    * tuples, lists, sets/frozensets (sorted) become lists;
    * finite integral floats become ints (``1.0`` -> ``1``), other finite floats keep Python's
      shortest round-trip ``repr`` (the same in every process), non-finite floats become the strings
      ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``;
    * ``bool``, ``None``, ``int`` and ``str`` are kept as they are.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        if value.is_integer():
            return int(value)
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"canonical JSON needs string keys, got {key!r}")
            out[key] = normalise(item)
        return out
    if isinstance(value, (list, tuple)):
        return [normalise(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((normalise(item) for item in value), key=lambda v: json.dumps(v, sort_keys=True))
    raise TypeError(f"value of type {type(value).__name__} cannot be put in canonical JSON")


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` as canonical JSON: normalised, sorted keys, compact, ASCII only."""
    text = json.dumps(normalise(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


def blake3_hex(data: bytes, chars: int | None = None) -> str:
    """blake3 of ``data`` as lowercase hex, optionally truncated to ``chars`` characters."""
    digest = blake3.blake3(data).hexdigest()
    return digest if chars is None else digest[:chars]


def digest_of(value: Any, *, domain: str) -> str:
    """blake3 of the canonical JSON of ``value`` (``DIGEST_HEX_CHARS`` hex), tagged by ``domain``.

    The domain tag keeps digests of different kinds of things from ever being equal by accident.
    """
    return blake3_hex(domain.encode("ascii") + b"\0" + canonical_json(value), DIGEST_HEX_CHARS)


def abbrev(digest: str | None, chars: int = 12) -> str:
    """A digest shortened for messages: ``'3fa1c02b9e77…'``."""
    if digest is None:
        return "unset"
    return digest if len(digest) <= chars else digest[:chars] + "…"
