"""Which threads run during a cold request, with prefixshare attached (A) and without (R), and in the MP server.

    python benchmarks/threads.py [--lengths 1024,4096] [--runs 3] [--idle 10] [--out docs/benchmarks/threads.json]

The bench's P7 (a miss's TTFT with prefixshare over the raw engine's) is mostly a gap between two processes, not
prefixshare's work on a request (``benchmarks/miss_path.py``: the server idling beside the raw engine costs about
as much as attaching prefixshare). On a 2-core host every wakeup of another thread can preempt one of the
engine's OpenMP threads, and the whole team waits for it. This counts, per thread, CPU seconds and voluntary /
involuntary context switches over each cold request (replica A: prefixshare's connector, a miss that is stored;
replica R: vLLM alone; alternating, the same lengths, fresh prompts), from ``/proc/<pid>/task``, named by the
replica itself (Python thread names; the kernel's name for threads Python did not start), and the server's
threads over the same windows and over ``--idle`` seconds of nothing (the server names its kernel threads after
its Python threads: :func:`prefixshare.server.plugins.main.name_native_threads`).

Medians per request; *involuntary* switches of a replica's compute threads are the preemptions the prefill pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _meta import run_header


def _delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per thread name (threads of one name summed): CPU seconds and context switches between two readings."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"threads": 0, "cpu_s": 0.0, "voluntary": 0,
                                                             "involuntary": 0})
    for tid, now in after.items():
        was = before.get(tid, {"cpu_s": 0.0, "voluntary": 0, "involuntary": 0})
        row = out[now["name"]]
        row["threads"] += 1
        for key in ("cpu_s", "voluntary", "involuntary"):
            row[key] += now[key] - was[key]
    return {name: row for name, row in out.items() if row["cpu_s"] or row["voluntary"] or row["involuntary"]}


def _medians(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    names = sorted({name for row in rows for name in row})
    zero = {"threads": 0, "cpu_s": 0.0, "voluntary": 0, "involuntary": 0}
    out = {}
    for name in names:
        vals = [row.get(name, zero) for row in rows]
        out[name] = {key: round(statistics.median(v[key] for v in vals), 3) for key in zero}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["involuntary"]))


def _totals(per_name: dict[str, dict[str, float]]) -> dict[str, float]:
    return {key: round(sum(row[key] for row in per_name.values()), 3) for key in ("cpu_s", "voluntary", "involuntary")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds the idle server is watched")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from prefixshare.bench._procs import ReplicaSession
    from prefixshare.bench._replica import thread_counters
    from prefixshare.bench._run import Bench, Settings, _ids

    lengths = [int(x) for x in args.lengths.split(",")]
    s = Settings.for_run(False, lengths=lengths, p5_pairs=2)
    bench = Bench(s, log=lambda m: sys.stderr.write(m + "\n"))
    bench._setup()
    policy = bench._policy()
    rows: dict[str, dict[str, list[Any]]] = {str(n): {"A": [], "R": [], "server_during_A": [], "ttft_A": [],
                                                      "ttft_R": []} for n in lengths}
    with bench._server(policy) as server, \
            ReplicaSession(bench.work / "replicas", "A", bench.replica_spec("A", policy, log_level="WARNING"),
                           env=bench.replica_env()) as a, \
            ReplicaSession(bench.work / "replicas", "R", bench.replica_spec("R", None, log_level="WARNING"),
                           env=bench.replica_env()) as r:
        warmup = _ids("warmup", s.warmup_tokens, 0, s.seed)
        for rep in (a, r):
            rep.run([{"op": "generate", "ids": warmup, "tag": "w", "stats": False}])
        time.sleep(2.0)
        s0 = thread_counters(server.pid)
        time.sleep(args.idle)
        idle = _delta(s0, thread_counters(server.pid))
        for n in lengths:
            for i in range(args.runs):
                for name, rep in (("A", a), ("R", r)) if i % 2 == 0 else (("R", r), ("A", a)):
                    srv0 = thread_counters(server.pid)
                    steps = rep.run([{"op": "threads"},
                                     {"op": "generate", "ids": _ids("thr", n + 1, i, s.seed), "tag": f"{name}{n}:{i}",
                                      "stats": False},
                                     {"op": "threads"}])
                    rows[str(n)][name].append(_delta(steps[0]["threads"], steps[2]["threads"]))
                    rows[str(n)][f"ttft_{name}"].append(steps[1]["seconds"])
                    if name == "A":
                        rows[str(n)]["server_during_A"].append(_delta(srv0, thread_counters(server.pid)))
                    time.sleep(1.0)  # the store of A's miss lands before the next request
    result: dict[str, Any] = {
        **run_header("threads.py", argv),
        "runs": args.runs, "idle_s": args.idle,
        "server_idle_per_s": {name: {k: v if k == "threads" else round(v / args.idle, 3) for k, v in row.items()}
                              for name, row in sorted(idle.items(), key=lambda kv: -kv[1]["voluntary"])},
        "lengths": {},
    }
    for n, by in rows.items():
        per = {key: _medians(by[key]) for key in ("A", "R", "server_during_A")}
        result["lengths"][n] = {"ttft_s": {"A": statistics.median(by["ttft_A"]), "R": statistics.median(by["ttft_R"])},
                                "totals": {key: _totals(v) for key, v in per.items()}, "threads": per}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for n, row in result["lengths"].items():
        sys.stdout.write(f"{n} tokens: TTFT A {row['ttft_s']['A']:.3f} s, R {row['ttft_s']['R']:.3f} s; "
                         f"totals {json.dumps(row['totals'])}\n")
    sys.stdout.write("server idle, per second: " + json.dumps(result["server_idle_per_s"])[:2000] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
