"""What the machine charges for memory that sat idle: the first write into (or read of) pages nobody touched for a
few seconds, against the same access a moment after the pages were touched.

A store's path touches memory that waits between requests: the engine's copy of a request's KV goes into the
server's chunk buffers (POSIX shared memory, allocated when the server starts) and the fs tier writes through the
page cache. On a virtual machine whose host reclaims guest memory that sits idle, the first touch of such a page
after an idle spell costs a fault the guest does not see (its own page-fault counters stay flat); the time goes
to the host. A raw engine's prefill touches its own KV blocks the same way, but a pre-warm or a stored miss
touches more memory per request than the prefill alone, so on such a host it pays more than the raw engine.
The benchmark records this probe beside P3 and P6, whose figures it can explain (``benchmarks/idle_memory.py``
runs it on its own, over longer idle times).

Kinds, each one region per idle time, every page written once before the idle spell:

* ``anon_4k``: anonymous memory with transparent huge pages refused (``MADV_NOHUGEPAGE``);
* ``anon_thp``: the same with ``MADV_HUGEPAGE`` (2 MiB pages where the kernel gives them);
* ``shm``: a POSIX shared-memory file mapped shared, as the server's chunk buffers are;
* ``page_cache_read``: a file in the page cache, read back into a buffer touched just before (as P3's raw
  reads are timed).
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixshare.bench._micro import _read

KINDS = ("anon_4k", "anon_thp", "shm", "page_cache_read")
_MIB = 1 << 20


def _filled(size: int) -> bytes:
    """``size`` bytes (a multiple of 1 MiB) that are not zero, so no page of a region is the kernel's zero page."""
    return os.urandom(_MIB) * (size // _MIB)


def _region(kind: str, size: int, work: Path, tag: str) -> Any:
    """A region of ``kind`` with every page written: an mmap, or a file's path for ``page_cache_read``."""
    if kind == "page_cache_read":
        path = work / f"{tag}.bin"
        path.write_bytes(_filled(size))
        return path
    if kind == "shm":
        path = Path("/dev/shm") / f"prefixshare-idle-{os.getpid()}-{tag}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
            path.unlink()  # the mapping keeps its pages
    else:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE if kind == "anon_thp" else mmap.MADV_NOHUGEPAGE)
    region.write(_filled(size))
    return region


def _touch_seconds(kind: str, region: Any, payload: bytes, scratch: bytearray) -> float:
    """One timed access: a write of ``payload`` into the region, or a read of the file into ``scratch``."""
    if kind == "page_cache_read":
        return _read(region, scratch)
    t0 = time.perf_counter()
    region.seek(0)
    region.write(payload)
    return time.perf_counter() - t0


def idle_round(idles: list[float], size: int, work: Path, tag: str) -> dict[str, dict[str, float]]:
    """GB/s per kind and idle time (seconds, as the key's string), for one round: every region written, then each
    timed once its idle time has passed (idle times in increasing order)."""
    payload = _filled(size)
    scratch = bytearray(payload)  # the reads' destination, touched just now
    regions = {(kind, idle): _region(kind, size, work, f"{tag}-{kind}-{idle:g}") for idle in idles for kind in KINDS}
    touched = time.perf_counter()
    out: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    try:
        for idle in sorted(idles):
            time.sleep(max(0.0, touched + idle - time.perf_counter()))
            for kind in KINDS:
                out[kind][f"{idle:g}"] = size / _touch_seconds(kind, regions[(kind, idle)], payload, scratch) / 1e9
    finally:
        for (kind, _), region in regions.items():
            if kind == "page_cache_read":
                region.unlink(missing_ok=True)
            else:
                region.close()
    return out


def idle_memory(idles: list[float], size: int, rounds: int, work: Path | None = None) -> dict[str, Any]:
    """The probe: median GB/s per kind and idle time over ``rounds``, each kind's ratio to its shortest idle time,
    and every round's figures."""
    idles = sorted(idles)
    with tempfile.TemporaryDirectory(prefix="prefixshare-idle-", dir=work) as tmp:
        runs = [idle_round(idles, size, Path(tmp), f"r{r}") for r in range(rounds)]
    keys = [f"{i:g}" for i in idles]
    gbps = {kind: {k: round(statistics.median(run[kind][k] for run in runs), 3) for k in keys} for kind in KINDS}
    return {"bytes": size, "idle_s": idles, "rounds": rounds, "gbps": gbps,
            "ratio_to_first": {kind: {k: round(v / row[keys[0]], 3) for k, v in row.items()}
                               for kind, row in gbps.items()},
            "runs": [{kind: {k: round(v, 3) for k, v in row.items()} for kind, row in run.items()} for run in runs]}
