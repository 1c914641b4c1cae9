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
read of its usage and nothing else. A chunk just written is not evicted before the L2 tier's store has read it
(for :data:`FRESH_S` at most): LMCache's loop may evict it in that window, and it is then lost from every tier.

Before L1 reserves memory (a store from an engine, a load from the L2 tier), if the reservation would not fit,
the reserving thread runs an eviction round itself, with the ratio that makes it fit (at least LMCache's): a
reservation fails only when what L1 holds cannot be evicted (staged, read, or waiting for its L2 write), not
because the eviction thread had not run yet. The controller's ``/status`` entry reports those unevictable bytes
(``prefixshare_unevictable_bytes``; the room a writer has is L1's size less them) and the bytes L1 has reserved
since it started (``prefixshare_reserved_bytes_total``; what of a writer's stores has reached the server), which
warm's pacing reads (:mod:`prefixshare.warm._room`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

#: shortest time between two checks of L1's usage (bounds what a burst of writes costs the thread)
MIN_GAP_S = 0.02
#: the check still runs this often when nothing wakes it (LMCache's own period)
IDLE_S = 1.0
#: after a round that found nothing evictable (every chunk still waiting for its L2 write), the next one waits
#: this long at least: a store slower than its writers would otherwise log and scan L1 at every write
EMPTY_ROUND_GAP_S = 0.1
#: eviction rounds a reservation that would not fit may run before it is tried anyway
MAX_RESERVE_ROUNDS = 3
#: how long a chunk just written into L1 is kept from eviction, at most, while the L2 tier's store has not read it
FRESH_S = 1.0
_FRESH_PRUNE_AT = 4096

#: L1 events after which eviction may have work: room taken, or a chunk no longer held by a reader
_WAKE_ON = ("on_l1_keys_reserved_write", "on_l1_keys_write_finished", "on_l1_keys_read_finished",
            "on_l1_keys_finish_write_and_reserve_read")

#: what the loop uses of LMCache's L1 eviction controller; without any of it, LMCache's own loop runs
_NEEDS = ("_eviction_config", "_eviction_policy", "_l1_manager", "_stop_flag", "execute_eviction_action",
          "_publish_skipped", "_publish_triggered")


class _Fresh:
    """Chunks written into L1 that the L2 tier's store has not read yet (it read-locks a chunk while it writes it
    out, from a queue it drains when woken): evicting one in that window loses it from every tier. Each is held
    from eviction until that read begins, for :data:`FRESH_S` at most (a chunk no L2 tier will take, with no
    tier or a store policy that skips it, becomes evictable then)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[Any, float] = {}

    def add(self, keys: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._until) > _FRESH_PRUNE_AT:
                self._until = {k: t for k, t in self._until.items() if t > now}
            for key in keys:
                self._until[key] = now + FRESH_S

    def discard(self, keys: Any) -> None:
        with self._lock:
            for key in keys:
                self._until.pop(key, None)

    def held(self, key: Any) -> bool:
        until = self._until.get(key)
        return until is not None and until > time.monotonic()


def _listener_class(base: type) -> type:
    """A listener of L1's events (``base``: LMCache's ``L1ManagerListener``) that sets ``self.wake`` on
    :data:`_WAKE_ON`, keeps ``self.fresh`` (a :class:`_Fresh`) and ignores the rest (every abstract method
    implemented, whatever LMCache adds)."""

    def wake(self: Any, *args: Any, **kwargs: Any) -> None:
        self.wake.set()

    def written(self: Any, keys: Any, *args: Any, **kwargs: Any) -> None:
        self.fresh.add(keys)  # before the wake: a round it starts holds them already
        self.wake.set()

    def read_or_gone(self: Any, keys: Any, *args: Any, **kwargs: Any) -> None:
        self.fresh.discard(keys)

    def ignore(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    handlers = {n: wake for n in _WAKE_ON}
    handlers.update({"on_l1_keys_write_finished": written, "on_l1_keys_reserved_read": read_or_gone,
                     "on_l1_keys_deleted_by_manager": read_or_gone})
    names = set(getattr(base, "__abstractmethods__", ())) | {n for n in handlers if hasattr(base, n)}
    namespace: dict[str, Any] = {n: handlers.get(n, ignore) for n in names}

    def __init__(self: Any, event: threading.Event, fresh: _Fresh) -> None:  # noqa: N807
        self.wake, self.fresh = event, fresh

    namespace["__init__"] = __init__
    return type("PrefixShareEvictionWake", (base,), namespace)


def _evictable(ctrl: Any) -> Callable[[Any], bool]:
    """LMCache's test (not locked), less the chunks the L2 tier's store has not read yet (:class:`_Fresh`)."""
    l1, fresh = ctrl._l1_manager, getattr(ctrl, "_prefixshare_fresh", None)
    if fresh is None:
        return l1.is_key_evictable
    return lambda key: l1.is_key_evictable(key) and not fresh.held(key)


def _round(ctrl: Any, usage: float, ratio: float, lmcache_log: Any, why: str) -> int:
    """One eviction round of LMCache's policy (``ratio`` of L1's keys, those not locked), serialized with any
    other; the number of keys it evicted."""
    config = ctrl._eviction_config
    with ctrl._prefixshare_round:
        if lmcache_log is not None:  # LMCache's own line for each round (operators and our tests count them)
            lmcache_log.info("L1 memory usage %.2f %s; triggering eviction.", usage, why)
        actions = ctrl._eviction_policy.get_eviction_actions(ratio, key_eligible_filter=_evictable(ctrl))
        for action in actions:
            ctrl.execute_eviction_action(action)
    ctrl._publish_triggered(usage, config.trigger_watermark)
    return sum(len(getattr(action, "keys", ())) for action in actions)


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
            evicted = _round(self, usage, config.eviction_ratio, lmcache_log,
                             f"above watermark {config.trigger_watermark:.2f}")
            self._stop_flag.wait(MIN_GAP_S if evicted else EMPTY_ROUND_GAP_S)

    eviction_loop.prefixshare_wakes = True  # type: ignore[attr-defined]
    return eviction_loop


def _layout_bytes(layout_desc: Any) -> int:
    """Bytes of one object of ``layout_desc`` (LMCache's MemoryLayoutDesc: shapes and dtypes); 0 when unknown."""
    try:
        return sum(int(shape.numel()) * dtype.itemsize for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes))
    except (AttributeError, TypeError):
        return 0


def _make_room(ctrl: Any, need: int, lmcache_log: Any) -> None:
    """Evict (LMCache's policy, unlocked keys only) until ``need`` more bytes fit in the controller's L1, in at
    most :data:`MAX_RESERVE_ROUNDS` rounds; a round that evicts nothing ends it (what is left is locked)."""
    config = ctrl._eviction_config
    for _ in range(MAX_RESERVE_ROUNDS):
        used, total = ctrl._l1_manager.get_memory_usage()
        if used + need <= total or used <= 0:
            return
        # the policy's ratio counts keys: the share of what L1 holds that frees ``need``, LMCache's ratio at least
        ratio = min(max(config.eviction_ratio, (used + need - total) / used * 1.05), 1.0)
        if not _round(ctrl, used / total, ratio, lmcache_log, f"cannot take {need} more bytes"):
            return


def _unevictable_bytes(l1: Any, fresh: _Fresh | None) -> int:
    """Bytes L1 holds that no eviction can free now: staged (being written), read (a load, or the L2 tier's
    write of it) and fresh (waiting for that write: :class:`_Fresh`) objects."""
    staged = int(getattr(l1, "_staging_bytes", 0) or 0)
    held = 0
    for key, entry in list(l1._objects.items()):
        if entry.read_lock.is_locked() or (fresh is not None and fresh.held(key)):
            held += entry.memory_obj.get_size()
    return staged + held


class _Reserved:
    """Bytes L1 has reserved since it was built (a counter, thread-safe): a writer that knows how much it sent
    reads from it how much of that has reached the server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


def _reserve_write(original: Callable[..., Any]) -> Callable[..., Any]:
    def reserve_write(self: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        """LMCache's ``reserve_write``, after an eviction round when the reservation would not fit; what it
        reserved is counted."""
        make_room = getattr(self, "_prefixshare_make_room", None)
        if make_room is None or not keys:
            return original(self, keys, *args, **kwargs)
        per_key = _layout_bytes(kwargs.get("layout_desc", args[1] if len(args) > 1 else None))
        if per_key:
            make_room(per_key * len(keys))
        result = original(self, keys, *args, **kwargs)
        reserved: _Reserved | None = getattr(self, "_prefixshare_reserved", None)
        if reserved is not None and isinstance(result, dict):
            reserved.add(per_key * sum(1 for value in result.values() if value[1] is not None))
        return result

    reserve_write.prefixshare_makes_room = True  # type: ignore[attr-defined]
    return reserve_write


def _report_status(original: Callable[[Any], dict]) -> Callable[[Any], dict]:
    def report_status(self: Any) -> dict:
        status = original(self)
        l1 = getattr(self, "_l1_manager", None)
        if hasattr(self, "_prefixshare_wake") and hasattr(l1, "_prefixshare_reserved"):
            try:
                status["prefixshare_unevictable_bytes"] = _unevictable_bytes(
                    l1, getattr(self, "_prefixshare_fresh", None))
            except (AttributeError, TypeError):  # another LMCache's L1: the fields are left out, never made up
                return status
            status["prefixshare_reserved_bytes_total"] = l1._prefixshare_reserved.total
        return status

    return report_status


def install() -> bool:
    """Make LMCache's L1 eviction controllers built from now on wake on L1's events, and their L1 evict before a
    reservation that would not fit; True when it did (or had). An LMCache without that controller, or whose
    controller lacks what the loop uses, keeps its own loop and reservations."""
    try:
        from lmcache.v1.distributed.internal_api import L1ManagerListener
        from lmcache.v1.distributed.l1_manager import L1Manager
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
    lmcache_log = getattr(eviction_controller, "logger", None)

    def __init__(self: Any, l1_manager: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original_init(self, l1_manager, *args, **kwargs)
        self._prefixshare_wake = threading.Event()
        self._prefixshare_round = threading.Lock()
        self._prefixshare_fresh = _Fresh()
        l1_manager.register_listener(listener(self._prefixshare_wake, self._prefixshare_fresh))
        if all(hasattr(self, n) for n in _NEEDS):
            l1_manager._prefixshare_make_room = lambda need: _make_room(self, need, lmcache_log)
            l1_manager._prefixshare_reserved = _Reserved()

    cls.__init__ = __init__
    cls.eviction_loop = _loop(original_loop, lmcache_log)
    if hasattr(cls, "report_status"):
        cls.report_status = _report_status(cls.report_status)
    reserve = getattr(L1Manager, "reserve_write", None)
    if reserve is not None and not getattr(reserve, "prefixshare_makes_room", False):
        L1Manager.reserve_write = _reserve_write(reserve)
    return True
