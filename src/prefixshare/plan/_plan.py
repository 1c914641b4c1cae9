"""The plan itself: KV size per prompt length, time to move it per link, and whether that beats prefill.

Sharing a prefix's KV only pays when loading it from a peer or store is faster than recomputing it.
Recompute costs ``tokens / prefill rate``; loading costs ``bytes / link rate`` plus any fixed
per-load latency. Both are linear in tokens, so the verdict mostly depends on the ratio of the
prefill rate to the link rate, and this module makes that ratio visible before anyone builds
anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from prefixshare.plan._errors import PlanError
from prefixshare.plan._link import Link, parse_link
from prefixshare.plan._shape import DTYPE_BYTES, ModelShape, kv_bytes_per_token, shape_from_config

Verdict = Literal["sharing beats prefill", "prefill is faster"]
SHARING_WINS: Final = "sharing beats prefill"
PREFILL_WINS: Final = "prefill is faster"

DEFAULT_PROMPT_LENGTHS: Final = (1024, 4096, 16384, 32768)
DEFAULT_LINKS: Final = ("2.5GbE", "10GbE", "25GbE", "100GbE")


@dataclass(frozen=True)
class Transfer:
    """Moving one row's KV over one link.

    ``transfer_s`` is the wire time alone; ``load_s`` adds the fixed per-load latency and is what
    the verdict compares with prefill. ``verdict`` is ``None`` when no prefill rate was given.
    """

    link: str
    transfer_s: float
    load_s: float
    verdict: Verdict | None

    @property
    def sharing_wins(self) -> bool | None:
        return None if self.verdict is None else self.verdict == SHARING_WINS

    def to_dict(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "transfer_s": self.transfer_s,
            "load_s": self.load_s,
            "verdict": self.verdict,
            "sharing_wins": self.sharing_wins,
        }


@dataclass(frozen=True)
class PlanRow:
    """One prompt length: its KV size, prefill time (if a rate was given) and one transfer per link."""

    tokens: int
    kv_bytes: int
    prefill_s: float | None
    transfers: tuple[Transfer, ...]

    def transfer(self, link: str) -> Transfer:
        """The transfer over ``link`` (its canonical name, e.g. ``"10GbE"`` or ``"3.2GB/s"``)."""
        for t in self.transfers:
            if t.link == link:
                return t
        raise KeyError(link)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "kv_bytes": self.kv_bytes,
            "prefill_s": self.prefill_s,
            "transfers": [t.to_dict() for t in self.transfers],
        }


@dataclass(frozen=True)
class Plan:
    """Result of :func:`plan`. ``to_dict()`` is the JSON the CLI prints with ``--json``."""

    shape: ModelShape
    kv_dtype: str
    bytes_per_element: int
    kv_bytes_per_token: int
    links: tuple[Link, ...]
    rows: tuple[PlanRow, ...]
    prefill_tokens_per_s: float | None
    per_load_latency_s: float
    efficiency: float
    concurrency: int
    notes: tuple[str, ...]

    @property
    def formula(self) -> str:
        """How ``kv_bytes_per_token`` was computed, so the number can be checked by hand."""
        s = self.shape
        dtype = f"{self.bytes_per_element} B ({self.kv_dtype})"
        if s.is_mla:
            body = f"{s.num_layers} layers x ({s.kv_lora_rank} latent + {s.qk_rope_head_dim} rope) x {dtype}"
        else:
            body = f"{s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} head dim x 2 (K,V) x {dtype}"
        return f"{body} = {self.kv_bytes_per_token:,} bytes/token"

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.to_dict(),
            "kv_dtype": self.kv_dtype,
            "bytes_per_element": self.bytes_per_element,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "formula": self.formula,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "per_load_latency_s": self.per_load_latency_s,
            "efficiency": self.efficiency,
            "concurrency": self.concurrency,
            "links": [link.to_dict() for link in self.links],
            "rows": [row.to_dict() for row in self.rows],
            "notes": list(self.notes),
        }


def _positive_number(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _prompt_lengths(values: Iterable[int]) -> tuple[int, ...]:
    lengths = tuple(values)
    if not lengths:
        raise PlanError("give at least one prompt length")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise PlanError(f"prompt length must be a positive integer, got {n!r}")
    return lengths


def parse_prompt_lengths(text: str) -> list[int]:
    """``"1024,4k,32K"`` -> ``[1024, 4096, 32768]``. ``k`` is 1024, as in "a 32k context"."""
    lengths: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        multiplier = 1024 if part[-1] in "kK" else 1
        digits = part[:-1] if multiplier > 1 else part
        if not digits.isdigit() or int(digits) <= 0:
            raise PlanError(f"bad prompt length {part!r}: use positive integers like 4096 or 4k")
        lengths.append(int(digits) * multiplier)
    if not lengths:
        raise PlanError(f"bad prompt lengths {text!r}: use a comma-separated list like 1024,4096")
    return lengths


def _links(links: Iterable[str | Link]) -> tuple[Link, ...]:
    """Parse the links, refusing none at all and any name given twice."""
    link_objs = tuple(parse_link(link) for link in links)
    if not link_objs:
        raise PlanError("give at least one link")
    names = [link.name for link in link_objs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise PlanError(f"link given twice: {', '.join(dupes)}")
    return link_objs


def _efficiency(efficiency: float) -> float:
    """The fraction of the line rate a transfer gets: in (0, 1]."""
    eff = _positive_number(efficiency, "efficiency")
    if eff > 1:
        raise PlanError(f"efficiency is a fraction of the line rate, at most 1.0, got {efficiency!r}")
    return eff


def _latency(per_load_latency_s: float) -> float:
    """The fixed per-load latency, in seconds (>= 0), as a float."""
    latency = per_load_latency_s
    if isinstance(latency, bool) or not isinstance(latency, int | float) or not math.isfinite(latency) or latency < 0:
        raise PlanError(f"per-load latency must be a number of seconds >= 0, got {per_load_latency_s!r}")
    return float(latency)


def _check_concurrency(concurrency: int) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise PlanError(f"concurrency must be an integer >= 1, got {concurrency!r}")


def _row(
    tokens: int,
    per_token: int,
    rate: float | None,
    links: tuple[Link, ...],
    *,
    efficiency: float,
    concurrency: int,
    latency: float,
) -> PlanRow:
    """One prompt length: its KV bytes, its prefill time at ``rate`` and its load time over each link."""
    nbytes = tokens * per_token
    prefill_s = None if rate is None else tokens / rate
    transfers = []
    for link in links:
        wire = link.seconds_for(nbytes, efficiency=efficiency, sharers=concurrency)
        load = wire + latency
        verdict: Verdict | None = None
        if prefill_s is not None:
            verdict = SHARING_WINS if load < prefill_s else PREFILL_WINS
        transfers.append(Transfer(link=link.name, transfer_s=wire, load_s=load, verdict=verdict))
    return PlanRow(tokens=tokens, kv_bytes=nbytes, prefill_s=prefill_s, transfers=tuple(transfers))


def _length_notes(model: ModelShape, lengths: tuple[int, ...]) -> list[str]:
    """A note naming the prompt lengths longer than the model's context, if any."""
    if model.max_position_embeddings is None:
        return []
    too_long = [n for n in lengths if n > model.max_position_embeddings]
    if not too_long:
        return []
    return [
        f"prompt lengths {', '.join(map(str, too_long))} exceed the model's "
        f"max_position_embeddings ({model.max_position_embeddings})"
    ]


def plan(
    shape: ModelShape | str | os.PathLike[str] | Mapping[str, Any],
    prompt_lengths: Iterable[int] = DEFAULT_PROMPT_LENGTHS,
    links: Iterable[str | Link] = DEFAULT_LINKS,
    prefill_tokens_per_s: float | None = None,
    kv_dtype: str = "auto",
    concurrency: int = 1,
    *,
    per_load_latency_s: float = 0.0,
    efficiency: float = 1.0,
) -> Plan:
    """KV bytes per prompt length, time to move them over each link, and a verdict against prefill.

    ``shape`` is a :class:`ModelShape` or anything :func:`shape_from_config` accepts.
    ``links`` are :class:`Link` objects or strings for :func:`parse_link`; times use the raw line
    rate scaled by ``efficiency`` (default 1.0, so the times are a best case). ``concurrency`` is
    how many loads share the link at once: each gets an even share of it, while prefill (per
    replica, on its own GPU) is unaffected. ``per_load_latency_s`` is a fixed cost added to every
    load (lookup, connection, first byte). With ``prefill_tokens_per_s`` each transfer gets a
    verdict: :data:`SHARING_WINS` when loading is strictly faster than recomputing, else
    :data:`PREFILL_WINS`; without it, verdicts are ``None``.
    """
    model = shape if isinstance(shape, ModelShape) else shape_from_config(shape)
    lengths = _prompt_lengths(prompt_lengths)
    link_objs = _links(links)
    rate = None if prefill_tokens_per_s is None else _positive_number(prefill_tokens_per_s, "prefill rate (tokens/s)")
    eff = _efficiency(efficiency)
    latency = _latency(per_load_latency_s)
    _check_concurrency(concurrency)

    dtype = model.resolve_kv_dtype(kv_dtype)
    per_token = kv_bytes_per_token(model, dtype)
    rows = [
        _row(tokens, per_token, rate, link_objs, efficiency=eff, concurrency=concurrency, latency=latency)
        for tokens in lengths
    ]
    notes = [*model.notes, *_length_notes(model, lengths)]

    return Plan(
        shape=model,
        kv_dtype=dtype,
        bytes_per_element=DTYPE_BYTES[dtype],
        kv_bytes_per_token=per_token,
        links=link_objs,
        rows=tuple(rows),
        prefill_tokens_per_s=rate,
        per_load_latency_s=latency,
        efficiency=eff,
        concurrency=concurrency,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------------
# Human formatting (used by the CLI table; decimal units match how link rates are quoted)
# --------------------------------------------------------------------------------------------------


def format_bytes(nbytes: int) -> str:
    """``603979776`` -> ``"0.60 GB (576 MiB)"``: decimal for comparing with link rates, binary for RAM."""
    if nbytes < 1000:
        return f"{nbytes} B"
    # A decimal unit is used from 0.1 of it up, so 603,979,776 bytes reads "0.60 GB" as people quote it.
    decimal_units = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))
    binary_units = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
    decimal = next((nbytes / f, u) for f, u in decimal_units if nbytes >= f * 0.1)
    binary = next((nbytes / f, u) for f, u in binary_units if nbytes >= f)
    return f"{_sig(decimal[0])} {decimal[1]} ({_sig(binary[0])} {binary[1]})"


def _sig(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_seconds(seconds: float) -> str:
    """Compact duration: ``"1.93 s"``, ``"48 ms"``, ``"120 µs"``."""
    if seconds >= 1:
        return f"{_sig(seconds)} s"
    if seconds >= 1e-3:
        return f"{_sig(seconds * 1e3)} ms"
    return f"{_sig(seconds * 1e6)} µs"
