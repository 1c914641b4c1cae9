"""The fs tier's server-side adapter driven directly, without a server: a request's chunks are hashed and
written by a pool of threads and read back the same way; writers racing on one directory never publish a
torn chunk; a chunk that fails does not fail the others. (End to end, through real servers and engines:
tests/faults/test_corruption.py and tests/faults/test_store_down.py.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

from prefixshare.server.plugins import integrity  # noqa: E402
from prefixshare.server.plugins.fs import CheckedFSL2Adapter, CheckedFSL2AdapterConfig  # noqa: E402

CHUNK = 256 * 1024


class Obj:
    """What the adapter uses of an LMCache memory object: its bytes."""

    def __init__(self, data: bytes | int) -> None:
        self.byte_array = bytearray(data)


def adapter(directory: Path, **params: Any) -> CheckedFSL2Adapter:
    return CheckedFSL2Adapter({"base_path": str(directory), **params})


def keys(n: int, model: str = "fs-test", seed: int = 0) -> list[Any]:
    return [ObjectKey(chunk_hash=(seed * 1000 + i).to_bytes(16, "big"), model_name=model, kv_rank=0) for i in range(n)]


def payloads(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([(seed + i) % 251]) * 7 + os.urandom(CHUNK - 7) for i in range(n)]


def store(a: CheckedFSL2Adapter, ks: list[Any], data: list[bytes], timeout_s: float = 30.0) -> int:
    """The task's result: bytes written (>= 0), or -1 when it failed."""
    task = a.submit_store_task(ks, [Obj(d) for d in data])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = a.pop_completed_store_tasks()
        if task in done:
            return int(done[task])
        time.sleep(0.001)
    raise AssertionError("store task did not complete")


def load(a: CheckedFSL2Adapter, ks: list[Any], timeout_s: float = 30.0) -> tuple[list[int], list[Obj]]:
    dst = [Obj(CHUNK) for _ in ks]
    task = a.submit_load_task(ks, dst)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        bitmap = a.query_load_result(task)
        if bitmap is not None:
            return bitmap.get_indices_list(), dst
        time.sleep(0.001)
    raise AssertionError("load task did not complete")


def chunk_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".data")


def test_a_request_round_trips_through_the_pool_and_leaves_only_whole_chunks(tmp_path: Path) -> None:
    a = adapter(tmp_path, io_threads=4)
    try:
        ks, data = keys(12), payloads(12)
        assert store(a, ks, data) == 12 * CHUNK  # success, and the payload bytes written
        files = chunk_files(tmp_path)
        assert len(files) == 12 and not list(tmp_path.glob("*.tmp"))
        assert all(f.stat().st_size == CHUNK + integrity.TRAILER_BYTES for f in files)
        assert all(integrity.verify_file(f).verdict == "ok" for f in files)
        assert all((f.stat().st_mode & 0o777) & ~0o640 == 0 for f in files)  # never world-readable
        loaded, dst = load(a, ks)
        assert loaded == list(range(12))
        assert [bytes(o.byte_array) for o in dst] == data  # each chunk in its own slot, in order
        assert store(a, ks, data) == 0  # already there: nothing rewritten
        assert a.report_status()["chunks_verified"] == 12
    finally:
        a.close()


def test_a_chunk_written_slice_by_slice_and_in_short_writes_has_the_whole_chunks_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer hashes and writes a chunk a slice at a time (the last one shorter) and finishes writes the
    kernel cut short: the file is the payload and the trailer of the whole payload, byte for byte."""
    from prefixshare.server.plugins import fs

    monkeypatch.setattr(fs, "WRITE_SLICE_BYTES", 100_000)  # a 256 KiB chunk: two whole slices and a remainder
    real_write, calls = os.write, []

    def short_write(fd: int, data: Any) -> int:
        calls.append(len(data))
        return real_write(fd, memoryview(data)[:30_000])  # never more than 30 kB at a time

    monkeypatch.setattr(fs.os, "write", short_write)
    a = adapter(tmp_path, io_threads=2)
    try:
        ks, data = keys(3, seed=7), payloads(3, seed=7)
        assert store(a, ks, data) == 3 * CHUNK
    finally:
        a.close()
    monkeypatch.setattr(fs.os, "write", real_write)
    assert max(calls) <= 100_000 and len(calls) > 3 * 9  # sliced, and every slice finished in short writes
    for k, payload in zip(ks, data, strict=True):
        path = tmp_path / a._key_to_path(k).name
        assert path.read_bytes() == payload + integrity.trailer(path.name, payload)
        assert integrity.verify_file(path).verdict == "ok"


def _recorded_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes asked, flags) of every ``os.preadv`` the adapter makes from now on."""
    from prefixshare.server.plugins import fs

    calls: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        calls.append((sum(len(b) for b in buffers), flags))
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(fs.os, "preadv", preadv)
    return calls


def test_a_chunk_read_slice_by_slice_is_the_chunk_and_a_truncated_one_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of the page cache the reader asks for READ_SLICE_BYTES at a time (the last one shorter): the chunk
    loads byte for byte and checks; a chunk file cut short in its second slice is refused (and set aside), the
    others load."""
    from prefixshare.server.plugins import fs

    monkeypatch.setattr(fs, "READ_SLICE_BYTES", 100_000)  # a 256 KiB chunk: two whole slices and a remainder
    monkeypatch.setattr(fs, "_NOWAIT", None)  # as if nothing were cached
    a = adapter(tmp_path, io_threads=2)
    try:
        ks, data = keys(3, seed=9), payloads(3, seed=9)
        assert store(a, ks, data) == 3 * CHUNK
        victim = a._key_to_path(ks[1])
        with open(victim, "r+b") as f:
            f.truncate(150_000)  # in the second slice
        calls = _recorded_reads(monkeypatch)
        loaded, dst = load(a, ks)
    finally:
        a.close()
    assert loaded == [0, 2] and all(bytes(dst[i].byte_array) == data[i] for i in loaded)
    sizes = [size for size, _ in calls]
    assert max(sizes) <= 100_000 and sizes.count(100_000) >= 5, sizes
    assert victim.with_name(victim.name + integrity.QUARANTINE_SUFFIX).exists()


def test_a_chunk_the_page_cache_holds_is_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Just written, the chunks are in the page cache: each is read in two reads that do not wait for the device
    (its first slice, then the rest), not slice by slice (slices cost a cached read 10-15 %)."""
    from prefixshare.server.plugins import fs

    if fs._NOWAIT is None:
        pytest.skip("this system has no RWF_NOWAIT")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, fs._NOWAIT)
    except OSError as exc:
        pytest.skip(f"this filesystem does not read with RWF_NOWAIT: {exc}")
    finally:
        os.close(fd)
    monkeypatch.setattr(fs, "READ_SLICE_BYTES", 100_000)
    a = adapter(tmp_path, io_threads=2)
    try:
        ks, data = keys(3, seed=11), payloads(3, seed=11)
        assert store(a, ks, data) == 3 * CHUNK
        calls = _recorded_reads(monkeypatch)
        loaded, dst = load(a, ks)
    finally:
        a.close()
    assert loaded == [0, 1, 2] and all(bytes(dst[i].byte_array) == data[i] for i in loaded)
    assert sorted(calls) == sorted([(100_000, fs._NOWAIT), (CHUNK - 100_000, fs._NOWAIT)] * 3), calls


def test_a_damaged_chunk_is_refused_alone_and_quarantined(tmp_path: Path) -> None:
    a = adapter(tmp_path, io_threads=3)
    try:
        ks, data = keys(8), payloads(8)
        assert store(a, ks, data) >= 0
        victim = a._key_to_path(ks[5])
        raw = bytearray(victim.read_bytes())
        raw[1000] ^= 0xFF
        victim.write_bytes(raw)
        loaded, dst = load(a, ks)
        assert loaded == [0, 1, 2, 3, 4, 6, 7]
        assert all(bytes(dst[i].byte_array) == data[i] for i in loaded)
        assert not victim.exists() and victim.with_name(victim.name + integrity.QUARANTINE_SUFFIX).exists()
        assert a.report_status()["chunks_damaged"] == 1
    finally:
        a.close()


def test_writers_racing_on_one_directory_never_publish_a_torn_chunk(tmp_path: Path) -> None:
    """Eight servers' adapters store the same chunks at once (replicas computing one popular document) while
    a ninth loads them in a loop. With one shared temporary name per chunk (LMCache's ``<chunk>.tmp``) a
    writer truncates a file another is about to publish, and a reader quarantines a good chunk."""
    writers = [adapter(tmp_path, io_threads=2) for _ in range(8)]
    reader = adapter(tmp_path, io_threads=4)
    spans: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    for w in writers:
        inner = w._store_chunk

        def timed(final: Path, tmp: Path, payload: memoryview, inner: Any = inner) -> int:
            t0 = time.monotonic()
            n = inner(final, tmp, payload)
            with lock:
                if n:
                    spans.append((t0, time.monotonic(), final.name))
            return n

        w._store_chunk = timed  # type: ignore[method-assign]
    try:
        rounds, per_round = 6, 6
        seen_torn, loads = 0, 0
        for r in range(rounds):
            ks, data = keys(per_round, seed=r + 1), payloads(per_round, seed=r)
            results: list[Any] = []
            threads = [threading.Thread(target=lambda w=w: results.append(store(w, ks, data))) for w in writers]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                loaded, dst = load(reader, ks)
                loads += 1
                seen_torn += sum(bytes(dst[i].byte_array) != data[i] for i in loaded)
            for t in threads:
                t.join()
            assert len(results) == len(writers) and all(res >= 0 for res in results), results
        # the fault happened: two writers were writing the same chunk at the same time
        by_name: dict[str, list[tuple[float, float]]] = {}
        for t0, t1, name in spans:
            by_name.setdefault(name, []).append((t0, t1))
        overlapping = sum(any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(v) for (b0, b1) in v[i + 1:])
                          for v in by_name.values())
        assert overlapping > 0, "no two writers overlapped on a chunk: the race was not exercised"
        assert loads > 0
        assert seen_torn == 0
        assert reader.report_status()["chunks_damaged"] == 0
        assert not list(tmp_path.glob("*" + integrity.QUARANTINE_SUFFIX))
        assert not list(tmp_path.glob("*.tmp"))
        files = chunk_files(tmp_path)
        assert len(files) == rounds * per_round
        assert all(integrity.verify_file(f).verdict == "ok" for f in files)
    finally:
        for w in [*writers, reader]:
            w.close()


def test_a_store_that_went_away_fails_the_write_and_the_adapter_keeps_working(tmp_path: Path) -> None:
    store_dir = tmp_path / "kv"
    store_dir.mkdir()
    a = adapter(store_dir)
    try:
        away = tmp_path / "kv.away"
        store_dir.rename(away)
        store_dir.write_text("not a directory\n")
        assert store(a, keys(3), payloads(3)) == -1  # LMCache's "failed"
        loaded, _ = load(a, keys(3))
        assert loaded == []
        store_dir.unlink()
        away.rename(store_dir)
        ks, data = keys(3, seed=9), payloads(3)
        assert store(a, ks, data) >= 0
        assert load(a, ks)[0] == [0, 1, 2]
    finally:
        a.close()


def test_fsync_is_the_tier_configs_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    for fsync, expected in ((False, 0), (True, 4)):
        synced.clear()
        a = adapter(tmp_path / str(fsync), fsync=fsync)
        try:
            assert store(a, keys(4), payloads(4)) >= 0
        finally:
            a.close()
        assert len(synced) == expected


@pytest.mark.parametrize("params, message", [
    ({"io_threads": 0}, "io_threads must be an integer from 1 to 64"),
    ({"io_threads": "4"}, "io_threads must be an integer from 1 to 64"),
    ({"fsync": "yes"}, "fsync must be true or false"),
])
def test_bad_adapter_parameters_are_named(tmp_path: Path, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckedFSL2AdapterConfig.from_dict({"base_path": str(tmp_path), **params})


def test_servers_writing_different_digests_load_each_others_chunks(tmp_path: Path) -> None:
    """One store, two servers: one left at the default digest (xxh3), one told ``digest: blake3`` (a tier whose
    integrity changed on some nodes first). Each writes its own digest and loads the other's chunks checked;
    a flipped byte is refused under either; an unknown digest name is refused when the adapter is built."""
    fast, slow = adapter(tmp_path), adapter(tmp_path, digest="blake3")
    try:
        ks_fast, ks_slow = keys(2, seed=1), keys(2, seed=2)
        data_fast, data_slow = payloads(2, seed=1), payloads(2, seed=2)
        assert store(fast, ks_fast, data_fast) == store(slow, ks_slow, data_slow) == 2 * CHUNK
        algorithms = {f.name: f.read_bytes()[-integrity.TRAILER_BYTES + 5] for f in chunk_files(tmp_path)}
        assert sorted(algorithms.values()) == [1, 1, 3, 3]  # blake3 twice, xxh3 twice
        for reader in (fast, slow):
            loaded, dst = load(reader, ks_fast + ks_slow)
            assert loaded == [0, 1, 2, 3] and [bytes(o.byte_array) for o in dst] == data_fast + data_slow
        victim = fast._key_to_path(ks_fast[0])
        raw = bytearray(victim.read_bytes())
        raw[CHUNK // 2] ^= 0x10
        victim.write_bytes(raw)
        victim_slow = slow._key_to_path(ks_slow[0])
        raw = bytearray(victim_slow.read_bytes())
        raw[CHUNK // 2] ^= 0x10
        victim_slow.write_bytes(raw)
        loaded, _ = load(slow, ks_fast + ks_slow)
        assert loaded == [1, 3] and slow.report_status()["chunks_damaged"] == 2
        assert fast.report_status()["integrity"] == "xxh3" and slow.report_status()["integrity"] == "blake3"
    finally:
        fast.close()
        slow.close()
    with pytest.raises(ValueError, match="xxh3"):
        CheckedFSL2AdapterConfig.from_dict({"base_path": str(tmp_path), "digest": "md5"})


def test_a_task_completes_even_when_its_bookkeeping_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last chunk's thread completes the task: if what runs after the chunks raises (a listener of LMCache's),
    the server still gets the task's result, with the chunks that were checked, instead of waiting for ever."""
    a = adapter(tmp_path, io_threads=2)
    try:
        ks, data = keys(3), payloads(3)

        def broken(*_: Any) -> None:
            raise RuntimeError("a listener failed")

        monkeypatch.setattr(a, "_notify_keys_stored", broken)
        assert store(a, ks, data) == -1  # completed, and failed: its keys were not accounted
        assert len(chunk_files(tmp_path)) == 3  # the chunks themselves were written whole
        monkeypatch.setattr(a, "_notify_keys_accessed", broken)
        loaded, dst = load(a, ks)
        assert loaded == [0, 1, 2] and [bytes(o.byte_array) for o in dst] == data
        assert a.verified == 3
    finally:
        a.close()


def test_closing_fails_the_queued_chunks_and_completes_their_task(tmp_path: Path) -> None:
    """Chunks still queued when the adapter closes are cancelled, and their load completes (as misses) before the
    adapter's events are closed; a load submitted after close completes at once, empty."""
    a = adapter(tmp_path, io_threads=1)
    ks, data = keys(8), payloads(8)
    store(a, ks, data)
    gate = threading.Event()
    real = a._read_checked

    def slow(path: Path, dst: memoryview) -> Any:
        gate.wait(10)
        return real(path, dst)

    a._read_checked = slow  # type: ignore[method-assign]
    dst = [Obj(CHUNK) for _ in ks]
    task = a.submit_load_task(ks, dst)
    closer = threading.Thread(target=a.close)
    closer.start()
    time.sleep(0.2)  # close is waiting for the running chunk; the queued ones are cancelled
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    bitmap = a._completed_load_tasks.pop(task)
    assert bitmap.get_indices_list() in ([], [0])  # at most the chunk that was running when close began
    late = a.submit_load_task(ks, [Obj(CHUNK) for _ in ks])
    assert a._completed_load_tasks.pop(late).get_indices_list() == []
