"""The MP server says when a chunk an engine stored never reached its L2 tier.

LMCache's store loop reads every chunk an engine wrote into L1 and hands it to each L2 tier's store. A chunk that
is gone by then (evicted or deleted) is skipped, and it is lost from every tier; one still being written is
skipped as well. LMCache logs that at debug level and publishes an event (``L1_READ_FAILED``, during
``l2_store``) that only its metrics count, when they are on. :func:`install` makes every store controller built
afterwards log it as a warning (``store.chunks_not_stored``: how many, why, the total since start) and count it in
its ``/status`` entry (``prefixshare_chunks_not_stored``, per reason). The engine is not told: a later request
for that prefix misses and computes it. warm's verification finds the chunk missing and prefills its document
again.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from prefixshare._log import get_logger

log = get_logger("prefixshare.server")

#: LMCache's reasons for a chunk its store loop could not read, as the warning explains them
REASONS = {
    "not_found": "gone from the server's memory (evicted or deleted) before its L2 write: lost from every tier",
    "write_locked": "still being written into the server's memory when the store loop read it: not written to L2",
}


class _Watch:
    """Stands in for a store controller's event bus: every event passes through to the bus unchanged, and a chunk
    the store loop could not read (``failed``, during ``l2_store``) is logged and counted first."""

    def __init__(self, bus: Any, failed: Any) -> None:
        self._bus, self._failed = bus, failed
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def publish(self, event: Any) -> None:
        meta = getattr(event, "metadata", None) or {}
        if getattr(event, "event_type", None) == self._failed and meta.get("during") == "l2_store":
            self._not_stored(str(meta.get("reason")), list(meta.get("keys") or ()))
        self._bus.publish(event)

    def _not_stored(self, reason: str, keys: list[Any]) -> None:
        with self._lock:
            total = self.counts[reason] = self.counts.get(reason, 0) + len(keys)
        log.warning("store.chunks_not_stored", chunks=len(keys), reason=reason, since_start=total,
                    what=REASONS.get(reason, reason), models=sorted({str(getattr(k, "model_name", "?")) for k in keys}))

    def snapshot(self) -> dict[str, int]:
        """Chunks not stored since start, per reason (a copy)."""
        with self._lock:
            return dict(self.counts)

    def __getattr__(self, name: str) -> Any:  # whatever else LMCache asks of its bus
        return getattr(self._bus, name)


def _status(original: Callable[[Any], dict]) -> Callable[[Any], dict]:
    def report_status(self: Any) -> dict:
        status = original(self)
        watch = getattr(self, "_event_bus", None)
        if isinstance(watch, _Watch):
            status["prefixshare_chunks_not_stored"] = watch.snapshot()
        return status

    return report_status


def install() -> bool:
    """Make LMCache's store controllers built from now on log and count the chunks their store loop could not
    read; True when it did (or had). An LMCache without that controller or event changes nothing."""
    try:
        from lmcache.v1.distributed.storage_controllers import store_controller
        from lmcache.v1.mp_observability.event import EventType
    except ImportError:
        return False
    cls = getattr(store_controller, "StoreController", None)
    failed = getattr(EventType, "L1_READ_FAILED", None)
    if cls is None or failed is None:
        return False
    original_init = cls.__init__
    if getattr(original_init, "prefixshare_watches", False):
        return True

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original_init(self, *args, **kwargs)
        bus = getattr(self, "_event_bus", None)
        if hasattr(bus, "publish"):
            self._event_bus = _Watch(bus, failed)

    __init__.prefixshare_watches = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    if hasattr(cls, "report_status"):
        cls.report_status = _status(cls.report_status)
    return True
