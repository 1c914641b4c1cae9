"""What a store holds, per fingerprint namespace: chunk files, bytes, ages, manifests, documents, hits."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefixshare.keys import namespace as namespace_of
from prefixshare.fingerprint import read_manifests
from prefixshare.policies import Policy
from prefixshare.server.plugins.integrity import QUARANTINE_SUFFIX, payload_size
from prefixshare.keys import ChunkFile, parse_chunk_file
from prefixshare.warm import Registry

NAMESPACE_PREFIX = "prefixshare-"
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class StoredFile:
    """A chunk file on disk (``chunk`` is None for a stale temporary file)."""

    path: Path
    size: int
    mtime: float
    chunk: ChunkFile | None


@dataclass
class StoreScan:
    """Every file of the store's directory tiers that LMCache wrote."""

    dirs: list[Path]
    chunks: list[StoredFile] = field(default_factory=list)
    tmp: list[StoredFile] = field(default_factory=list)
    #: ``.data`` files whose names are not LMCache keys
    other: list[Path] = field(default_factory=list)
    #: chunk files found damaged on load and set aside by the server (``<name>.data.corrupt``)
    quarantined: list[StoredFile] = field(default_factory=list)

    def by_namespace(self) -> dict[str, list[StoredFile]]:
        out: dict[str, list[StoredFile]] = {}
        for f in self.chunks:
            assert f.chunk is not None
            out.setdefault(f.chunk.namespace, []).append(f)
        return out


def scan_store(policy: Policy) -> StoreScan:
    """Stat every chunk file of the policy's directory tiers (one pass, no file is opened)."""
    scan = StoreScan(policy.directories)
    for directory in scan.dirs:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        for entry in entries:
            name = entry.name
            damaged = name.endswith(QUARANTINE_SUFFIX)
            if not (name.endswith(".data") or name.endswith(TMP_SUFFIX) or damaged) or name.startswith("."):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            path = Path(entry.path)
            if damaged:
                scan.quarantined.append(StoredFile(path, st.st_size, st.st_mtime,
                                                   parse_chunk_file(name[: -len(QUARANTINE_SUFFIX)])))
                continue
            if name.endswith(TMP_SUFFIX):
                scan.tmp.append(StoredFile(path, st.st_size, st.st_mtime, None))
                continue
            parsed = parse_chunk_file(name)
            if parsed is None:
                scan.other.append(path)
            else:
                scan.chunks.append(StoredFile(path, st.st_size, st.st_mtime, parsed))
    return scan


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds") if ts is not None else None


def local_hits() -> dict[str, dict[str, int]]:
    """Hit counters of this node's engines, per namespace, from their published stats snapshots."""
    from prefixshare._paths import run_dir

    out: dict[str, Counter[str]] = {}
    for path in sorted((run_dir() / "stats").glob("*.json")):
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if snap.get("role") != "scheduler" or not snap.get("namespace"):
            continue
        counter = out.setdefault(snap["namespace"], Counter())
        for key in ("requests", "hits", "tokens_loaded", "bytes_loaded", "tokens_stored", "bytes_stored"):
            counter[key] += int(snap.get(key) or 0)
        counter["engines"] += 1
    return {ns: dict(c) for ns, c in out.items()}


def inspect_store(policy: Policy, *, now: float | None = None) -> dict[str, Any]:
    """A JSON-ready description of the store: per namespace, what is there and who wrote it."""
    now = time.time() if now is None else now
    root = policy.store_root
    scan = scan_store(policy)
    manifests = read_manifests(str(root)) if root is not None else []
    corrupt_manifests = [c.model_dump() for c in getattr(manifests, "corrupt", [])]
    by_ns_manifest = {namespace_of(m.fingerprint): m for m in manifests}
    registry = Registry(root) if root is not None else None
    records = registry.records() if registry is not None else None
    hits = local_hits()
    files = scan.by_namespace()

    present: dict[str, set[tuple[str, str]]] = {
        ns: {(f.chunk.chunk_hash, f.chunk.salt) for f in fs if f.chunk is not None} for ns, fs in files.items()
    }
    docs_by_ns: dict[str, list[dict[str, Any]]] = {}
    for record in records.records if records is not None else []:
        have = present.get(record.namespace, set())
        missing = sum(1 for h in record.chunk_hashes if (h, record.salt) not in have)
        docs_by_ns.setdefault(record.namespace, []).append({
            "id": record.id, "tokens": record.tokens, "chunks": record.chunks, "bytes": record.bytes,
            "source": record.source, "warmed_at": record.warmed_at, "host": record.host, "tenant": record.tenant,
            "complete": missing == 0, "missing_chunks": missing,
        })

    names = sorted(set(files) | set(by_ns_manifest) | set(docs_by_ns))
    namespaces = []
    for ns in names:
        fs = files.get(ns, [])
        mtimes = [f.mtime for f in fs]
        manifest = by_ns_manifest.get(ns)
        salts = Counter(f.chunk.salt or "" for f in fs if f.chunk is not None)
        entry: dict[str, Any] = {
            "namespace": ns,
            "prefixshare": ns.startswith(NAMESPACE_PREFIX),
            "fingerprint": manifest.digest if manifest else None,
            "manifest": None,
            "chunk_files": len(fs),
            "chunks": len(present.get(ns, ())),
            "bytes": sum(f.size for f in fs),
            "kv_bytes": sum(payload_size(f.path, f.size) for f in fs),
            "quarantined": sum(1 for q in scan.quarantined if q.chunk is not None and q.chunk.namespace == ns),
            "oldest": _iso(min(mtimes)) if mtimes else None,
            "newest": _iso(max(mtimes)) if mtimes else None,
            "age_s": {"oldest": round(now - min(mtimes), 1), "newest": round(now - max(mtimes), 1)} if mtimes else None,
            "salts": {(k or "(none)"): v for k, v in sorted(salts.items())},
            "documents": sorted(docs_by_ns.get(ns, []), key=lambda d: d["id"]),
            "hits": hits.get(ns),
        }
        if manifest is not None:
            fp = manifest.fingerprint
            entry["manifest"] = {
                "short": fp.short, "host": manifest.host, "created_at": manifest.created_at.isoformat(),
                "model_type": fp.model.model_type, "layers": fp.model.num_hidden_layers,
                "kv_heads": fp.model.num_key_value_heads, "head_dim": fp.model.head_dim,
                "weights": fp.weights.digest[:12], "tokenizer": fp.tokenizer.digest[:12],
                "engine": fp.engine.engine, "kv_layout": fp.engine.kv_layout, "kv_dtype": fp.engine.kv_dtype,
                "block_size": fp.engine.block_size, "chunk_size": fp.engine.chunk_size, "tenant": fp.tenant,
                "url": manifest.url,
            }
        namespaces.append(entry)
    return {
        "store": str(root) if root is not None else None,
        "dirs": [str(d) for d in scan.dirs],
        "namespaces": namespaces,
        "totals": {
            "namespaces": len(namespaces),
            "chunk_files": len(scan.chunks),
            "bytes": sum(f.size for f in scan.chunks),
            "documents": sum(len(n["documents"]) for n in namespaces),
            "tmp_files": len(scan.tmp),
            "other_files": len(scan.other),
            "quarantined_files": len(scan.quarantined),
        },
        "corrupt_manifests": corrupt_manifests,
        "corrupt_records": [{"path": c.path, "reason": c.reason} for c in (records.corrupt if records else [])],
        "generated_at": _iso(now),
    }


@dataclass(frozen=True)
class DamagedChunk:
    """A chunk file that will never be loaded: set aside by the server, or failing its integrity check."""

    path: Path
    verdict: str  # "quarantined" or an integrity verdict ("digest-mismatch", "truncated", "unverified", ...)
    bytes: int
    mtime: float
    namespace: str | None


def damaged_chunks(policy: Policy, *, verify: bool = True, scan: StoreScan | None = None,
                   uncheckable: list[DamagedChunk] | None = None) -> list[DamagedChunk]:
    """Chunk files of prefixshare namespaces that no engine will load: those the server quarantined on load
    and, with ``verify``, every file of a checked fs tier (``integrity`` not ``none``) whose digest fails (this
    reads every byte of the store once), under the tier's keys when it is keyed (read from this process's
    environment). Keyed chunks this process holds no key for are not damaged: they go to ``uncheckable``
    when a list is given (never to gc)."""
    from prefixshare.server.plugins.integrity import UNCHECKABLE, StoreKeyError, tier_keyring, verify_file

    scan = scan or scan_store(policy)
    out = [DamagedChunk(f.path, "quarantined", f.size, f.mtime, f.chunk.namespace if f.chunk else None)
           for f in scan.quarantined]
    if not verify:
        return out
    keyrings: dict[Path, Any] = {}
    for t in policy.l2:
        if getattr(t, "type", None) == "fs" and getattr(t, "integrity", "none") != "none":
            try:
                keyrings[Path(t.base_path)] = tier_keyring(t)
            except StoreKeyError:
                keyrings[Path(t.base_path)] = None  # keyed chunks cannot be checked here: uncheckable
    for f in scan.chunks:
        if f.chunk is None or not f.chunk.namespace.startswith(NAMESPACE_PREFIX) or f.path.parent not in keyrings:
            continue
        verdict = verify_file(f.path, keyrings[f.path.parent])
        if verdict.verdict in UNCHECKABLE:
            if uncheckable is not None:
                uncheckable.append(DamagedChunk(f.path, verdict.verdict, f.size, f.mtime, f.chunk.namespace))
        elif verdict.verdict not in ("ok", "missing"):  # missing: deleted since the scan (gc, eviction)
            out.append(DamagedChunk(f.path, verdict.verdict, f.size, f.mtime, f.chunk.namespace))
    return out
