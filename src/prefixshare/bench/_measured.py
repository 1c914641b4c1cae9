"""``prefixshare plan --measure``: the plan's link table with this node's measured tiers and prefill beside it.

The plan's arithmetic (:mod:`prefixshare.plan`) divides a prompt's KV bytes by a rated link. Here each L2 tier of
a policy is measured from this node, through the adapter its MP server would build (:func:`measure_tier`: a test
object of a few hundred MB, in chunks of the policy's chunk size for the model's KV bytes per token, stored, found
by a second adapter, loaded back, compared byte for byte, then deleted), and the engine's prefill cost comes from
what was measured on this node:

* ``--model DIR``: a short measured prefill of the raw engine (no prefixshare attached): a few distinct prompts at
  a few lengths, greedy, one output token each; their times are fitted to the cost model's
  ``a*n + b*n^2`` (:class:`prefixshare.runtime._cost.Fit`);
* else the cost model's persisted estimates (``<run_dir>/cost/<namespace>.json``, written by every attached
  connector): the newest one that holds prefill observations, named in the output;
* ``--prefill-rate`` overrides both with a flat rate.

A measured tier's load of ``n`` tokens is predicted as its lookup latency plus ``n x bytes/token`` at its measured
load rate (page cache evicted, for ``fs``: another node's read comes from the medium); the verdict per prompt length
compares that with the prefill cost, and the break-even prompt length is where they cross (prefill grows at least
linearly, a load linearly, so there is at most one crossing). The engine-side copy from the server into the KV
cache is not part of a tier's figure (the cost model's ``transfer`` estimate, where one was persisted, is shown
beside it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixshare._log import get_logger

log = get_logger("prefixshare.plan")

#: the size of the test object each tier stores and reads back, by default
DEFAULT_MEASURE_BYTES = 256 * 10**6
#: prompt lengths a measured prefill always times (capped by the model's context), the longest planned length is
#: added up to PREFILL_MAX_TOKENS (attention makes prefill superlinear: a fit over short prompts alone
#: extrapolates badly), and prompts per length (the fastest counts: the first prompt of a new length pays one-off
#: costs)
PREFILL_LENGTHS = (256, 1024)
PREFILL_MAX_TOKENS = 8192
PREFILL_PROMPTS = 2


def prefill_lengths(planned: list[int]) -> tuple[int, ...]:
    """The lengths a measured prefill times for a plan of ``planned`` prompt lengths."""
    longest = min(max(planned, default=PREFILL_LENGTHS[-1]), PREFILL_MAX_TOKENS)
    return tuple(sorted({*PREFILL_LENGTHS, longest}))


# --- the prefill cost ------------------------------------------------------------------------------------------


@dataclass
class PrefillCost:
    """``seconds(n) = a * n/1e3 + b * (n/1e3)^2`` for a cold prefill of ``n`` tokens, and where it came from."""

    a: float
    b: float
    source: str
    observations: int = 0

    def seconds(self, tokens: int) -> float:
        k = tokens / 1e3
        return self.a * k + self.b * k * k

    def tokens_per_s(self, tokens: int) -> float:
        s = self.seconds(tokens)
        return tokens / s if s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"a_s_per_ktok": self.a, "b_s_per_ktok2": self.b, "source": self.source,
                "observations": self.observations}


def flat_prefill(tokens_per_s: float) -> PrefillCost:
    return PrefillCost(a=1e3 / tokens_per_s, b=0.0, source=f"--prefill-rate {tokens_per_s:g} tokens/s")


def persisted_prefill(directory: Path | None = None) -> tuple[PrefillCost, dict[str, Any]] | None:
    """The newest persisted cost model with prefill observations (any namespace), with its transfer estimate."""
    from prefixshare._paths import run_dir
    from prefixshare.runtime import Fit

    directory = directory or run_dir() / "cost"
    best: tuple[float, Path, dict[str, Any]] | None = None
    for path in directory.glob("*.json") if directory.is_dir() else ():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not data.get("prefill", {}).get("n"):
            continue
        updated = float(data.get("updated_at") or path.stat().st_mtime)
        if best is None or updated > best[0]:
            best = (updated, path, data)
    if best is None:
        return None
    updated, path, data = best
    fit = Fit(2, ridge=(1e-9, 1e-6))
    fit.load(data["prefill"])
    if fit.w is None:
        return None
    age_h = (time.time() - updated) / 3600
    cost = PrefillCost(a=fit.w[0], b=fit.w[1], observations=fit.n,
                       source=f"the cost model's estimates for namespace {data.get('namespace', path.stem)} "
                              f"({fit.n} prefill steps, updated {age_h:.1f} h ago; {path})")
    extra: dict[str, Any] = {"path": str(path), "updated_at": updated}
    transfer = Fit(2)
    transfer.load(data.get("transfer", {}))
    if transfer.w is not None:
        # seconds ~ w0 * 1 + w1 * MB: the engine-side copy from the server into the KV cache
        extra["engine_copy"] = {"latency_s": transfer.w[0],
                                "mbps": (1 / transfer.w[1]) if transfer.w[1] > 0 else None, "n": transfer.n}
    return cost, extra


def measured_prefill(model: str, policy: Any, *, lengths: tuple[int, ...] = PREFILL_LENGTHS,
                     prompts: int = PREFILL_PROMPTS, dtype: str | None = None,
                     log_line: Callable[[str], None] | None = None) -> tuple[PrefillCost, dict[str, Any]]:
    """Time cold prefills of the raw engine (``vllm.LLM``, no connector) and fit the cost model's curve.

    Every prompt is distinct random token ids (the engine's prefix cache serves none of them); one warm-up
    prompt is not timed (first-call compilation)."""
    import random

    from prefixshare.runtime import Fit
    from prefixshare.warm import apply_engine_env, vllm_engine_kwargs

    apply_engine_env(engine="vllm")
    from vllm import LLM, SamplingParams

    kwargs = vllm_engine_kwargs(policy, model, dtype=dtype)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    max_len = int(llm.llm_engine.model_config.max_model_len)
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    usable = sorted({min(n, max_len - 2) for n in lengths if n > 0})
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(n: int) -> dict[str, Any]:
        return {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]}

    llm.generate([prompt(min(64, usable[0]))], params, use_tqdm=False)  # warm-up, untimed
    fit = Fit(2, ridge=(1e-9, 1e-6))
    fit.alpha = 0.0  # every observation weighs the same: this is one measurement, not a running estimate
    samples: list[dict[str, Any]] = []
    for n in usable:
        times = []
        for _ in range(prompts):
            t0 = time.perf_counter()
            llm.generate([prompt(n)], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            samples.append({"tokens": n, "seconds": round(times[-1], 4)})
        fit.observe((n / 1e3, (n / 1e3) ** 2), min(times))
        if log_line:
            log_line(f"prefill {n} tokens: {min(times):.3f} s (fastest of {prompts})")
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and callable(getattr(core, "shutdown", None)):
        core.shutdown()
    assert fit.w is not None
    cost = PrefillCost(a=fit.w[0], b=fit.w[1], observations=len(samples),
                       source=f"measured on this node: raw vLLM prefill of {model} ({len(samples)} prompts, "
                              f"{', '.join(map(str, usable))} tokens, the fastest of {prompts} per length)")
    return cost, {"samples": samples, "lengths": usable, "engine_start_s": round(start_s, 1)}


# --- the tiers -------------------------------------------------------------------------------------------------


@dataclass
class TierLink:
    """One tier as a link: its measured lookup latency and load rate from this node (or why it has none)."""

    name: str
    describe: str
    latency_s: float | None = None
    load_bytes_per_s: float | None = None
    store_bytes_per_s: float | None = None
    load_kind: str = "load"
    error: str | None = None
    fix: str | None = None
    figures: dict[str, Any] | None = None

    def load_s(self, nbytes: int) -> float | None:
        if self.latency_s is None or not self.load_bytes_per_s:
            return None
        return self.latency_s + nbytes / self.load_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "describe": self.describe, "latency_s": self.latency_s,
                "load_bytes_per_s": self.load_bytes_per_s, "load_gbit_per_s": (self.load_bytes_per_s or 0) * 8 / 1e9
                or None, "store_bytes_per_s": self.store_bytes_per_s, "load_kind": self.load_kind,
                "error": self.error, "fix": self.fix, "figures": self.figures}


def _fix(tier: Any, error: str) -> str:
    if error.startswith("unreachable"):
        if tier.type == "fs":
            return (f"mount or create {tier.base_path} (readable and writable by this user), or fix base_path in "
                    "the policy")
        return "start it, or fix its address in the policy; until then every request on this node recomputes"
    if "client" in error or "No module" in error or "ModuleNotFoundError" in error:
        return f"pip install 'prefixshare[{tier.requires_extra}]'" if tier.requires_extra else "install its client"
    return "run prefixshare doctor --policy P.yaml on this node, and prefixshare bench --tiers P.yaml for details"


def measure_tier_links(policy: Any, *, bytes_per_token: int, total_bytes: int = DEFAULT_MEASURE_BYTES,
                       reps: int = 3, log_line: Callable[[str], None] | None = None) -> list[TierLink]:
    """Each L2 tier of ``policy`` measured from this node: a test object of about ``total_bytes`` in chunks of
    the policy's chunk size (``bytes_per_token`` x ``policy.chunk_size``), ``reps`` times."""
    from prefixshare.bench._micro import adapter_env, environment
    from prefixshare.bench._tiers import TierBenchSettings, label, measure_tier
    from prefixshare.tiers import require_client

    chunk_bytes = bytes_per_token * policy.chunk_size
    chunks = max(1, min(256, round(total_bytes / chunk_bytes)))
    settings = TierBenchSettings(chunks=chunks, chunk_tokens=policy.chunk_size, reps=reps, raw=False,
                                 bytes_per_token=bytes_per_token)
    links = []
    with environment(adapter_env()):  # LMCache's loggers made while measuring stay at its quiet level
        for tier in policy.l2:
            name = label(tier)
            if log_line:
                log_line(f"measuring {name}: {reps} x {chunks} chunks of {chunk_bytes / 1e6:.1f} MB "
                         f"({chunks * chunk_bytes / 1e6:.0f} MB)")
            link = TierLink(name=name, describe=tier.describe())
            try:
                require_client(tier)
                entry = measure_tier(tier, settings)
            except Exception as exc:  # noqa: BLE001 - a tier that cannot be measured is named, the others measured
                entry = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in entry:
                link.error, link.fix = entry["error"], _fix(tier, entry["error"])
                log.warning("plan.tier_unmeasured", tier=name, error=link.error, fix=link.fix)
            else:
                evicted = entry.get("load_evicted_mbps")
                load = evicted or entry["load_mbps"]
                link.load_kind = "load, page cache evicted" if evicted else "load"
                link.load_bytes_per_s = load["median"] * 1e6
                link.store_bytes_per_s = entry["store_mbps"]["median"] * 1e6
                link.latency_s = entry["lookup_ms"]["median"] / 1e3
                link.figures = {k: entry[k] for k in ("store_mbps", "lookup_ms", "load_mbps", "load_evicted_mbps",
                                                      "medium", "adapter") if k in entry}
            links.append(link)
    return links


# --- the table -------------------------------------------------------------------------------------------------


def break_even_tokens(prefill: PrefillCost, latency_s: float, bytes_per_token: int,
                      bytes_per_s: float) -> int | None:
    """The shortest prompt whose load (``latency_s + n * bytes_per_token / bytes_per_s``) beats its prefill, or
    None when no prompt length does (prefill - load is convex and starts negative: one crossing at most)."""
    a, b = prefill.a / 1e3, prefill.b / 1e6  # seconds per token, per token^2
    c = bytes_per_token / bytes_per_s
    if b <= 0:
        return None if a <= c else math.ceil(latency_s / (a - c)) if latency_s > 0 else 1
    # b n^2 + (a - c) n - L = 0, the positive root
    n = (-(a - c) + math.sqrt((a - c) ** 2 + 4 * b * latency_s)) / (2 * b)
    return max(1, math.ceil(n))


def measured_plan(shape: Any, *, lengths: list[int], rated: list[Any], tiers: list[TierLink],
                  prefill: PrefillCost | None, kv_dtype: str = "auto", chunk_tokens: int = 1,
                  context: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan's rows for ``lengths`` with a column per rated link and per measured tier, a verdict for each,
    and each column's break-even prompt length, rounded up to whole chunks of ``chunk_tokens`` (the store holds
    nothing shorter) (JSON-ready)."""
    from prefixshare.plan import PREFILL_WINS, SHARING_WINS, plan

    base = plan(shape, prompt_lengths=lengths, links=rated, kv_dtype=kv_dtype)
    bpt = base.kv_bytes_per_token
    columns: list[dict[str, Any]] = []
    for link in base.links:
        columns.append({"name": link.name, "kind": "rated", "latency_s": 0.0, "bytes_per_s": link.bytes_per_s})
    for t in tiers:
        columns.append({"name": f"{t.name} (measured)", "kind": "measured", "latency_s": t.latency_s,
                        "bytes_per_s": t.load_bytes_per_s, "error": t.error, "fix": t.fix})
    for col in columns:
        if prefill is not None and col["bytes_per_s"]:
            n = break_even_tokens(prefill, col["latency_s"] or 0.0, bpt, col["bytes_per_s"])
            col["break_even_tokens"] = None if n is None else -(-n // chunk_tokens) * chunk_tokens
    rows = []
    for n in lengths:
        nbytes = n * bpt
        prefill_s = prefill.seconds(n) if prefill is not None else None
        cells = []
        for col in columns:
            load_s = (col["latency_s"] or 0.0) + nbytes / col["bytes_per_s"] if col["bytes_per_s"] else None
            verdict = None
            if load_s is not None and prefill_s is not None:
                verdict = SHARING_WINS if load_s < prefill_s else PREFILL_WINS
            cells.append({"link": col["name"], "load_s": load_s, "verdict": verdict})
        rows.append({"tokens": n, "kv_bytes": nbytes, "prefill_s": prefill_s, "cells": cells})
    return {"kind": "measured plan", "shape": base.shape.name, "kv_dtype": base.kv_dtype,
            "kv_bytes_per_token": bpt, "formula": base.formula, "chunk_tokens": chunk_tokens,
            "prefill": prefill.to_dict() if prefill is not None else None,
            "columns": columns, "tiers": [t.to_dict() for t in tiers], "rows": rows,
            "notes": [*base.notes], **(context or {})}
