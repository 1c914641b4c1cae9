"""Stores after the first token: a request's KV is copied into the server off the engine's step.

LMCache's worker copies a step's KV into the server in ``wait_for_save``, at the end of vLLM's forward pass.
On accelerators it does that asynchronously (a copy stream, a commit thread); on a CPU engine its transfer
context is synchronous: two RPCs to the server and the copy into the server's shared memory run inside the
step, so the step's sampled token, a request's first token among them, waits for the store. That wait is
what a miss costs on top of the raw engine (the benchmark's P7).

:class:`DeferredStores` moves that work to one thread of the worker's own: ``submit_store`` queues it and
returns an unresolved future, which LMCache's worker adapter already keeps per request; the request's blocks
stay allocated until the future resolves, through vLLM's delayed block freeing (``request_finished`` returns
True, ``get_finished`` reports the request once its store is done), exactly as for the accelerator path. The
blocks a queued store reads are therefore never reused before it has read them:

* a running request's blocks are its own; a finished one's are freed only after ``get_finished``;
* a preempted request's blocks are freed at once, so vLLM flushes before the next forward
  (``handle_preemptions`` -> ``flush_inflight_stores``), which here waits for the queue to drain;
* shutdown drains the queue before the worker unregisters from the server (:meth:`drain`).

One thread, in submission order: stores of the same request reach the server in the order they were
produced. A store whose RPC fails or times out resolves False (the KV is simply not stored) and clears the
worker's health flag, as a failed submit does (:class:`prefixshare.adapters.vllm.connector.WorkerSide`); the
stores queued behind it are then dropped unsent, as LMCache drops a store submitted to a server it knows is down.
Every store that does not reach the server is reported to ``on_failure`` with its reason (counted and logged).

When LMCache's worker finds the server unhealthy it reports every store it tracks as finished, and vLLM frees
their blocks: :meth:`DeferredStores.abandon` runs first, so that no store queued then is sent later (it is
dropped) and the one being copied has finished reading its blocks.

The copy itself is :mod:`prefixshare.adapters.vllm._store_copy`'s where the KV is vLLM's CPU layout (one pass,
no OpenMP), LMCache's gather otherwise. Each store's copy runs on a thread of its own that ends with the store,
not on the queue's long-lived thread (:mod:`prefixshare.adapters._threads` says why: a long-lived thread's
OpenMP pool slowed every later load's copy 1.7x on 2 cores, which is what P5 measured against LMCache's
connector).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from prefixshare.adapters._threads import on_own_thread
from prefixshare.adapters.vllm._store_copy import submit_store

#: how long a flush (preemption) or a drain (shutdown) waits for queued stores, at most, beyond the RPC bound
DRAIN_GRACE_S = 5.0


class _Dropped(Exception):
    """A queued store not sent: the server is known to be down."""


class DeferredStores:
    """One queue of stores per worker, shared by every transfer context the worker's adapter creates (a
    restarted server makes the adapter build a new one)."""

    def __init__(self, rpc_timeout_s: float, on_failure: Callable[[str, str, BaseException | None], None],
                 healthy: Callable[[], bool] = lambda: True,
                 on_first_copy: Callable[[bool], None] = lambda here: None) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self.on_failure = on_failure
        #: told once, after the first store's copy, whether prefixshare made it (True) or LMCache's gather did
        self.on_first_copy = on_first_copy
        #: the worker's view of the server: a queued store is dropped at once (resolves False) when it is down,
        #: so stores queued behind a failure do not each wait out the RPC timeout while holding their blocks
        self.healthy = healthy
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixshare-store")
        self._lock = threading.Lock()
        self._pending: set[threading.Event] = set()
        self._running: threading.Event | None = None  # the store the thread is on (its ``done``), if any
        #: stores queued before the newest :meth:`abandon` are dropped unsent
        self._generation = 0
        self._closed = False
        #: counters for tests and stats: stores queued, completed, failed; longest queue seen
        self.queued = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0  # of the failed: dropped unsent because the server was down
        self.max_depth = 0
        self.copies = 0  # stores whose KV was copied into the server's buffers (sent, whatever the commit said)
        self.own_copies = 0  # of those, the ones prefixshare copied (:mod:`._store_copy`), not LMCache's gather

    def wrap(self, context: Any) -> Any:
        """``context`` with its stores deferred (idempotent; any other context is returned as is)."""
        if isinstance(context, DeferredContext):
            return context
        return DeferredContext(context, self)

    def submit(self, request_id: str, run: Callable[[], Any], completion: Any) -> None:
        """Queue ``run`` (the wrapped context's synchronous submit_store); ``completion`` gets its result."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                completion.set_result(False)
                return
            self._pending.add(done)
            generation = self._generation
            self.queued += 1
            self.max_depth = max(self.max_depth, len(self._pending))

        def task() -> None:
            ok = False
            error: BaseException | None = None
            reason = "refused"
            self._running = done
            try:
                if generation != self._generation or not self.healthy():
                    raise _Dropped
                inner = on_own_thread(run, name="prefixshare-store-copy")
                ok = bool(inner.result(timeout=self.rpc_timeout_s)) if inner is not None else False
            except _Dropped:
                self.dropped += 1
                reason = "server_down"
            except BaseException as exc:  # noqa: BLE001 - a store that fails is a store not made, never a crash
                error, reason = exc, "rpc_failed"
            finally:
                with self._lock:
                    self._pending.discard(done)
                    self._running = None
                    if ok:
                        self.completed += 1
                    else:
                        self.failed += 1
                completion.set_result(ok)  # resolved before ``done``: a flush that returns sees it resolved
                done.set()
            if not ok:
                self.on_failure(request_id, reason, error)

        self._pool.submit(task)

    def copied(self, here: bool) -> None:
        """A store's copy was made, by prefixshare (``here``) or by LMCache's gather."""
        self.copies += 1
        self.own_copies += here
        if self.copies == 1:
            self.on_first_copy(here)

    def abandon(self, timeout_s: float | None = None) -> int:
        """Drop every store queued so far that has not started (each resolves False, reason ``server_down``),
        and wait (at most ``timeout_s``, by default its RPCs' bound) for the one being made, which may be
        reading its blocks. Returns how many were queued or running."""
        with self._lock:
            self._generation += 1
            pending = len(self._pending)
            running = self._running
        if running is not None:
            running.wait(self.rpc_timeout_s * 2 + DRAIN_GRACE_S if timeout_s is None else timeout_s)
        return pending

    def depth(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every store queued so far has finished (True) or ``timeout_s`` passed (False)."""
        limit = self.rpc_timeout_s * 2 + DRAIN_GRACE_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._lock:
            pending = list(self._pending)
        for done in pending:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def drain(self, timeout_s: float | None = None, running_timeout_s: float | None = None) -> bool:
        """Refuse new stores, finish the queued ones (bounded), stop the thread.

        When the queue does not finish in time, the stores not yet started are dropped, but the one running is
        waited for (``running_timeout_s``, by default its RPCs' bound): it may be copying into a buffer the
        server reserved for it, and the worker unregisters right after the drain. An engine that leaves a
        reservation uncommitted loses that store (the server's guard discards it); one that leaves mid-copy
        could write into memory the server has already handed to someone else."""
        with self._lock:
            self._closed = True
        finished = self.flush(timeout_s)
        self._pool.shutdown(wait=finished, cancel_futures=not finished)
        if not finished:
            running = self._running
            if running is not None:
                running.wait(self.rpc_timeout_s * 2 + DRAIN_GRACE_S if running_timeout_s is None
                             else running_timeout_s)
        return finished


class DeferredContext:
    """A synchronous transfer context whose ``submit_store`` returns before the copy; everything else is the
    wrapped context's (``submit_retrieve`` stays synchronous: a load must be in the blocks before the step
    that reads them)."""

    def __init__(self, inner: Any, stores: DeferredStores) -> None:
        self._inner = inner
        self._stores = stores

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def submit_store(self, request_id: str, key: Any, kv_caches: Any, block_ids: Any, event: Any,
                     blocks_in_chunk: int) -> Any:
        from lmcache.v1.multiprocess.futures import MessagingFuture

        completion: Any = MessagingFuture()
        inner, stores = self._inner, self._stores

        def run() -> Any:
            future, here = submit_store(inner, request_id, key, kv_caches, block_ids, event, blocks_in_chunk)
            stores.copied(here)
            return future

        stores.submit(request_id, run, completion)
        return completion

    def flush_inflight_stores(self) -> None:
        self._stores.flush()
        self._inner.flush_inflight_stores()

    def close(self) -> None:
        self._stores.flush()
        self._inner.close()
