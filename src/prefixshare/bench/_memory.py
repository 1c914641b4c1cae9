"""What the machine charges for memory that sat idle: the first write into (or read of) pages nobody touched for
milliseconds to seconds, against the same access right after the pages were touched.

A store's path touches memory that waits between requests: the engine's copy of a request's KV goes into the
server's chunk buffers (POSIX shared memory, allocated when the server starts) and the fs tier writes through the
page cache. On a virtual machine whose host reclaims guest memory that sits idle, the first touch of such a page
after an idle spell costs a fault the guest does not see (its own page-fault counters stay flat); the time goes
to the host. A raw engine's prefill touches its own KV blocks the same way, but a pre-warm or a stored miss
touches more memory per request than the prefill alone, so on such a host it pays more than the raw engine.
The cost can start within milliseconds and varies with the host's state: page-cache reads of 25 MiB ran 11.5 GB/s
at once, 7 GB/s after 20 ms and 3.3 GB/s after 50 ms in one run, and 5.8 GB/s at once, 5.6 GB/s after 50 ms and
4.7 GB/s after 200 ms in another (run 20261207T030639Z-6857cc); so any two accesses compared in a benchmark must
start from the same state. The benchmark records this probe beside P3 and P6, whose figures it can explain
(``benchmarks/idle_memory.py`` runs it on its own, over other idle times).

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


#: idle spells up to this long are timed from an access of their own region right before (touch, wait, time):
#: on this box the cost grows within milliseconds, and the spells of the shared schedule below drift by the
#: tens of milliseconds that writing every region and timing the other kinds take
SHORT_IDLE_S = 0.5


def idle_round(idles: list[float], size: int, work: Path, tag: str) -> dict[str, dict[str, float]]:
    """GB/s per kind and idle time (seconds, as the key's string), for one round. A short idle time
    (``SHORT_IDLE_S`` or less; 0: *touched just before*) is timed right after an untimed access of its own region
    and a wait of that long; the longer ones share one schedule: each of their regions accessed, then each timed
    once its idle time has passed (in increasing order)."""
    payload = _filled(size)
    scratch = bytearray(payload)  # the reads' destination, touched just now
    regions = {(kind, idle): _region(kind, size, work, f"{tag}-{kind}-{idle:g}") for idle in idles for kind in KINDS}
    out: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    short, long = [i for i in sorted(idles) if i <= SHORT_IDLE_S], [i for i in sorted(idles) if i > SHORT_IDLE_S]
    try:
        for idle in short:
            for kind in KINDS:
                _touch_seconds(kind, regions[(kind, idle)], payload, scratch)
                time.sleep(idle)
                out[kind][f"{idle:g}"] = size / _touch_seconds(kind, regions[(kind, idle)], payload, scratch) / 1e9
        for idle in long:  # touched again now: their spells start here, not when the short ones began
            for kind in KINDS:
                _touch_seconds(kind, regions[(kind, idle)], payload, scratch)
        touched = time.perf_counter()
        for idle in long:
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
