"""Fingerprint manifests stored beside the KV store, so any replica can explain a mismatch.

Layout (any fsspec URL: a local directory, ``file://``, ``memory://``, ``s3://``...)::

    <store>/.prefixshare/manifests/<fingerprint digest>.json

Each manifest is one JSON object::

    {"format": "prefixshare-manifest/1", "digest": "<32 hex>", "fingerprint": {...},
     "created_at": "2025-01-01T00:00:00+00:00", "host": "...", "prefixshare_version": "0.1.0",
     "extra": {...}, "checksum": "<blake3 of the canonical JSON of every other key>"}

The checksum makes a hand-edited or truncated manifest detectable; such manifests are skipped,
logged and reported (:attr:`ManifestList.corrupt`), never trusted. Local files are written
atomically with mode 0o640 in directories of mode 0o750. Only JSON is ever read or written.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from prefixshare._version import __version__
from prefixshare._files import write_private_atomic
from prefixshare._log import get_logger
from prefixshare.errors import FingerprintError
from prefixshare.fingerprint._canonical import blake3_hex, canonical_json
from prefixshare.fingerprint._diff import Difference, diff
from prefixshare.fingerprint._types import Fingerprint

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def _logger() -> Any:
    # Resolved per call, not at import: prefixshare._log.get_logger binds (and so freezes) the
    # structlog configuration current at call time, and the CLI configures logging after imports.
    return get_logger(__name__)


MANIFEST_FORMAT = "prefixshare-manifest/1"
MANIFEST_DIR = ".prefixshare/manifests"
_MAX_MANIFEST_BYTES = 4 * 1024 * 1024


class Manifest(BaseModel):
    """A fingerprint as recorded in a store, with who wrote it and when.

    ``url`` is where it was read from or written to (not part of the stored JSON).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = MANIFEST_FORMAT
    digest: str
    fingerprint: Fingerprint
    created_at: datetime
    host: str
    prefixshare_version: str
    extra: dict[str, JsonValue] = Field(default_factory=dict)
    checksum: str
    url: str | None = Field(default=None, exclude=True)


class CorruptManifest(BaseModel):
    """A manifest file that could not be trusted, and why."""

    model_config = ConfigDict(frozen=True)

    url: str
    reason: str


class ManifestList(list[Manifest]):
    """The valid manifests of a store; :attr:`corrupt` lists the files that were skipped."""

    def __init__(self, manifests: Iterable[Manifest] = (), corrupt: list[CorruptManifest] | None = None) -> None:
        super().__init__(manifests)
        self.corrupt: list[CorruptManifest] = corrupt or []


def _checksum(body: dict[str, Any]) -> str:
    return blake3_hex(b"prefixshare-manifest\0" + canonical_json(body))


def _resolve(store_url: str | os.PathLike[str]) -> tuple[AbstractFileSystem, str, str]:
    """Filesystem, manifest directory path on it, and a printable URL prefix for that directory."""
    from fsspec.core import url_to_fs

    url = os.fspath(store_url)
    try:
        fs, root = url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise FingerprintError(f"cannot open store {url!r}: {exc}") from exc
    root = root.rstrip("/") or "/"
    directory = f"{root.rstrip('/')}/{MANIFEST_DIR}"
    return fs, directory, f"{url.rstrip('/')}/{MANIFEST_DIR}"


def _is_local(fs: AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def write_manifest(
    store_url: str | os.PathLike[str], fp: Fingerprint, *, extra: dict[str, Any] | None = None
) -> Manifest:
    """Record ``fp`` in ``<store>/.prefixshare/manifests/<fp.digest>.json`` and return the manifest.

    Writing the same fingerprint again replaces the manifest (atomically on local filesystems;
    object stores replace whole objects). ``extra`` must be JSON-serialisable.
    """
    fs, directory, shown = _resolve(store_url)
    body: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "digest": fp.digest,
        "fingerprint": fp.model_dump(mode="json"),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "prefixshare_version": __version__,
        "extra": extra or {},
    }
    try:
        body["checksum"] = _checksum(body)
    except TypeError as exc:
        raise FingerprintError(f"manifest extra must be JSON data: {exc}") from exc
    data = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode("utf-8")
    path = f"{directory}/{fp.digest}.json"
    url = f"{shown}/{fp.digest}.json"
    try:
        if _is_local(fs):
            write_private_atomic(Path(path), data)
        else:
            fs.makedirs(directory, exist_ok=True)
            fs.pipe_file(path, data)
    except OSError as exc:
        raise FingerprintError(f"cannot write manifest {url}: {exc}") from exc
    _logger().info("manifest_written", url=url, fingerprint=fp.short)
    return Manifest.model_validate({**body, "url": url})


def load_manifest(data: bytes | str, *, url: str = "<memory>") -> Manifest:
    """Parse and verify one manifest; raise :class:`FingerprintError` saying what is wrong with it."""
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise FingerprintError(f"manifest {url} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise FingerprintError(f"manifest {url} is not a JSON object")
    if raw.get("format") != MANIFEST_FORMAT:
        raise FingerprintError(f"manifest {url} has unknown format {raw.get('format')!r}")
    body = {k: v for k, v in raw.items() if k != "checksum"}
    try:
        expected = _checksum(body)
    except TypeError as exc:
        raise FingerprintError(f"manifest {url} holds non-JSON data: {exc}") from exc
    if raw.get("checksum") != expected:
        raise FingerprintError(f"manifest {url} fails its integrity checksum (edited or truncated)")
    try:
        manifest = Manifest.model_validate({**raw, "url": url})
    except ValidationError as exc:
        raise FingerprintError(f"manifest {url} is malformed: {exc}") from exc
    if manifest.fingerprint.digest != manifest.digest:
        raise FingerprintError(
            f"manifest {url} records digest {manifest.digest} but its fingerprint hashes to "
            f"{manifest.fingerprint.digest} (written by an incompatible prefixshare version?)"
        )
    return manifest


def read_manifests(store_url: str | os.PathLike[str]) -> ManifestList:
    """Every valid manifest in the store, newest first.

    Corrupt ones (bad JSON, failed checksum, file name not matching the digest...) are skipped,
    logged as warnings and listed in the result's :attr:`ManifestList.corrupt`.
    """
    fs, directory, shown = _resolve(store_url)
    try:
        fs.invalidate_cache(directory)  # other replicas write here: never trust a cached listing
        paths = sorted(fs.glob(f"{directory}/*.json")) if fs.exists(directory) else []
    except OSError as exc:
        raise FingerprintError(f"cannot list manifests in {shown}: {exc}") from exc
    result = ManifestList()
    for path in paths:
        name = str(path).rsplit("/", 1)[-1]
        url = f"{shown}/{name}"
        try:
            size = fs.size(path)
            if size is not None and size > _MAX_MANIFEST_BYTES:
                raise FingerprintError(f"manifest {url} is too large ({size} bytes)")
            manifest = load_manifest(fs.cat_file(path), url=url)
            if name != f"{manifest.digest}.json":
                raise FingerprintError(f"manifest {url} is named after another digest ({manifest.digest})")
        except (FingerprintError, OSError) as exc:
            _logger().warning("manifest_corrupt", url=url, reason=str(exc))
            result.corrupt.append(CorruptManifest(url=url, reason=str(exc)))
            continue
        result.append(manifest)
    result.sort(key=lambda m: m.created_at, reverse=True)
    return result


def explain(store_url: str | os.PathLike[str], local_fp: Fingerprint) -> list[tuple[Manifest, list[Difference]]]:
    """Compare ``local_fp`` with every manifest in the store, closest first.

    Each entry is ``(manifest, differences)``; an empty list means that manifest's writer uses
    exactly this fingerprint. Entries are ordered by number of differing fields, then newest first.
    """
    manifests = read_manifests(store_url)
    pairs = [(m, diff(local_fp, m.fingerprint)) for m in manifests]
    pairs.sort(key=lambda pair: len(pair[1]))  # stable: newest first within equal distance
    return pairs
