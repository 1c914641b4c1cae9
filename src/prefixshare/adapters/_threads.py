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
    ``max_workers`` run at once, and each runs on a thread of its own that ends with it."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "prefixshare-kv-copy") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._cond = threading.Condition()
        self._waiting: deque[Future[Any]] = deque()  # submitted, not started: in submission order
        self._threads: set[threading.Thread] = set()
        self._running = 0
        self._shutdown = False
        self._count = itertools.count()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append(future)
            thread = threading.Thread(target=self._run, args=(future, fn, args, kwargs), daemon=True,
                                      name=f"{self._prefix}_{next(self._count)}")
            self._threads.add(thread)
        thread.start()
        return future

    def _run(self, future: Future[Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        with self._cond:
            while self._waiting[0] is not future or self._running >= self.max_workers:
                self._cond.wait()
            self._waiting.popleft()
            self._cond.notify_all()  # the next one in line may start too, when a slot is free
            start = future.set_running_or_notify_cancel()
            if start:
                self._running += 1
        try:
            if start:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - the future carries it, as ThreadPoolExecutor's does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            with self._cond:
                if start:
                    self._running -= 1
                self._threads.discard(threading.current_thread())
                self._cond.notify_all()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for future in self._waiting:
                    future.cancel()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()

    def live_threads(self) -> int:
        """Threads of this executor alive now (running a task, or waiting for their turn)."""
        with self._cond:
            return len(self._threads)
