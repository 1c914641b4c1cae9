"""Whose time is a miss's extra time? The bench's P7 (cold TTFT with prefixshare / the raw engine's, two
processes) taken apart by what each replica has running beside the engine.

    python benchmarks/miss_path.py [--rounds 2] [--out docs/benchmarks/miss-path.json]

Four replicas of the bench model, each a fresh process computing the same fresh prompts cold (1k and 4k
tokens; the first request of each replica is a warm-up and is dropped), run in the order R S B P, ``--rounds``
times, so drift between processes shows as a spread rather than a bias:

* **R**: vLLM without prefixshare, nothing else running (P7's denominator);
* **S**: the same raw engine while the node's MP server (fs tier, as the bench's replica A has it) runs idle
  beside it: what the server's presence costs on shared cores;
* **B**: prefixshare attached, every request told to leave the store alone (``prefixshare.load: never``,
  ``prefixshare.store: false``): what the connector's presence costs;
* **P**: prefixshare attached, every request a miss that is then stored (P7's numerator).

Also sampled: the idle server's CPU use (its utime + stime over 10 s). Ratios are of medians against R.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (1024, 4096)
RUNS = {1024: 5, 4096: 3}


def _ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]  # the bench model has 4,096 tokens


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pids(port: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "miss-path.json")
    args = parser.parse_args()
    from prefixshare.bench._procs import run_replica
    from prefixshare.model import ensure_model
    from prefixshare.policies import Policy
    from prefixshare.server import LMCacheServer

    work = Path(tempfile.mkdtemp(prefix="miss-path-", dir="/var/tmp"))
    model = ensure_model(Path.home() / ".cache" / "prefixshare" / "models" / "bench-bench", shape="bench")
    port = 20000 + os.getpid() % 10000
    policy = Policy.build(chunk_size=256, l1={"size_gb": 1.0},
                          server={"port": port, "http_port": port + 1, "start_timeout_s": 120},
                          load={"timeout_s": 600.0}, l2=[{"type": "fs", "base_path": str(work / "store"),
                                                           "create": True}])
    bypass = {"prefixshare.load": "never", "prefixshare.store": False}
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in LENGTHS} for k in "RSBP"}
    idle_cpu: list[float] = []
    seed = 0
    try:
        for rnd in range(args.rounds):
            for kind in "RSBP":
                steps = [{"op": "generate", "ids": _ids(512, 999_000 + rnd), "tag": "warmup"}]
                for n in LENGTHS:
                    for i in range(RUNS[n]):
                        seed += 1
                        step = {"op": "generate", "ids": _ids(n + 1, seed), "tag": f"{n}:{i}"}
                        if kind == "B":
                            step["params"] = bypass
                        steps.append(step)
                spec = {"model": str(model), "policy": policy.to_dict() if kind in "BP" else None,
                        "instance": f"miss-{kind}-{rnd}", "steps": steps, "log_level": "WARNING",
                        "engine": {"max_model_len": 4096 + 256, "block_size": 128}}
                env = {"VLLM_CPU_KVCACHE_SPACE": "4", "PREFIXSHARE_CACHE_DIR": str(work / "cache")}
                server = LMCacheServer(policy, log_path=work / "server.log") if kind != "R" else None
                try:
                    if server is not None:
                        server.start()
                        if kind == "S" and rnd == 0:
                            pids = _server_pids(port)
                            before = sum(_cpu_s(p) for p in pids)
                            time.sleep(10)
                            idle_cpu.append((sum(_cpu_s(p) for p in pids) - before) / 10)
                    result = run_replica(work / "replicas", f"{kind}{rnd}", spec, env=env, timeout_s=1800)
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
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"run_id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6], "commit": commit,
           "rounds": args.rounds, "rows": rows, "idle_server_cpu_cores": idle_cpu}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for n in LENGTHS:
        sys.stdout.write(f"{n}: " + ", ".join(f"{k} {rows[n][k]['over_raw']:.3f}x" for k in "RSBP") + "\n")
    sys.stdout.write(f"idle server: {idle_cpu} cores\n")


if __name__ == "__main__":
    main()
