"""What a miss costs on SGLang: the bench's P7 (cold TTFT with prefixshare attached / the raw engine's) for
SGLang's CPU engine, which the bench (vLLM only) does not cover.

    python benchmarks/sglang_miss_path.py [--rounds 2] [--pause 1.0] [--out docs/benchmarks/sglang-miss-path.json]

Per round, three fresh SGLang processes of the bench model compute fresh prompts cold (1k and 4k tokens,
``max_new_tokens=1``, so a request's time is its time to first token; the first request of each is a warm-up
and is dropped), in an order that alternates between rounds:

* **R**: SGLang without prefixshare (P7's denominator);
* **L**: SGLang with LMCache's own integration (``enable_lmcache``, LMCache's tree cache, the same MP server
  settings and store), every request a miss that LMCache stores: whose cost a miss's cost is;
* **Q**: SGLang with prefixshare attached (fs tier, integrity on, an MP server beside it), stored misses and
  bypassed requests (``load=never``, ``store=False``: no lookup, no store) alternating, which one goes first
  alternating too. *stored / bypassed* is what a miss's lookup and store add in the same process; *stored / R*
  is the goal's ratio, across processes.

Every request waits ``--pause`` seconds first, so that what the previous request left running (a store's copy
into the server, its write to the medium) has ended: this measures what a miss's first token waits for, not
what its store takes from the next request. The MP server's CPU seconds over L's and Q's runs are recorded
(an engine registered with it keeps it busier than an idle one). The run checks that Q's stores happened (the store holds one chunk
file per stored chunk) and that R and Q answered every prompt with the same token.

SGLang's CPU engine needs the test-only ``sgl_kernel`` stand-in (tests/shims; see tests/e2e/common.py), so this
script drives the test helper ``tests/helpers/sglang_replica.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
sys.path.insert(0, str(ROOT / "tests"))
LENGTHS = (1024, 4096)
PAIRS = {1024: 4, 4096: 2}
CHUNK = 256


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4000) for _ in range(n)]  # the bench model has 4,096 tokens


def _requests(kind: str, rnd: int, pause_s: float) -> list[dict[str, Any]]:
    """The round's requests for ``kind``: the same prompts for R and Q (seeded by round), tagged."""
    out: list[dict[str, Any]] = [{"prompt_token_ids": _ids(512, 900_000 + rnd), "max_tokens": 1, "tag": "warmup"}]
    seed = 1000 * rnd
    for n in LENGTHS:
        for i in range(PAIRS[n]):
            order = ("stored", "bypassed") if (i + rnd) % 2 == 0 else ("bypassed", "stored")
            for how in order:
                seed += 1
                req: dict[str, Any] = {"prompt_token_ids": _ids(n + 1, seed), "max_tokens": 1,
                                       "pause_before_s": pause_s, "tag": f"{n}:{how}"}
                if kind == "Q" and how == "bypassed":
                    req.update(load="never", store=False)
                out.append(req)
    return out


def _chunk_files(store: Path) -> int:
    return sum(1 for p in store.rglob("*") if p.is_file() and not p.name.endswith((".tmp", ".json", ".corrupt"))
               and not p.name.startswith("."))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_round(work: Path, rnd: int, model: Path, policy: Any, pause_s: float) -> dict[str, Any]:
    from e2e.common import run_replica

    from prefixshare.server import LMCacheServer

    out: dict[str, Any] = {}
    from prefixshare.adapters.sglang import write_lmcache_config

    for kind in ("RLQ" if rnd % 2 == 0 else "QLR"):
        reqs = _requests(kind, rnd, pause_s)
        tags = [r.pop("tag") for r in reqs]
        if kind == "R":
            result = run_replica(work, f"R{rnd}", model, None, reqs, engine_type="sglang", timeout=1800)
        elif kind == "L":
            shutil.rmtree(Path(policy.l2[0].base_path), ignore_errors=True)
            engine = {"enable_lmcache": True, "lmcache_config_file": str(write_lmcache_config(policy, f"L{rnd}"))}
            with LMCacheServer(policy, log_path=work / f"serverL{rnd}.log") as server:
                cpu0, t0 = _cpu_s(server.pid), time.monotonic()
                result = run_replica(work, f"L{rnd}", model, None, reqs, engine_type="sglang", timeout=1800,
                                     engine=engine)
                out["server_cores_L"] = (_cpu_s(server.pid) - cpu0) / (time.monotonic() - t0)
        else:
            shutil.rmtree(Path(policy.l2[0].base_path), ignore_errors=True)
            with LMCacheServer(policy, log_path=work / f"server{rnd}.log") as server:
                cpu0, t0 = _cpu_s(server.pid), time.monotonic()
                result = run_replica(work, f"Q{rnd}", model, policy, reqs, engine_type="sglang", timeout=1800)
                out["server_cores_Q"] = (_cpu_s(server.pid) - cpu0) / (time.monotonic() - t0)
                expected = sum(len(r["prompt_token_ids"]) // CHUNK for r, t in zip(reqs, tags, strict=True)
                               if "bypassed" not in t)
                deadline = time.monotonic() + 60
                while _chunk_files(Path(policy.l2[0].base_path)) < expected and time.monotonic() < deadline:
                    time.sleep(0.1)
                out["chunks_expected"], out["chunks_on_medium"] = expected, _chunk_files(Path(policy.l2[0].base_path))
                out["q_stats"] = {k: result["stats"].get(k) for k in ("requests", "tokens_loaded", "tokens_stored")}
        out[kind] = [{"tag": t, "seconds": r["seconds"], "token": r["token_ids"][0],
                      "storage_tokens": r["storage_tokens"]} for t, r in zip(tags, result["results"], strict=True)]
        sys.stdout.write(f"round {rnd} {kind}: done\n")
        sys.stdout.flush()
    return out


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for n in LENGTHS:
        r = [x["seconds"] for rd in rounds for x in rd["R"] if x["tag"].startswith(f"{n}:")]
        q = {how: [x["seconds"] for rd in rounds for x in rd["Q"] if x["tag"] == f"{n}:{how}"]
             for how in ("stored", "bypassed")}
        pairs = [s / b for rd in rounds for s, b in zip(
            [x["seconds"] for x in rd["Q"] if x["tag"] == f"{n}:stored"],
            [x["seconds"] for x in rd["Q"] if x["tag"] == f"{n}:bypassed"], strict=True)]
        lm = [x["seconds"] for rd in rounds for x in rd["L"] if x["tag"].startswith(f"{n}:")]
        out[str(n)] = {
            "raw_s": {"median": med(r), "values": r},
            "lmcache_s": {"median": med(lm), "values": lm},
            "lmcache_over_raw": med(lm) / med(r),
            "stored_s": {"median": med(q["stored"]), "values": q["stored"]},
            "bypassed_s": {"median": med(q["bypassed"]), "values": q["bypassed"]},
            "stored_over_raw": med(q["stored"]) / med(r),
            "bypassed_over_raw": med(q["bypassed"]) / med(r),
            "stored_over_bypassed_pairs": med(pairs),
            "added_s": med(q["stored"]) - med(q["bypassed"]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause", type=float, default=1.0, help="sleep before each request (s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "sglang-miss-path.json")
    args = parser.parse_args()
    from prefixshare.model import ensure_model
    from prefixshare.policies import Policy

    work = Path(tempfile.mkdtemp(prefix="sglang-miss-", dir="/var/tmp"))
    model = ensure_model(Path.home() / ".cache" / "prefixshare" / "models" / "bench-bench", shape="bench")
    port = 20000 + os.getpid() % 10000
    policy = Policy.build(chunk_size=CHUNK, l1={"size_gb": 1.0},
                          server={"port": port, "http_port": port + 1, "start_timeout_s": 120},
                          load={"timeout_s": 600.0}, l2=[{"type": "fs", "base_path": str(work / "store"),
                                                           "create": True}])
    os.environ["PREFIXSHARE_CACHE_DIR"] = str(work / "cache")
    started = time.monotonic()
    try:
        rounds = [_run_round(work, rnd, model, policy, args.pause) for rnd in range(args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mismatched = [(i, k, a["tag"]) for i, rd in enumerate(rounds) for k in "LQ"
                  for a, b in zip(rd["R"], rd[k], strict=True) if a["token"] != b["token"]]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    result = {
        "run_id": f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}", "commit": commit,
        "dirty": dirty, "command": " ".join(["python", "benchmarks/sglang_miss_path.py", *sys.argv[1:]]),
        "cpus": len(os.sched_getaffinity(0)), "rounds": args.rounds, "pause_s": args.pause, "pairs": PAIRS,
        "wall_s": round(time.monotonic() - started, 1),
        "stores_landed": all(rd["chunks_on_medium"] >= rd["chunks_expected"] for rd in rounds),
        "first_tokens_differ": mismatched,
        "server_cores": {k: statistics.median(rd[f"server_cores_{k}"] for rd in rounds) for k in "LQ"},
        "per_length": _summary(rounds), "rounds_raw": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "rounds_raw"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
