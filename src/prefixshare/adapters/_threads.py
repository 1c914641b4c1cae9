"""Threads that end with their work, for the copies of KV between an engine's blocks and the MP server.

Those copies are torch code that starts OpenMP parallel regions, and a thread that does so keeps an OpenMP
thread pool for as long as it lives. With two pools alive on a machine with few cores, GNU OpenMP counts more
threads than cores and stops spin-waiting between parallel regions, so every later parallel region of the
engine waits to be woken: its forward passes and its own copies all slow down, for the life of the process.
Measured on 2 cores: vLLM's copy of a load into its blocks took 1.7x as long after one store had run on a
long-lived thread (benchmarks/hits_after_deferred_store.py); SGLang's prefills, bypassed ones too, took 1.06x
(4k tokens) to 1.13x (1k) as long once LMCache's store executor had run a store (the first version of
benchmarks/sglang_miss_path.py). A thread that ends takes its pool with it, so every copy here runs on a thread
of its own.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


def on_own_thread(run: Callable[[], Any], name: str = "prefixshare-kv-copy") -> Any:
    """``run()`` on a fresh thread, joined: its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


class ThreadPerTaskExecutor(Executor):
    """A drop-in for ``ThreadPoolExecutor(max_workers)``: tasks start in the order they were submitted, at most
    ``max_workers`` run at once, and each runs on a thread of its own that ends with it (a task waiting for its
    turn holds no thread)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "prefixshare-kv-copy") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._waiting: deque[tuple[Future[Any], Callable[..., Any], tuple, dict]] = deque()
        self._threads: set[threading.Thread] = set()
        self._shutdown = False
        self._count = itertools.count()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append((future, fn, args, kwargs))
            started = self._start_next()
        for thread in started:
            thread.start()
        return future

    def _start_next(self) -> list[threading.Thread]:
        """Threads for the next waiting tasks while a slot is free (called holding the lock; started after)."""
        started = []
        while self._waiting and len(self._threads) < self.max_workers:
            future, fn, args, kwargs = self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            thread = threading.Thread(target=self._run, args=(future, fn, args, kwargs), daemon=True,
                                      name=f"{self._prefix}_{next(self._count)}")
            self._threads.add(thread)
            started.append(thread)
        return started

    def _run(self, future: Future[Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the future carries it, as ThreadPoolExecutor's does
            future.set_exception(exc)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                started = self._start_next()
            for thread in started:
                thread.start()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                for future, *_ in self._waiting:
                    future.cancel()
                self._waiting.clear()
        while wait:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                break
            for thread in threads:
                thread.join()

    def live_threads(self) -> int:
        """Threads of this executor alive now (each running a task)."""
        with self._lock:
            return len(self._threads)
