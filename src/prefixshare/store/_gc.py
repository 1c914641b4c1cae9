"""Garbage collection of a directory store: by age (TTL), then oldest first down to a byte budget.

:func:`plan_gc` decides and touches nothing; :func:`run_gc` deletes exactly what a plan lists (a file that
changed since the plan — rewritten, so newer — is left alone and reported). The CLI's ``--dry-run`` prints
the plan; ``gc`` without it computes the same plan and runs it.

What is deleted:

* chunk files of prefixshare namespaces whose age (since written: LMCache never rewrites a chunk that
  exists) exceeds the TTL;
* then, oldest first, until the namespaces' bytes fit ``max_bytes``: whole registered documents (a
  document's age is that of its newest chunk; chunks a kept document shares stay) and chunks of no
  registered document;
* LMCache's temporary files older than the TTL (writes that never finished);
* registry records of documents that lost a chunk (no longer fully warm: warm them again), and registry
  records or manifests that cannot be read (corrupt);
* damaged chunks: files the server set aside on load (``*.data.corrupt``) always, and with ``verify`` every
  chunk file that fails its integrity check (``prefixshare doctor --verify`` lists the same files).

Files of other namespaces (plain LMCache users sharing the directory) are never touched.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixshare.fingerprint import read_manifests
from prefixshare.policies import Policy
from prefixshare.store._inspect import NAMESPACE_PREFIX, StoredFile, damaged_chunks, scan_store
from prefixshare.warm import Registry

#: temporary files younger than this are writes in progress, whatever the TTL
MIN_TMP_AGE_S = 3600.0


@dataclass(frozen=True)
class Deletion:
    path: str
    kind: str  # "chunk", "tmp", "record", "manifest"
    reason: str  # "ttl", "max_bytes", "stale_tmp", "chunks_gone", "corrupt", "damaged:<verdict>"
    bytes: int = 0
    mtime: float | None = None
    namespace: str | None = None
    document: str | None = None


@dataclass
class GcPlan:
    store: str | None
    ttl_s: float | None
    max_bytes: int | None
    now: float
    bytes_before: int = 0
    deletions: list[Deletion] = field(default_factory=list)

    @property
    def bytes_freed(self) -> int:
        return sum(d.bytes for d in self.deletions if d.kind in ("chunk", "tmp"))

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - sum(d.bytes for d in self.deletions if d.kind == "chunk")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.deletions:
            out[d.kind] = out.get(d.kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "ttl_s": self.ttl_s, "max_bytes": self.max_bytes, "now": self.now,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "bytes_freed": self.bytes_freed, "counts": self.counts(),
                "deletions": [asdict(d) for d in self.deletions]}


@dataclass
class GcResult:
    plan: GcPlan
    deleted: list[Deletion] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), "deleted": [d.path for d in self.deleted], "skipped": self.skipped}


def plan_gc(policy: Policy, *, ttl_s: float | None = None, max_bytes: int | None = None,
            now: float | None = None, namespaces: list[str] | None = None, verify: bool = False) -> GcPlan:
    """What gc would delete from the policy's store (nothing is touched)."""
    now = time.time() if now is None else now
    root = policy.store_root
    scan = scan_store(policy)
    plan = GcPlan(str(root) if root is not None else None, ttl_s, max_bytes, now)
    damaged = [d for d in damaged_chunks(policy, verify=verify, scan=scan)
               if namespaces is None or d.namespace in namespaces]
    for d in damaged:
        plan.deletions.append(Deletion(str(d.path), "chunk", f"damaged:{d.verdict}", d.bytes, d.mtime, d.namespace))
    gone_damaged = {d.path for d in damaged}
    scan.chunks = [f for f in scan.chunks if f.path not in gone_damaged]

    def ours(f: StoredFile) -> bool:
        assert f.chunk is not None
        ns = f.chunk.namespace
        return ns.startswith(NAMESPACE_PREFIX) and (namespaces is None or ns in namespaces)

    candidates = sorted((f for f in scan.chunks if ours(f)), key=lambda f: (f.mtime, f.path.name))
    plan.bytes_before = sum(f.size for f in candidates) + sum(d.bytes for d in damaged)
    keep: list[StoredFile] = []
    for f in candidates:
        if ttl_s is not None and now - f.mtime > ttl_s:
            plan.deletions.append(_chunk(f, "ttl"))
        else:
            keep.append(f)
    records = Registry(root).records() if root is not None else None
    if max_bytes is not None:
        keep = _evict(plan, keep, max_bytes, records.records if records is not None else [])
    tmp_age = max(ttl_s if ttl_s is not None else MIN_TMP_AGE_S, MIN_TMP_AGE_S)
    for f in sorted(scan.tmp, key=lambda f: f.path.name):
        if now - f.mtime > tmp_age and f.path.name.startswith(NAMESPACE_PREFIX):
            plan.deletions.append(Deletion(str(f.path), "tmp", "stale_tmp", f.size, f.mtime))

    if root is not None:
        remaining = {(f.chunk.namespace, f.chunk.chunk_hash, f.chunk.salt) for f in keep if f.chunk is not None}
        remaining |= {(f.chunk.namespace, f.chunk.chunk_hash, f.chunk.salt) for f in scan.chunks
                      if f.chunk is not None and not ours(f)}
        assert records is not None
        for record in records.records:
            if namespaces is not None and record.namespace not in namespaces:
                continue
            if any((record.namespace, h, record.salt) not in remaining for h in record.chunk_hashes):
                path = records.paths[(record.fingerprint, record.salt, record.id)]
                plan.deletions.append(Deletion(str(path), "record", "chunks_gone", namespace=record.namespace,
                                               document=record.id))
        for bad in records.corrupt:
            plan.deletions.append(Deletion(bad.path, "record", "corrupt"))
        for bad in read_manifests(str(root)).corrupt:
            plan.deletions.append(Deletion(bad.url, "manifest", "corrupt"))
    return plan


def _evict(plan: GcPlan, keep: list[StoredFile], max_bytes: int, records: list[Any]) -> list[StoredFile]:
    """Delete oldest first until ``keep`` fits ``max_bytes``.

    A registered document is one unit (its age: its newest chunk): deleting its first chunk alone would leave
    the rest of its prefix chain unreachable but on disk. Chunks another kept document also uses stay. Chunks
    of no registered document are units of their own.
    """
    files_of_key: dict[tuple[str, str, str], list[StoredFile]] = {}
    for f in keep:
        assert f.chunk is not None
        files_of_key.setdefault((f.chunk.namespace, f.chunk.chunk_hash, f.chunk.salt), []).append(f)
    users: dict[tuple[str, str, str], int] = {}
    units: list[tuple[float, str, list[tuple[str, str, str]]]] = []
    claimed: set[tuple[str, str, str]] = set()
    for record in records:
        keys = [(record.namespace, h, record.salt) for h in record.chunk_hashes]
        keys = [k for k in keys if k in files_of_key]
        if not keys:
            continue
        for k in keys:
            users[k] = users.get(k, 0) + 1
        claimed.update(keys)
        newest = max(f.mtime for k in keys for f in files_of_key[k])
        units.append((newest, f"doc:{record.namespace}:{record.id}", keys))
    for key, files in files_of_key.items():
        if key not in claimed:
            units.append((max(f.mtime for f in files), f"chunk:{files[0].path.name}", [key]))
    units.sort(key=lambda u: (u[0], u[1]))
    total = sum(f.size for f in keep)
    gone: set[str] = set()
    for _, _, keys in units:
        if total <= max_bytes:
            break
        for k in keys:
            users[k] = users.get(k, 1) - 1
            if users[k] > 0:
                continue  # another document still needs this chunk
            for f in sorted(files_of_key[k], key=lambda f: f.path.name):
                if str(f.path) not in gone:
                    gone.add(str(f.path))
                    plan.deletions.append(_chunk(f, "max_bytes"))
                    total -= f.size
    return [f for f in keep if str(f.path) not in gone]


def _chunk(f: StoredFile, reason: str) -> Deletion:
    assert f.chunk is not None
    return Deletion(str(f.path), "chunk", reason, f.size, f.mtime, f.chunk.namespace)


def run_gc(plan: GcPlan) -> GcResult:
    """Delete exactly what ``plan`` lists; files changed since the plan are left and reported."""
    result = GcResult(plan)
    for d in plan.deletions:
        path = Path(d.path)
        try:
            if d.mtime is not None and os.stat(path).st_mtime != d.mtime:
                result.skipped.append({"path": d.path, "reason": "changed since the plan"})
                continue
            path.unlink()
        except FileNotFoundError:
            result.skipped.append({"path": d.path, "reason": "already gone"})
            continue
        except OSError as exc:
            result.skipped.append({"path": d.path, "reason": str(exc)})
            continue
        result.deleted.append(d)
    return result
