"""Links between replicas and the KV store: named presets and user-measured rates.

All rates are stored in bits per second because that is how links are sold (2.5GbE, Thunderbolt 5
at 80 Gb/s). Preset rates are the raw line rate, an upper bound on throughput: real transfers lose
some of it to framing, TCP, serialization and storage, so times computed from presets are a best
case. Pass a measured rate (``3.2GB/s``) or an efficiency factor below 1.0 to be realistic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixshare.plan._errors import PlanError


@dataclass(frozen=True)
class Link:
    """A named link with a rate in bits per second."""

    name: str
    bits_per_s: float
    description: str = ""

    def __post_init__(self) -> None:
        if not self.bits_per_s > 0:
            raise PlanError(f"link {self.name!r}: rate must be positive, got {self.bits_per_s!r} bit/s")

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8

    def seconds_for(self, nbytes: int, *, efficiency: float = 1.0, sharers: int = 1) -> float:
        """Seconds to move ``nbytes`` when ``sharers`` transfers split this link evenly.

        ``bytes / (bits_per_s * efficiency / 8)`` scaled by ``sharers``: fair sharing is the
        optimistic case for concurrent loads, which matches this module's "upper bound on speed" stance.
        """
        return nbytes * sharers / (self.bytes_per_s * efficiency)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "bits_per_s": self.bits_per_s,
            "bytes_per_s": self.bytes_per_s,
        }


# Raw line rates. Keys are the canonical names shown in tables.
LINK_PRESETS: Mapping[str, Link] = {
    link.name: link
    for link in (
        Link("2.5GbE", 2.5e9, "2.5 Gigabit Ethernet"),
        Link("10GbE", 10e9, "10 Gigabit Ethernet"),
        Link("25GbE", 25e9, "25 Gigabit Ethernet"),
        Link("100GbE", 100e9, "100 Gigabit Ethernet"),
        Link("200GbE", 200e9, "200 Gigabit Ethernet"),
        Link("TB4", 40e9, "Thunderbolt 4 (40 Gb/s)"),
        Link("TB5", 80e9, "Thunderbolt 5 (80 Gb/s)"),
    )
}


def _preset_key(text: str) -> str:
    return re.sub(r"[\s_-]", "", text.lower())


_PRESET_ALIASES: Mapping[str, str] = {
    **{_preset_key(name): name for name in LINK_PRESETS},
    "thunderbolt4": "TB4",
    "thunderbolt5": "TB5",
    "2.5gbit": "2.5GbE",
    "10gbit": "10GbE",
    "25gbit": "25GbE",
    "100gbit": "100GbE",
    "200gbit": "200GbE",
}

# "3.2GB/s", "800 MB/s", "25Gb/s", "25Gbps", "25 Gbit/s", "1.5GiB/s". Upper-case B is bytes and
# lower-case b is bits, the usual convention; "bit"/"byte" spelled out are unambiguous.
_RATE = re.compile(
    r"""^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*
        (?P<prefix>[kKmMgGtT]?)(?P<binary>i?)
        (?P<unit>bits?|bytes?|B|b)
        \s*(?:/\s*s(?:ec)?|ps)\s*$""",
    re.VERBOSE,
)
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def _bad_link(text: str) -> PlanError:
    return PlanError(
        f"bad link {text!r}: use a preset ({', '.join(LINK_PRESETS)}) or a measured rate "
        "such as 3.2GB/s (bytes) or 25Gb/s (bits)"
    )


def parse_link(spec: str | Link) -> Link:
    """A :class:`Link` from a preset name (``10GbE``, ``TB5``, ``thunderbolt 4``) or a rate string.

    Rates follow the usual convention: ``GB/s``/``GBps`` are gigabytes per second (e.g. a measured
    copy speed), ``Gb/s``/``Gbps``/``Gbit/s`` gigabits (e.g. an iperf3 result). ``Gi`` prefixes are
    binary. The canonical name (``3.2GB/s``) is kept so tables show what the user typed.
    """
    if isinstance(spec, Link):
        return spec
    text = str(spec)
    preset = _PRESET_ALIASES.get(_preset_key(text))
    if preset is not None:
        return LINK_PRESETS[preset]
    match = _RATE.match(text)
    if match is None:
        raise _bad_link(text)
    number = float(match["num"])
    prefix = match["prefix"]
    binary = match["binary"]
    unit = match["unit"]
    if binary and not prefix:
        raise _bad_link(text)
    is_bytes = unit == "B" or unit.startswith("byte")
    scale = (1024 if binary else 1000) ** _PREFIX[prefix.lower()]
    bits = number * scale * (8 if is_bytes else 1)
    if not bits > 0:
        raise PlanError(f"bad link {text!r}: rate must be positive")
    prefix_shown = prefix.upper() if prefix.lower() != "k" else "k"
    name = f"{number:g}{prefix_shown}{binary}{'B' if is_bytes else 'b'}/s"
    return Link(name, bits, "measured rate" if is_bytes else "measured rate (bits)")


def link_from_gbps(gbps: float) -> Link:
    """A link of ``gbps`` gigabits per second (what iperf3 and NIC specs report)."""
    if not gbps > 0:
        raise PlanError(f"bad link rate {gbps!r} Gb/s: must be positive")
    return Link(f"{gbps:g}Gb/s", gbps * 1e9, "measured rate (bits)")
