"""Guards installed inside the LMCache MP server before it starts (:mod:`prefixshare.server.plugins.main`).

**An abandoned store is discarded, never admitted.** An engine stores a chunk in two steps: it reserves the
chunk's buffer in the server (``PREPARE_STORE``), copies its KV into it, then commits (``COMMIT_STORE``). When
an engine unregisters, exits or is reaped with reservations still uncommitted — its store RPC timed out, it
was killed mid-copy, its shutdown drain gave up — LMCache's server marks those buffers *written* and admits
them: the key becomes a hit whose bytes are whatever the buffer held (zeros, or half a copy). The L2 tiers
then persist them (with a valid integrity trailer: the digest covers the bytes as written), and every replica
on the store loads that KV as if it were the prefix's. ``tests/faults/test_abandoned_stores.py`` reproduces
it with a raw client (reserve, then unregister), and shows the guard turning it into a miss.

The guard replaces the release of an unregistered or reaped engine's entry: its uncommitted reservations are
discarded (unlocked and freed, no write-finished event, so nothing reaches L2); reads and the layout are
released as LMCache releases them. A store lost this way is recomputed by the next request that needs it.

Each guard checks the LMCache internals it relies on and fails the server's start with the LMCache version
named if they are not there (a new LMCache must be looked at, not run unguarded).
"""

from __future__ import annotations

from typing import Any

from prefixshare._log import get_logger

log = get_logger("prefixshare.server")


class GuardError(RuntimeError):
    """LMCache's internals are not what a guard was written against."""


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


def _discard_abandoned_writes(storage_manager: Any, keys: list[Any], tag: str) -> int:
    """Unlock and free ``keys``' staging buffers in every L1 that holds one; returns how many were discarded."""
    from lmcache.v1.distributed.l1_manager import L1Error

    discarded = 0
    for manager in storage_manager._l1_managers_by_id.values():
        results = manager.finish_write_and_delete(keys, tag=tag)
        discarded += sum(1 for err in results.values() if err == L1Error.SUCCESS)
    return discarded


def discard_abandoned_stores() -> None:
    """Install the abandoned-store guard (idempotent)."""
    from lmcache.v1.distributed import storage_manager as sm
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.multiprocess.modules.engine_driven_transfer import EngineDrivenTransferModule

    original = getattr(EngineDrivenTransferModule, "_release_entry", None)
    if getattr(original, "prefixshare_guard", False):
        return
    tag = getattr(sm, "_L1_WRITE_TAG", None)
    if original is None or tag is None or not hasattr(L1Manager, "finish_write_and_delete"):
        raise GuardError(f"LMCache {_lmcache_version()}: EngineDrivenTransferModule._release_entry, the storage "
                         "manager's write tag or L1Manager.finish_write_and_delete is gone; review "
                         "prefixshare.server.plugins.guards for this version")

    def _release_entry(self: Any, instance_id: int, entry: Any) -> None:
        with self._pending_shm_lock:
            stale = [k for k in self._pending_shm_writes if k[0] == instance_id]
            abandoned = [key for k in stale for key in (self._pending_shm_writes.pop(k) or [])]
        if abandoned:
            discarded = _discard_abandoned_writes(self._ctx.storage_manager, abandoned, tag)
            log.warning("server.store_abandoned", instance_id=instance_id, chunks=len(abandoned),
                        discarded=discarded, model=getattr(entry, "model_name", None),
                        why="an engine left with stores reserved but never committed: discarded, not admitted")
        original(self, instance_id, entry)  # no writes left for it to admit; reads and the layout as LMCache does

    _release_entry.prefixshare_guard = True  # type: ignore[attr-defined]
    EngineDrivenTransferModule._release_entry = _release_entry


def install() -> None:
    """Every guard."""
    discard_abandoned_stores()
