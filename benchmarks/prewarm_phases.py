"""P6 at chosen lengths, as ``prefixshare bench`` measures it, with warm()'s own timing of its steps.

    python benchmarks/prewarm_phases.py [--lengths 2k] [--runs 9] [--out docs/benchmarks/prewarm-phases.json]

Replica A (prefixshare attached, the bench's fs store and MP server) pre-warms a document with
:func:`prefixshare.warm.warm`; replica R (the raw engine, no prefixshare) then prefills the document's exact
tokens; pairs alternate. Per run: warm()'s wall time, the raw prefill's, and the report's ``phases`` (plan,
triage, prefill, verify, record). Medians per length, and the ratio warm / raw (P6's goal: at most 1.1).

What it tells apart: warm()'s bookkeeping (plan, triage, record), the engine's call with the copy of its KV into
the server (prefill, against R's raw prefill of the same tokens) and the wait until the store holds every chunk
(verify), and from the chunk files' modification times, when the store's write landed after the engine's call
returned (first and last file) and how long after the last one warm saw it. The bench's model, engine and
policy (``prefixshare.bench._run``); nothing is published by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _meta import run_header


def _pairs(bench: Any, n: int, runs: int) -> list[dict[str, float]]:
    """``runs`` pre-warms of fresh ``n``-token documents in A, each followed by R's raw prefill of its tokens."""
    from prefixshare.bench._procs import ReplicaSession
    from prefixshare.bench._run import _PAUSE_S, _ids

    s = bench.s
    policy, env = bench._policy(), bench.replica_env()
    warmup = _ids("warmup", s.warmup_tokens, 0, s.seed)
    rows: list[dict[str, float]] = []
    replicas = bench.work / "replicas"
    with bench._server(policy), \
            ReplicaSession(replicas, "A", bench.replica_spec("A", policy, interactive=True), env=env,
                           timeout_s=3600) as a, \
            ReplicaSession(replicas, "R", bench.replica_spec("R", None, interactive=True), env=env,
                           timeout_s=3600) as r:
        a.run([{"op": "generate", "ids": warmup, "tag": "warmup"}])
        r.run([{"op": "generate", "ids": warmup, "tag": "warmup"}])
        time.sleep(1.0)  # the warm-up's store lands
        for i in range(runs):
            sent = time.time()
            [warmed] = a.run([{"op": "warm", "doc_id": f"phases-{n}-{i}", "text": bench._text(n, 1000 + i),
                               "tag": f"prewarm:{n}:{i}"}])
            landing = _landing(bench.store, sent, time.time(), warmed["report"]["phases"])
            time.sleep(_PAUSE_S)
            [raw] = r.run([{"op": "generate", "ids": warmed["ids"], "tag": f"raw:{n}:{i}"}])
            time.sleep(_PAUSE_S)
            report = warmed["report"]
            assert report["totals"]["warmed"] == report["totals"]["verified"] == 1, report  # a real pre-warm
            rows.append({"warm_s": warmed["seconds"], "raw_prefill_s": raw["seconds"], **report["phases"], **landing})
    return rows


def _landing(store: Path, sent: float, back: float, phases: dict[str, float]) -> dict[str, float]:
    """When this warm's chunk files were written, in seconds after the engine's call returned (the files written
    while the step ran, by modification time; the call's end is when the step came back less warm's verify and
    record, so these read a few milliseconds early), and how long after the last one warm's scan saw it."""
    written = [p.stat().st_mtime for p in store.glob("*.data")]
    written = [t for t in written if sent <= t <= back]
    assert written, "no chunk file was written during the pre-warm"
    returned = back - phases["verify"] - phases["record"]
    last = max(written) - returned
    return {"first_file_s": min(written) - returned, "last_file_s": last, "seen_after_last_file_s": phases["verify"] - last}


def measure(lengths: list[int], runs: int) -> dict[str, Any]:
    from prefixshare.bench._run import Bench, Settings

    out: dict[str, Any] = {**run_header("prewarm_phases.py"), "runs": runs, "per_length": {}}
    for n in lengths:
        bench = Bench(Settings.for_run(False, lengths=[n], slow_lengths=[n], runs=max(runs, 5), docs=None),
                      log=lambda _: None)
        bench._setup()
        rows = _pairs(bench, n, runs)
        medians = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
        out["per_length"][str(n)] = {"median_s": medians,
                                     "warm_over_raw": round(medians["warm_s"] / medians["raw_prefill_s"], 3),
                                     "runs": [{k: round(v, 4) for k, v in r.items()} for r in rows]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2k", help="comma-separated prompt lengths, e.g. 1k,2k")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    from prefixshare.plan import parse_prompt_lengths

    result = measure(list(parse_prompt_lengths(args.lengths)), args.runs)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for n, row in result["per_length"].items():
        m = row["median_s"]
        steps = ", ".join(f"{k.removesuffix('_s')} {m[k] * 1e3:.0f} ms" for k in m
                          if k not in ("warm_s", "raw_prefill_s"))
        sys.stdout.write(f"{n} tokens: warm {m['warm_s']:.3f} s / raw prefill {m['raw_prefill_s']:.3f} s = "
                         f"{row['warm_over_raw']:.3f}x; {steps}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
