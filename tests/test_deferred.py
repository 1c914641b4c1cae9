"""The worker's deferred stores (policy ``store.defer``), without an engine: order, flush, failure, drain.

The engine-level proof (a replica whose stores were deferred serves another replica the same greedy tokens
and logprobs as a cold run) is in tests/e2e/test_vllm_sharing.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from prefixshare.adapters.vllm._deferred import DeferredContext, DeferredStores

pytest.importorskip("lmcache")
from lmcache.v1.multiprocess.futures import MessagingFuture  # noqa: E402


class SyncContext:
    """Stands in for LMCache's synchronous engine-driven context: submit_store does the work and returns a
    resolved future; ``gate`` holds a store until the test releases it."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: dict[str, BaseException | bool] = {}
        self.flushed = 0
        self.closed = False
        self.retrieves = 0
        self.threads: list[threading.Thread] = []

    def submit_store(self, request_id: str, key: Any, kv: Any, blocks: Any, event: Any, n: int) -> Any:
        self.threads.append(threading.current_thread())
        assert self.gate.wait(10)
        outcome = self.fail.get(request_id, True)
        if isinstance(outcome, BaseException):
            raise outcome
        self.order.append(request_id)
        future: Any = MessagingFuture()
        future.set_result(outcome)
        return future

    def submit_retrieve(self, *args: Any, **kwargs: Any) -> str:
        self.retrieves += 1
        return "retrieved"

    def flush_inflight_stores(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed = True


def _store(ctx: DeferredContext, rid: str) -> Any:
    return ctx.submit_store(rid, None, {}, [[0]], None, 1)


def test_store_returns_before_the_copy_and_resolves_after() -> None:
    inner, failures = SyncContext(), []
    stores = DeferredStores(5.0, lambda rid, why, err: failures.append((rid, err)))
    ctx = stores.wrap(inner)
    inner.gate.clear()
    started = time.monotonic()
    future = _store(ctx, "a")
    assert time.monotonic() - started < 1.0 and not future.query()  # the step did not wait for the copy
    assert stores.depth() == 1
    inner.gate.set()
    assert future.result(timeout=5) is True
    assert inner.order == ["a"] and stores.completed == 1 and not failures
    assert ctx.submit_retrieve() == "retrieved" and inner.retrieves == 1  # everything else is the inner's
    assert stores.wrap(ctx) is ctx  # wrapping twice is a no-op
    assert stores.drain()


def test_each_store_copies_on_a_thread_that_ends_with_it() -> None:
    """A thread that ran the copy's torch code keeps an OpenMP pool while it lives, and a second live pool made
    every later load's copy in the engine 1.7x slower on 2 cores (see _deferred's doc): each store runs on a
    thread of its own, which is gone once the store has resolved."""
    inner = SyncContext()
    stores = DeferredStores(5.0, lambda rid, why, err: None)
    ctx = stores.wrap(inner)
    assert [_store(ctx, rid).result(timeout=5) for rid in ("a", "b")] == [True, True]
    first, second = inner.threads
    assert first is not second and threading.current_thread() not in (first, second)
    first.join(2), second.join(2)
    assert not first.is_alive() and not second.is_alive()
    assert stores.drain()


def test_submission_order_and_flush_waits_for_every_queued_store() -> None:
    inner = SyncContext()
    stores = DeferredStores(5.0, lambda rid, why, err: None)
    ctx = stores.wrap(inner)
    inner.gate.clear()
    futures = [_store(ctx, f"r{i}") for i in range(6)]
    assert stores.max_depth == 6
    threading.Timer(0.3, inner.gate.set).start()
    ctx.flush_inflight_stores()  # what vLLM calls before a forward that may reuse a preempted request's blocks
    assert all(f.query() for f in futures) and inner.flushed == 1
    assert inner.order == [f"r{i}" for i in range(6)]
    assert stores.drain()


def test_a_store_that_raises_resolves_false_and_reports_the_error() -> None:
    inner, failures = SyncContext(), []
    stores = DeferredStores(5.0, lambda rid, why, err: failures.append((rid, why, type(err).__name__ if err else None)))
    ctx = stores.wrap(inner)
    inner.fail = {"dead": TimeoutError("PREPARE_STORE timed out"), "refused": False}
    results = [_store(ctx, rid).result(timeout=5) for rid in ("dead", "refused", "ok")]
    assert results == [False, False, True]
    assert failures == [("dead", "rpc_failed", "TimeoutError"), ("refused", "refused", None)]
    assert (stores.completed, stores.failed) == (1, 2)
    assert stores.drain()


def test_drain_is_bounded_and_refuses_new_stores() -> None:
    inner = SyncContext()
    stores = DeferredStores(5.0, lambda rid, why, err: None)
    ctx = stores.wrap(inner)
    inner.gate.clear()
    stuck = _store(ctx, "stuck")
    started = time.monotonic()
    # a store that never finishes does not hang shutdown: the queue's bound, then the running store's
    assert stores.drain(timeout_s=0.3, running_timeout_s=0.3) is False
    assert 0.6 <= time.monotonic() - started < 2.0
    late = _store(ctx, "late")
    assert late.query() and late.result() is False  # after drain: refused at once, never queued
    inner.gate.set()
    assert stuck.result(timeout=5) is True
    ctx.close()
    assert inner.closed


def test_a_drain_that_gives_up_still_waits_for_the_store_being_copied() -> None:
    """Shutdown unregisters the worker right after the drain, and the server then frees what the worker left
    reserved: the store already running (maybe mid-copy into its reserved buffer) is waited for; the stores
    behind it are dropped unsent."""
    inner = SyncContext()
    stores = DeferredStores(5.0, lambda rid, why, err: None)
    ctx = stores.wrap(inner)
    inner.gate.clear()
    running, queued = _store(ctx, "running"), _store(ctx, "queued")
    time.sleep(0.1)  # the thread is inside "running"
    threading.Timer(0.6, inner.gate.set).start()
    started = time.monotonic()
    assert stores.drain(timeout_s=0.2, running_timeout_s=5.0) is False  # the queue did not finish in time ...
    assert 0.4 <= time.monotonic() - started < 3.0 and running.query()  # ... but the running store did
    assert running.result() is True and inner.order == ["running"] and not queued.query()


def test_stores_queued_behind_a_dead_server_are_dropped_unsent() -> None:
    """Once the worker knows the server is down (its health flag cleared), a queued store resolves False at
    once instead of waiting out its RPC timeout while the engine holds its blocks."""
    inner = SyncContext()
    up = threading.Event()
    lost: list[tuple[str, str]] = []
    stores = DeferredStores(5.0, lambda rid, why, err: lost.append((rid, why)), healthy=up.is_set)
    ctx = stores.wrap(inner)
    futures = [_store(ctx, f"r{i}") for i in range(3)]
    assert [f.result(timeout=5) for f in futures] == [False, False, False]
    assert inner.order == [] and stores.dropped == 3 and stores.failed == 3
    assert lost == [(f"r{i}", "server_down") for i in range(3)]  # every one reported, with its reason
    up.set()
    assert _store(ctx, "back").result(timeout=5) is True and inner.order == ["back"]
    assert stores.drain()


def test_abandon_drops_what_is_queued_even_if_the_server_answers_again_and_waits_for_the_running_store() -> None:
    """LMCache's worker, finding the server unhealthy, reports every store it tracks as finished and vLLM frees
    their blocks: a store queued then must never be sent later (its blocks may hold another request's KV by
    then), even when the server is healthy again by the time the queue reaches it; the store being copied is
    waited for before abandon returns."""
    inner = SyncContext()
    lost: list[tuple[str, str]] = []
    stores = DeferredStores(5.0, lambda rid, why, err: lost.append((rid, why)))
    ctx = stores.wrap(inner)
    inner.gate.clear()
    running, queued = _store(ctx, "running"), _store(ctx, "queued")
    time.sleep(0.1)  # the thread is inside "running"
    threading.Timer(0.4, inner.gate.set).start()
    started = time.monotonic()
    assert stores.abandon() == 2
    assert time.monotonic() - started >= 0.3 and running.query()  # returned only once the running store ended
    assert queued.result(timeout=5) is False and inner.order == ["running"]
    assert lost == [("queued", "server_down")]
    assert _store(ctx, "after").result(timeout=5) is True and inner.order == ["running", "after"]  # new ones go
    assert stores.drain()
