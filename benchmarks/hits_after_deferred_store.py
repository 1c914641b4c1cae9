"""P5's gap, isolated: a warm request's time with deferred stores, before and after the replica's first store.

    python benchmarks/hits_after_deferred_store.py [--tokens 8192] [--hits 6] [--out docs/benchmarks/defer-hits.json]

The full bench's P5 (prefixshare's connector against LMCache's, warm loads from the server's L1) grew with the
prompt (+7 ms at 1k to +39 ms at 8k in run 518ca328dead) while prefixshare's hooks stayed under 1 ms. With
``store.defer: false`` the gap is gone, so this script holds everything else fixed and varies only what the
replica's store thread has done. On the bench's model and one server:

* **P** (``store.defer: false``) computes the document once, so the server holds it in L1;
* **O** (``store.defer: true``, the default) loads it ``--hits`` times (each after emptying its own prefix
  cache) **before** it has ever stored anything, then computes one other prompt (a miss: its store runs on the
  store thread), then loads the document ``--hits`` times again;
* **N** (``store.defer: false``) does the same, as the control: its stores run inside the step.

Each row is one load's wall time (one generated token). A gap that opens only after O's first deferred store,
and not after N's synchronous one, is the deferral's. Results in JSON with run id and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from _meta import run_header

ROOT = Path(__file__).resolve().parent.parent


def _hits(replica: Any, doc: list[int], n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        [step, _] = replica.run([{"op": "generate", "ids": doc, "tag": f"{tag}{i}", "reset_local": True,
                                  "stats": False}, {"op": "sleep", "seconds": 0.1}])
        assert step["num_cached_tokens"] >= len(doc) - 1, step  # a load from the server, not a recompute
        out.append(round(step["seconds"], 4))
    return out


def run(tokens: int, hits: int) -> dict[str, Any]:
    from prefixshare.bench._procs import ReplicaSession
    from prefixshare.bench._run import Bench, Settings, _ids

    s = Settings.for_run(False, lengths=[tokens], p5_pairs=2)
    bench = Bench(s, log=lambda _: None)
    bench._setup()
    policy = bench._policy()

    def defer(on: bool) -> Any:
        return policy.model_copy(update={"store": policy.store.model_copy(update={"defer": on})})

    doc, other = _ids("p5", tokens + 1, 0, s.seed), _ids("defer-miss", 2048, 0, s.seed)
    spec = bench.replica_spec
    rows: dict[str, Any] = {}
    with bench._server(policy):
        with ReplicaSession(bench.work / "replicas", "P", spec("P", defer(False), log_level="WARNING"),
                            env=bench.replica_env(), timeout_s=900) as p:
            p.run([{"op": "generate", "ids": doc, "tag": "store", "stats": False}, {"op": "sleep", "seconds": 1.0}])
        for name, on in (("O", True), ("N", False)):
            with ReplicaSession(bench.work / "replicas", name, spec(name, defer(on), log_level="WARNING"),
                                env=bench.replica_env(), timeout_s=900) as r:
                _hits(r, doc, 1, "first")  # the process's first request (seconds of one-time setup): not counted
                before = _hits(r, doc, hits, "before")
                r.run([{"op": "generate", "ids": other, "tag": "miss", "stats": False}, {"op": "sleep", "seconds": 1.0}])
                after = _hits(r, doc, hits, "after")
            rows[name] = {"defer": on, "before_s": before, "after_s": after,
                          "before_median_s": statistics.median(before), "after_median_s": statistics.median(after),
                          "after_over_before": statistics.median(after) / statistics.median(before)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hits", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "defer-hits.json")
    args = parser.parse_args()
    rows = run(args.tokens, args.hits)
    out = {**run_header("hits_after_deferred_store.py"), "tokens": args.tokens, "hits": args.hits, "replicas": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name} (defer {row['defer']}): before {row['before_median_s'] * 1e3:.1f} ms, after a store "
              f"{row['after_median_s'] * 1e3:.1f} ms ({row['after_over_before']:.2f}x)")


if __name__ == "__main__":
    main()
