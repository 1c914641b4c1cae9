"""The MP server's L1 eviction, woken by the memory it guards instead of once a second.

LMCache's L1 eviction thread sleeps one second, then, if L1 is over its watermark (``trigger_watermark``, 0.8),
evicts ``eviction_ratio`` (0.2) of it. So a full L1 takes new KV at ``eviction_ratio`` of its size per second
at most (200 MB/s for 1 GB): every store that arrives in between and finds no room is dropped (the server logs
``Failed to batched allocate``; the engine is not told), and a load, which needs L1 room too, misses. A
prefill on an accelerator produces KV far faster than that.

:func:`install`, called by the server's entry point before LMCache builds its controllers, keeps LMCache's
policy, watermark and ratio and changes only when the check runs: the eviction thread also wakes when L1
takes a write or releases a read (a store reserved or finished, a chunk's copy to the L2 tier done, which is
when it becomes evictable), at most every :data:`MIN_GAP_S` (:data:`EMPTY_ROUND_GAP_S` after a round that found
nothing evictable), and still once a second when nothing happens. A wake with L1 under its watermark costs one
read of its usage and nothing else.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

#: shortest time between two checks of L1's usage (bounds what a burst of writes costs the thread)
MIN_GAP_S = 0.02
#: the check still runs this often when nothing wakes it (LMCache's own period)
IDLE_S = 1.0
#: after a round that found nothing evictable (every chunk still waiting for its L2 write), the next one waits
#: this long at least: a store slower than its writers would otherwise log and scan L1 at every write
EMPTY_ROUND_GAP_S = 0.1

#: L1 events after which eviction may have work: room taken, or a chunk no longer held by a reader
_WAKE_ON = ("on_l1_keys_reserved_write", "on_l1_keys_write_finished", "on_l1_keys_read_finished",
            "on_l1_keys_finish_write_and_reserve_read")

#: what the loop uses of LMCache's L1 eviction controller; without any of it, LMCache's own loop runs
_NEEDS = ("_eviction_config", "_eviction_policy", "_l1_manager", "_stop_flag", "execute_eviction_action",
          "_publish_skipped", "_publish_triggered")


def _listener_class(base: type) -> type:
    """A listener of L1's events (``base``: LMCache's ``L1ManagerListener``) that sets ``self.wake`` on
    :data:`_WAKE_ON` and ignores the rest (every abstract method implemented, whatever LMCache adds)."""

    def wake(self: Any, *args: Any, **kwargs: Any) -> None:
        self.wake.set()

    def ignore(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    names = set(getattr(base, "__abstractmethods__", ())) | {n for n in _WAKE_ON if hasattr(base, n)}
    namespace: dict[str, Any] = {n: (wake if n in _WAKE_ON else ignore) for n in names}
    namespace["__init__"] = lambda self, event: setattr(self, "wake", event)
    return type("PrefixShareEvictionWake", (base,), namespace)


def _loop(original: Callable[[Any], None], lmcache_log: Any) -> Callable[[Any], None]:
    def eviction_loop(self: Any) -> None:
        """LMCache's L1 eviction loop, checking when woken (see the module) rather than each second."""
        wake: threading.Event | None = getattr(self, "_prefixshare_wake", None)
        if wake is None or not all(hasattr(self, n) for n in _NEEDS):
            original(self)
            return
        config = self._eviction_config
        while not self._stop_flag.is_set():
            woken = wake.wait(IDLE_S)
            wake.clear()
            if self._stop_flag.is_set():
                return
            used, total = self._l1_manager.get_memory_usage()
            if getattr(config, "extra_logging_enabled", False) and hasattr(self, "_maybe_log_memory_usage"):
                self._maybe_log_memory_usage(used, total)
            usage = used / total if total else 0.0
            if usage < config.trigger_watermark:
                if not woken:  # LMCache's once-a-second tick event, not one per write
                    self._publish_skipped(usage, config.trigger_watermark)
                continue
            if lmcache_log is not None:  # LMCache's own line for each round (operators and our tests count them)
                lmcache_log.info("L1 memory usage %.2f above watermark %.2f; triggering eviction.", usage,
                                 config.trigger_watermark)
            actions = self._eviction_policy.get_eviction_actions(
                config.eviction_ratio, key_eligible_filter=self._l1_manager.is_key_evictable)
            for action in actions:
                self.execute_eviction_action(action)
            self._publish_triggered(usage, config.trigger_watermark)
            evicted = sum(len(getattr(action, "keys", ())) for action in actions)
            self._stop_flag.wait(MIN_GAP_S if evicted else EMPTY_ROUND_GAP_S)

    eviction_loop.prefixshare_wakes = True  # type: ignore[attr-defined]
    return eviction_loop


def install() -> bool:
    """Make LMCache's L1 eviction controllers built from now on wake on L1's events; True when it did (or had).
    An LMCache without that controller, or whose controller lacks what the loop uses, keeps its own loop."""
    try:
        from lmcache.v1.distributed.internal_api import L1ManagerListener
        from lmcache.v1.distributed.storage_controllers import eviction_controller
    except ImportError:
        return False
    cls = getattr(eviction_controller, "L1EvictionController", None)
    original_loop = getattr(cls, "eviction_loop", None)
    if cls is None or original_loop is None:
        return False
    if getattr(original_loop, "prefixshare_wakes", False):
        return True
    original_init = cls.__init__
    listener = _listener_class(L1ManagerListener)

    def __init__(self: Any, l1_manager: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original_init(self, l1_manager, *args, **kwargs)
        self._prefixshare_wake = threading.Event()
        l1_manager.register_listener(listener(self._prefixshare_wake))

    cls.__init__ = __init__
    cls.eviction_loop = _loop(original_loop, getattr(eviction_controller, "logger", None))
    return True
