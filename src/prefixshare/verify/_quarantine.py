"""Setting aside the chunks a failed verification loaded, so that no replica loads them again.

* In every directory (fs) tier of the policy, each object of those chunks (every KV rank and object group)
  is renamed ``<name>.corrupt``: the path the servers use for a chunk that fails its digest. Lookups stop
  finding it on every node; ``prefixshare doctor`` lists it; ``prefixshare store gc --verify`` removes it.
* This node's MP server drops the same keys from its memory tier (L1; ``DELETE /cache/objects``), where a
  chunk stays after it was loaded. Servers of other nodes keep their L1 copies until they evict them: run
  verification on every node (each verifies the hits its own replicas served).
* Tiers without a directory (resp, valkey, s3, mooncake_store, nixl_store) are asked to delete the keys
  through the same server call: their objects are gone rather than set aside.
* A JSON record of the mismatch is written beside the store (``<store>/.prefixshare/verify/``), for doctor.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefixshare._log import get_logger
from prefixshare.keys import ChunkHasher, parse_chunk_file
from prefixshare.policies import Policy
from prefixshare.runtime import VerifyTask
from prefixshare.server.plugins.integrity import QUARANTINE_SUFFIX

RECORDS_DIR = ".prefixshare/verify"
RECORD_FORMAT = "prefixshare-verify-mismatch/1"
#: kv_rank of a world of one (LMCache packs world size, rank, local world size and local rank)
_RANK_WS1 = (1 << 24) | (1 << 8)


@dataclass
class Quarantined:
    """What one quarantine set aside."""

    chunks: int
    files: list[str] = field(default_factory=list)
    #: keys this node's server dropped from memory (and from tiers without a directory), or why it could not
    server_deleted: int = 0
    server_error: str | None = None
    record: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "files": len(self.files), "server_deleted": self.server_deleted,
                "server_error": self.server_error, "record": self.record}


def loaded_chunk_hashes(policy: Policy, task: VerifyTask) -> list[str]:
    """The chunk hashes of what the request loaded: every whole chunk of the prompt that its first
    ``loaded_tokens`` tokens touch (an engine computes a prompt's last token itself, so a prompt of whole chunks
    loads all but one token of its last chunk)."""
    size = policy.chunk_size
    chunks = min(len(task.token_ids) // size, -(-task.loaded_tokens // size))
    hasher = ChunkHasher(size, policy.server.hash_algorithm)
    return hasher.hashes(task.token_ids[: chunks * size])


def quarantine(policy: Policy, task: VerifyTask, details: dict[str, Any]) -> Quarantined:
    """Set aside every object of the chunks ``task`` loaded (see the module's docstring); never raises for a
    store that does not answer (what could be done is done, and reported)."""
    log = get_logger(__name__, namespace=task.namespace, request_id=task.request_id)
    hashes = set(loaded_chunk_hashes(policy, task))
    salt = task.store_salt or ""
    out = Quarantined(len(hashes))
    keys: dict[tuple[str, int, int], None] = {}
    for directory in policy.directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            chunk = parse_chunk_file(name)
            if chunk is None or chunk.namespace != task.namespace or chunk.salt != salt or chunk.chunk_hash not in hashes:
                continue
            path = Path(directory) / name
            try:
                os.replace(path, path.with_name(name + QUARANTINE_SUFFIX))
            except FileNotFoundError:
                continue  # evicted or removed since the listing
            out.files.append(str(path))
            keys[(chunk.chunk_hash, chunk.kv_rank, chunk.group)] = None
    if not keys:  # no directory tier holds them: the keys of a world of one, group 0
        keys = {(h, _RANK_WS1, 0): None for h in hashes}
    tier = "all" if any(getattr(t, "base_path", None) is None for t in policy.l2) else "l1"
    out.server_deleted, out.server_error = _server_delete(policy, task, list(keys), tier)
    out.record = _write_record(policy, task, details, out)
    log.warning("store.verify_quarantined", chunks=out.chunks, files=len(out.files),
                server_deleted=out.server_deleted, server_error=out.server_error)
    return out


def _server_delete(policy: Policy, task: VerifyTask, keys: list[tuple[str, int, int]], tier: str) -> tuple[int, str | None]:
    body = {"keys": [{"chunk_hash_hex": h, "model_name": task.namespace, "kv_rank": rank, "object_group_id": group,
                      "cache_salt": task.store_salt or ""} for h, rank, group in keys],
            "tier": tier, "force": True}
    try:
        response = httpx.request("DELETE", policy.server.http_url + "/cache/objects", json=body, timeout=5.0)
    except httpx.HTTPError as exc:
        return 0, f"the server at {policy.server.http_url} does not answer ({exc})"
    if response.status_code != 200:
        return 0, f"DELETE /cache/objects answered HTTP {response.status_code}: {response.text[:200]}"
    data = response.json()
    deleted = data.get("deleted", 0)
    return (len(deleted) if isinstance(deleted, list) else int(deleted or 0)), (
        None if data.get("ok", True) else str(data.get("error"))[:200])


def _write_record(policy: Policy, task: VerifyTask, details: dict[str, Any], q: Quarantined) -> str | None:
    import json

    from prefixshare._files import write_private_atomic

    root = policy.store_root
    if root is None:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = root / RECORDS_DIR / f"{stamp}-{task.namespace[-12:]}-{os.getpid()}-{time.time_ns() % 10**9:09d}.json"
    record = {"format": RECORD_FORMAT, "namespace": task.namespace, "instance": task.instance,
              "request_id": task.request_id, "document_id": task.params.get("prefixshare.document_id"),
              "tokens": len(task.token_ids), "loaded_tokens": task.loaded_tokens, "at": time.time(),
              "host": socket.gethostname(), "comparison": details, "quarantined": q.to_dict()}
    try:
        write_private_atomic(path, json.dumps(record, indent=1).encode(), stop=root, fsync=False)
    except OSError as exc:
        get_logger(__name__).warning("verify.record_failed", path=str(path), error=str(exc))
        return None
    return str(path)


def mismatch_records(policy: Policy) -> list[dict[str, Any]]:
    """The mismatch records beside the store, newest first (JSON only; a file that is not one is skipped)."""
    import json

    root = policy.store_root
    if root is None:
        return []
    out = []
    try:
        paths = sorted((root / RECORDS_DIR).glob("*.json"), reverse=True)
    except OSError:
        return []
    for path in paths:
        try:
            data = json.loads(path.read_bytes()[: 1 << 20])
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == RECORD_FORMAT:
            out.append({**data, "path": str(path)})
    return out
