"""Whose time is a miss's extra time? The bench's P7 (cold TTFT with prefixshare / the raw engine's, two
processes) taken apart by what each replica has running beside the engine.

    python benchmarks/miss_path.py [--rounds 2] [--pause 1.0] [--out docs/benchmarks/miss-path.json]

Four replicas of the bench model, each a fresh process computing the same fresh prompts cold (1k and 4k
tokens; the first request of each replica is a warm-up and is dropped), run in the order R S B P, ``--rounds``
times, so drift between processes shows as a spread rather than a bias:

* **R**: vLLM without prefixshare, nothing else running (P7's denominator);
* **S**: the same raw engine while the node's MP server (fs tier, as the bench's replica A has it) runs idle
  beside it: what the server's presence costs on shared cores;
* **B**: prefixshare attached, every request told to leave the store alone (``prefixshare.load: never``,
  ``prefixshare.store: false``): what the connector's presence costs;
* **P**: prefixshare attached, every request a miss that is then stored (P7's numerator).

Then, per round, one more replica with prefixshare attached, **Q**, driven request by request: stored misses
and bypassed requests alternate, and after each the driver waits until the store's files are all on disk and
then ``--pause`` seconds more, so that nothing one request leaves running overlaps the next. Q answers two
questions the stream cannot tell apart:

* does a miss's **first token** wait for anything (its TTFT over the bypassed request's, same process, nothing
  running beside either)? and how long after its first token is its KV on the medium (*landed*)?
* what does a store **cost in CPU** (the engine process's and the server process's CPU seconds over the
  request and its pause, stored minus bypassed)? On a CPU engine those cores are the prefill's: in a stream
  that CPU is taken from whatever request runs next, which is the stream's P/R over B/R.

Also sampled: the idle server's CPU use (its utime + stime over 10 s, by its pid). Ratios are of medians
against R.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _meta import run_header

from prefixshare.bench._procs import cpu_seconds, prompt_ids

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (1024, 4096)
RUNS = {1024: 5, 4096: 3}


def _q_session(work: Path, rnd: int, spec: dict[str, Any], server: Any, store: Path, bypass: dict[str, Any],
               pause_s: float, seed: int, chunk: int) -> tuple[dict[str, Any], int]:
    """Q: stored misses and bypassed requests alternating in one replica, each followed by the store landing
    and a pause; per request its TTFT, when its chunks were on disk, and the engine's and server's CPU seconds
    over the request and its pause."""
    from prefixshare.bench._procs import ReplicaSession
    from prefixshare.bench._run import _wait_chunks

    rows: dict[str, Any] = {n: {"stored": [], "bypassed": []} for n in LENGTHS}
    with ReplicaSession(work / "replicas", f"Q{rnd}", {**spec, "interactive": True, "steps": []}) as q:
        q.run([{"op": "generate", "ids": prompt_ids(512, 999_500 + rnd)}])
        expected = 512 // chunk
        _wait_chunks(store, expected)
        time.sleep(pause_s)
        for n in LENGTHS:
            for i in range(RUNS[n]):
                pair = ["stored", "bypassed"] if i % 2 == 0 else ["bypassed", "stored"]
                for kind in pair:
                    seed += 1
                    step = {"op": "generate", "ids": prompt_ids(n + 1, seed)}
                    if kind == "bypassed":
                        step["params"] = bypass
                    engine0, server0, t0 = cpu_seconds(q.proc.pid), cpu_seconds(server.pid), time.perf_counter()
                    ttft = q.run([step])[0]["seconds"]
                    landed = None
                    if kind == "stored":
                        expected += n // chunk
                        waited = _wait_chunks(store, expected)
                        landed = None if waited is None else time.perf_counter() - t0 - ttft
                    time.sleep(pause_s)
                    rows[n][kind].append({"ttft_s": ttft, "landed_after_first_token_s": landed,
                                          "engine_cpu_s": cpu_seconds(q.proc.pid) - engine0,
                                          "server_cpu_s": cpu_seconds(server.pid) - server0,
                                          "window_s": time.perf_counter() - t0})
    return rows, seed


def _q_summary(q_rows: list[dict[str, Any]], idle_server: float) -> dict[str, Any]:
    """Q's rounds per length: first-token ratio (stored / bypassed), landing time, and the store's CPU."""
    out: dict[str, Any] = {}
    med = statistics.median
    for n in LENGTHS:
        rows = {k: [r for q in q_rows for r in q[n][k]] for k in ("stored", "bypassed")}
        ttft = {k: med(r["ttft_s"] for r in rows[k]) for k in rows}
        engine = {k: med(r["engine_cpu_s"] for r in rows[k]) for k in rows}
        server = {k: med(r["server_cpu_s"] for r in rows[k]) for k in rows}
        landed = [r["landed_after_first_token_s"] for r in rows["stored"]]
        out[str(n)] = {
            "ttft_s": ttft, "first_token_ratio": ttft["stored"] / ttft["bypassed"],
            "landed_after_first_token_s": med(x for x in landed if x is not None) if any(
                x is not None for x in landed) else None,
            "not_landed": sum(x is None for x in landed),
            "engine_cpu_s": engine, "server_cpu_s": server,
            "store_cpu_s": {"engine": engine["stored"] - engine["bypassed"],
                            "server": server["stored"] - server["bypassed"]},
            "store_cpu_over_prefill_cpu": ((engine["stored"] - engine["bypassed"]) + (
                server["stored"] - server["bypassed"])) / engine["bypassed"],
            "idle_server_cpu_s_per_window": idle_server * med(r["window_s"] for r in rows["bypassed"]),
            "rows": rows,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause", type=float, default=1.0, help="Q's pause after each request's store landed (s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "miss-path.json")
    args = parser.parse_args()
    from prefixshare.bench._procs import run_replica
    from prefixshare.model import ensure_model
    from prefixshare.policies import Policy
    from prefixshare.server import LMCacheServer

    work = Path(tempfile.mkdtemp(prefix="miss-path-", dir="/var/tmp"))
    model = ensure_model(Path.home() / ".cache" / "prefixshare" / "models" / "bench-bench", shape="bench")
    port = 20000 + os.getpid() % 10000
    chunk = 256
    policy = Policy.build(chunk_size=chunk, l1={"size_gb": 1.0},
                          server={"port": port, "http_port": port + 1, "start_timeout_s": 120},
                          load={"timeout_s": 600.0}, l2=[{"type": "fs", "base_path": str(work / "store"),
                                                           "create": True}])
    bypass = {"prefixshare.load": "never", "prefixshare.store": False}
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in LENGTHS} for k in "RSBP"}
    q_rows: list[dict[str, Any]] = []
    idle_cpu: list[float] = []
    seed = 0
    engine = {"max_model_len": 4096 + 256, "block_size": 128}
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "4", "PREFIXSHARE_CACHE_DIR": str(work / "cache")})
    try:
        for rnd in range(args.rounds):
            for kind in "RSBPQ":
                server = LMCacheServer(policy, log_path=work / "server.log") if kind != "R" else None
                try:
                    if server is not None:
                        shutil.rmtree(work / "store", ignore_errors=True)
                        server.start()
                        if kind == "S":
                            before = cpu_seconds(server.pid)
                            time.sleep(10)
                            idle_cpu.append((cpu_seconds(server.pid) - before) / 10)
                    spec = {"model": str(model), "policy": policy.to_dict() if kind in "BPQ" else None,
                            "instance": f"miss-{kind}-{rnd}", "log_level": "WARNING", "engine": engine}
                    if kind == "Q":
                        rows, seed = _q_session(work, rnd, spec, server, work / "store", bypass, args.pause, seed,
                                                chunk)
                        q_rows.append(rows)
                        sys.stdout.write(f"round {rnd} Q: " + ", ".join(
                            f"{n}: stored {statistics.median(r['ttft_s'] for r in rows[n]['stored']):.2f} s, "
                            f"bypassed {statistics.median(r['ttft_s'] for r in rows[n]['bypassed']):.2f} s"
                            for n in LENGTHS) + "\n")
                        continue
                    steps = [{"op": "generate", "ids": prompt_ids(512, 999_000 + rnd), "tag": "warmup"}]
                    for n in LENGTHS:
                        for i in range(RUNS[n]):
                            seed += 1
                            step = {"op": "generate", "ids": prompt_ids(n + 1, seed), "tag": f"{n}:{i}"}
                            if kind == "B":
                                step["params"] = bypass
                            steps.append(step)
                    result = run_replica(work / "replicas", f"{kind}{rnd}", {**spec, "steps": steps}, timeout_s=1800)
                finally:
                    if server is not None:
                        server.stop()
                for s in result["steps"]:
                    if s.get("tag", "warmup") != "warmup":
                        times[kind][int(s["tag"].split(":")[0])].append(s["seconds"])
                sys.stdout.write(f"round {rnd} {kind}: " + ", ".join(
                    f"{n}: {statistics.median(times[kind][n][-RUNS[n]:]):.2f} s" for n in LENGTHS) + "\n")
                sys.stdout.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {n: {k: {"median_s": statistics.median(times[k][n]), "values": times[k][n],
                    "over_raw": statistics.median(times[k][n]) / statistics.median(times["R"][n])} for k in "RSBP"}
            for n in LENGTHS}
    idle = statistics.median(idle_cpu)
    q = _q_summary(q_rows, idle)
    out = {**run_header("miss_path.py"), "rounds": args.rounds, "pause_s": args.pause, "rows": rows, "q": q,
           "idle_server_cpu_cores": idle_cpu}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for n in LENGTHS:
        qn = q[str(n)]
        sys.stdout.write(f"{n}: " + ", ".join(f"{k} {rows[n][k]['over_raw']:.3f}x" for k in "RSBP")
                         + f"; Q first token {qn['first_token_ratio']:.3f}x, landed "
                         f"{qn['landed_after_first_token_s']} s after it, store CPU engine "
                         f"{qn['store_cpu_s']['engine'] * 1e3:.0f} ms + server {qn['store_cpu_s']['server'] * 1e3:.0f}"
                         f" ms = {qn['store_cpu_over_prefill_cpu'] * 100:.1f} % of the prefill's CPU\n")
    sys.stdout.write(f"idle server: {idle_cpu} cores\n")


if __name__ == "__main__":
    main()
