"""The MP server's L1 eviction wakes on L1's events (:mod:`prefixshare.server.plugins.eviction`): LMCache's own
L1 manager and eviction controller, in this process, filled over the watermark; LMCache's loop as it ships is the
control (it cannot evict before its one-second sleep ends)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.config import EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.l1_manager import L1Manager  # noqa: E402
from lmcache.v1.distributed.storage_controllers import eviction_controller  # noqa: E402

from prefixshare.server.plugins import eviction  # noqa: E402

L1_BYTES = 16 << 20
OBJECT_BYTES = 1 << 20


def _l1() -> Any:
    return L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=L1_BYTES, use_lazy=False,
                                                                         shm_name="")))


def _write(l1: Any, count: int, stored: bool = True) -> list[Any]:
    """``count`` objects of 1 MiB written into ``l1`` (reserved, then admitted: resident), and, if ``stored``,
    read and released as the L2 tier's store does when it writes them out (then evictable)."""
    layout = MemoryLayoutDesc(shapes=[torch.Size([OBJECT_BYTES])], dtypes=[torch.uint8])
    keys = [ObjectKey(chunk_hash=os.urandom(16), model_name="eviction-test", kv_rank=0) for _ in range(count)]
    reserved = l1.reserve_write(keys, [False] * count, layout, tag="test")
    assert all(obj is not None for _, obj in reserved.values()), reserved
    l1.finish_write(keys, tag="test")
    if stored:
        l1.reserve_read(keys)
        l1.finish_read(keys)
    return keys


def _usage(l1: Any) -> float:
    used, total = l1.get_memory_usage()
    return used / total


def _seconds_to_evict(l1: Any, watermark: float, limit_s: float = 3.0) -> float:
    """Seconds from now until ``l1`` is under ``watermark`` (polled every 5 ms), or ``limit_s``."""
    t0 = time.monotonic()
    while _usage(l1) >= watermark and time.monotonic() - t0 < limit_s:
        time.sleep(0.005)
    return time.monotonic() - t0


def _controller(l1: Any) -> Any:
    controller = eviction_controller.L1EvictionController(l1, EvictionConfig(eviction_policy="LRU"))
    controller.start()
    time.sleep(0.05)  # its thread is in its wait
    return controller


def _install(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`eviction.install`, undone after the test (LMCache's classes as they were)."""
    cls = eviction_controller.L1EvictionController
    for owner, name in ((cls, "__init__"), (cls, "eviction_loop"), (cls, "report_status"),
                        (L1Manager, "reserve_write")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    assert eviction.install()


def test_l1_eviction_runs_when_l1_fills_not_on_the_next_second(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = eviction_controller.L1EvictionController
    watermark = EvictionConfig(eviction_policy="LRU").trigger_watermark

    # control: LMCache's loop as it ships sleeps a second before it looks
    l1 = _l1()
    controller = _controller(l1)
    try:
        _write(l1, 15)  # 15 of 16 MiB: over the watermark
        assert _usage(l1) > watermark
        shipped = _seconds_to_evict(l1, watermark)
    finally:
        controller.stop()
    assert shipped >= 0.5, f"LMCache's own loop evicted after {shipped:.3f} s: the control does not hold"

    _install(monkeypatch)
    assert eviction.install()  # idempotent
    l1 = _l1()
    controller = _controller(l1)
    try:
        _write(l1, 12)  # 12 of 16: under the watermark, a wake evicts nothing
        time.sleep(0.2)
        assert _usage(l1) == 12 / 16
        _write(l1, 3)  # 15 of 16
        woken = _seconds_to_evict(l1, watermark)
        assert woken < 0.3, f"evicted {woken:.3f} s after L1 crossed its watermark"
        assert _usage(l1) < watermark
        # LMCache's policy and ratio are kept: the oldest objects go, a fifth of L1 (and a bit more) at a time
        assert _usage(l1) >= 15 / 16 - 0.2 - 2 * OBJECT_BYTES / L1_BYTES
    finally:
        t0 = time.monotonic()
        controller.stop()
    assert time.monotonic() - t0 < 1.5  # stop still ends the thread


def test_a_full_l1_with_nothing_evictable_is_not_scanned_at_every_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks still being written (staged: write-locked, like chunks waiting for a slow L2 tier) cannot be evicted;
    a round that finds nothing to evict makes the next wait EMPTY_ROUND_GAP_S, so writes arriving every 10 ms
    cost a round (a scan of L1 and LMCache's log line) every 0.1 s, not every 20 ms."""
    _install(monkeypatch)
    l1 = _l1()
    layout = MemoryLayoutDesc(shapes=[torch.Size([OBJECT_BYTES])], dtypes=[torch.uint8])
    keys = [ObjectKey(chunk_hash=os.urandom(16), model_name="eviction-test", kv_rank=0) for _ in range(14)]
    l1.reserve_write(keys, [False] * len(keys), layout, tag="test")  # staged, never admitted
    assert _usage(l1) > EvictionConfig(eviction_policy="LRU").trigger_watermark
    controller = _controller(l1)
    rounds: list[float] = []
    monkeypatch.setattr(controller, "_publish_triggered", lambda *a: rounds.append(time.monotonic()))
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            controller._prefixshare_wake.set()  # what each write or release does
            time.sleep(0.01)
    finally:
        controller.stop()
    assert _usage(l1) == 14 / 16  # nothing was evictable
    assert 3 <= len(rounds) <= 1.0 / eviction.EMPTY_ROUND_GAP_S + 2, len(rounds)


def _keys(count: int) -> list[Any]:
    return [ObjectKey(chunk_hash=os.urandom(16), model_name="eviction-test", kv_rank=0) for _ in range(count)]


def _reserve(l1: Any, keys: list[Any]) -> list[Any]:
    """Reserve ``keys`` (1 MiB each); the errors L1 answered, one per key."""
    layout = MemoryLayoutDesc(shapes=[torch.Size([OBJECT_BYTES])], dtypes=[torch.uint8])
    return [error for error, _ in l1.reserve_write(keys, [False] * len(keys), layout, tag="test").values()]


def test_a_reservation_that_would_not_fit_evicts_first_in_the_reserving_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The eviction thread is never started here: only the reservation itself can make room. Control: LMCache's
    L1 as it ships refuses the same reservation (OUT_OF_MEMORY: the server drops that store)."""
    from lmcache.v1.distributed.error import L1Error

    def fill_and_reserve() -> tuple[Any, list[Any], list[Any]]:
        l1 = _l1()
        eviction_controller.L1EvictionController(l1, EvictionConfig(eviction_policy="LRU"))  # never started
        batches = [_write(l1, 5) for _ in range(3)]  # 15 of 16 MiB, resident and unlocked: evictable
        return l1, batches, _reserve(l1, _keys(4))

    l1, _, errors = fill_and_reserve()
    l1.close()
    assert set(errors) == {L1Error.OUT_OF_MEMORY}, "control: LMCache's L1 took 4 MiB more into 1 MiB of room"

    _install(monkeypatch)
    l1, batches, errors = fill_and_reserve()
    try:
        assert set(errors) == {L1Error.SUCCESS}
        gone = [[key for key in batch if l1.get_object_state(key) is None] for batch in batches]
        # LRU: only the oldest batch lost objects, as many as the reservation needed (15 + 4 - 16), no more
        assert [len(g) for g in gone] == [3, 0, 0], gone
    finally:
        l1.close()


def test_what_cannot_be_evicted_is_reported_and_a_reservation_past_it_still_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged (being written) and read (being loaded, or written to the L2 tier) objects cannot be evicted: a
    reservation past them fails at once (no wait, no hang), and the controller's status says how many bytes they
    hold, which is what warm's pacing subtracts from L1's size, and how many bytes it reserved in all (what of a
    writer's stores reached it)."""
    from lmcache.v1.distributed.error import L1Error

    _install(monkeypatch)
    l1 = _l1()
    controller = eviction_controller.L1EvictionController(l1, EvictionConfig(eviction_policy="LRU"))
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 0
    staged = _keys(10)
    assert set(_reserve(l1, staged)) == {L1Error.SUCCESS}  # staged, never admitted
    read = _write(l1, 4)
    l1.reserve_read(read[:3])
    status = controller.report_status()
    assert status["prefixshare_unevictable_bytes"] == 13 * OBJECT_BYTES
    assert status["prefixshare_reserved_bytes_total"] == 14 * OBJECT_BYTES  # what reached L1: staged or written
    t0 = time.monotonic()
    assert set(_reserve(l1, _keys(4))) == {L1Error.OUT_OF_MEMORY}  # 1 MiB was evictable, 2 free: 4 do not fit
    assert time.monotonic() - t0 < 0.5
    assert l1.get_object_state(read[3]) is None  # the one unlocked object went, in the attempt
    assert all(l1.get_object_state(key) is not None for key in read[:3])
    l1.finish_read(read[:3])
    l1.finish_write(staged, tag="test")  # admitted: held until the L2 tier's store has read them (FRESH_S)
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 10 * OBJECT_BYTES
    l1.reserve_read(staged)  # ... which it does, and releases them
    l1.finish_read(staged)
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 0
    assert set(_reserve(l1, _keys(4))) == {L1Error.SUCCESS}
    assert controller.report_status()["prefixshare_reserved_bytes_total"] == 18 * OBJECT_BYTES  # the refused: none
    l1.close()


def test_a_chunk_the_l2_tier_has_not_read_yet_is_not_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk just written waits for the L2 tier's store to read it out (unlocked, in LMCache's queue): evicted
    then, it is lost from every tier. It is held until that read begins, or FRESH_S. Control: without the hold
    (the same reservation, the same L1) LMCache's policy takes the unread chunks, the oldest."""
    from lmcache.v1.distributed.error import L1Error

    _install(monkeypatch)
    monkeypatch.setattr(eviction, "FRESH_S", 0.5)

    def fill() -> tuple[Any, Any, list[Any], list[Any]]:
        l1 = _l1()
        controller = eviction_controller.L1EvictionController(l1, EvictionConfig(eviction_policy="LRU"))
        unread = _write(l1, 8, stored=False)  # the oldest: written, not yet read by the L2 tier
        stored = _write(l1, 7)  # newer, written out: evictable
        return l1, controller, unread, stored

    l1, controller, unread, stored = fill()
    controller._prefixshare_fresh = None  # the control: LMCache's test alone
    assert set(_reserve(l1, _keys(4))) == {L1Error.SUCCESS}
    assert any(l1.get_object_state(key) is None for key in unread), "control: no unread chunk was evicted"
    l1.close()

    l1, controller, unread, stored = fill()
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 8 * OBJECT_BYTES
    assert set(_reserve(l1, _keys(4))) == {L1Error.SUCCESS}
    assert all(l1.get_object_state(key) is not None for key in unread)
    assert sum(l1.get_object_state(key) is None for key in stored) == 3
    l1.reserve_read(unread[:2])  # the L2 tier's store reads two, writes them, releases them
    l1.finish_read(unread[:2])
    # 6 unread, and the 4 just reserved (staged: written by nobody in this test)
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 10 * OBJECT_BYTES
    time.sleep(0.6)  # FRESH_S: the rest become evictable (a chunk no tier takes is not held for ever)
    assert controller.report_status()["prefixshare_unevictable_bytes"] == 4 * OBJECT_BYTES
    l1.close()


def test_a_chunk_gone_before_the_l2_tier_read_it_is_logged_and_counted(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Any) -> None:
    """LMCache's store loop skips a chunk that left L1 before it read it (lost from every tier) with a line at debug
    level only. With prefixshare's server it is a warning and a count in the store controller's /status. LMCache's
    real L1, store controller (its thread never started: the test runs its step) and prefixshare's fs tier; of
    four chunks written, three are deleted before the step. Control: the one left is written to the store, and a
    step that reads every chunk logs nothing."""
    from lmcache.v1.distributed.error import L1Error
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.storage_controllers import store_controller
    from lmcache.v1.distributed.storage_controllers.store_policy import create_store_policy
    from lmcache.v1.distributed.storage_controllers.utils import L2AdapterDescriptor
    from structlog.testing import capture_logs

    from prefixshare.server.plugins import losses
    from prefixshare.server.plugins.fs import CheckedFSL2Adapter

    cls = store_controller.StoreController
    for name in ("__init__", "report_status"):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    assert losses.install() and losses.install()  # a second install changes nothing
    l1 = _l1()
    config = FSL2AdapterConfig(base_path=str(tmp_path))
    adapter = CheckedFSL2Adapter(config)
    controller = cls(l1, [adapter], [L2AdapterDescriptor(index=0, config=config)], create_store_policy("default"))
    try:
        def step() -> list[dict[str, Any]]:
            with capture_logs() as logs:
                controller._process_new_keys(controller._listener.pop_pending_keys())
            return [e for e in logs if e["event"] == "store.chunks_not_stored"]

        keys = _write(l1, 4, stored=False)
        assert set(l1.delete(keys[:3]).values()) == {L1Error.SUCCESS}
        lost = step()
        assert [(e["chunks"], e["reason"], e["since_start"], e["log_level"]) for e in lost] == [
            (3, "not_found", 3, "warning")], lost
        assert "lost from every tier" in lost[0]["what"]
        assert controller.report_status()["prefixshare_chunks_not_stored"] == {"not_found": 3}
        deadline = time.monotonic() + 10
        while len(list(tmp_path.rglob("*.data"))) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(list(tmp_path.rglob("*.data"))) == 1  # the chunk still in L1 was written out
        _write(l1, 2, stored=False)
        assert step() == []  # control: every chunk read, nothing said
        assert controller.report_status()["prefixshare_chunks_not_stored"] == {"not_found": 3}
    finally:
        adapter.close()
        l1.close()
