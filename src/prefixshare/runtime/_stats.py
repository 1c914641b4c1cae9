"""Counters of a connector, and their publication off the request path.

Nothing is written on the request path: a finished request only marks its runtime's snapshot out of date
(an in-memory counter, shared with readers through a small memory-mapped ``.seq`` file beside the
snapshot), and one daemon thread per process writes the snapshots (and the cost model's estimates) at most
every ``PUBLISH_INTERVAL_S``. :func:`read_stats` waits for a live process's snapshot to catch up with its
counter, so a reader never sees counters older than the requests it saw finish.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import struct
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixshare._paths import run_dir


@dataclass
class Stats:
    """One connector's counters (scheduler side: what :func:`read_stats` merges)."""

    requests: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_loaded: int = 0
    tokens_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    admitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    #: store hits set aside for verification, and those not kept (by reason: rate, pending, lora, error)
    verify_sampled: int = 0
    verify_dropped: Counter[str] = field(default_factory=Counter)
    #: stores the engine made that never reached the server, by reason (worker side: the engine's stores)
    stores_lost: Counter[str] = field(default_factory=Counter)
    # the newest latencies only (a long-running engine must not grow these, nor sort them all on every publish)
    lookup_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    load_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def to_dict(self) -> dict[str, Any]:
        def summary(values: deque[float]) -> dict[str, float | int | None]:
            ordered = sorted(values)
            return {
                "count": len(ordered),
                "median": ordered[len(ordered) // 2] if ordered else None,
                "max": ordered[-1] if ordered else None,
                "last": values[-1] if values else None,  # the newest request's
            }

        return {
            "requests": self.requests,
            "lookups": self.lookups,
            "hits": self.hits,
            "tokens_loaded": self.tokens_loaded,
            "tokens_stored": self.tokens_stored,
            "bytes_loaded": self.bytes_loaded,
            "bytes_stored": self.bytes_stored,
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "fallbacks": dict(self.fallbacks),
            "verify_sampled": self.verify_sampled,
            "verify_dropped": dict(self.verify_dropped),
            "stores_lost": dict(self.stores_lost),
            "lookup_ms": summary(self.lookup_ms),
            "load_ms": summary(self.load_ms),
        }


class StatsPublisher:
    """The publishing half of a :class:`~prefixshare.runtime.ConnectorRuntime`: its snapshot file, the shared
    counter readers wait on, and the hand-off to the writer thread. The runtime provides ``snapshot()``,
    ``cost``, ``log`` and ``instance``, and calls :meth:`_start_publishing` once it can take a snapshot."""

    cost: Any
    log: Any
    instance: str
    role: str

    def snapshot(self) -> dict[str, Any]:  # pragma: no cover - the runtime's
        raise NotImplementedError

    def _start_publishing(self) -> None:
        self._stats_path = run_dir() / "stats" / f"{self.instance}-{self.role}-{os.getpid()}.json"
        self._stats_path.parent.mkdir(parents=True, exist_ok=True)
        #: bumped on the request path whenever the snapshot is out of date; readers compare it with the snapshot's
        self._seq = _SharedCounter(self._stats_path.with_suffix(".seq"))
        self._write_lock = threading.Lock()
        self._written = -1  # the counter value the newest written snapshot covers
        self._last_publish = 0.0
        self._queued = False  # waiting for the writer thread
        self._closed = False
        if self.cost is not None:
            self.cost.defer = self._mark  # its estimates are persisted by the writer thread as well
        _LIVE.add(self)
        self.publish(force=True)

    #: a runtime's snapshot is written at most this often (by the writer thread, never on the request path)
    PUBLISH_INTERVAL_S = 0.05

    def publish(self, force: bool = False) -> None:
        """Mark the snapshot out of date: the writer thread writes it within ``PUBLISH_INTERVAL_S`` (at once when it
        was idle). This is all a request pays: a counter in shared memory and, at most once per write, a hand-off
        to the writer. ``force``: write it now, in this thread (start-up, shutdown)."""
        if force:
            self.flush()
        else:
            self._mark()

    def _mark(self) -> None:
        self._seq.bump()
        if not self._queued and not self._closed:
            self._queued = True
            _writer().submit(self)

    def flush(self, cost: bool = True) -> None:
        """Write the snapshot (and, with ``cost``, the cost model's estimates when they changed) now, in the calling
        thread."""
        with self._write_lock:
            seq = self._seq.value
            self._last_publish = time.monotonic()
            tmp = self._stats_path.with_suffix(f".{threading.get_ident()}.tmp")
            try:
                tmp.write_text(json.dumps({**self.snapshot(), "seq": seq}))
                tmp.replace(self._stats_path)
                self._written = seq
            except OSError as exc:
                self.log.warning("stats.publish_failed", error=str(exc))
            if cost and self.cost is not None:
                self.cost.save(force=True)

    def _background_write(self) -> bool:
        """The writer thread's turn: the snapshot when it changed, the cost estimates at most once a second (the
        estimates file is read, merged and written: ~0.5 ms). True while something is left to write."""
        if self.dirty:
            self.flush(cost=False)
        if self._cost_pending():
            self.cost.save()  # type: ignore[union-attr]
            return self._cost_pending()
        return False

    def _cost_pending(self) -> bool:
        return self.cost is not None and self.cost._dirty and self.cost.path is not None

    @property
    def dirty(self) -> bool:
        """True while the published snapshot is older than the counters."""
        return self._written != self._seq.value

    @property
    def pending(self) -> bool:
        """True while the snapshot or the cost model's estimates are not written yet."""
        return self.dirty or self._cost_pending()

    def close(self) -> None:
        """Write the final snapshot and stop publishing (idempotent; also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.pending:
            self.flush()
        self._seq.close()




# --- publishing off the request path ------------------------------------------------------------------------


class _SharedCounter:
    """A counter other processes can read: 8 bytes of a memory-mapped file beside the snapshot. Bumping it is a
    store to memory (no system call); :func:`read_stats` reads the file to see whether a snapshot is behind."""

    def __init__(self, path: Path) -> None:
        self.path: Path | None = path
        self._map: mmap.mmap | None = None
        self._view: Any = [0]
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
            try:
                os.ftruncate(fd, 8)
                self._map = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
            self._view = memoryview(self._map).cast("Q")
        except (OSError, ValueError):  # still counts; readers just cannot wait for this process
            self.path = None

    def bump(self) -> None:
        self._view[0] += 1

    @property
    def value(self) -> int:
        return int(self._view[0])

    def detach(self) -> None:
        """In a forked child: keep counting privately (the parent's file and its readers are the parent's)."""
        self._view, self._map, self.path = [self.value], None, None

    def close(self) -> None:
        value = self.value
        if self._map is not None:
            self._view.release()
            self._map.close()
            self._map = None
        self._view = [value]
        if self.path is not None:
            self.path.unlink(missing_ok=True)  # a closed runtime's snapshot is final: nothing to wait for
            self.path = None


def read_counter(path: Path) -> int | None:
    """The value of a :class:`_SharedCounter` file (None when there is none)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return struct.unpack("=Q", data)[0] if len(data) == 8 else None


class _Writer:
    """The one daemon thread per process that writes runtimes' snapshots off the request path.

    While requests come it ticks every ``PUBLISH_INTERVAL_S`` and writes the snapshots marked since the last tick:
    handing one over is a list append under an uncontended lock, no system call. After ``PARK_AFTER_S`` without
    anything to write it parks on an event; the next request wakes it (one futex call) and is written at once."""

    PARK_AFTER_S = 1.0

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: list[StatsPublisher] = []
        self._wake = threading.Event()
        self.parked = False
        self.thread = threading.Thread(target=self._run, name="prefixshare-stats", daemon=True)
        self.thread.start()

    def submit(self, rt: StatsPublisher) -> None:
        with self._lock:
            self._pending.append(rt)
        if self.parked:
            self.parked = False
            self._wake.set()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
            now = time.monotonic()
            if not batch:
                if now - idle_since < self.PARK_AFTER_S:
                    time.sleep(self.interval)
                    continue
                self.parked = True
                with self._lock:
                    if self._pending:  # handed over just before it parked: nobody will wake it
                        self.parked = False
                        continue
                self._wake.wait()
                self._wake.clear()
                idle_since = time.monotonic()
                continue
            idle_since = now
            later: list[StatsPublisher] = []
            for rt in dict.fromkeys(batch):
                if rt._closed:
                    continue  # close() wrote the final snapshot
                if rt.dirty and now - rt._last_publish < rt.PUBLISH_INTERVAL_S:
                    later.append(rt)  # written moments ago (a reader flushed it): keep the interval
                    continue
                rt._queued = False  # a request finishing from here on hands it over again
                try:
                    if rt._background_write():
                        later.append(rt)  # the cost estimates wait for their interval: come back
                except Exception as exc:  # noqa: BLE001 - the writer must survive whatever one snapshot does
                    rt.log.warning("stats.publish_failed", error=str(exc))
            if later:
                with self._lock:
                    self._pending.extend(later)
            time.sleep(self.interval)


_LIVE: weakref.WeakSet[StatsPublisher] = weakref.WeakSet()
_WRITER: _Writer | None = None
_WRITER_LOCK = threading.Lock()


def _writer() -> _Writer:
    global _WRITER
    writer = _WRITER
    if writer is None:
        with _WRITER_LOCK:
            if _WRITER is None:
                _WRITER = _Writer(StatsPublisher.PUBLISH_INTERVAL_S)
            writer = _WRITER
    return writer


def _close_all() -> None:
    """At interpreter exit: every runtime still open writes its final snapshot."""
    for rt in list(_LIVE):
        try:
            rt.close()
        except Exception:  # noqa: BLE001, S110 - exiting anyway; a snapshot we cannot write is lost either way
            pass


def _after_fork_in_child() -> None:
    global _WRITER, _WRITER_LOCK
    _WRITER, _WRITER_LOCK = None, threading.Lock()  # the parent's thread does not exist here
    for rt in list(_LIVE):
        rt._queued = False
        rt._seq.detach()


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: how long :func:`read_stats` waits for live processes' snapshots to catch up with their counters
READ_SETTLE_S = 1.0


def _pid_alive(pid: Any) -> bool:
    """Whether a process that may still publish runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return isinstance(pid, int)
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")
    except (OSError, ValueError):
        return True


def _read_settled(path: Path, deadline: float) -> dict[str, Any] | None:
    """A snapshot, once it covers every request its (live) process has finished, or at ``deadline``."""
    while True:
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
            snap = None
        if snap is None or "seq" not in snap or time.monotonic() >= deadline:
            return snap
        counter = read_counter(path.with_suffix(".seq"))
        if counter is None or counter <= snap["seq"] or not _pid_alive(snap.get("pid")):
            return snap
        time.sleep(0.005)


def read_stats(instance: str) -> dict[str, Any]:
    """Merge the stats snapshots every process of ``instance`` published (see StatsPublisher.publish).

    Snapshots are current: this process's runtimes write what is pending first, and a live process's snapshot
    is waited for (up to ``READ_SETTLE_S``) until it covers every request that process has finished."""
    total: dict[str, Any] = {"instance": instance, "processes": 0}
    counters = ("requests", "lookups", "hits", "tokens_loaded", "tokens_stored", "bytes_loaded", "bytes_stored",
                "admitted")
    for name in counters:
        total[name] = 0
    refused: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    verify: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    for rt in list(_LIVE):  # this process's own engines: write what is pending, no waiting for the thread
        if rt.instance == instance and rt.pending:
            rt.flush()
    deadline = time.monotonic() + READ_SETTLE_S
    for path in sorted((run_dir() / "stats").glob(f"{instance}-*.json")):
        snap = _read_settled(path, deadline)
        if snap is None:
            continue
        total["processes"] += 1
        lost.update(snap.get("stores_lost", {}))  # counted where the stores are made (workers)
        if snap.get("role") == "verifier":  # what the checking half judged (prefixshare.verify)
            verify.update({k: int(snap.get(k) or 0) for k in VERDICTS})
            continue
        if snap.get("role") != "scheduler":
            continue
        verify["sampled"] += int(snap.get("verify_sampled") or 0)
        dropped.update(snap.get("verify_dropped", {}))
        for name in counters:
            total[name] += snap.get(name, 0)
        refused.update(snap.get("refused", {}))
        fallbacks.update(snap.get("fallbacks", {}))
        total["namespace"] = snap.get("namespace")
        total["fingerprint"] = snap.get("fingerprint")
        total["kv_bytes_per_token"] = snap.get("kv_bytes_per_token")
        total["lookup_ms"] = snap.get("lookup_ms")
        total["load_ms"] = snap.get("load_ms")
        if "cost" in snap:
            total["cost"] = snap["cost"]
    total["refused"], total["fallbacks"], total["stores_lost"] = dict(refused), dict(fallbacks), dict(lost)
    total["verify"] = {"sampled": verify["sampled"], "dropped": dict(dropped),
                       **{k: verify[k] for k in VERDICTS}}
    return total


#: the verdicts of sampled verification (see prefixshare.verify), as counted in stats
VERDICTS = ("ok", "mismatch", "unverifiable")


def add_verdicts(instance: str, counts: dict[str, int]) -> None:
    """Count verification verdicts in the instance's stats (one snapshot file per instance, role 'verifier';
    its writer is the process that verifies, one at a time per instance)."""
    path = run_dir() / "stats" / f"{instance}-verifier.json"
    try:
        snap = json.loads(path.read_text())
    except (OSError, ValueError):
        snap = {}
    if not isinstance(snap, dict):
        snap = {}
    out = {"instance": instance, "role": "verifier", "pid": os.getpid(), "updated_at": time.time()}
    for k in VERDICTS:
        out[k] = int(snap.get(k) or 0) + int(counts.get(k, 0))
    from prefixshare._files import write_private_atomic

    write_private_atomic(path, json.dumps(out).encode(), stop=run_dir(), fsync=False)
