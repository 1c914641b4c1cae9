"""Test-only: one side of a store-level transfer through an L2 tier's adapter, run inside a lab node.

``python transfer.py SPEC.json`` prints one ``RESULT {json}`` line. The spec::

    {"role": "store" | "load", "tier": {...tier config...}, "chunks": N, "chunk_bytes": B, "seed": S,
     "model": NAME, "timeout_s": T}

The adapter is built exactly as the MP server builds it (``prefixshare.bench._tiers.build_adapter``: the tier's
``--l2-adapter`` JSON through LMCache's parser and factory, chunks in a real L1 memory manager). *store* (on
node A) writes ``chunks`` objects whose bytes derive from ``seed``; *load* (on node B, another process: another
node's server, no memory of the store) looks them up, loads them into zeroed objects and compares every byte
with what ``seed`` says was stored. Keys derive from ``seed`` and ``model`` too, so the two sides agree without
talking to each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


CLOSE_TIMEOUT_S = 5.0


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from lmcache.v1.distributed.api import ObjectKey

    from prefixshare.bench._tiers import _Buffers, _wait, build_adapter
    from prefixshare.tiers import tier_class

    tier = tier_class(spec["tier"]["type"]).model_validate(spec["tier"])
    n, size, seed, timeout = int(spec["chunks"]), int(spec["chunk_bytes"]), int(spec["seed"]), float(spec["timeout_s"])
    keys = [ObjectKey(chunk_hash=hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest(),
                      model_name=spec["model"], kv_rank=0) for i in range(n)]
    buffers = _Buffers(n, size)
    stride = 64
    base = random.Random(seed).randbytes(size + n * stride)
    for i, view in enumerate(buffers.src_views):  # what the store side writes, and the load side expects
        view[:] = base[i * stride:i * stride + size]
    out: dict[str, object] = {"role": spec["role"], "bytes": n * size, "chunks": n, "phase": "connect"}
    import threading

    def bail() -> None:  # nothing answered in time (a cut link: connects wait for SYNs that never return)
        print("RESULT " + json.dumps({**out, "ok": False, "error": f"no answer within {timeout:g} s "
                                      f"(phase: {out['phase']})"}), flush=True)
        os._exit(0)

    watchdog = threading.Timer(timeout + 2.0, bail)
    watchdog.daemon = True
    watchdog.start()
    adapter, _ = build_adapter(tier, buffers.manager)
    out["phase"] = spec["role"]
    try:
        if spec["role"] == "store":
            done: dict[int, object] = {}

            def popped(tid: int) -> object:
                done.update(adapter.pop_completed_store_tasks())
                return done.pop(tid, None)

            t0 = time.perf_counter()
            tid = adapter.submit_store_task(keys, buffers.src)
            result = _wait(adapter.get_store_event_fd(), lambda: popped(tid), timeout, "store")
            out["store_s"] = time.perf_counter() - t0
            out["ok"] = bool(result.is_successful())
        else:
            t0 = time.perf_counter()
            tid = adapter.submit_lookup_and_lock_task(keys, {})
            found = _wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid),
                          timeout, "lookup")
            out["lookup_s"] = time.perf_counter() - t0
            out["found"] = found.popcount()
            out["phase"] = "load"
            buffers.clear_targets()
            t0 = time.perf_counter()
            tid = adapter.submit_load_task(keys, buffers.dst)
            got = _wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid), timeout, "load")
            out["load_s"] = time.perf_counter() - t0
            out["loaded"] = got.popcount()
            out["bytes_equal"] = not buffers.mismatches()
            out["ok"] = out["found"] == n and out["loaded"] == n and out["bytes_equal"]
            adapter.submit_unlock(keys)
            if spec.get("delete"):
                adapter.delete(keys)
    except Exception as exc:  # noqa: BLE001 - reported in the result: a failed transfer is a row, not a crash
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
    # close in a thread, bounded: against an unreachable store (a cut link) an adapter's close can wait on its
    # workers' connects; the result is printed either way and the process exits
    watchdog.cancel()
    closer = threading.Thread(target=adapter.close, daemon=True)
    t0 = time.perf_counter()
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    out["close_s"] = round(time.perf_counter() - t0, 3)
    out["close_hung"] = closer.is_alive()
    print("RESULT " + json.dumps(out), flush=True)
    if not out["close_hung"]:
        buffers.close()
    os._exit(0)


if __name__ == "__main__":
    main()
