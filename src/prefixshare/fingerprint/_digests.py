"""Content digests of (large) files, cached on disk so a restarted replica does not re-read weights.

Each file is hashed once with blake3 (streamed in large blocks, multi-threaded) and remembered by
``(real path, size, mtime_ns)`` in a small JSON file, ``digests.json``, under the cache directory:
``cache_dir`` when given, else ``$PREFIXSHARE_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixshare``, else
``~/.cache/prefixshare``. A file whose size or mtime changed is hashed again. The cache file is
replaced atomically; a corrupt or unreadable one is ignored (and rewritten on the next save), and a
cache directory that cannot be written only costs speed, never correctness.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from prefixshare._paths import CACHE_ENV, cache_dir

from prefixshare._log import get_logger
from prefixshare.errors import FingerprintError


def _logger() -> Any:
    # Resolved per call, not at import: prefixshare._log.get_logger binds (and so freezes) the
    # structlog configuration current at call time, and the CLI configures logging after imports.
    return get_logger(__name__)


CACHE_FILE = "digests.json"
_CACHE_FORMAT = "prefixshare-digests/1"
_BLOCK = 16 * 1024 * 1024
_MAX_ENTRIES = 20_000


def default_cache_dir() -> Path:
    """The directory holding ``digests.json`` when no ``cache_dir`` is given (prefixshare's cache dir)."""
    return cache_dir()


def hash_file(path: Path) -> str:
    """Full blake3 hex digest of the bytes of ``path`` (streamed, using every core blake3 wants)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            hasher.update(view[:n])
    return hasher.hexdigest()


@dataclass(frozen=True)
class _Stat:
    size: int
    mtime_ns: int


def _stat(path: Path) -> _Stat:
    try:
        st = path.stat()
    except OSError as exc:
        raise FingerprintError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return _Stat(st.st_size, st.st_mtime_ns)


class DigestCache:
    """Per-file blake3 digests remembered by ``(real path, size, mtime_ns)``.

    Use as a context manager (or call :meth:`save`) so new digests reach the cache file.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.path = self.directory / CACHE_FILE
        self._entries: dict[str, dict[str, Any]] = self._load()
        self._dirty = False
        self._lock = threading.Lock()
        self.hashed = 0  #: files hashed (not served from the cache) since this object was created

    def __enter__(self) -> DigestCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.save()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            _logger().warning("digest_cache_ignored", path=str(self.path), reason=str(exc))
            return {}
        if not isinstance(raw, dict) or raw.get("format") != _CACHE_FORMAT or not isinstance(raw.get("entries"), dict):
            _logger().warning("digest_cache_ignored", path=str(self.path), reason="unexpected content")
            return {}
        entries: dict[str, dict[str, Any]] = {}
        for key, entry in raw["entries"].items():
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("size"), int)
                and isinstance(entry.get("mtime_ns"), int)
                and isinstance(entry.get("blake3"), str)
            ):
                entries[key] = entry
        return entries

    def digest(self, path: str | os.PathLike[str]) -> str:
        """blake3 hex digest of the file at ``path``, from the cache when size and mtime match."""
        real = Path(os.path.realpath(path))
        key = str(real)
        before = _stat(real)
        with self._lock:
            entry = self._entries.get(key)
        if entry and entry["size"] == before.size and entry["mtime_ns"] == before.mtime_ns:
            return str(entry["blake3"])
        try:
            digest = hash_file(real)
        except OSError as exc:
            raise FingerprintError(f"cannot read {path}: {exc.strerror or exc}") from exc
        self.hashed += 1
        after = _stat(real)
        if after != before:
            # Changed while we read it: the digest is of a mix of versions. Do not remember it.
            raise FingerprintError(f"{path} changed while it was being hashed; retry once it is stable")
        with self._lock:
            self._entries[key] = {"size": before.size, "mtime_ns": before.mtime_ns, "blake3": digest}
            self._dirty = True
        _logger().debug("file_hashed", path=key, size=before.size)
        return digest

    def save(self) -> None:
        """Write new digests to the cache file atomically; failures are logged, never raised."""
        if not self._dirty:
            return
        with self._lock:
            merged = {**self._load(), **self._entries}
            # Forget files that are gone, and bound the size of the cache.
            merged = {k: v for k, v in merged.items() if os.path.exists(k)}
            if len(merged) > _MAX_ENTRIES:
                merged = dict(list(merged.items())[-_MAX_ENTRIES:])
            payload = json.dumps({"format": _CACHE_FORMAT, "entries": merged}, sort_keys=True)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".digests-", suffix=".tmp", dir=self.directory)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as handle:
                        handle.write(payload)
                        handle.flush()
                        os.fsync(handle.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                _logger().warning("digest_cache_not_saved", path=str(self.path), reason=str(exc))
                return
            self._entries = merged
            self._dirty = False
