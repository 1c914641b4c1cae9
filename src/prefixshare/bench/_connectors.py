"""P5 as the engine sees it: the same warm requests through prefixshare's connector and through LMCache's plain
``LMCacheMPConnector``, on one MP server and one store, interleaved.

Two replicas stay up side by side (:class:`~prefixshare.bench._procs.ReplicaSession`; one request runs at a time,
the other replica idles): **O**, prefixshare's connector with its hooks timed (``hook_timings``), and **L**,
LMCache's own connector with the same server settings. Per length, each first computes two documents of its
own, which its connector stores through the server (L1 and the store: each under its connector's keys, LMCache
keying by the model's name), then the pairs alternate which replica goes first; every request empties the
engine's own prefix cache first, so each is a load from the server's L1 (the shortest warm request there is:
the largest share for a fixed overhead), and each replica sleeps briefly after its request so that its
background threads (prefixshare's stats writer) do not run into the other's. The difference of each pair is
everything prefixshare's connector adds — its calls, its port checks, its hooks — and the hook timings split it.

(Both replicas store their own copies on purpose: chunks another server wrote reach this server's L1 by a
prefetch from the store, chunks it stored itself stay in L1 — a different path, which would be measured instead
of the connector.)
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from prefixshare.bench._procs import ReplicaSession


def run_connector_pairs(bench: Any, warmup: list[int], docs: dict[int, list[list[int]]]) -> dict[str, Any]:
    """Replicas O and L on one server (the bench's store); returns each request's step result by tag and the
    replicas' final results. ``bench``: the :class:`~prefixshare.bench._run.Bench` (its settings and plumbing);
    ``docs``: per length, at least two documents nobody has stored yet."""
    s = bench.s
    policy = bench._policy()
    env = bench.replica_env()
    workdir = bench.work / "replicas"
    steps: dict[str, dict[str, Any]] = {}
    bench.log(f"P5: prefixshare's connector vs LMCache's, {s.p5_pairs} interleaved pairs per length ...")
    with bench._server(policy), \
            ReplicaSession(workdir, "O", bench.replica_spec("O", policy, log_level="WARNING", hook_timings=True),
                           env=env, timeout_s=1800) as ours, \
            ReplicaSession(workdir, "L", bench.replica_spec("L", policy, log_level="WARNING", connector="lmcache",
                                                            instance="lmcache-plain"), env=env, timeout_s=1800) as plain:
        for replica in (ours, plain):
            replica.run([{"op": "generate", "ids": warmup, "tag": "warmup", "stats": False}])
        for n in s.lengths:
            primed = docs[n][:2]
            for j, ids in enumerate(primed):
                for name, replica in (("O", ours), ("L", plain)):
                    [out, _] = replica.run([_request(ids, f"store:{name}:{n}:{j}"), _PAUSE])
                    steps[out["tag"]] = out
            for k in range(s.p5_pairs):
                ids = primed[k % len(primed)]
                order = [("O", ours), ("L", plain)] if k % 2 == 0 else [("L", plain), ("O", ours)]
                for name, replica in order:
                    [out, _] = replica.run([_request(ids, f"{name}:{n}:{k}"), _PAUSE])
                    steps[out["tag"]] = out
    return {"steps": steps, "O": _slim(ours.result), "L": _slim(plain.result)}


#: after each request: the replica's background threads finish (its stats writer flushes within 50 ms)
_PAUSE = {"op": "sleep", "seconds": 0.1}


def _request(ids: list[int], tag: str) -> dict[str, Any]:
    return {"op": "generate", "ids": ids, "tag": tag, "reset_local": True, "stats": False}


def _slim(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"engine_s": result.get("engine_s"), "wall_s": result.get("wall_s"),
            "stats": {k: v for k, v in (result.get("stats") or {}).items() if k in (
                "requests", "lookups", "hits", "tokens_loaded", "tokens_stored", "fallbacks")}}


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the order statistics ``(j, n+1-j)`` with the
    largest ``j`` whose binomial tail P(Bin(n, 1/2) < j) stays within ``(1 - level) / 2``."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    tail, j, cumulative = (1 - level) / 2, 0, 0.0
    while j < n // 2:
        cumulative += math.comb(n, j) / 2 ** n
        if cumulative > tail:
            break
        j += 1
    j = max(j, 1)
    return (xs[j - 1], xs[n - j])


def connector_rows(pairs: dict[str, Any], lengths: list[int], p5_pairs: int, chunk: int) -> dict[str, Any]:
    """Per length: both connectors' warm TTFTs, the paired differences (median, its 95 % interval, % of LMCache's
    warm TTFT), the pairs where either replica did not load the prompt (left out, counted), and per hook the
    µs prefixshare spent in it per request (median)."""
    from prefixshare.bench._micro import summary

    steps = pairs["steps"]
    rows: dict[str, Any] = {}
    for n in lengths:
        ours, plain, diffs, ratios, hooks = [], [], [], [], {}
        not_loaded = 0
        for k in range(p5_pairs):
            o, lc = steps.get(f"O:{n}:{k}"), steps.get(f"L:{n}:{k}")
            if o is None or lc is None:
                continue
            if min(o["num_cached_tokens"], lc["num_cached_tokens"]) < n // chunk * chunk or not (
                    o.get("reset") and lc.get("reset")):
                not_loaded += 1  # a recompute, or a hit in the engine's own prefix cache: not a load
                continue
            ours.append(o["seconds"])
            plain.append(lc["seconds"])
            diffs.append(o["seconds"] - lc["seconds"])
            ratios.append(o["seconds"] / lc["seconds"])
            for hook, t in (o.get("hooks") or {}).items():
                hooks.setdefault(hook, {"us": [], "calls": []})
                hooks[hook]["us"].append(t["us"])
                hooks[hook]["calls"].append(t["calls"])
        if not diffs:
            rows[str(n)] = {"tokens": n, "pairs": 0, "pairs_not_loaded": not_loaded}
            continue
        low, high = median_ci(diffs)
        base = statistics.median(plain)
        per_hook = {h: {"us_median": statistics.median(v["us"]), "calls_median": statistics.median(v["calls"])}
                    for h, v in sorted(hooks.items())}
        rows[str(n)] = {
            "tokens": n, "pairs": len(diffs), "pairs_not_loaded": not_loaded,
            "ours_ttft_s": summary(ours, keep=True), "lmcache_ttft_s": summary(plain, keep=True),
            "added_s": statistics.median(diffs), "added_ci95_s": [low, high], "added_values_s": diffs,
            "ratio_median": statistics.median(ratios),
            "added_pct_of_warm_ttft": statistics.median(diffs) / base * 100,
            "added_pct_ci95": [low / base * 100, high / base * 100],
            "hooks_us_per_request": per_hook,
            "hooks_us_total": sum(v["us_median"] for v in per_hook.values()),
        }
    return rows
