"""Copies of KV run on threads that end with them (prefixshare.adapters._threads), and SGLang's store copies
are moved onto such threads in LMCache's real transfer context."""

from __future__ import annotations

import threading
import time

import pytest

from prefixshare.adapters._threads import ThreadPerTaskExecutor, on_own_thread


def test_on_own_thread_returns_and_raises_from_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []
    assert on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError):
        on_own_thread(lambda: {}["missing"])


def test_tasks_start_in_order_at_most_max_workers_at_once_each_on_its_own_thread() -> None:
    ex = ThreadPerTaskExecutor(2)
    lock = threading.Lock()
    started: list[int] = []
    threads: list[threading.Thread] = []
    running = peak = 0
    gate = threading.Event()

    def task(i: int) -> int:
        nonlocal running, peak
        with lock:
            started.append(i)
            threads.append(threading.current_thread())
            running += 1
            peak = max(peak, running)
        gate.wait(5)
        time.sleep(0.01)
        with lock:
            running -= 1
        return i * i

    futures = [ex.submit(task, i) for i in range(8)]
    time.sleep(0.1)
    assert sorted(started) == [0, 1] and ex.live_threads() == 2  # two slots: the others wait, holding no thread
    gate.set()
    assert [f.result(timeout=5) for f in futures] == [i * i for i in range(8)]
    ex.shutdown(wait=True)
    assert sorted(started) == list(range(8)) and peak == 2
    assert len(set(threads)) == 8 and not any(t.is_alive() for t in threads)
    assert ex.live_threads() == 0

    serial, order = ThreadPerTaskExecutor(1), []  # one slot: tasks run strictly in submission order
    for f in [serial.submit(order.append, i) for i in range(20)]:
        f.result(timeout=5)
    serial.shutdown()
    assert order == list(range(20))


def test_an_exception_is_the_futures_and_shutdown_cancels_what_has_not_started() -> None:
    ex = ThreadPerTaskExecutor(1)
    gate = threading.Event()
    failing = ex.submit(lambda: 1 / 0)
    blocker = ex.submit(gate.wait, 5)
    queued = ex.submit(lambda: "never")
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=5)
    time.sleep(0.05)
    ex.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert blocker.result(timeout=5) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(lambda: None)
    ex.shutdown(wait=True)
    assert ex.live_threads() == 0


def test_sglang_store_copies_move_off_lmcaches_long_lived_pool() -> None:
    """LMCache's own async transfer context (the one its SGLang connector stores through): its commit executor
    is swapped for one whose threads end with each copy, with the same number of workers; a second call (or
    an LMCache without that executor) changes nothing."""
    from lmcache.v1.multiprocess.transfer_context.async_engine_driven import AsyncEngineDrivenTransferContext

    from prefixshare.adapters.sglang import _compat

    context = AsyncEngineDrivenTransferContext(0, None, commit_workers=3)  # type: ignore[arg-type]

    class Connector:
        _transfer_ctx = context

    try:
        assert _compat.store_copies_on_threads_that_end(Connector())
        executor = context._commit_executor
        assert isinstance(executor, ThreadPerTaskExecutor) and executor.max_workers == 3
        assert _compat.store_copies_on_threads_that_end(Connector()) and context._commit_executor is executor
        ran: list[threading.Thread] = []
        executor.submit(lambda: ran.append(threading.current_thread())).result(timeout=5)
        ran[0].join(5)
        assert not ran[0].is_alive()
    finally:
        context.close()  # LMCache's close shuts the (swapped) executor down
    assert not _compat.store_copies_on_threads_that_end(type("NoContext", (), {})())
