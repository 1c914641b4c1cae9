"""Human durations (``"15m"``, ``"7d"``) and sizes (``"50GB"``, ``"512MiB"``), both ways.

Parsing is exact (``decimal``) so that ``"1.5GB"`` is exactly 1_500_000_000 bytes; formatting
(:func:`_exact_duration`, :func:`_exact_size`) only picks a unit that divides the value exactly, so a
formatted value always parses back to the very same number. Stdlib only: imported by config code.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"

#: Seconds per duration unit. Lowercase only: ``"1M"`` (months? minutes?) is rejected, not guessed.
_DURATION_UNITS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
    "w": Decimal(604800),
}
_DURATION_PART = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d|w)")
_DURATION_FULL = re.compile(rf"(?:\s*{_NUMBER}\s*(?:ms|s|m|h|d|w))+\s*")
_PLAIN_NUMBER = re.compile(rf"\s*{_NUMBER}\s*")

#: Bytes per size unit; matched case-insensitively (``"gb"`` is ``"GB"``, ``"gib"`` is ``"GiB"``).
_SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE_FULL = re.compile(rf"\s*({_NUMBER})\s*([A-Za-z]*)\s*")

_DURATION_HELP = (
    "expected seconds (e.g. 3600) or a number with a unit ms, s, m, h, d, w (e.g. '30s', '15m', '1h', '7d')"
)
_SIZE_HELP = (
    "expected bytes (e.g. 1073741824) or a number with a unit: KB, MB, GB, TB, PB (powers of 1000) "
    "or KiB, MiB, GiB, TiB, PiB (powers of 1024), e.g. '50GB', '512MiB'"
)


def parse_duration(value: str | int | float) -> float:
    """Return a duration in seconds.

    Accepts a non-negative number of seconds (``30``, ``1.5``) or a string: a plain number
    (``"30"``) or one or more ``<number><unit>`` parts with units ``ms``, ``s``, ``m``, ``h``, ``d``,
    ``w`` (``"30s"``, ``"15m"``, ``"1.5h"``, ``"7d"``, ``"1h30m"``). Raises :class:`ValueError` with
    the accepted forms otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"invalid duration {value!r} (a {type(value).__name__}): {_DURATION_HELP}")
    if not isinstance(value, str):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid duration {value!r}: must be a finite number >= 0; {_DURATION_HELP}")
        return float(value)
    if _PLAIN_NUMBER.fullmatch(value):
        return float(Decimal(value.strip()))
    if not _DURATION_FULL.fullmatch(value):
        raise ValueError(f"invalid duration {value!r}: {_DURATION_HELP}")
    total = sum((Decimal(num) * _DURATION_UNITS[unit] for num, unit in _DURATION_PART.findall(value)), Decimal(0))
    return float(total)


def parse_size(value: str | int | float) -> int:
    """Return a size in bytes.

    Accepts a non-negative integer number of bytes or a string ``<number>[unit]``: decimal units
    ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` (powers of 1000), binary units ``KiB``, ``MiB``, ``GiB``,
    ``TiB``, ``PiB`` (powers of 1024), or ``B``; case-insensitive. ``"1.5GB"`` is fine, a size that is
    not a whole number of bytes (``"1.0001KB"``) is not. Raises :class:`ValueError` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"invalid size {value!r} (a {type(value).__name__}): {_SIZE_HELP}")
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise ValueError(f"invalid size {value!r}: must be a whole number of bytes >= 0; {_SIZE_HELP}")
        return int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must be >= 0; {_SIZE_HELP}")
        return value
    match = _SIZE_FULL.fullmatch(value)
    if match is None:
        raise ValueError(f"invalid size {value!r}: {_SIZE_HELP}")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.lower() or "b")
    if factor is None:
        raise ValueError(f"invalid size {value!r}: unknown unit {unit!r}; {_SIZE_HELP}")
    try:
        total = Decimal(number) * factor
    except InvalidOperation:  # pragma: no cover - the regex only lets valid numbers through
        raise ValueError(f"invalid size {value!r}: {_SIZE_HELP}") from None
    if total != total.to_integral_value():
        raise ValueError(f"invalid size {value!r}: {total} is not a whole number of bytes")
    return int(total)


def _exact_duration(seconds: float) -> str | int | float:
    """The most readable form of ``seconds`` that :func:`parse_duration` maps back to the same float."""
    if not seconds.is_integer():
        return seconds
    whole = int(seconds)
    if whole == 0:
        return 0
    for unit in ("d", "h", "m"):
        per = int(_DURATION_UNITS[unit])
        if whole % per == 0:
            return f"{whole // per}{unit}"
    return f"{whole}s"


def _exact_size(size: int) -> str | int:
    """The shortest exact human form of ``size`` bytes (``"50GB"``, ``"512MiB"``), else the int."""
    best: str | int = size
    best_number = size
    for unit, factor in _SIZE_UNITS.items():
        if factor > 1 and size >= factor and size % factor == 0 and size // factor < best_number:
            best_number = size // factor
            best = f"{best_number}{_UNIT_SPELLING[unit]}"
    return best


_UNIT_SPELLING = {
    "b": "B",
    "kb": "KB",
    "mb": "MB",
    "gb": "GB",
    "tb": "TB",
    "pb": "PB",
    "kib": "KiB",
    "mib": "MiB",
    "gib": "GiB",
    "tib": "TiB",
    "pib": "PiB",
}
