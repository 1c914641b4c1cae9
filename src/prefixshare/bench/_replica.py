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
* ``{"op": "fadvise", "dir": PATH}`` — evict a directory's files from the page cache (POSIX_FADV_DONTNEED).
* ``{"op": "throttle", "path": PATH, "chunk_delay_s": S}`` — set a throttled store's delay (its control file,
  :func:`prefixshare.bench._procs.set_throttle`); the server reads it at its next load. Or, calibrated on this
  replica's own earlier steps: ``{"op": "throttle", "path": PATH, "factor": F, "load_tags": [...],
  "recompute_tags": [...], "chunks": K}`` sets the delay per chunk so that a load is predicted to take ``F`` x the
  median of the ``recompute_tags`` steps, the ``load_tags`` steps being the unthrottled loads (never under 0).
* ``{"op": "sleep", "seconds": S}`` — wait (e.g. for the store's health check to pass again).
* ``{"op": "clear_l1", "url": "http://HOST:HTTP_PORT"}`` — empty the MP server's L1 (``POST /cache/clear``), so
  that the next load reads the store's medium (L2) again, not the server's memory.

The engine is wired with the connector's keyword arguments directly (no server check), so a replica may
talk to a server whose L2 tier prefixshare's policy does not describe (the benchmarks' throttled store).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
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
    started = time.perf_counter()
    llm, read_stats, ps = _start_engine(spec, engine)
    result: dict[str, Any] = {"engine_s": time.perf_counter() - started, "steps": []}
    requests = 0
    for step in spec["steps"]:
        out: dict[str, Any] = {"op": step["op"], "tag": step.get("tag")}
        if step["op"] == "generate":
            out.update(_generate(llm, step))
            requests += 1
            if read_stats is not None and step.get("stats", True):
                stats = _settled_stats(read_stats, requests)
                out["stats"] = {k: stats.get(k) for k in ("tokens_loaded", "hits", "lookups", "fallbacks",
                                                          "tokens_stored", "requests")}
                lookup_ms = stats.get("lookup_ms") or {}
                out["stats"]["lookup_ms_last"] = lookup_ms.get("last") if isinstance(lookup_ms, dict) else None
        elif step["op"] == "warm":
            out.update(_warm(llm, ps, step))
            requests += 1
        elif step["op"] == "fadvise":
            t0 = time.perf_counter()
            out["bytes"] = evict_dir(step["dir"])
            out["seconds"] = time.perf_counter() - t0
        elif step["op"] == "throttle":
            from prefixshare.bench._procs import set_throttle

            delay = float(step.get("chunk_delay_s", 0.0))
            if "factor" in step:
                seconds = {s["tag"]: s["seconds"] for s in result["steps"] if s.get("tag") and "seconds" in s}
                recompute = statistics.median(seconds[t] for t in step["recompute_tags"])
                load = statistics.median(seconds[t] for t in step["load_tags"])
                out.update(recompute_s=recompute, load_s=load, target_s=float(step["factor"]) * recompute)
                delay = max(0.0, out["target_s"] - load) / int(step["chunks"])
            set_throttle(step["path"], chunk_delay_s=delay, read_gbps=step.get("read_gbps"))
            out["chunk_delay_s"] = delay
        elif step["op"] == "sleep":
            time.sleep(float(step["seconds"]))
        elif step["op"] == "clear_l1":
            import httpx

            t0 = time.perf_counter()
            httpx.post(step["url"].rstrip("/") + "/cache/clear", json={"tier": "l1"}, timeout=30).raise_for_status()
            out["seconds"] = time.perf_counter() - t0
        else:
            raise ValueError(f"unknown step {step['op']!r}")
        result["steps"].append(out)
    if read_stats is not None:
        result["stats"] = _settled_stats(read_stats, requests)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown: the process is done


def _start_engine(spec: dict[str, Any], engine: dict[str, Any]) -> tuple[Any, Callable[[], dict[str, Any]] | None, Any]:
    """The engine (the raw engine when the spec's policy is ``null``), a reader of its prefixshare stats (None for
    the raw engine) and, when a step pre-warms, the :class:`~prefixshare.share.PrefixShare` it warms through."""
    import vllm

    ps = None
    read_stats = None
    if spec.get("policy") is None:
        llm = vllm.LLM(**engine)
    else:
        from prefixshare.runtime import read_stats as _read_stats
        from prefixshare.adapters.vllm import engine_kwargs
        from prefixshare.policies import policy_from_mapping

        policy = policy_from_mapping(spec["policy"], source="bench spec")
        llm = vllm.LLM(**engine_kwargs(policy, instance=spec["instance"], **engine))

        def read_stats() -> dict[str, Any]:
            return _read_stats(spec["instance"])

        if any(step["op"] == "warm" for step in spec["steps"]):
            from prefixshare.share import PrefixShare

            ps = PrefixShare(policy, server=False, instance=spec["instance"])
            ps.engines.append(llm)
    return llm, read_stats, ps


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


if __name__ == "__main__":
    main()
