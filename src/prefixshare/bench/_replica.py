"""One benchmark replica in its own process: ``python -m prefixshare.bench._replica SPEC.json``.

A fresh process per replica is the point: nothing is shared with another replica but the store. The spec
names the model, the engine's keyword arguments, the policy (``null``: vLLM without prefixshare, the raw
engine) and a list of steps; the replica prints one ``RESULT {json}`` line on stdout (logs go to stderr).

Steps (each may carry a ``tag`` that is copied into its result):

* ``{"op": "generate", "ids": [...], "params": {...}, "max_tokens": 1, "reset_local": false}`` — one
  request; its wall time is the TTFT when ``max_tokens`` is 1 (the prefill or the load, plus one token).
  ``reset_local`` empties the engine's own prefix cache first (so the prompt is computed or loaded from the
  store, never served from this replica's memory); ``profile: true`` adds a cProfile summary of the request
  (the engine runs in this process: scheduler, worker and connector).
* ``{"op": "warm", "doc_id": ID, "text": TEXT}`` — :func:`prefixshare.warm.warm` on one document (the
  pre-warm path); returns its wall time, the report and the document's prefix token ids.
* ``{"op": "warm_corpus", "docs": [[ID, TEXT], ...], "batch_tokens": N}`` — :func:`prefixshare.warm.warm`
  over a whole corpus in one call (P6's corpus); returns its wall time, the report's totals and rates, the
  store's bytes written as the progress reported them, and every document's prefix token ids.
* ``{"op": "prefill_batches", "docs": [[ids...], ...], "batch_tokens": N}`` — the same documents prefilled by
  this engine in batches of about N tokens, as warm batches them (the raw engine's reference for the corpus).
* ``{"op": "fadvise", "dir": PATH}`` — evict a directory's files from the page cache (POSIX_FADV_DONTNEED).
* ``{"op": "throttle", "path": PATH, "chunk_delay_s": S}`` — set a throttled store's delay (its control file,
  :func:`prefixshare.bench._procs.set_throttle`); the server reads it at its next load. Or, calibrated on this
  replica's own earlier steps: ``{"op": "throttle", "path": PATH, "factor": F, "load_tags": [...],
  "recompute_tags": [...], "chunks": K}`` sets the delay per chunk so that a load is predicted to take ``F`` x the
  median of the ``recompute_tags`` steps, the ``load_tags`` steps being the unthrottled loads (never under 0).
* ``{"op": "sleep", "seconds": S}`` — wait (e.g. for the store's health check to pass again).
* ``{"op": "threads"}`` — this process's threads now (:func:`thread_counters`): for each, its Python name (or the
  kernel's, for threads Python did not start: OpenMP's, gloo's), CPU seconds and context switches so far.
* ``{"op": "clear_l1", "url": "http://HOST:HTTP_PORT"}`` — empty the MP server's L1 (``POST /cache/clear``), so
  that the next load reads the store's medium (L2) again, not the server's memory.

The engine is wired with the connector's keyword arguments directly (no server check), so a replica may
talk to a server whose L2 tier prefixshare's policy does not describe (the benchmarks' throttled store).

``"connector": "lmcache"`` wires LMCache's own ``LMCacheMPConnector`` to the policy's server instead of
prefixshare's (the same server settings; no policy, no namespace: LMCache keys by the model's name), the
baseline that shows what prefixshare's connector adds. ``"hook_timings": true`` times prefixshare's work in
each of its connector's hooks (the scheduler side's and worker side's methods, around LMCache's own) and
adds, to each ``generate`` step, the µs and calls of each in that request (``hooks``).

``"interactive": true``: after the engine starts the replica prints ``READY``, then reads one JSON object per
line on stdin — ``{"steps": [...]}`` runs those steps and prints ``STEPS [results]``; ``{"exit": true}`` ends
with the ``RESULT`` line — so that a driver can interleave the requests of two replicas
(:class:`prefixshare.bench._procs.ReplicaSession`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixshare._env import VLLM_QUIET

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: ~3 s start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (else vLLM wants 92 % of RAM)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _key, _value in VLLM_QUIET.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def reset_local_cache(llm: Any, timeout_s: float = 10.0) -> bool:
    """Empty the engine's local prefix cache (vLLM refuses while a connector still holds blocks: step it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if llm.reset_prefix_cache() is not False:
            return True
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.01)


def evict_dir(path: str) -> int:
    """POSIX_FADV_DONTNEED every file under ``path``; returns the bytes advised."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                fd = os.open(full, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def _settled_stats(read: Any, requests: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """Stats once the scheduler has published ``requests`` finished requests (snapshots lag by <= 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        if stats.get("requests", 0) >= requests or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _top(profiler: Any, n: int) -> list[dict[str, Any]]:
    """The ``n`` functions with the most cumulative time (and their own time) of a cProfile run."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{path.rsplit('site-packages/', 1)[-1]}:{line}({name})", "calls": calls,
                     "own_s": round(own, 4), "cumulative_s": round(cum, 4)})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:n]


def main() -> None:
    spec = json.loads(open(sys.argv[1], encoding="utf-8").read())
    from prefixshare._log import configure

    configure(level=spec.get("log_level", "WARNING"), json=True)
    import vllm  # noqa: F401 - loaded here, once the logs are configured (the step helpers use it)

    from prefixshare.adapters.vllm import fix_in_process_engine

    fix_in_process_engine()
    engine = {"model": spec["model"], "dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni",
              "block_size": 32, "enable_prefix_caching": True, "seed": 0, **spec.get("engine", {})}
    hooks = HookTimer() if spec.get("hook_timings") else None
    started = time.perf_counter()
    llm, read_stats, ps = _start_engine(spec, engine)
    runner = _Steps(llm, read_stats, ps, hooks)
    result: dict[str, Any] = {"engine_s": time.perf_counter() - started, "steps": runner.done}
    if spec.get("interactive"):
        _line("READY")
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("exit"):
                break
            _line("STEPS " + json.dumps([runner.run(step) for step in message["steps"]]))
    else:
        for step in spec["steps"]:
            runner.run(step)
    if read_stats is not None:
        result["stats"] = _settled_stats(read_stats, runner.requests)
    _line("RESULT " + json.dumps(result))
    os._exit(0)  # skip engine teardown: the process is done


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _Steps:
    """Runs steps on one engine, keeping every result (``done``) and the count of requests it sent."""

    def __init__(self, llm: Any, read_stats: Callable[[], dict[str, Any]] | None, ps: Any,
                 hooks: HookTimer | None) -> None:
        self.llm, self.read_stats, self.ps, self.hooks = llm, read_stats, ps, hooks
        self.done: list[dict[str, Any]] = []
        self.requests = 0

    def run(self, step: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"op": step["op"], "tag": step.get("tag")}
        if step["op"] == "generate":
            before = self.hooks.snapshot() if self.hooks is not None else None
            out.update(_generate(self.llm, step))
            if before is not None:
                out["hooks"] = self.hooks.since(before)  # type: ignore[union-attr]
            self.requests += 1
            if self.read_stats is not None and step.get("stats", True):
                stats = _settled_stats(self.read_stats, self.requests)
                out["stats"] = {k: stats.get(k) for k in ("tokens_loaded", "hits", "lookups", "fallbacks",
                                                          "tokens_stored", "requests")}
                # the cost model's decisions so far, by phase:choice (a lookup abandoned at its deadline shows here)
                out["stats"]["cost_decisions"] = (stats.get("cost") or {}).get("decisions")
                lookup_ms = stats.get("lookup_ms") or {}
                out["stats"]["lookup_ms_last"] = lookup_ms.get("last") if isinstance(lookup_ms, dict) else None
        elif step["op"] == "warm":
            out.update(_warm(self.llm, self.ps, step))
            self.requests += 1
        elif step["op"] == "warm_corpus":
            out.update(_warm_corpus(self.llm, self.ps, step))
            self.requests += out["report"]["totals"]["warmed"]
        elif step["op"] == "prefill_batches":
            out.update(_prefill_batches(self.llm, step))
            self.requests += len(step["docs"])
        elif step["op"] == "throttle":
            out.update(_throttle(step, self.done))
        else:
            out.update(_other_step(step))
        self.done.append(out)
        return out


def _throttle(step: dict[str, Any], done: list[dict[str, Any]]) -> dict[str, Any]:
    from prefixshare.bench._procs import set_throttle

    out: dict[str, Any] = {}
    delay = float(step.get("chunk_delay_s", 0.0))
    if "factor" in step:
        seconds = {s["tag"]: s["seconds"] for s in done if s.get("tag") and "seconds" in s}
        recompute = statistics.median(seconds[t] for t in step["recompute_tags"])
        load = statistics.median(seconds[t] for t in step["load_tags"])
        out.update(recompute_s=recompute, load_s=load, target_s=float(step["factor"]) * recompute)
        delay = max(0.0, out["target_s"] - load) / int(step["chunks"])
    set_throttle(step["path"], chunk_delay_s=delay, read_gbps=step.get("read_gbps"))
    out["chunk_delay_s"] = delay
    return out


def thread_counters(pid: int | None = None) -> dict[str, dict[str, Any]]:
    """Every thread of this process (``/proc/self/task``) by kernel thread id: ``name`` (the Python thread's name
    where Python started it, else the kernel's ``comm``), ``cpu_s`` (user + system), ``voluntary`` and
    ``involuntary`` context switches since it started. Two readings around a request say which threads ran, and
    which were preempted, during it."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, Any]] = {}
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[task.name] = {"name": names.get(int(task.name), comm), "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
                          "voluntary": int(status["voluntary_ctxt_switches"]),
                          "involuntary": int(status["nonvoluntary_ctxt_switches"])}
    return out


def _other_step(step: dict[str, Any]) -> dict[str, Any]:
    """``fadvise``, ``sleep``, ``threads`` and ``clear_l1``."""
    out: dict[str, Any] = {}
    if step["op"] == "fadvise":
        t0 = time.perf_counter()
        out["bytes"] = evict_dir(step["dir"])
        out["seconds"] = time.perf_counter() - t0
    elif step["op"] == "sleep":
        time.sleep(float(step["seconds"]))
    elif step["op"] == "threads":
        out["threads"] = thread_counters()
    elif step["op"] == "clear_l1":
        import httpx

        t0 = time.perf_counter()
        httpx.post(step["url"].rstrip("/") + "/cache/clear", json={"tier": "l1"}, timeout=30).raise_for_status()
        out["seconds"] = time.perf_counter() - t0
    else:
        raise ValueError(f"unknown step {step['op']!r}")
    return out


#: prefixshare's own work in its vLLM connector, per hook: (class path, method) — what runs around LMCache's
HOOKS = [
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "on_tracker"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "before_lookup"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "load_failed"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "after_lookup"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "loading"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "on_step_scheduled"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "on_connector_output"),
    ("prefixshare.adapters.vllm.connector:SchedulerSide", "before_request_finished"),
    ("prefixshare.runtime:ConnectorRuntime", "finish"),
    ("prefixshare.adapters.vllm.connector:WorkerSide", "gate"),
]


class HookTimer:
    """Wraps each of :data:`HOOKS` (class attributes, so every instance in this process) with a timer:
    calls and nanoseconds per hook, read as differences between snapshots. The wrapper's own cost (~0.2 µs a
    call) is included."""

    def __init__(self) -> None:
        import importlib

        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        for path, name in HOOKS:
            module, cls_name = path.split(":")
            cls = getattr(importlib.import_module(module), cls_name)
            key = f"{cls_name}.{name}"
            self.ns[key] = self.calls[key] = 0
            setattr(cls, name, self._wrap(key, cls.__dict__[name]))

    def _wrap(self, key: str, raw: Any) -> Any:
        import functools

        clock, ns, calls = time.perf_counter_ns, self.ns, self.calls
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[key] += clock() - t0
                calls[key] += 1

        return staticmethod(timed) if isinstance(raw, staticmethod) else timed

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.ns), dict(self.calls)

    def since(self, before: tuple[dict[str, int], dict[str, int]]) -> dict[str, dict[str, float]]:
        ns0, calls0 = before
        return {k: {"us": round((self.ns[k] - ns0[k]) / 1e3, 2), "calls": self.calls[k] - calls0[k]}
                for k in self.ns if self.calls[k] != calls0[k]}


def _start_engine(spec: dict[str, Any], engine: dict[str, Any]) -> tuple[Any, Callable[[], dict[str, Any]] | None, Any]:
    """The engine (the raw engine when the spec's policy is ``null``), a reader of its prefixshare stats (None for
    the raw engine) and, when a step pre-warms, the :class:`~prefixshare.share.PrefixShare` it warms through."""
    import vllm

    ps = None
    read_stats = None
    if spec.get("policy") is None:
        llm = vllm.LLM(**engine)
    elif spec.get("connector") == "lmcache":
        from prefixshare.policies import policy_from_mapping

        policy = policy_from_mapping(spec["policy"], source="bench spec")
        llm = vllm.LLM(**engine, kv_transfer_config=lmcache_transfer_config(policy))
    else:
        from prefixshare.runtime import read_stats as _read_stats
        from prefixshare.adapters.vllm import engine_kwargs
        from prefixshare.policies import policy_from_mapping

        policy = policy_from_mapping(spec["policy"], source="bench spec")
        llm = vllm.LLM(**engine_kwargs(policy, instance=spec["instance"], **engine))

        def read_stats() -> dict[str, Any]:
            return _read_stats(spec["instance"])

        if spec.get("interactive") or any(step["op"] == "warm" for step in spec.get("steps", [])):
            from prefixshare.share import PrefixShare

            ps = PrefixShare(policy, server=False, instance=spec["instance"])
            ps.engines.append(llm)
    return llm, read_stats, ps


def lmcache_transfer_config(policy: Any) -> dict[str, Any]:
    """LMCache's own MP connector on the policy's server, with the settings prefixshare's connector gives it
    (RPC timeout, heartbeat, recompute on a failed load): the same transport, none of prefixshare's work."""
    from prefixshare.adapters.vllm import kv_transfer_config

    ours = kv_transfer_config(policy, instance="lmcache-plain")
    extra = {k: v for k, v in ours["kv_connector_extra_config"].items() if k.startswith("lmcache.")}
    return {**ours, "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_connector_extra_config": extra}


def _generate(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    """A ``generate`` step: one request (after emptying the local prefix cache if asked), its wall time, its
    output and, if asked, a cProfile summary of it."""
    import vllm

    out: dict[str, Any] = {}
    if step.get("reset_local"):
        out["reset"] = reset_local_cache(llm)
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=step.get("max_tokens", 1), logprobs=1, ignore_eos=True, detokenize=False,
        extra_args={"kv_transfer_params": step["params"]} if step.get("params") else None,
    )
    profiler = None
    if step.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": step["ids"]}], params, use_tqdm=False)[0]
    out["seconds"] = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        out["profile"] = _top(profiler, int(step.get("profile_top", 30)))
    comp = res.outputs[0]
    out["token_ids"] = list(comp.token_ids)
    out["logprobs"] = [lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids, strict=False)]
    out["prompt_tokens"] = len(step["ids"])
    out["num_cached_tokens"] = int(res.num_cached_tokens or 0)
    return out


def _warm(llm: Any, ps: Any, step: dict[str, Any]) -> dict[str, Any]:
    """A ``warm`` step: the document's prefix token ids, then :func:`prefixshare.warm.warm`'s wall time and report."""
    from prefixshare.warm import warm
    from prefixshare.warm import as_template, prefix_ids

    out: dict[str, Any] = {}
    tok = llm.get_tokenizer()
    out["ids"] = prefix_ids(tok, as_template(None).resolve(tok), step["text"])
    t0 = time.perf_counter()
    report = warm(ps, {step["doc_id"]: step["text"]}, llm, strict=False)
    out["seconds"] = time.perf_counter() - t0
    out["report"] = report.to_dict()
    return out


def _warm_corpus(llm: Any, ps: Any, step: dict[str, Any]) -> dict[str, Any]:
    """A ``warm_corpus`` step: one warm() call over every document, its progress reports kept."""
    from prefixshare.warm import as_template, prefix_ids, warm

    tok = llm.get_tokenizer()
    template = as_template(None).resolve(tok)
    samples: list[dict[str, Any]] = []

    def progress(p: Any) -> None:
        samples.append({"phase": p.phase, "elapsed_s": round(p.elapsed_s, 3), "bytes_done": p.bytes_done,
                        "stored_bytes": p.stored_bytes, "documents_done": p.documents_done})

    t0 = time.perf_counter()
    report = warm(ps, dict(step["docs"]), llm, strict=False, batch_tokens=int(step["batch_tokens"]),
                  progress=progress)
    seconds = time.perf_counter() - t0
    full = report.to_dict()
    keys = ("totals", "rates", "ok", "verification", "phases", "paced_seconds")
    return {"seconds": seconds, "report": {k: full[k] for k in keys},
            "progress": samples, "ids": [prefix_ids(tok, template, text) for _, text in step["docs"]]}


def _prefill_batches(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    """A ``prefill_batches`` step: the documents in warm's batches, one token each, timed as a whole."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    batches: list[list[list[int]]] = [[]]
    size = 0
    for ids in step["docs"]:
        if batches[-1] and size + len(ids) > int(step["batch_tokens"]):
            batches.append([])
            size = 0
        batches[-1].append(ids)
        size += len(ids)
    t0 = time.perf_counter()
    for batch in batches:
        llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    return {"seconds": time.perf_counter() - t0, "batches": len(batches),
            "tokens": sum(len(ids) for ids in step["docs"])}


if __name__ == "__main__":
    main()
