"""The benchmark run: every measure in one run (so ratios are meaningful on a noisy machine), fresh-process
replicas, medians of ``runs`` repetitions with min/max (and every value in results.json), and pass/fail
against the project's goals.

Every figure is held against something that can embarrass it:

* a speedup against the **raw engine** (vLLM without prefixshare), not against our own cold path;
* a lower bound (P2's floor) **measured so it cannot be beaten**: the run fails loudly when a warm request
  beats it by more than 5 % (:class:`FloorBeaten`: the bound, not the product, is wrong);
* a choice (P4, load or recompute) **by regret** against the better option measured in the same replica,
  interleaved, at points around break-even where the choice is hard;
* the cost of attaching prefixshare to a miss (P7) against the same raw engine;
* what prefixshare's connector adds to a warm request (P5) against LMCache's own connector on the same server.

Replicas (each a fresh process, :mod:`prefixshare.bench._replica`); documents are ``n + 1`` tokens, ``n`` a
multiple of the block and chunk sizes, so a load and a prefix-cache hit both leave exactly one token to compute:

* **A** (server SA, empty fs store, prefixshare attached) and **R** (vLLM without prefixshare), up side by side,
  their requests interleaved: per length, ``runs`` documents computed cold by A (P7's numerator, and what B
  loads; the run waits until each one's chunks are on the store's medium before the next request) and by R
  (P1's and P7's raw baseline), and, in A, another cold prompt of the same length that prefixshare is told to
  leave alone (``prefixshare.load: never``, ``prefixshare.store: false``: P7's breakdown, in one process); then
  the P6 documents pre-warmed by A with :func:`prefixshare.warm.warm`, each followed by R prefilling its exact
  tokens (P6's reference); then the corpus, A then R;
* **B** (server SB on the same directory: another node): each document loaded from the store (P1/P2 warm,
  page cache warm), then asked again at once: the whole prefix is in B's own KV cache, so that request
  computes one token with everything else in place (P2's floor, measured in the same replica, interleaved);
* **B-evicted** (fresh server SE): the same, with the store's files evicted from the page cache first;
* **C** (server ST: the same directory behind a throttled fs adapter whose delay a control file sets while it
  runs; policy ``load.mode: auto``): per sweep length, its own unthrottled forced loads and recomputes first;
  then per point the store throttled so that a load is predicted to take ``factor`` x that recompute, and, per
  run, the same document forced to load
  (``prefixshare.load: always``), forced to recompute (``never``) and left to the cost model (``auto``),
  the server's L1 emptied before each load so it reads the throttled medium (P4);
* **O** and **L** (server SP on the same directory, both up at once, requests alternating): the same warm
  requests through prefixshare's connector and through LMCache's plain ``LMCacheMPConnector`` (P5; see
  :mod:`prefixshare.bench._connectors`).

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
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixshare.bench._connectors import connector_rows, run_connector_pairs
from prefixshare.bench._micro import STORE_IO_DIRS, copy_path, machine, runtime_overhead, store_io, summary
from prefixshare.bench._procs import run_replica, throttled_store_spec
from prefixshare.errors import PrefixShareError
from prefixshare.keys import REQ_LOAD, REQ_STORE
from prefixshare.server.plugins.integrity import DEFAULT_ALGORITHM, payload_size

#: the goals the project holds itself to; "max" goals are upper bounds, "min" lower bounds
GOALS: dict[str, dict[str, Any]] = {
    "P1": {"what": "raw engine cold TTFT / cross-replica warm TTFT at 4k tokens", "min": 20.0},
    "P2": {"what": "warm TTFT / floor (one token computed with the prefix cached, in the same replica, + KV bytes "
                   "at the copy path's best bandwidth)", "max": 1.5},
    "P3": {"what": "prefixshare's fs tier adapter (integrity on) / raw sequential I/O (write, read, read evicted)",
           "min": 0.8},
    "P4": {"what": "regret of load.mode auto: its TTFT / the better of forced load and forced recompute, same "
                   "replica, interleaved, at 0.25-4x break-even", "max": 1.1},
    "P5": {"what": "what prefixshare's connector adds to a warm request as the engine sees it: warm TTFT through it - "
                   "through LMCache's plain MP connector (same server, same store, interleaved), % of warm TTFT",
           "max_pct": 1.0},
    "P5_calls": {"what": "prefixshare's per-request scheduler-side calls, timed in-process (P5's breakdown)",
                 "max_us": 50.0},
    "P6": {"what": "pre-warm wall time / raw engine prefill of the same tokens", "max": 1.1},
    "P7": {"what": "miss overhead: cold TTFT with prefixshare attached / raw engine cold TTFT", "max": 1.03},
    "KV": {"what": "KV bytes per token: measured from the store's files vs `prefixshare plan`"},
}

#: a warm request this much under its floor means the floor is not a lower bound: the run fails
FLOOR_TOLERANCE = 0.95


class FloorBeaten(PrefixShareError):
    """A warm TTFT beat P2's floor: the bound is broken (results are written before this is raised)."""


@dataclass
class Settings:
    quick: bool = False
    shape: str = "bench"
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    #: lengths of P6 (each needs further prefills of its own)
    slow_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    #: P4's sweep: lengths, load/recompute factors around break-even, runs per point
    sweep_lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    sweep_factors: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
    sweep_runs: int = 3
    runs: int = 5
    #: P3's repetitions per length (raw I/O and each adapter, interleaved): a 1k-token round is a few milliseconds
    #: of I/O, so on a shared 2-core box a median of 5 moves with a couple of slow rounds (0.78x and 1.64x a day
    #: apart at 1k); 15 rounds of every length cost about a minute
    io_reps: int = 15
    #: P5: interleaved pairs (prefixshare's connector, LMCache's) per length
    p5_pairs: int = 20
    #: P6's corpus: documents of about corpus_tokens tokens warmed in one call, and warm's batch size
    corpus_docs: int = 200
    corpus_tokens: int = 256
    corpus_batch_tokens: int = 16384
    chunk_size: int = 256
    block_size: int = 128
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
            base = cls(quick=True, shape="tiny", lengths=[256, 512], slow_lengths=[512], sweep_lengths=[512],
                       runs=5, io_reps=5, p5_pairs=6, corpus_docs=12, corpus_tokens=128, chunk_size=64, block_size=32,
                       l1_gb=0.2, kv_cache_gb=1, evicted=False,
                       warmup_tokens=128, out=cache_dir() / "bench" / "quick-results", docs=None)
        else:
            base = cls()
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        base.slow_lengths = [n for n in base.slow_lengths if n in base.lengths] or base.lengths[:1]
        base.sweep_lengths = [n for n in base.sweep_lengths if n in base.lengths] or base.lengths[:1]
        step = max(base.chunk_size, base.block_size)
        if any(n % step for n in base.lengths):
            raise ValueError(f"prompt lengths must be multiples of the chunk and block sizes ({step}): {base.lengths}")
        return base


def _ids(kind: str, n: int, i: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{kind}:{n}:{i}")
    return [rng.randrange(16, 4000) for _ in range(n)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commit() -> str:
    """The commit the run measured (``-dirty`` when the tree had changes), or ``unknown`` outside git."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


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
        self.run_id = uuid.uuid4().hex[:12]

    # --- plumbing ------------------------------------------------------------------------------------
    def _policy(self, *, mode: str = "always", throttle: Path | None = None, store: Path | None = None) -> Any:
        from prefixshare.policies import Policy

        fields: dict[str, Any] = {
            "chunk_size": self.s.chunk_size,
            "l1": {"size_gb": self.s.l1_gb},
            "server": {"port": _free_port(), "http_port": _free_port(), "start_timeout_s": 120},
            # generous: a slow store must be judged by the cost model, not cut off by the timeout
            "load": {"timeout_s": 600.0, "mode": mode},
        }
        if throttle is not None:
            spec = throttled_store_spec(str(self.store), control_path=str(throttle))
            fields["server"]["extra_args"] = ["--l2-adapter", json.dumps(spec)]
        else:
            fields["l2"] = [{"type": "fs", "base_path": str(store or self.store), "create": True}]
        return Policy.build(**fields)

    def _digest(self) -> str:
        """The digest the run's fs tier checks chunks with (its ``integrity``; ``none``: unchecked)."""
        return str(self._policy().l2[0].integrity)

    def replica_spec(self, name: str, policy: Any, **extra: Any) -> dict[str, Any]:
        """A replica's spec (:mod:`prefixshare.bench._replica`): the bench's model and engine, ``policy`` (None: the
        raw engine), ``extra`` fields (steps, interactive, log level, ...)."""
        return {"model": str(self.model), "policy": policy.to_dict() if policy is not None else None,
                "instance": f"bench-{name}-{os.getpid()}", "log_level": "INFO",
                "engine": {"max_model_len": max(self.s.lengths) + 256, "block_size": self.s.block_size}, **extra}

    def replica_env(self) -> dict[str, str]:
        """The environment every replica of the run gets: its cache dir and the engine's KV cache size."""
        return {"PREFIXSHARE_CACHE_DIR": str(self.work / "cache"), "VLLM_CPU_KVCACHE_SPACE": str(self.s.kv_cache_gb)}

    def _replica(self, name: str, policy: Any, steps: list[dict[str, Any]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.log(f"replica {name}: {sum(1 for s in steps if s['op'] in ('generate', 'warm'))} requests ...")
        result = run_replica(self.work / "replicas", name, self.replica_spec(name, policy, steps=steps),
                             env=self.replica_env(), timeout_s=3600)
        self.timings[f"replica_{name}_s"] = round(time.perf_counter() - t0, 1)
        self.log(f"replica {name}: done in {self.timings[f'replica_{name}_s']:.0f} s")
        return result

    def _server(self, policy: Any) -> Any:
        from prefixshare.server import LMCacheServer

        return LMCacheServer(policy, log_path=self.work / f"server-{policy.server.port}.log")

    @staticmethod
    def _by_tag(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {s["tag"]: s for s in result["steps"] if s.get("tag")}

    def _series(self, steps: dict[str, dict[str, Any]], prefix: str, n: int, runs: int | None = None) -> list[float]:
        runs = self.s.runs if runs is None else runs
        return [steps[f"{prefix}:{n}:{i}"]["seconds"] for i in range(runs) if f"{prefix}:{n}:{i}" in steps]

    # --- the run -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        s = self.s
        info, kvb = self._setup()
        io = self._measure_io(kvb)
        idle = self._measure_idle_memory(kvb)
        overhead, overhead_rules = self._measure_overhead()

        # documents: n + 1 tokens (see the module's docstring)
        warmup = _ids("warmup", s.warmup_tokens, 0, s.seed)
        docs = {n: [_ids("doc", n + 1, i, s.seed) for i in range(s.runs)] for n in s.lengths}
        texts = {n: [(f"bench-{n}-{i}", self._text(n, i)) for i in range(s.runs)] for n in s.slow_lengths}

        a, r, twin = self._run_a_and_r(warmup, docs, texts)
        # R's steps and its twin's P7 requests (tagged rawtwin:...) in one map
        a_steps, r_steps = self._by_tag(a), {**self._by_tag(twin), **self._by_tag(r)}
        b = self._run_b(warmup, docs, a_steps)
        b_steps = self._by_tag(b)
        be_steps = self._run_b_evicted(warmup, docs) if s.evicted else {}
        sweep = self._run_sweep(docs)
        connectors = self._run_connectors(warmup, {n: [_ids("p5", n + 1, j, s.seed) for j in range(2)]
                                                   for n in s.lengths})

        kv_measured = self._kv_bytes_per_token()
        self.timings["total_s"] = round(time.perf_counter() - self.started, 1)
        results = self._assemble(info, machine()["load_average"], kvb, kv_measured, io, overhead, a, a_steps,
                                 b_steps, be_steps, r_steps, sweep, connectors)
        results["profile_warm_request"] = self._profile_warm_request(a_steps, b, b_steps)
        results["idle_memory"] = idle
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
        """P3 and the floor's bandwidths (no engine running): raw I/O, the fs L2 path (prefixshare's checked
        adapter, LMCache's plain one and LMCache's native one) and the copy path's in-memory stages, per length."""
        s = self.s
        self.log("raw sequential I/O, the fs L2 adapters and the in-memory copy path ...")
        t0 = time.perf_counter()
        io: dict[str, Any] = {}
        chunk_bytes = s.chunk_size * kvb
        digest = self._digest()
        if digest == "none":  # the floor still needs a digest's rate; the one a checked tier gets by default
            digest = DEFAULT_ALGORITHM
        for n in s.lengths:
            size = n * kvb
            io[str(n)] = {**store_io(self.work, size, chunk_bytes, s.io_reps),
                          "copy": copy_path(size, chunk_bytes, s.runs, digest=digest)}
        self.timings["io_s"] = round(time.perf_counter() - t0, 1)
        return io

    def _measure_idle_memory(self, kvb: int) -> dict[str, Any]:
        """What this machine charges for memory that sat idle (:mod:`prefixshare.bench._memory`), for accesses of
        about the shortest length's KV: the store path writes into memory that waits between requests (the server's
        chunk buffers, the page cache), so on a host that reclaims idle memory P3 and P6 pay for it."""
        from prefixshare.bench._memory import idle_memory

        s = self.s
        self.log("what idle memory costs on this machine ...")
        t0 = time.perf_counter()
        size = max(1, round(min(s.lengths) * kvb / (1 << 20))) << 20
        result = idle_memory([0.0, 1.0] if s.quick else [0.0, 0.05, 1.0, 5.0], size, 1 if s.quick else 2,
                             work=self.work)
        self.timings["idle_memory_s"] = round(time.perf_counter() - t0, 1)
        return result

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

    def _run_a_and_r(self, warmup: list[int], docs: dict[int, list[list[int]]],
                     texts: dict[int, list[tuple[str, str]]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """A (prefixshare attached, its server SA, an empty store), R (the raw engine) and R's twin (a second raw
        engine, the same in every way) up side by side, their requests interleaved (one runs at a time, the others
        idle), so that the machine's drift between two processes run one after the other stays out of P7's and
        P6's ratios (run one after the other, A's bypassed requests, which do nothing, measured 1.01-1.16x R's).
        The twin computes P7's prompts too: the ratio of two raw engines on the same prompts is what two processes
        differ by with nothing between them, the resolution P7 is read against.

        Per length and document: A's cold request (stored after its first token), R's raw cold request of the
        same tokens, and A's bypassed request of another prompt of that length, the order reversed every other
        document. After A's cold request the driver waits until its chunks are on the store's medium
        (``landed_s``, from the first token) and each request is followed by a short pause, so the store copy
        made after a first token never runs into the next request: P7 is what a miss's first token waits for
        (what the store costs the machine's CPU afterwards is benchmarks/miss_path.py's). Then, per P6
        document, A pre-warms it and R prefills its exact tokens; then the corpus, A then R."""
        from prefixshare.bench._procs import ReplicaSession

        s = self.s
        pol_a = self._policy()
        env = self.replica_env()
        bypassed = {REQ_LOAD: "never", REQ_STORE: False}
        landed: dict[str, float | None] = {}
        t0 = time.perf_counter()
        self.log(f"replicas A, R and R's twin, interleaved: {len(s.lengths) * s.runs * 4} requests, "
                 f"{len(s.slow_lengths) * s.runs} pre-warms and their raw prefills ...")
        with self._server(pol_a), \
                ReplicaSession(self.work / "replicas", "A", self.replica_spec("A", pol_a, interactive=True),
                               env=env, timeout_s=7200) as a, \
                ReplicaSession(self.work / "replicas", "R", self.replica_spec("R", None, interactive=True),
                               env=env, timeout_s=7200) as r, \
                ReplicaSession(self.work / "replicas", "R2", self.replica_spec("R2", None, interactive=True),
                               env=env, timeout_s=7200) as twin:
            for replica in (a, r, twin):
                replica.run([{"op": "generate", "ids": warmup, "tag": "warmup"}])
            time.sleep(1.0)  # the warm-up's store lands

            self._interleave_misses(a, r, twin, docs, bypassed, landed)
            for n in s.slow_lengths:
                for i, (doc_id, text) in enumerate(texts[n]):
                    [warmed] = a.run([{"op": "warm", "doc_id": doc_id, "text": text, "tag": f"prewarm:{n}:{i}"}])
                    time.sleep(_PAUSE_S)
                    r.run([{"op": "generate", "ids": warmed["ids"], "tag": f"raw:{n}:{i}"}])
                    time.sleep(_PAUSE_S)
            if s.corpus_docs:
                corpus = [(f"corpus-{i}", self._text(s.corpus_tokens, 100_000 + i)) for i in range(s.corpus_docs)]
                [warmed] = a.run([{"op": "warm_corpus", "docs": corpus, "batch_tokens": s.corpus_batch_tokens,
                                   "tag": "corpus"}])
                time.sleep(_PAUSE_S)
                r.run([{"op": "prefill_batches", "docs": warmed["ids"], "batch_tokens": s.corpus_batch_tokens,
                        "tag": "corpus_raw"}])
        for step in a.result["steps"]:  # type: ignore[index]
            if step.get("tag") in landed:
                step["landed_s"] = landed[step["tag"]]
        self.timings["replicas_A_R_s"] = round(time.perf_counter() - t0, 1)
        self.log(f"replicas A and R: done in {self.timings['replicas_A_R_s']:.0f} s")
        return a.result, r.result, twin.result  # type: ignore[return-value]

    def _interleave_misses(self, a: Any, r: Any, twin: Any, docs: dict[int, list[list[int]]],
                           bypassed: dict[str, Any], landed: dict[str, float | None]) -> None:
        """P7's requests: per length one untimed prompt in each replica, then per document A's cold request
        (its chunks waited for on the medium: ``landed``), R's raw cold request, the twin's and A's bypassed one,
        the order reversed every other document."""
        s = self.s

        def cold(n: int, i: int, ids: list[int]) -> None:
            before = _chunk_files(self.store)
            [out] = a.run([{"op": "generate", "ids": ids, "tag": f"cold:{n}:{i}"}])
            waited = _wait_chunks(self.store, before + n // s.chunk_size)
            landed[out["tag"]] = waited
            time.sleep(_PAUSE_S)

        def raw(n: int, i: int, ids: list[int]) -> None:
            r.run([{"op": "generate", "ids": ids, "tag": f"rawcold:{n}:{i}"}])
            time.sleep(_PAUSE_S)

        def raw_twin(n: int, i: int, ids: list[int]) -> None:
            twin.run([{"op": "generate", "ids": ids, "tag": f"rawtwin:{n}:{i}"}])
            time.sleep(_PAUSE_S)

        def bypass(n: int, i: int, ids: list[int]) -> None:
            a.run([{"op": "generate", "ids": _ids("bypass", n + 1, i, s.seed), "tag": f"bypass:{n}:{i}",
                    "params": bypassed}])
            time.sleep(_PAUSE_S)

        for n in s.lengths:
            # a process's first prompt of a length pays one-off costs (~1.4x at 4k here): one untimed prompt
            # of each length in both replicas first (A's bypassed: nothing stored)
            first = _ids("first", n + 1, 0, s.seed)
            a.run([{"op": "generate", "ids": first, "tag": f"first:{n}", "params": bypassed}])
            r.run([{"op": "generate", "ids": first, "tag": f"first:{n}"}])
            twin.run([{"op": "generate", "ids": first, "tag": f"first:{n}"}])
            for i, ids in enumerate(docs[n]):
                for step in ((cold, raw, raw_twin, bypass) if i % 2 == 0 else (bypass, raw_twin, raw, cold)):
                    step(n, i, ids)

    def _run_b(self, warmup: list[int], docs: dict[int, list[list[int]]],
               a_steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """B: cross-replica warm (page cache warm), each followed by its floor request; then one more load (a
        pre-warmed document) under cProfile: where a warm request's time goes in the engine process."""
        s = self.s
        steps = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        for n in s.lengths:
            for i, ids in enumerate(docs[n]):
                steps.append({"op": "generate", "ids": ids, "tag": f"warm:{n}:{i}"})
                steps.append({"op": "generate", "ids": ids, "tag": f"floor:{n}:{i}"})
        big = max(s.slow_lengths)
        steps.append({"op": "generate", "ids": a_steps[f"prewarm:{big}:0"]["ids"], "tag": "profiled", "profile": True,
                      "profile_top": 40})
        pol_b = self._policy()
        with self._server(pol_b):
            return self._replica("B", pol_b, steps)

    def _run_b_evicted(self, warmup: list[int], docs: dict[int, list[list[int]]]) -> dict[str, dict[str, Any]]:
        """B-evicted: cross-replica warm with the store's files evicted from the page cache before each load, each
        followed by its floor request; returns its steps by tag."""
        s = self.s
        steps = [{"op": "generate", "ids": warmup, "tag": "warmup"}]
        for n in s.lengths:
            for i, ids in enumerate(docs[n]):
                steps.append({"op": "fadvise", "dir": str(self.store)})
                steps.append({"op": "generate", "ids": ids, "tag": f"warm:{n}:{i}"})
                steps.append({"op": "generate", "ids": ids, "tag": f"floor:{n}:{i}"})
        pol_e = self._policy()
        with self._server(pol_e):
            be = self._replica("B-evicted", pol_e, steps)
        return self._by_tag(be)

    def _run_connectors(self, warmup: list[int], docs: dict[int, list[list[int]]]) -> dict[str, Any]:
        """O and L: P5 as the engine sees it (see :mod:`prefixshare.bench._connectors`)."""
        t0 = time.perf_counter()
        out = run_connector_pairs(self, warmup, docs)
        self.timings["replicas_O_L_s"] = round(time.perf_counter() - t0, 1)
        return out

    def _run_sweep(self, docs: dict[int, list[list[int]]]) -> dict[str, Any]:
        """C: P4's sweep around break-even (see the module's docstring); returns its plan and its replica."""
        s = self.s
        control = self.work / "throttle.json"
        pol = self._policy(mode="auto", throttle=control)
        url = f"http://127.0.0.1:{pol.server.http_port}"
        plan: dict[str, Any] = {}
        steps: list[dict[str, Any]] = [
            {"op": "throttle", "path": str(control), "chunk_delay_s": 0.0},
            {"op": "generate", "ids": _ids("warmup", s.warmup_tokens, 2, s.seed), "tag": "warmup"}]
        for n in s.sweep_lengths:
            chunks = n // s.chunk_size
            # this replica's own unthrottled load and recompute of these prompts: what the factors scale
            cal = [f"{n}:cal:{r}" for r in range(s.sweep_runs)]
            for r, tag in enumerate(cal):
                steps += self._sweep_triple(docs[n][r % s.runs], tag, url, auto=False)
            points = []
            for f in s.sweep_factors:
                points.append({"factor": f})
                steps.append({"op": "throttle", "path": str(control), "factor": f, "chunks": chunks,
                              "load_tags": [f"load:{t}" for t in cal], "recompute_tags": [f"recompute:{t}" for t in cal],
                              "tag": f"throttle:{n}:{f}"})
                for r in range(s.sweep_runs):
                    steps += self._sweep_triple(docs[n][r % s.runs], f"{n}:{f}:{r}", url)
            steps.append({"op": "throttle", "path": str(control), "chunk_delay_s": 0.0})
            plan[str(n)] = {"chunks": chunks, "calibration_tags": cal, "points": points}
        with self._server(pol):
            c = self._replica("C", pol, steps)
        return {"plan": plan, "replica": c}

    @staticmethod
    def _sweep_triple(ids: list[int], tag: str, url: str, *, auto: bool = True) -> list[dict[str, Any]]:
        """One run of a sweep point: forced load, forced recompute, auto (the server's L1 emptied before each
        load, the engine's prefix cache before each request)."""
        steps = [
            {"op": "clear_l1", "url": url},
            {"op": "generate", "ids": ids, "tag": f"load:{tag}", "reset_local": True, "params": {REQ_LOAD: "always"}},
            {"op": "generate", "ids": ids, "tag": f"recompute:{tag}", "reset_local": True,
             "params": {REQ_LOAD: "never"}},
        ]
        if auto:
            steps += [{"op": "clear_l1", "url": url},
                      {"op": "generate", "ids": ids, "tag": f"auto:{tag}", "reset_local": True}]
        return steps

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
                  b_steps: dict[str, Any], be_steps: dict[str, Any], r_steps: dict[str, Any],
                  sweep: dict[str, Any], connectors: dict[str, Any]) -> dict[str, Any]:
        from prefixshare.plan import plan

        s = self.s
        predicted = plan(s.shape, prompt_lengths=[max(s.lengths)], kv_dtype="float32").kv_bytes_per_token
        digest = self._digest()
        hashing = digest != "none"
        per_length: dict[str, Any] = {}
        for n in s.lengths:
            per_length[str(n)] = self._length_row(n, kvb, io, overhead, a_steps, b_steps, be_steps, r_steps, hashing)
        for n, row in connector_rows(connectors, s.lengths, s.p5_pairs, s.chunk_size).items():
            per_length[n]["connectors"] = row
        results = {
            "run_id": self.run_id,
            "commit": _commit(),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": s.command,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
            # how KV moves between the engines and the server (the policy's server.shm_name)
            "transport": "shared memory" if self._policy().server.shm_segment else "pickle",
            "integrity_hashing": hashing,
            "integrity": digest,
            "machine": info, "load_average_end": load_end,
            "model": {"shape": s.shape, "path": str(self.model), "kv_bytes_per_token": kvb},
            "kv_bytes_per_token": {"measured": kv_measured, "plan": predicted,
                                   "agree": kv_measured["bytes_per_token"] == predicted},
            "per_length": per_length,
            "sweep": self._sweep_results(sweep),
            "replica_stats": {"A": _slim(a.get("stats")), "C": _slim(sweep["replica"].get("stats"))},
            "connectors": {"replicas": {k: connectors[k] for k in ("O", "L")}},
            "corpus": _corpus(a_steps.get("corpus"), r_steps.get("corpus_raw")),
            "timings": self.timings,
            "interleaved_a_r": True,  # A and R up side by side, requests alternating (P7, P6)
        }
        results["goals"] = evaluate(results)
        return results

    def _length_row(self, n: int, kvb: int, io: dict[str, Any], overhead: dict[str, Any], a_steps: dict[str, Any],
                    b_steps: dict[str, Any], be_steps: dict[str, Any], r_steps: dict[str, Any],
                    hashing: bool) -> dict[str, Any]:
        """One prompt length: TTFTs against the raw engine and the floor (P1, P2), the miss overhead (P7), the
        store's I/O (P3), the overhead (P5) and, at the P6 lengths, pre-warm."""
        s = self.s
        raw_cold = summary(self._series(r_steps, "rawcold", n))
        twin = self._series(r_steps, "rawtwin", n)
        cold = summary(self._series(a_steps, "cold", n))
        bypass = summary(self._series(a_steps, "bypass", n))
        warm = summary(self._series(b_steps, "warm", n))
        one = summary(self._series(b_steps, "floor", n))
        loaded = [b_steps[f"warm:{n}:{i}"]["num_cached_tokens"] for i in range(s.runs)]
        floor_hits = [b_steps[f"floor:{n}:{i}"]["num_cached_tokens"] for i in range(s.runs)]
        kv_bytes = n * kvb
        floor = _floor(kv_bytes, one["median"], io[str(n)], hashing, evicted=False)
        row: dict[str, Any] = {
            "tokens": n, "prompt_tokens": n + 1, "kv_bytes": kv_bytes,
            "raw_cold_ttft_s": raw_cold, "cold_ttft_s": cold, "warm_ttft_s": warm,
            "warm_loaded_tokens": loaded,
            "speedup_raw_cold_over_warm": raw_cold["median"] / warm["median"],
            "speedup_cold_over_warm": cold["median"] / warm["median"],
            "one_token_ttft_s": one, "one_token_cached_tokens": floor_hits,
            "floor_s": floor, "warm_over_floor": warm["median"] / floor["total_s"],
            "bypassed_cold_ttft_s": bypass,
            "raw_twin_cold_ttft_s": summary(twin) if twin else None,
            "miss_overhead": {**_miss_overhead(cold, raw_cold, bypass, a_steps, n, s.runs, overhead[str(n)]),
                              # two raw engines on the same prompts: what P7's two processes differ by unaided
                              "raw_twin_ratio": statistics.median(twin) / raw_cold["median"] if twin else None},
            "io": io[str(n)],
            "overhead_us": overhead[str(n)],
            "overhead_pct_of_warm_ttft": overhead[str(n)]["total_us"] / 1e6 / warm["median"] * 100,
            "overhead_pct_of_cold_ttft": overhead[str(n)]["total_us"] / 1e6 / cold["median"] * 100,
        }
        if be_steps:
            warm_ev = summary(self._series(be_steps, "warm", n))
            one_ev = summary(self._series(be_steps, "floor", n))
            floor_ev = _floor(kv_bytes, one_ev["median"], io[str(n)], hashing, evicted=True)
            row.update({"warm_evicted_ttft_s": warm_ev, "one_token_evicted_ttft_s": one_ev,
                        "floor_evicted_s": floor_ev, "warm_evicted_over_floor": warm_ev["median"] / floor_ev["total_s"],
                        "warm_evicted_loaded_tokens": [be_steps[f"warm:{n}:{i}"]["num_cached_tokens"]
                                                       for i in range(s.runs)]})
        row["fs_l2_over_raw"] = _over_raw(io[str(n)], "fs_l2")
        row["fs_l2_plain_over_raw"] = _over_raw(io[str(n)], "fs_l2_plain")
        if "fs_l2_native" in io[str(n)]:
            row["fs_l2_native_over_raw"] = _over_raw(io[str(n)], "fs_l2_native")
        if n in s.slow_lengths:
            prewarm = summary(self._series(a_steps, "prewarm", n))
            raw_prefill = summary(self._series(r_steps, "raw", n))
            row.update({"prewarm_s": prewarm, "prewarm_tokens": len(a_steps[f"prewarm:{n}:0"]["ids"]),
                        "raw_prefill_s": raw_prefill, "prewarm_over_raw": prewarm["median"] / raw_prefill["median"],
                        "prewarm_phases_s": self._phases(a_steps, n)})
        return row

    def _phases(self, a_steps: dict[str, dict[str, Any]], n: int) -> dict[str, float]:
        """warm()'s own timing of its steps (its report's ``phases``), the median per step over P6's runs."""
        reports = [a_steps[f"prewarm:{n}:{i}"].get("report") or {} for i in range(self.s.runs)
                   if f"prewarm:{n}:{i}" in a_steps]
        names = list(reports[0].get("phases") or {}) if reports else []
        return {name: statistics.median(r["phases"][name] for r in reports if name in r.get("phases", {}))
                for name in names}

    def _sweep_results(self, sweep: dict[str, Any]) -> dict[str, Any]:
        """P4 per length and point: forced load, forced recompute and auto (same replica, interleaved), the
        ratio the throttle achieved, the decisions auto took and its regret."""
        s, c = self.s, sweep["replica"]
        steps = self._by_tag(c)
        out: dict[str, Any] = {"per_length": {}, "decisions": ((c.get("stats") or {}).get("cost") or {}).get(
            "decisions"), "estimates": ((c.get("stats") or {}).get("cost") or {}).get("estimates")}
        for n_key, plan in sweep["plan"].items():
            n = int(n_key)
            cal = plan["calibration_tags"]
            calibration = {"load_s": summary([steps[f"load:{t}"]["seconds"] for t in cal]),
                           "recompute_s": summary([steps[f"recompute:{t}"]["seconds"] for t in cal])}
            points = []
            for p in plan["points"]:
                throttle = steps[f"throttle:{n}:{p['factor']}"]
                p = {**p, "chunk_delay_s": throttle["chunk_delay_s"], "target_load_s": throttle["target_s"]}
                tags = [f"{n}:{p['factor']}:{r}" for r in range(s.sweep_runs)]
                load = summary([steps[f"load:{t}"]["seconds"] for t in tags])
                recompute = summary([steps[f"recompute:{t}"]["seconds"] for t in tags])
                auto = summary([steps[f"auto:{t}"]["seconds"] for t in tags])
                auto_loaded = [steps[f"auto:{t}"]["num_cached_tokens"] for t in tags]
                choices = ["load" if k >= s.chunk_size else "recompute" for k in auto_loaded]
                best = min(load["median"], recompute["median"])
                better = "load" if load["median"] < recompute["median"] else "recompute"
                points.append({
                    **p, "load_s": load, "recompute_s": recompute, "auto_s": auto,
                    "load_loaded_tokens": [steps[f"load:{t}"]["num_cached_tokens"] for t in tags],
                    "recompute_loaded_tokens": [steps[f"recompute:{t}"]["num_cached_tokens"] for t in tags],
                    "auto_loaded_tokens": auto_loaded, "auto_choices": choices,
                    "achieved_load_over_recompute": load["median"] / recompute["median"],
                    "better": better, "right_choices": sum(ch == better for ch in choices),
                    "regret": auto["median"] / best,
                })
            out["per_length"][n_key] = {"chunks": plan["chunks"], "calibration": calibration, "points": points}
        return out


#: after each of A's and R's requests: the replica's background threads (stats writer, OpenMP's spinning workers)
#: settle before the other replica's request starts
_PAUSE_S = 0.2


def _chunk_files(store: Path) -> int:
    """Chunk files (``*.data``) in the fs store: what has landed on the medium."""
    return sum(name.endswith(".data") for _, _, names in os.walk(store) for name in names)


def _wait_chunks(store: Path, expected: int, timeout_s: float = 120.0) -> float | None:
    """Seconds until ``expected`` chunk files are in the store (None: not within ``timeout_s``)."""
    t0 = time.perf_counter()
    while _chunk_files(store) < expected:
        if time.perf_counter() - t0 > timeout_s:
            return None
        time.sleep(0.005)
    return time.perf_counter() - t0


def _floor(kv_bytes: int, one_token_s: float, io: dict[str, Any], hashing: bool, *, evicted: bool) -> dict[str, Any]:
    """P2's floor: the replica's own one-token TTFT with the prefix cached (measured) + the KV bytes through each
    stage of the copy path at that stage's best measured bandwidth: the medium's raw sequential read (page cache
    or evicted), the digest (when the tier checks integrity: it hashes each chunk in the thread that read it, after
    the read) and one copy into the engine's memory. The server reads the chunks from L2 during the lookup and
    the engine copies them after it, so the stages add; each at its best, so the sum cannot be beaten."""
    read = max(io["raw"]["read_evicted_gbps" if evicted else "read_warm_gbps"]["values"]) * 1e9
    hash_bw = max(io["copy"]["hash_gbps"]["values"]) * 1e9
    copy_bw = max(io["copy"]["copy_gbps"]["values"]) * 1e9
    terms = {"one_token_s": one_token_s, "read_s": kv_bytes / read, "hash_s": kv_bytes / hash_bw if hashing else 0.0,
             "copy_s": kv_bytes / copy_bw}
    return {**terms, "total_s": sum(terms.values()), "read_gbps": read / 1e9, "hash_gbps": hash_bw / 1e9,
            "copy_gbps": copy_bw / 1e9}


def _corpus(warmed: dict[str, Any] | None, raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """P6's corpus: one warm() call over every document against the raw engine prefilling the same token ids in
    the same batches (replica R, run after A): documents/s, tokens/s, KV GB/s of each, and the store's write
    rate from warm's progress reports (KV bytes of the call's chunks found in the fs tier, over time)."""
    if not warmed or not raw:
        return None
    totals, rates = warmed["report"]["totals"], warmed["report"]["rates"]
    docs, kv = totals["warmed"], totals["warmed_bytes"]
    stored = [p for p in warmed.get("progress", []) if p.get("stored_bytes") is not None]
    last = stored[-1] if stored else None
    return {
        "documents": totals["documents"], "warmed": docs, "failed": totals["failed"], "tokens": raw["tokens"],
        "kv_bytes": kv, "warm_s": warmed["seconds"], "raw_s": raw["seconds"], "raw_batches": raw["batches"],
        "warm_over_raw": warmed["seconds"] / raw["seconds"],
        "warm_documents_per_s": docs / warmed["seconds"], "raw_documents_per_s": totals["documents"] / raw["seconds"],
        "warm_kv_gbps": kv / warmed["seconds"] / 1e9, "raw_kv_gbps": kv / raw["seconds"] / 1e9,
        "warm_prefill_s": rates.get("prefill_s"),
        "store_write_gbps_during_prefill": (last["stored_bytes"] / last["elapsed_s"] / 1e9
                                            if last and last["elapsed_s"] > 0 else None),
        "progress": warmed.get("progress", []), "verified": totals.get("verified"),
        "retried": totals.get("retried"), "paced_s": warmed["report"].get("paced_seconds"),
        "phases": warmed["report"].get("phases"),
    }


def _miss_overhead(cold: dict[str, Any], raw_cold: dict[str, Any], bypass: dict[str, Any], a_steps: dict[str, Any],
                   n: int, runs: int, overhead: dict[str, Any]) -> dict[str, Any]:
    """P7 at one length: cold TTFT with prefixshare / the raw engine's (another process, run after: the goal), and
    the same against prompts of the same length that prefixshare left alone in the same process, interleaved
    (``in_process_ratio``: what the lookup and the store copy add, without the drift between processes). The
    in-process difference is split into the lookup that missed (the connector's own timing of it), prefixshare's
    calls (P5, in-process) and the rest — the copy of the KV into the server and anything else — by difference."""
    lookups = []
    for i in range(runs):
        st = (a_steps.get(f"cold:{n}:{i}") or {}).get("stats") or {}
        if st.get("lookup_ms_last") is not None:
            lookups.append(st["lookup_ms_last"] / 1e3)
    pairs = [a_steps[f"cold:{n}:{i}"]["seconds"] - a_steps[f"bypass:{n}:{i}"]["seconds"] for i in range(runs)
             if f"cold:{n}:{i}" in a_steps and f"bypass:{n}:{i}" in a_steps]
    # what the bypassed requests did, from the connector's counters before and after each (must be nothing)
    touched = {"lookups": 0, "tokens_stored": 0, "tokens_loaded": 0}
    order = list(a_steps)
    for i in range(runs):
        tag = f"bypass:{n}:{i}"
        before = a_steps[order[order.index(tag) - 1]].get("stats") or {}
        after = a_steps[tag].get("stats") or {}
        for key in touched:
            touched[key] += (after.get(key) or 0) - (before.get(key) or 0)
    added = statistics.median(pairs) if pairs else float("nan")
    lookup = statistics.median(lookups) if lookups else None
    ours = overhead["total_us"] / 1e6
    landed = [a_steps[f"cold:{n}:{i}"].get("landed_s") for i in range(runs) if f"cold:{n}:{i}" in a_steps]
    on_disk = [x for x in landed if x is not None]
    return {"ratio": cold["median"] / raw_cold["median"], "in_process_ratio": cold["median"] / bypass["median"],
            "added_s": added, "added_values_s": pairs, "lookup_s": lookup, "ours_s": ours,
            "rest_s": added - (lookup or 0.0) - ours, "lookup_values_s": lookups, "bypassed_did": touched,
            # when each cold request's chunks were all on the store's medium, from its first token (None: not
            # within the wait; absent in runs where A and R ran one after the other)
            "landed_s": statistics.median(on_disk) if on_disk else None, "landed_values_s": landed}


def _over_raw(io: dict[str, Any], src: str) -> dict[str, float]:
    """One length's fs L2 adapter throughput over raw sequential I/O: write, read (page cache warm), read evicted."""
    fs, rw = io[src], io["raw"]
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


def floor_check(results: dict[str, Any]) -> dict[str, Any]:
    """Every warm/floor ratio against :data:`FLOOR_TOLERANCE`: ``{"ok": bool, "beaten": [...]}``."""
    beaten = []
    for n, row in results["per_length"].items():
        for key in ("warm_over_floor", "warm_evicted_over_floor"):
            if key in row and row[key] < FLOOR_TOLERANCE:
                beaten.append({"tokens": int(n), "ratio": key, "value": row[key]})
    return {"tolerance": FLOOR_TOLERANCE, "ok": not beaten, "beaten": beaten}


def evaluate(results: dict[str, Any]) -> dict[str, Any]:
    """Pass/fail of every goal, with the measured values it was judged on."""
    rows = results["per_length"]
    lengths = sorted(int(n) for n in rows)
    at = "4096" if "4096" in rows else str(lengths[-1])
    goals: dict[str, Any] = {}
    p1 = rows[at]["speedup_raw_cold_over_warm"]
    goals["P1"] = {**GOALS["P1"], "at_tokens": int(at), "value": p1, "pass": p1 >= GOALS["P1"]["min"],
                   "per_length": {n: r["speedup_raw_cold_over_warm"] for n, r in rows.items()}}
    p2 = {n: r["warm_over_floor"] for n, r in rows.items()}
    p2e = {n: r["warm_evicted_over_floor"] for n, r in rows.items() if "warm_evicted_over_floor" in r}
    worst = max([*p2.values(), *p2e.values()])
    goals["P2"] = {**GOALS["P2"], "value": worst, "pass": worst <= GOALS["P2"]["max"], "page_cache_warm": p2,
                   "evicted": p2e or None, "floor_check": floor_check(results)}
    p3 = {n: r["fs_l2_over_raw"] for n, r in rows.items()}
    worst3 = min(v for d in p3.values() for v in d.values())
    goals["P3"] = {**GOALS["P3"], "value": worst3, "pass": worst3 >= GOALS["P3"]["min"], "per_length": p3,
                   "lmcache_plain_adapter": {n: r["fs_l2_plain_over_raw"] for n, r in rows.items()},
                   "lmcache_native_adapter": {n: r.get("fs_l2_native_over_raw") for n, r in rows.items()}}
    regrets = {f"{n}@{p['factor']}": p["regret"] for n, d in results["sweep"]["per_length"].items()
               for p in d["points"]}
    goals["P4"] = {**GOALS["P4"], "value": max(regrets.values()), "pass": max(regrets.values()) <= GOALS["P4"]["max"],
                   "per_point": regrets}
    goals["P5"] = _p5_goal(rows)
    us = {n: r["overhead_us"]["total_us"] for n, r in rows.items()}
    pct = {n: r["overhead_pct_of_warm_ttft"] for n, r in rows.items()}
    goals["P5_calls"] = {**GOALS["P5_calls"], "value_us": max(us.values()), "value_pct": max(pct.values()),
                         "pass": max(us.values()) <= GOALS["P5_calls"]["max_us"], "us": us, "pct_of_warm_ttft": pct}
    p6 = {n: r["prewarm_over_raw"] for n, r in rows.items() if "prewarm_over_raw" in r}
    if (results.get("corpus") or {}).get("warm_over_raw") is not None:
        p6["corpus"] = results["corpus"]["warm_over_raw"]
    goals["P6"] = {**GOALS["P6"], "value": max(p6.values()), "pass": max(p6.values()) <= GOALS["P6"]["max"],
                   "per_length": p6}
    p7 = {n: r["miss_overhead"]["ratio"] for n, r in rows.items()}
    twins = {n: r["miss_overhead"].get("raw_twin_ratio") for n, r in rows.items()}
    goals["P7"] = {**GOALS["P7"], "value": max(p7.values()), "pass": max(p7.values()) <= GOALS["P7"]["max"],
                   "per_length": p7,
                   # R's twin over R, per length: two raw engines' own difference, against which P7 is read
                   "raw_twin": twins if all(v is not None for v in twins.values()) else None}
    kv = results["kv_bytes_per_token"]
    goals["KV"] = {**GOALS["KV"], "value": kv["measured"]["bytes_per_token"], "plan": kv["plan"], "pass": kv["agree"]}
    return goals


def _p5_goal(rows: dict[str, Any]) -> dict[str, Any]:
    """P5 on the worst length's median paired difference; ``resolved``: whether the 95 % interval of every length
    lies on one side of the goal (else the run cannot tell pass from miss: more pairs are needed)."""
    measured = {n: r["connectors"] for n, r in rows.items() if (r.get("connectors") or {}).get("pairs")}
    if not measured:
        return {**GOALS["P5"], "value_pct": None, "pass": False, "resolved": False, "per_length": {},
                "note": "no pair was measured"}
    pct = {n: c["added_pct_of_warm_ttft"] for n, c in measured.items()}
    ci = {n: c["added_pct_ci95"] for n, c in measured.items()}
    goal = GOALS["P5"]["max_pct"]
    worst = max(pct.values())
    return {**GOALS["P5"], "value_pct": worst, "pass": worst <= goal and len(measured) == len(rows),
            "resolved": all(hi <= goal or lo > goal for lo, hi in ci.values()), "per_length": pct, "ci95": ci,
            "added_ms": {n: c["added_s"] * 1e3 for n, c in measured.items()}}


def run_bench(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything, write ``results.json``, the plots and (full runs) the markdown table; raise
    :class:`FloorBeaten` (after writing them) when a warm request beat P2's floor."""
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
    for name in ("store", *STORE_IO_DIRS.values()):
        shutil.rmtree(bench.work / name, ignore_errors=True)
    check = results["goals"]["P2"]["floor_check"]
    if not check["ok"]:
        raise FloorBeaten(f"a warm request beat P2's floor by more than {1 - FLOOR_TOLERANCE:.0%}: {check['beaten']}; "
                          f"the floor is not a lower bound on this machine (results: {out / 'results.json'})")
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
