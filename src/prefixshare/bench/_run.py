"""The benchmark run: every measure in one run (so ratios are meaningful on a noisy machine), fresh-process
replicas, medians of ``runs`` repetitions with min/max, and pass/fail against the project's goals.

Replicas (each a fresh process, :mod:`prefixshare.bench._replica`):

* **A** (server SA, empty fs store): per length, ``runs`` documents computed cold (P1 cold TTFT), each asked
  again at once (P1 same-replica local prefix-cache TTFT); then the P6 documents pre-warmed with
  :func:`prefixshare.warm.warm` (wall time);
* **R** (vLLM without prefixshare), right after A: the P6 documents' exact tokens, prefilled raw (P6 reference),
  each asked again (the engine's own local prefix cache: its best case, for P2);
* **B** (server SB on the same directory: another node): the same documents loaded from the store (P1/P2
  cross-replica warm TTFT; the files were written seconds before: page cache warm);
* **B-evicted** (fresh server SE): the same, with the store's files evicted from the page cache
  (posix_fadvise DONTNEED) before every request (P2 evicted);
* **C0**, **C** (server ST: the same directory behind a throttled fs adapter, policy ``load.mode: auto``): C0
  meets the slow store uncalibrated (it learns); fresh C asks for A's documents, interleaved with documents the
  store does not hold (P4: hit vs cold in the same process and minutes).

Each replica first runs one warm-up request (a fresh process's first request pays one-off costs, ~2x).
Documents are random token ids (a random-weight model does not care) except P6's, which are text because
``warm`` takes documents.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixshare.bench._micro import fs_l2_io, machine, raw_io, runtime_overhead, summary
from prefixshare.bench._procs import run_replica
from prefixshare.bench._procs import throttled_store_spec
from prefixshare.server.plugins.integrity import payload_size

#: the goals the project holds itself to (issue #6); "max" goals are upper bounds, "min" lower bounds
GOALS: dict[str, dict[str, Any]] = {
    "P1": {"what": "cold TTFT / cross-replica warm TTFT at 4k tokens", "min": 20.0},
    "P2": {"what": "warm TTFT / physical limit (local TTFT + KV bytes / raw read bandwidth)", "max": 1.5},
    "P3": {"what": "LMCache fs L2 throughput / raw sequential I/O (write, read)", "min": 0.8},
    "P4": {"what": "TTFT of a hit on a throttled store (load.mode auto) / cold TTFT (same replica, interleaved)",
           "max": 1.1},
    "P5": {"what": "prefixshare's per-request overhead", "max_us": 50.0, "max_pct": 1.0},
    "P6": {"what": "pre-warm wall time / raw engine prefill of the same tokens", "max": 1.1},
    "KV": {"what": "KV bytes per token: measured from the store's files vs `prefixshare plan`"},
}


@dataclass
class Settings:
    quick: bool = False
    shape: str = "bench"
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    #: lengths of P4 and P6 (each needs further prefills of its own)
    slow_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    runs: int = 5
    chunk_size: int = 256
    block_size: int = 128
    #: the throttled store's added delay per chunk read (P4)
    chunk_delay_s: float = 2.0
    l1_gb: float = 1.0
    kv_cache_gb: int = 4
    evicted: bool = True
    warmup_tokens: int = 512
    out: Path = Path("docs/benchmarks")
    docs: Path | None = Path("docs/benchmarks.md")
    command: str = ""
    seed: int = 0

    @classmethod
    def for_run(cls, quick: bool, **overrides: Any) -> Settings:
        from prefixshare._paths import cache_dir

        if quick:
            base = cls(quick=True, shape="tiny", lengths=[256, 512], slow_lengths=[512], runs=5, chunk_size=64,
                       block_size=32, chunk_delay_s=0.25, l1_gb=0.2, kv_cache_gb=1, evicted=False, warmup_tokens=128,
                       out=cache_dir() / "bench" / "quick-results", docs=None)
        else:
            base = cls()
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        base.slow_lengths = [n for n in base.slow_lengths if n in base.lengths] or base.lengths[:1]
        return base


def _ids(kind: str, n: int, i: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{kind}:{n}:{i}")
    return [rng.randrange(16, 4000) for _ in range(n)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bench:
    def __init__(self, settings: Settings, log: Callable[[str], None] = print) -> None:
        self.s = settings
        self.log = log
        from prefixshare._paths import cache_dir

        self.out = settings.out.resolve()
        # replicas' specs and logs, servers' logs, the store: in the cache dir, not beside the results
        self.work = cache_dir() / "bench" / ("quick" if settings.quick else settings.shape)
        self.store = self.work / "store"
        self.timings: dict[str, float] = {}
        self.started = time.perf_counter()

    # --- plumbing ------------------------------------------------------------------------------------
    def _policy(self, *, mode: str = "always", slow: bool = False, store: Path | None = None) -> Any:
        from prefixshare.policies import Policy

        fields: dict[str, Any] = {
            "chunk_size": self.s.chunk_size,
            "l1": {"size_gb": self.s.l1_gb},
            "server": {"port": _free_port(), "http_port": _free_port(), "start_timeout_s": 120},
            # generous: a slow store must be judged by the cost model, not cut off by the timeout
            "load": {"timeout_s": 600.0, "mode": mode},
        }
        if slow:
            spec = throttled_store_spec(str(self.store), chunk_delay_s=self.s.chunk_delay_s)
            fields["server"]["extra_args"] = ["--l2-adapter", json.dumps(spec)]
        else:
            fields["l2"] = [{"type": "fs", "base_path": str(store or self.store), "create": True}]
        return Policy.build(**fields)

    def _replica(self, name: str, policy: Any, steps: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {"model": str(self.model), "policy": policy.to_dict() if policy is not None else None,
                "instance": f"bench-{name}-{os.getpid()}", "steps": steps, "log_level": "INFO",
                "engine": {"max_model_len": max(self.s.lengths) + 256, "block_size": self.s.block_size}}
        env = {"PREFIXSHARE_CACHE_DIR": str(self.work / "cache"), "VLLM_CPU_KVCACHE_SPACE": str(self.s.kv_cache_gb)}
        t0 = time.perf_counter()
        self.log(f"replica {name}: {sum(1 for s in steps if s['op'] != 'fadvise')} requests ...")
        result = run_replica(self.work / "replicas", name, spec, env=env, timeout_s=3600)
        self.timings[f"replica_{name}_s"] = round(time.perf_counter() - t0, 1)
        self.log(f"replica {name}: done in {self.timings[f'replica_{name}_s']:.0f} s")
        return result

    def _server(self, policy: Any) -> Any:
        from prefixshare.server import LMCacheServer

        return LMCacheServer(policy, log_path=self.work / f"server-{policy.server.port}.log")

    @staticmethod
    def _by_tag(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {s["tag"]: s for s in result["steps"] if s.get("tag")}

    def _series(self, steps: dict[str, dict[str, Any]], prefix: str, n: int) -> list[float]:
        return [steps[f"{prefix}:{n}:{i}"]["seconds"] for i in range(self.s.runs) if f"{prefix}:{n}:{i}" in steps]

    # --- the run -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        s = self.s
        info, kvb = self._setup()
        io = self._measure_io(kvb)
        overhead, overhead_rules = self._measure_overhead()

        # documents
        warmup = _ids("warmup", s.warmup_tokens, 0, s.seed)
        docs = {n: [_ids("doc", n, i, s.seed) for i in range(s.runs)] for n in s.lengths}
        texts = {n: [(f"bench-{n}-{i}", self._text(n, i)) for i in range(s.runs)] for n in s.slow_lengths}

        a = self._run_a(warmup, docs, texts)
        a_steps = self._by_tag(a)
        r_steps = self._by_tag(self._run_r(warmup, a_steps))
        b = self._run_b(warmup, docs, a_steps)
        b_steps = self._by_tag(b)
        be_steps = self._run_b_evicted(warmup, docs) if s.evicted else {}
        c0, c = self._run_c(docs, a_steps)
        c_steps = self._by_tag(c)

        kv_measured = self._kv_bytes_per_token()
        self.timings["total_s"] = round(time.perf_counter() - self.started, 1)
        info_end = machine()["load_average"]
        results = self._assemble(info, info_end, kvb, kv_measured, io, overhead, a, a_steps, b_steps, be_steps,
                                 r_steps, c0, c, c_steps)
        results["profile_warm_request"] = self._profile_warm_request(a_steps, b, b_steps)
        for n, row in results["per_length"].items():
            row["overhead_with_rules_us"] = overhead_rules[n]
        return results

    def _setup(self) -> tuple[dict[str, Any], int]:
        """A fresh work directory, the machine's description and the model; returns the machine and the model's KV
        bytes per token."""
        from prefixshare._paths import cache_dir
        from prefixshare.model import ensure_model, kv_bytes_per_token

        s = self.s
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        info = machine()
        self.log(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB; load {info['load_average']}")
        t0 = time.perf_counter()
        self.model = ensure_model(cache_dir() / "models" / f"bench-{s.shape}", shape=s.shape)
        self.timings["model_s"] = round(time.perf_counter() - t0, 1)
        return info, kv_bytes_per_token(s.shape)

    def _measure_io(self, kvb: int) -> dict[str, Any]:
        """P3 and the media bandwidth of P2 (no engine running): raw I/O and the fs L2 path, per length."""
        s = self.s
        self.log("raw sequential I/O and LMCache's fs L2 path ...")
        t0 = time.perf_counter()
        io: dict[str, Any] = {}
        for n in s.lengths:
            size = n * kvb
            io[str(n)] = {"raw": raw_io(self.work / "io", size, s.runs),
                          "fs_l2": fs_l2_io(self.work / "io-l2", s.chunk_size * kvb, n // s.chunk_size, s.runs)}
        self.timings["io_s"] = round(time.perf_counter() - t0, 1)
        return io

    def _measure_overhead(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """P5: the per-request overhead (in-process), with the default policy and with admission rules."""
        s = self.s
        self.log("per-request overhead (in-process) ...")
        t0 = time.perf_counter()
        iterations = 300 if s.quick else 2000
        # (its own store directory: the runtime writes a manifest for its made-up engine settings)
        scratch = self.work / "overhead-store"
        overhead = runtime_overhead(self.model, self._policy(store=scratch), s.lengths, iterations=iterations)
        # the same with the README's admission rules (they need a digest of the prompt)
        rules = self._policy(store=scratch).to_dict() | {"admission": {"all": [{"min_tokens": s.chunk_size}, {"any": [
            {"pinned": ["manual-*"]}, {"frequency": {"n": 2, "window": "1h"}}]}]}}
        from prefixshare.policies import Policy

        overhead_rules = runtime_overhead(self.model, Policy.build(**rules), s.lengths, iterations=iterations)
        self.timings["overhead_s"] = round(time.perf_counter() - t0, 1)
        return overhead, overhead_rules

    def _run_a(self, warmup: list[int], docs: dict[int, list[list[int]]],
               texts: dict[int, list[tuple[str, str]]]) -> dict[str, Any]:
        """A: cold, local, pre-warm."""
        s = self.s
        steps: list[dict[str, Any]] = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        for n in s.lengths:
            for i, ids in enumerate(docs[n]):
                steps.append({"op": "generate", "ids": ids, "tag": f"cold:{n}:{i}"})
                steps.append({"op": "generate", "ids": ids, "tag": f"local:{n}:{i}"})
        for n in s.slow_lengths:
            for i, (doc_id, text) in enumerate(texts[n]):
                steps.append({"op": "warm", "doc_id": doc_id, "text": text, "tag": f"prewarm:{n}:{i}"})
        pol_a = self._policy()
        with self._server(pol_a):
            return self._replica("A", pol_a, steps)

    def _run_r(self, warmup: list[int], a_steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """R, right after A (the P6 pair close in time): raw engine, the pre-warmed documents' exact tokens, each
        asked again at once (the engine's own local prefix cache, without prefixshare: its best case)."""
        s = self.s
        steps = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        for n in s.slow_lengths:
            for i in range(s.runs):
                ids = a_steps[f"prewarm:{n}:{i}"]["ids"]
                steps.append({"op": "generate", "ids": ids, "tag": f"raw:{n}:{i}"})
                steps.append({"op": "generate", "ids": ids, "tag": f"rawlocal:{n}:{i}"})
        return self._replica("R", None, steps)

    def _run_b(self, warmup: list[int], docs: dict[int, list[list[int]]],
               a_steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """B: cross-replica warm, page cache warm; then one more load (a pre-warmed document) under cProfile:
        where a warm request's time goes, in the engine process (scheduler, worker, connector)."""
        s = self.s
        steps = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        steps += [{"op": "generate", "ids": ids, "tag": f"warm:{n}:{i}"}
                  for n in s.lengths for i, ids in enumerate(docs[n])]
        big = max(s.slow_lengths)
        steps.append({"op": "generate", "ids": a_steps[f"prewarm:{big}:0"]["ids"], "tag": "profiled", "profile": True,
                      "profile_top": 40})
        pol_b = self._policy()
        with self._server(pol_b):
            return self._replica("B", pol_b, steps)

    def _run_b_evicted(self, warmup: list[int], docs: dict[int, list[list[int]]]) -> dict[str, dict[str, Any]]:
        """B-evicted: cross-replica warm, store files evicted from the page cache before each request; returns
        its steps by tag."""
        s = self.s
        steps = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        for n in s.lengths:
            for i, ids in enumerate(docs[n]):
                steps.append({"op": "fadvise", "dir": str(self.store)})
                steps.append({"op": "generate", "ids": ids, "tag": f"warm:{n}:{i}"})
        pol_e = self._policy()
        with self._server(pol_e):
            be = self._replica("B-evicted", pol_e, steps)
        return self._by_tag(be)

    def _run_c(self, docs: dict[int, list[list[int]]],
               a_steps: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """C0, C: throttled store, cost-aware loading."""
        s = self.s
        pol_t = self._policy(mode="auto", slow=True)
        with self._server(pol_t):
            steps = [{"op": "generate", "ids": _ids("warmup", s.warmup_tokens, 1, s.seed), "tag": "warmup"}]
            steps += [{"op": "generate", "ids": a_steps[f"prewarm:{n}:0"]["ids"], "tag": f"learn:{n}"}
                      for n in s.slow_lengths]
            c0 = self._replica("C0", pol_t, steps)
            # documents the store holds, interleaved with documents it does not hold (the cold reference of P4,
            # measured in the same process and minutes: a shared machine's load drifts between replicas)
            steps = [{"op": "generate", "ids": _ids("warmup", s.warmup_tokens, 2, s.seed), "tag": "warmup"}]
            for n in s.slow_lengths:
                for i, ids in enumerate(docs[n]):
                    steps.append({"op": "generate", "ids": ids, "tag": f"slow:{n}:{i}"})
                    steps.append({"op": "generate", "ids": _ids("fresh", n, i, s.seed), "tag": f"fresh:{n}:{i}"})
            c = self._replica("C", pol_t, steps)
        return c0, c

    def _profile_warm_request(self, a_steps: dict[str, dict[str, Any]], b: dict[str, Any],
                              b_steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """B's profiled warm request: its tokens, wall time, top functions and the cost model's observation."""
        big = max(self.s.slow_lengths)
        profiled = b_steps.get("profiled", {})
        return {"tokens": len(a_steps[f"prewarm:{big}:0"]["ids"]), "seconds": profiled.get("seconds"),
                "top": profiled.get("profile"), "cost": _decision_of(b, "profiled")}

    def _text(self, n: int, i: int) -> str:
        """A text document of about ``n`` tokens (P6: warm takes documents, not token ids)."""
        from transformers import AutoTokenizer

        from prefixshare.model import document_text

        if not hasattr(self, "_tok"):
            self._tok = AutoTokenizer.from_pretrained(str(self.model))
        ids = self._tok(document_text(n + 64, seed=1000 + n + i))["input_ids"]
        ids = [t for t in ids if t != self._tok.bos_token_id][: n - 1]
        return self._tok.decode(ids)

    def _kv_bytes_per_token(self) -> dict[str, Any]:
        sizes = [payload_size(p) for p in self.store.glob("prefixshare-*.data")]  # KV bytes, not the trailer
        chunk = statistics.median(sizes) / self.s.chunk_size if sizes else None
        return {"files": len(sizes), "median_file_bytes": statistics.median(sizes) if sizes else None,
                "bytes_per_token": chunk, "all_files_equal": len(set(sizes)) == 1 if sizes else None}

    # --- results --------------------------------------------------------------------------------------
    def _assemble(self, info: dict[str, Any], load_end: Any, kvb: int, kv_measured: dict[str, Any],
                  io: dict[str, Any], overhead: dict[str, Any], a: dict[str, Any], a_steps: dict[str, Any],
                  b_steps: dict[str, Any], be_steps: dict[str, Any], r_steps: dict[str, Any], c0: dict[str, Any],
                  c: dict[str, Any], c_steps: dict[str, Any]) -> dict[str, Any]:
        from prefixshare.plan import plan

        s = self.s
        predicted = plan(s.shape, prompt_lengths=[max(s.lengths)], kv_dtype="float32").kv_bytes_per_token
        per_length: dict[str, Any] = {}
        for n in s.lengths:
            per_length[str(n)] = self._length_row(n, kvb, io, overhead, a_steps, b_steps, be_steps, r_steps, c_steps)
        results = {
            "command": s.command,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
            # how KV moves between the engines and the server (the policy's server.shm_name)
            "transport": "shared memory" if self._policy().server.shm_segment else "pickle",
            "machine": info, "load_average_end": load_end,
            "model": {"shape": s.shape, "path": str(self.model), "kv_bytes_per_token": kvb},
            "kv_bytes_per_token": {"measured": kv_measured, "plan": predicted,
                                   "agree": kv_measured["bytes_per_token"] == predicted},
            "per_length": per_length,
            "cost_aware": self._cost_aware(c0, c),
            "replica_stats": {"A": _slim(a.get("stats")), "C": _slim(c.get("stats"))},
            "timings": self.timings,
        }
        results["goals"] = evaluate(results)
        return results

    def _length_row(self, n: int, kvb: int, io: dict[str, Any], overhead: dict[str, Any], a_steps: dict[str, Any],
                    b_steps: dict[str, Any], be_steps: dict[str, Any], r_steps: dict[str, Any],
                    c_steps: dict[str, Any]) -> dict[str, Any]:
        """The results of one prompt length: TTFTs against the limits (P1, P2), the store's I/O (P3), the overhead
        (P5) and, at the P4 and P6 lengths, the throttled store and pre-warm measures."""
        s = self.s
        cold = summary(self._series(a_steps, "cold", n))
        local = summary(self._series(a_steps, "local", n))
        warm = summary(self._series(b_steps, "warm", n))
        loaded = [b_steps[f"warm:{n}:{i}"]["num_cached_tokens"] for i in range(s.runs)]
        kv_bytes = n * kvb
        raw = io[str(n)]["raw"]
        limit_warm = local["median"] + kv_bytes / (raw["read_warm_gbps"]["median"] * 1e9)
        limit_cold = local["median"] + kv_bytes / (raw["read_evicted_gbps"]["median"] * 1e9)
        row: dict[str, Any] = {
            "tokens": n, "kv_bytes": kv_bytes,
            "cold_ttft_s": cold, "warm_ttft_s": warm, "local_ttft_s": local,
            "warm_loaded_tokens": summary([float(x) for x in loaded]),
            "speedup_cold_over_warm": cold["median"] / warm["median"],
            "speedup_cold_over_local": cold["median"] / local["median"],
            "limit_page_cache_warm_s": limit_warm, "limit_evicted_s": limit_cold,
            "warm_over_limit": warm["median"] / limit_warm,
            "io": io[str(n)],
            "overhead_us": overhead[str(n)],
            "overhead_pct_of_warm_ttft": overhead[str(n)]["total_us"] / 1e6 / warm["median"] * 100,
            "overhead_pct_of_cold_ttft": overhead[str(n)]["total_us"] / 1e6 / cold["median"] * 100,
        }
        if be_steps:
            warm_ev = summary(self._series(be_steps, "warm", n))
            row["warm_evicted_ttft_s"] = warm_ev
            row["warm_evicted_over_limit"] = warm_ev["median"] / limit_cold
        row["fs_l2_over_raw"] = _fs_l2_over_raw(io[str(n)])
        if n in s.slow_lengths:
            row.update(self._slow_fields(row, a_steps, r_steps, c_steps))
        return row

    def _slow_fields(self, row: dict[str, Any], a_steps: dict[str, Any], r_steps: dict[str, Any],
                     c_steps: dict[str, Any]) -> dict[str, Any]:
        """A P4/P6 length's further fields of its row (``row`` holds its cold and warm TTFTs and its I/O):
        the throttled store (P4), pre-warm vs raw prefill (P6) and the raw engine's own local TTFT."""
        n, kv_bytes, raw = row["tokens"], row["kv_bytes"], row["io"]["raw"]
        slow = summary(self._series(c_steps, "slow", n))
        prewarm = summary(self._series(a_steps, "prewarm", n))
        raw_prefill = summary(self._series(r_steps, "raw", n))
        fresh = summary(self._series(c_steps, "fresh", n))
        raw_local = summary(self._series(r_steps, "rawlocal", n))
        # the engine's own best case (no prefixshare) at the P6 documents' length
        read_bw = raw["read_warm_gbps"]["median"] * 1e9
        limit_engine = raw_local["median"] + kv_bytes / read_bw
        return {
            "throttled_auto_ttft_s": slow,
            "throttled_loaded_tokens": [c_steps[f"slow:{n}:{i}"]["num_cached_tokens"] for i in range(self.s.runs)],
            "throttled_cold_ttft_s": fresh,
            "throttled_over_cold": slow["median"] / fresh["median"],
            "throttled_over_replica_a_cold": slow["median"] / row["cold_ttft_s"]["median"],
            "prewarm_s": prewarm,
            "prewarm_tokens": len(a_steps[f"prewarm:{n}:0"]["ids"]),
            "raw_prefill_s": raw_prefill,
            "prewarm_over_raw": prewarm["median"] / raw_prefill["median"],
            "local_raw_engine_ttft_s": raw_local,
            "limit_engine_page_cache_warm_s": limit_engine,
            "warm_over_engine_limit": row["warm_ttft_s"]["median"] / limit_engine,
        }

    def _cost_aware(self, c0: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
        """P4's cost model: the throttle, the learning replica's (C0) and the measured replica's (C) decisions."""
        s = self.s
        cost_c = (c.get("stats") or {}).get("cost", {})
        cost_c0 = (c0.get("stats") or {}).get("cost", {})
        return {
            "throttle": {"chunk_delay_s": s.chunk_delay_s, "chunk_tokens": s.chunk_size},
            "learning_replica": {"decisions": cost_c0.get("decisions"), "recent": cost_c0.get("recent"),
                                 "ttft_s": {t: st["seconds"] for t, st in self._by_tag(c0).items()}},
            "measured_replica": {"decisions": cost_c.get("decisions"), "estimates": cost_c.get("estimates"),
                                 "median_abs_error": cost_c.get("median_abs_error"),
                                 "recent": cost_c.get("recent")},
        }


def _fs_l2_over_raw(io: dict[str, Any]) -> dict[str, float]:
    """One length's fs L2 throughput over raw sequential I/O: write, read (page cache warm), read evicted."""
    fs, rw = io["fs_l2"], io["raw"]
    return {
        "write": fs["write_gbps"]["median"] / rw["write_gbps"]["median"],
        "read_warm": fs["read_warm_gbps"]["median"] / rw["read_warm_gbps"]["median"],
        "read_evicted": fs["read_evicted_gbps"]["median"] / rw["read_evicted_gbps"]["median"],
    }


def _decision_of(result: dict[str, Any], tag: str) -> dict[str, Any] | None:
    """The load.outcome event of the last request of a replica (its lookup and transfer times)."""
    outcomes = [e for e in result.get("events", []) if e.get("event") == "load.outcome"]
    if not outcomes:
        return None
    e = outcomes[-1]
    return {k: e.get(k) for k in ("observed_s", "observed_lookup_s", "observed_transfer_s", "loaded_tokens")}


def _slim(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    if not stats:
        return None
    return {k: v for k, v in stats.items() if k != "cost"}


def evaluate(results: dict[str, Any]) -> dict[str, Any]:
    """Pass/fail of every goal, with the measured values it was judged on."""
    rows = results["per_length"]
    lengths = sorted(int(n) for n in rows)
    at = "4096" if "4096" in rows else str(lengths[-1])
    goals: dict[str, Any] = {}
    p1 = rows[at]["speedup_cold_over_warm"]
    goals["P1"] = {**GOALS["P1"], "at_tokens": int(at), "value": p1, "pass": p1 >= GOALS["P1"]["min"],
                   "per_length": {n: r["speedup_cold_over_warm"] for n, r in rows.items()}}
    p2 = {n: r["warm_over_limit"] for n, r in rows.items()}
    p2r = {n: r["warm_over_engine_limit"] for n, r in rows.items() if "warm_over_engine_limit" in r}
    p2e = {n: r["warm_evicted_over_limit"] for n, r in rows.items() if "warm_evicted_over_limit" in r}
    worst = max([*p2.values(), *p2e.values(), *p2r.values()])
    goals["P2"] = {**GOALS["P2"], "value": worst, "pass": worst <= GOALS["P2"]["max"], "page_cache_warm": p2,
                   "evicted": p2e or None, "engine_only_local": p2r or None}
    p3 = {n: r["fs_l2_over_raw"] for n, r in rows.items()}
    worst3 = min(v for d in p3.values() for v in d.values())
    goals["P3"] = {**GOALS["P3"], "value": worst3, "pass": worst3 >= GOALS["P3"]["min"], "per_length": p3}
    p4 = {n: r["throttled_over_cold"] for n, r in rows.items() if "throttled_over_cold" in r}
    goals["P4"] = {**GOALS["P4"], "value": max(p4.values()), "pass": max(p4.values()) <= GOALS["P4"]["max"],
                   "per_length": p4}
    us = {n: r["overhead_us"]["total_us"] for n, r in rows.items()}
    pct = {n: r["overhead_pct_of_warm_ttft"] for n, r in rows.items()}
    goals["P5"] = {**GOALS["P5"], "value_us": max(us.values()), "value_pct": max(pct.values()),
                   "pass": max(us.values()) <= GOALS["P5"]["max_us"] and max(pct.values()) <= GOALS["P5"]["max_pct"],
                   "us": us, "pct_of_warm_ttft": pct}
    p6 = {n: r["prewarm_over_raw"] for n, r in rows.items() if "prewarm_over_raw" in r}
    goals["P6"] = {**GOALS["P6"], "value": max(p6.values()), "pass": max(p6.values()) <= GOALS["P6"]["max"],
                   "per_length": p6}
    kv = results["kv_bytes_per_token"]
    goals["KV"] = {**GOALS["KV"], "value": kv["measured"]["bytes_per_token"], "plan": kv["plan"], "pass": kv["agree"]}
    return goals


def run_bench(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything, write ``results.json``, the plots and (full runs) the markdown table."""
    from prefixshare.bench._report import plots, render_markdown

    if not settings.command:
        settings.command = "prefixshare " + shlex.join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(
            "prefixshare") else "prefixshare bench" + (" --quick" if settings.quick else "")
    bench = Bench(settings, log)
    results = bench.run()
    out = bench.out
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["results_path"] = str(out / "results.json")
    if settings.docs is not None:
        settings.docs.parent.mkdir(parents=True, exist_ok=True)
        settings.docs.write_text(render_markdown(results, settings.docs))
        results["docs_path"] = str(settings.docs)
    shutil.rmtree(bench.work / "store", ignore_errors=True)
    shutil.rmtree(bench.work / "io", ignore_errors=True)
    shutil.rmtree(bench.work / "io-l2", ignore_errors=True)
    return results


def render_results(results_path: Path, docs: Path | None) -> dict[str, Any]:
    """Plots and page again from a ``results.json`` (nothing is measured)."""
    from prefixshare.bench._report import plots, render_markdown

    results_path = results_path.resolve()
    results = json.loads(results_path.read_text())
    results["command"] = results["command"].strip()
    results["plots"] = plots(results, results_path.parent)
    results["results_path"] = str(results_path)
    results_path.write_text(json.dumps(results, indent=1, default=str))
    if docs is not None:
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(render_markdown(results, docs))
        results["docs_path"] = str(docs)
    return results
