"""prefixshare's fs L2 adapter: LMCache's fs adapter plus integrity data, run inside LMCache's MP server.

Loaded by the server through LMCache's ``plugin`` L2 adapter type (the fs tier renders the spec; nothing in
prefixshare imports this module, which imports LMCache)::

    --l2-adapter '{"type": "plugin", "module_path": "prefixshare.server.plugins.fs",
                   "class_name": "CheckedFSL2Adapter", "adapter_params": {"base_path": "/dir"}, ...}'

File names, lookups (a file-exists check) and deletes are LMCache's fs adapter's own, so several servers on
one directory share chunks and LMCache's tools still read the files. What differs:

* **store** writes ``payload + trailer`` (see :mod:`prefixshare.server.plugins.integrity`) to a temporary file
  created with mode 0640 (never world-readable), then renames it into place;
* **load** reads the payload and the trailer, and accepts the chunk only if the digest over the file name and
  the payload matches. A damaged chunk (truncated, bit-flipped, copied in under another name, written
  without integrity data) is never loaded: the load reports a miss for it, so the engine recomputes from
  that chunk on, and the file is renamed ``<name>.corrupt`` (lookups stop finding it; ``prefixshare doctor``
  lists it, ``prefixshare store gc --damaged`` removes it). One structured log line per damaged chunk.

With ``key_env`` in the adapter's parameters (the fs tier's ``key_env``) digests are keyed: the key is read
from that environment variable of the server's process when the adapter starts (never from the policy), and
``accept_key_envs`` names further keys accepted for reading (a rotation). A chunk this server cannot check
because it holds no key (``keyed``) is not loaded and left in place; every other refusal is quarantined.

The digest costs one pass over the bytes on store and on load: XXH3-128 by default (``digest: xxh3``, about
a quarter of a memory copy's cost), blake3 when the tier says ``integrity: blake3`` or when digests are keyed
(about a memory copy's cost; rates in docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

from prefixshare._log import configure_from_environment, get_logger
from prefixshare.server.plugins import integrity

log = get_logger("prefixshare.store")

#: mode of every chunk file we create (before the process umask): the owner writes, its group reads
FILE_MODE = 0o640

#: chunks of one request written or read at once (the fs tier's ``io_threads``)
DEFAULT_IO_THREADS = 4

#: bytes hashed and then written at a time, so that the write copies them while they are in the core's cache
#: (1 MiB: 0.68-0.83x raw writes against 0.35-0.59x hashing the whole chunk first; benchmarks/store_io.py)
WRITE_SLICE_BYTES = 1 << 20

#: bytes asked of the kernel per read of a chunk out of the page cache: each read lets the kernel's readahead run
#: ahead of the copy into L1 (one read of a whole 6 MiB chunk waits for all of it, then copies; a readahead window
#: of 8 MiB, as here, covers the chunk). Chunk files evicted from the page cache, 4 threads, 16 x 6 MiB: 0.63-0.67x
#: one sequential stream over one file in whole-chunk reads (0.68-0.74x with the chunks announced by ``WILLNEED``),
#: 0.95-0.97x in 512 KiB reads (1 MiB: 0.84x; ``WILLNEED`` with slices: 0.66-0.69x) (ad hoc, this 2-core box's
#: virtual disk). A chunk the page cache holds is read whole instead (:func:`_read_cached`): slices cost it 10-15 %
READ_SLICE_BYTES = 512 << 10
#: preadv2's flag for "only what the page cache holds" (Linux 4.14+; None elsewhere: every chunk read in slices)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _read_cached(fd: int, dst: memoryview) -> int:
    """Bytes of a chunk read from the page cache alone, without waiting for the device (``RWF_NOWAIT``): its first
    slice, then, if that was there, the rest in one read; 0 when its start is not cached (the caller reads it in
    slices) or the system cannot tell."""
    if _NOWAIT is None:
        return 0
    first = min(dst.nbytes, READ_SLICE_BYTES)
    got = 0
    try:
        got = os.preadv(fd, [dst[:first]], 0, _NOWAIT)
        if got == first < dst.nbytes:
            got += os.preadv(fd, [dst[first:]], first, _NOWAIT)
    except OSError:  # EAGAIN: not (all) cached; EOPNOTSUPP: this filesystem cannot say
        pass
    return got


def _write_all(fd: int, data: memoryview | bytes) -> None:
    """``data`` written whole (a short write — a signal, some network file systems — is finished)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class CheckedFSL2AdapterConfig(FSL2AdapterConfig):
    """LMCache's fs adapter fields (``base_path``, ``relative_tmp_dir``, ``read_ahead_size``,
    ``use_odirect``; O_DIRECT is not used by this adapter: the trailer breaks block alignment), plus the names
    of the store key variables (``key_env``, ``accept_key_envs``), the chunks moved at once (``io_threads``) and
    whether each chunk is fsynced before it is published (``fsync``), and the unkeyed digest new chunks get
    (``digest``: ``xxh3`` or ``blake3``; keyed digests are always blake3's). LMCache's plugin loader builds it
    from the adapter's parameters by this class's name."""

    key_env: str | None = None
    accept_key_envs: tuple[str, ...] = ()
    io_threads: int = DEFAULT_IO_THREADS
    fsync: bool = False
    digest: str = integrity.DEFAULT_ALGORITHM

    @classmethod
    def from_dict(cls, d: dict) -> CheckedFSL2AdapterConfig:
        base = FSL2AdapterConfig.from_dict(d)
        config = cls(base.base_path, base.relative_tmp_dir, base.read_ahead_size, base.use_odirect)
        key_env, accept = d.get("key_env"), d.get("accept_key_envs") or []
        if key_env is not None and not isinstance(key_env, str):
            raise ValueError("key_env must be the name of an environment variable")
        if not isinstance(accept, list) or not all(isinstance(a, str) for a in accept):
            raise ValueError("accept_key_envs must be a list of environment variable names")
        if accept and key_env is None:
            raise ValueError("accept_key_envs needs key_env")
        config.key_env, config.accept_key_envs = key_env, tuple(accept)
        io_threads, fsync = d.get("io_threads", DEFAULT_IO_THREADS), d.get("fsync", False)
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or not 1 <= io_threads <= 64:
            raise ValueError("io_threads must be an integer from 1 to 64")
        if not isinstance(fsync, bool):
            raise ValueError("fsync must be true or false")
        config.io_threads, config.fsync = io_threads, fsync
        digest = d.get("digest", integrity.DEFAULT_ALGORITHM)
        integrity.algorithm_id(digest)  # ValueError naming the choices
        config.digest = digest
        return config


class CheckedFSL2Adapter(FSL2Adapter):
    """fs L2 adapter whose chunks carry a digest that every load verifies."""

    def __init__(self, config: FSL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        configure_from_environment()  # the MP server's process: log as the process that started it
        if isinstance(config, dict):
            config = CheckedFSL2AdapterConfig.from_dict(config)
        key_env = getattr(config, "key_env", None)
        #: None: unkeyed digests; else the keys this server signs with and accepts (StoreKeyError when missing)
        self.keyring = integrity.Keyring.from_env(key_env, getattr(config, "accept_key_envs", ())) if key_env else None
        config.use_odirect = False
        self.io_threads = int(getattr(config, "io_threads", DEFAULT_IO_THREADS))
        self.fsync = bool(getattr(config, "fsync", False))
        self.digest = str(getattr(config, "digest", integrity.DEFAULT_ALGORITHM))
        #: the threads that hash and move chunk bytes (both digests and file I/O release the GIL)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.io_threads, thread_name_prefix="prefixshare-fs-io")
        super().__init__(config)
        self.damaged = 0  # chunks refused on load since start
        self.verified = 0
        self.uncheckable = 0  # keyed chunks this server holds no key for (not loaded, left in place)
        self._log = log.bind(base_path=str(self._base_path))

    def _fan_out(self, fn: Any, calls: list[tuple[Any, ...]], then: Callable[[list[Any]], None]) -> None:
        """``fn(*args)`` for every ``args`` in ``calls`` on the I/O threads, ``io_threads`` at a time, then
        ``then(results)`` (every result or exception, in order) in the thread that ran the last call. Called from
        the server's thread: the first reads or writes start at once, with no hop through the adapter's event
        loop (two thread wake-ups: 0.5-1 ms of a 1k-token load on this 2-core box; 1k warm reads 0.84x -> 0.94x
        raw in benchmarks/store_io.py run 20261207T021927Z-1d5db0)."""
        results: list[Any] = [None] * len(calls)
        left = [len(calls)]
        lock = threading.Lock()

        def finished(i: int, future: Any) -> None:
            if future.cancelled():  # the pool shut down (close) before the call ran
                results[i] = concurrent.futures.CancelledError()
            else:
                exc = future.exception()
                results[i] = exc if exc is not None else future.result()
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                then(results)

        if not calls:
            then(results)
        for i, args in enumerate(calls):
            try:
                future = self._pool.submit(fn, *args)
            except RuntimeError as exc:  # closed: this call fails, as a cancelled one does
                future = concurrent.futures.Future()
                future.set_exception(exc)
            future.add_done_callback(lambda f, i=i: finished(i, f))

    # ---- store ----------------------------------------------------------------------------------------

    def _temp_path(self, tmp: Path) -> Path:
        """A temporary name no other writer uses: LMCache's is ``<chunk>.tmp`` for every writer, so two servers
        storing the same chunk at once (two replicas computing one popular document) truncate each other's
        file, and one renames it into place while the other is still writing: a reader meets a torn chunk and
        quarantines a good one. Still ends in ``.tmp`` (``store gc`` removes stale ones)."""
        return tmp.with_name(f"{tmp.stem}.{os.getpid()}-{secrets.token_hex(6)}.tmp")

    def _store_chunk(self, final: Path, tmp: Path, payload: memoryview) -> int:
        """Hash and write one chunk in this (pool) thread, slice by slice (each slice hashed right before it is
        written, while it is in the CPU's cache); 0 when it is already there, else its file's size."""
        if final.exists():
            return 0
        hasher = integrity.TrailerHasher(final.name, self.keyring, self.digest)
        tmp = self._temp_path(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            try:
                for start in range(0, payload.nbytes, WRITE_SLICE_BYTES):
                    piece = payload[start:start + WRITE_SLICE_BYTES]
                    hasher.update(piece)
                    _write_all(fd, piece)
                tail = hasher.trailer(payload.nbytes)
                _write_all(fd, tail)
                want = payload.nbytes + len(tail)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)  # published whole, or not at all
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return want

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> Any:
        """A request's chunks are written ``io_threads`` at a time, each hashed in the thread that writes it."""
        with self._lock:
            task_id = self._get_next_task_id()
        calls = [(*self._key_to_file_and_tmp_path(k), memoryview(o.byte_array).cast("B"))
                 for k, o in zip(keys, objects, strict=True)]
        self._fan_out(self._store_chunk, calls, lambda results: self._stored(keys, results, task_id))
        return task_id

    def _stored(self, keys: list[Any], results: list[Any], task_id: Any) -> None:
        """A store task's outcome, once every chunk's write ended: the keys written, its result, the event (the
        task completes even if this raises: the server never waits for it in vain)."""
        success, written = False, 0
        try:
            success = True
            stored_keys: list[Any] = []
            stored_sizes: list[int] = []
            for key, result in zip(keys, results, strict=True):
                if isinstance(result, BaseException):  # one failed chunk fails the task; the others were still tried
                    self._log.warning("store.write_failed", file=self._key_to_path(key).name, error=repr(result))
                    success = False
                elif result:
                    written += result - integrity.TRAILER_BYTES
                    stored_keys.append(key)
                    # the file's size: LMCache's delete subtracts what it stats, so usage must add the same
                    stored_sizes.append(result)
            if stored_keys:
                self._notify_keys_stored(stored_keys, stored_sizes)
        except BaseException:
            success = False
            raise
        finally:
            with self._lock:
                self._completed_store_tasks[task_id] = L2StoreResult(success, written)
            self._store_efd.notify()

    # ---- load -----------------------------------------------------------------------------------------

    def _read_checked(self, path: Path, dst: memoryview) -> integrity.Verdict:
        """Read one chunk into ``dst`` (whole if the page cache holds it, else :data:`READ_SLICE_BYTES` per read)
        and check it. Hashing slice by slice as they are read was measured slower here (benchmarks/store_io.py),
        unlike on store."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            n = dst.nbytes
            got = _read_cached(fd, dst)
            while got < n:
                k = os.preadv(fd, [dst[got:min(n, got + READ_SLICE_BYTES)]], got)
                if not k:
                    break
                got += k
            if got < n:
                return "truncated"
            tail = os.pread(fd, integrity.TRAILER_BYTES, n)
        finally:
            os.close(fd)
        # the digest named by the trailer, whatever this server writes (a store can change algorithm)
        return integrity.check(path.name, dst, tail, size, self.keyring)

    def _quarantine(self, path: Path, verdict: str) -> None:
        target = path.with_name(path.name + integrity.QUARANTINE_SUFFIX)
        try:
            os.replace(path, target)
            moved = True
        except OSError:
            moved = False
        self._log.warning("store.damaged_chunk", file=path.name, verdict=verdict, quarantined=moved,
                          action="not loaded; the engine recomputes from this chunk")

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> Any:
        with self._lock:
            task_id = self._get_next_task_id()
        self._start_load(keys, objects, task_id)
        return task_id

    def _start_load(self, keys: list[Any], objects: list[Any], task_id: Any) -> None:
        """Every chunk of the request read and checked, ``io_threads`` at a time. Not announced to the kernel
        first (``WILLNEED``): with reads in slices, that slowed evicted reads by a third (:data:`READ_SLICE_BYTES`)."""
        paths = [self._key_to_path(key) for key in keys]
        self._fan_out(self._read_checked, [(p, memoryview(o.byte_array).cast("B")) for p, o in
                                           zip(paths, objects, strict=True)],
                      lambda verdicts: self._loaded(keys, paths, verdicts, task_id))

    def _loaded(self, keys: list[Any], paths: list[Path], verdicts: list[Any], task_id: Any) -> None:
        """A load task's outcome, once every chunk was read and checked: the chunks loaded (damaged ones
        quarantined), its bitmap, the event (the task completes even if this raises, with the chunks checked
        so far)."""
        bitmap = Bitmap(len(keys))
        counts = {"ok": 0, "uncheckable": 0, "damaged": 0}
        try:
            for i, (path, verdict) in enumerate(zip(paths, verdicts, strict=True)):
                if isinstance(verdict, FileNotFoundError):
                    continue
                if isinstance(verdict, BaseException):
                    self._log.warning("store.read_failed", file=path.name, error=repr(verdict))
                elif verdict == "ok":
                    counts["ok"] += 1
                    bitmap.set(i)
                elif verdict in integrity.UNCHECKABLE:
                    counts["uncheckable"] += 1
                    self._log.warning("store.keyed_chunk", file=path.name, action="not loaded (this server holds "
                                      "no store key); set the fs tier's key_env on every server of this store")
                else:
                    counts["damaged"] += 1
                    self._quarantine(path, verdict)
            loaded = [keys[i] for i in bitmap.get_indices_list()]
            if loaded:
                self._notify_keys_accessed(loaded)
        finally:
            with self._lock:  # two loads can end at once, each in a thread of its own
                self.verified += counts["ok"]
                self.uncheckable += counts["uncheckable"]
                self.damaged += counts["damaged"]
                self._completed_load_tasks[task_id] = bitmap
            self._load_efd.notify()

    def close(self) -> None:
        # first: queued chunks are cancelled and their tasks completed (failed) while the events are still open
        self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        status.update(type="prefixshare.CheckedFSL2Adapter",
                      integrity="blake3-keyed" if self.keyring is not None else self.digest,
                      chunks_verified=self.verified, chunks_damaged=self.damaged, chunks_uncheckable=self.uncheckable)
        return status
