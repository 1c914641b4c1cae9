"""What a miss costs on SGLang: the bench's P7 (cold TTFT with prefixshare attached / the raw engine's) for
SGLang's CPU engine, which the bench (vLLM only) does not cover.

    python benchmarks/sglang_miss_path.py [--steps 6] [--pause 1.0] [--one-at-a-time ROUNDS] [--out FILE]

Three SGLang replicas of the bench model are up side by side, and their requests alternate (which one goes
first rotates from step to step), so drift on a shared machine falls on all of them alike:

* **R**: SGLang without prefixshare (P7's denominator);
* **L**: SGLang with LMCache's own integration (``enable_lmcache``, LMCache's tree cache), every request a miss
  that LMCache stores: whose cost a miss's cost is;
* **Q**: SGLang with prefixshare attached (fs tier, integrity on), each step one stored miss and one bypassed
  request (``load=never``, ``store=False``: no lookup, no store). *stored / bypassed* is what a miss's lookup
  and store add in the same process; *stored / R* is the goal's ratio.

Every replica runs with SGLang's ``sleep_on_idle`` (without it an idle scheduler polls and takes a core from
the one computing). L and Q share one MP server (their keys differ: LMCache keys by model name, prefixshare by fingerprint). Each
step computes fresh prompts cold, ``max_new_tokens=1`` (a request's time is its time to first token): one
prompt for R, L and Q's stored miss (their first tokens must agree), another for Q's bypassed request. Every
request waits ``--pause`` seconds first, so what the previous request left running (a store's copy into the
server, its write to the medium) has ended: this measures what a miss's first token waits for, not what its
store takes from the next request. The run checks that the stores happened (one chunk file per stored chunk of
L and of Q, and Q's own count of tokens stored).

``--one-at-a-time ROUNDS``: the same calls, but R, L and Q run one after another (the order rotating between
rounds), each alone on the machine and with SGLang's default settings (an idle scheduler polls), which is how a
user runs one replica; drift between the processes then shows as spread. Output: docs/benchmarks/
sglang-miss-path.json (side by side) or sglang-miss-path-alone.json.

SGLang's CPU engine needs the test-only ``sgl_kernel`` stand-in (tests/shims; see tests/e2e/common.py), so this
script drives the test helper ``tests/helpers/sglang_replica.py`` in its interactive mode.
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
from pathlib import Path
from typing import Any

from _meta import run_header

from prefixshare.bench._procs import cpu_seconds, prompt_ids
from prefixshare.bench._run import _chunk_files, _wait_chunks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
LENGTHS = (1024, 4096)
CHUNK = 256
CALLS = ("R", "L", "Qs", "Qb")


class _Replica:
    """One SGLang replica in the test helper's interactive mode: a request per line, a result per line."""

    def __init__(self, work: Path, name: str, spec: dict[str, Any]) -> None:
        from e2e.common import SCRIPTS, SHIM_ENV

        path = work / f"{name}.json"
        path.write_text(json.dumps({**spec, "interactive": True, "requests": [], "instance": name}))
        env = {**os.environ, **SHIM_ENV, "PREFIXSHARE_LOG_JSON": "1", "PREFIXSHARE_LOG_LEVEL": "WARNING"}
        self.name = name
        self.stderr = open(work / f"{name}.stderr", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS["sglang"]), str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"{self.name} ended (rc {self.proc.wait()}); see its .stderr")

    def generate(self, ids: list[int], pause_s: float, **params: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt_token_ids": ids, "max_tokens": 1, "pause_before_s": pause_s,
                                          **params}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("ONE "))

    def close(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self._expect("RESULT "))
        finally:
            self.proc.wait(timeout=120)
            self.stderr.close()


def _replica_specs(model: Path, policy: Any, idle_sleep: bool) -> dict[str, dict[str, Any]]:
    from prefixshare.adapters.sglang import write_lmcache_config

    engine: dict[str, Any] = {"sleep_on_idle": True} if idle_sleep else {}
    spec: dict[str, Any] = {"model": str(model), "policy": None, "engine": engine}
    return {"R": spec, "Q": {**spec, "policy": policy.to_dict()},
            "L": {**spec, "engine": {**engine, "enable_lmcache": True,
                                     "lmcache_config_file": str(write_lmcache_config(policy, "L"))}}}


def _call(replica: _Replica, call: str, step: tuple[int, list[int], list[int]], pause_s: float) -> dict[str, Any]:
    _n, a, b = step
    out = replica.generate(b, pause_s, load="never", store=False) if call == "Qb" else replica.generate(a, pause_s)
    return {"seconds": out["seconds"], "token": out["token_ids"][0]}


def _side_by_side(work: Path, specs: dict[str, dict[str, Any]], steps: list[tuple[int, list[int], list[int]]],
                  pause_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """R, L and Q up at once, each step's calls in an order that rotates from step to step."""
    rows: list[dict[str, Any]] = []
    replicas: dict[str, _Replica] = {}
    try:
        for name, spec in specs.items():
            replicas[name] = _Replica(work, name, spec)
            replicas[name].generate(prompt_ids(512, 100_000), pause_s)  # warm-up, dropped (Q's stored: its store path runs)
        for i, step in enumerate(steps):
            order = CALLS[i % 4:] + CALLS[:i % 4]
            row: dict[str, Any] = {"n": step[0], "order": list(order)}
            for call in order:
                row[call] = _call(replicas[call[0]], call, step, pause_s)
            rows.append(row)
            sys.stdout.write(f"{step[0]}: " + ", ".join(f"{c} {row[c]['seconds']:.2f} s" for c in CALLS) + "\n")
            sys.stdout.flush()
    finally:
        results = {name: rep.close() for name, rep in replicas.items()}
    return rows, results["Q"]["stats"] or {}


def _one_at_a_time(work: Path, specs: dict[str, dict[str, Any]], steps: list[tuple[int, list[int], list[int]]],
                   pause_s: float, rounds: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per round, R, L and Q one after another (the order rotates between rounds), each computing its share of
    the round's steps alone on the machine."""
    rows = [{"n": step[0]} for step in steps]
    q_stats: dict[str, Any] = {}
    for rnd in range(rounds):
        mine = range(rnd, len(steps), rounds)
        for name in "RLQ"[rnd % 3:] + "RLQ"[:rnd % 3]:
            replica = _Replica(work, f"{name}{rnd}", specs[name])
            try:
                replica.generate(prompt_ids(512, 100_000 + rnd), pause_s)  # warm-up, dropped
                for i in mine:
                    for call in ("Qs", "Qb") if name == "Q" else (name,):
                        rows[i][call] = _call(replica, call, steps[i], pause_s)
            finally:
                stats = replica.close()["stats"] or {}
            if name == "Q":
                q_stats = {k: q_stats.get(k, 0) + (stats.get(k) or 0) for k in ("requests", "tokens_loaded",
                                                                                   "tokens_stored")}
            sys.stdout.write(f"round {rnd} {name}: done\n")
            sys.stdout.flush()
    return rows, q_stats


def _measure(work: Path, model: Path, policy: Any, steps: dict[int, int], pause_s: float,
             rounds: int | None) -> dict[str, Any]:
    from prefixshare.server import LMCacheServer

    store = Path(policy.l2[0].base_path)
    plan = [(n, prompt_ids(n + 1, 2 * i), prompt_ids(n + 1, 2 * i + 1)) for i, n in enumerate(
        [n for n in LENGTHS for _ in range(steps[n])])]
    specs = _replica_specs(model, policy, idle_sleep=rounds is None)
    with LMCacheServer(policy, log_path=work / "server.log") as server:
        server_cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
        if rounds is None:
            rows, q_stats = _side_by_side(work, specs, plan, pause_s)
            warmups = 1
        else:
            rows, q_stats = _one_at_a_time(work, specs, plan, pause_s, rounds)
            warmups = rounds
        server_cores = (cpu_seconds(server.pid) - server_cpu0) / (time.monotonic() - t0)
        stored = warmups * 512 // CHUNK + sum(n // CHUNK for n, _a, _b in plan)
        _wait_chunks(store, 2 * stored, timeout_s=60)  # L stores the same prompts (its own keys): twice the files
        landed = _chunk_files(store)
    return {"rows": rows, "server_cores": server_cores, "chunks_expected": 2 * stored,
            "q_tokens_expected": stored * CHUNK, "chunk_files_on_medium": landed,
            "q_stats": {k: q_stats.get(k) for k in ("requests", "tokens_loaded", "tokens_stored")}}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for n in LENGTHS:
        mine = [r for r in rows if r["n"] == n]
        s = {c: [r[c]["seconds"] for r in mine] for c in CALLS}
        out[str(n)] = {
            "median_s": {c: med(v) for c, v in s.items()}, "values_s": s,
            "lmcache_over_raw": med(s["L"]) / med(s["R"]),
            "stored_over_raw": med(s["Qs"]) / med(s["R"]),
            "bypassed_over_raw": med(s["Qb"]) / med(s["R"]),
            "stored_over_lmcache": med(s["Qs"]) / med(s["L"]),
            "stored_over_bypassed_pairs": med(r["Qs"]["seconds"] / r["Qb"]["seconds"] for r in mine),
            "stored_minus_raw_pairs_s": med(r["Qs"]["seconds"] - r["R"]["seconds"] for r in mine),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps at 1k tokens (half as many at 4k)")
    parser.add_argument("--pause", type=float, default=1.0, help="sleep before each request (s)")
    parser.add_argument("--one-at-a-time", type=int, default=None, metavar="ROUNDS",
                        help="run R, L and Q one after another, in ROUNDS rounds, with SGLang's default settings "
                             "(no sleep_on_idle), instead of side by side")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is None:
        name = "sglang-miss-path.json" if args.one_at_a_time is None else "sglang-miss-path-alone.json"
        args.out = ROOT / "docs" / "benchmarks" / name
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
    steps = {1024: args.steps, 4096: max(1, args.steps // 2)}
    started = time.monotonic()
    try:
        measured = _measure(work, model, policy, steps, args.pause, args.one_at_a_time)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = measured.pop("rows")
    result = {
        **run_header("sglang_miss_path.py"),
        "cpus": len(os.sched_getaffinity(0)), "steps": steps, "pause_s": args.pause,
        "mode": "side by side" if args.one_at_a_time is None else f"one at a time, {args.one_at_a_time} rounds",
        "wall_s": round(time.monotonic() - started, 1), **measured,
        "stores_landed": measured["chunk_files_on_medium"] >= measured["chunks_expected"]
        and measured["q_stats"]["tokens_stored"] == measured["q_tokens_expected"],
        "first_tokens_differ": [(r["n"], c) for r in rows for c in ("L", "Qs") if r[c]["token"] != r["R"]["token"]],
        "per_length": _summary(rows), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
