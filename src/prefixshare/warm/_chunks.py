"""Which chunk objects a prefix becomes in the store, and whether a directory tier holds them.

The LMCache MP server keys a chunk ``ObjectKey(chunk_hash, model_name, kv_rank, object_group_id,
cache_salt)``; ``chunk_hash`` is LMCache's own rolling hash over the token ids at the server's chunk size
(:class:`lmcache.v1.multiprocess.token_hasher.TokenHasher`, blake3 by default), ``model_name`` is
prefixshare's namespace, and the fs tier writes one file per key::

    <namespace>@0x<kv_rank, 8 hex>@<object_group_id hex>@<chunk_hash hex>[@<cache_salt>].data

A prefix of ``n`` tokens becomes ``n // chunk_size`` chunks (a partial last chunk is never stored).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from prefixshare.policy import Policy

DATA_SUFFIX = ".data"
SEP = "@"
_PATH_SLASH = "-SEP-"


@dataclass(frozen=True)
class ChunkFile:
    """One stored object, parsed from its file name."""

    name: str
    namespace: str
    kv_rank: int
    group: int
    chunk_hash: str
    salt: str = ""

    @property
    def world_size(self) -> int:
        """LMCache packs ``(world_size << 24) | (rank << 16) | (local_ws << 8) | local_rank`` into kv_rank."""
        return (self.kv_rank >> 24) & 0xFF or 1

    @property
    def object(self) -> tuple[int, int]:
        return self.kv_rank, self.group


def chunk_file_name(namespace: str, kv_rank: int, group: int, chunk_hash: str, salt: str = "") -> str:
    base = f"{namespace.replace('/', _PATH_SLASH)}{SEP}{kv_rank:#010x}{SEP}{group:x}{SEP}{chunk_hash}"
    return f"{base}{SEP}{salt}{DATA_SUFFIX}" if salt else f"{base}{DATA_SUFFIX}"


def parse_chunk_file(name: str) -> ChunkFile | None:
    """The key a chunk file name encodes, or None when ``name`` is not one (LMCache's own rules)."""
    if not name.endswith(DATA_SUFFIX):
        return None
    parts = name[: -len(DATA_SUFFIX)].split(SEP)
    if len(parts) == 4:
        ns, rank, group, chunk = parts
        salt = ""
    elif len(parts) == 5:
        ns, rank, group, chunk, salt = parts
    else:
        return None
    try:
        bytes.fromhex(chunk)
        return ChunkFile(name, ns.replace(_PATH_SLASH, "/"), int(rank, 16), int(group, 16), chunk.lower(), salt)
    except ValueError:
        return None


def store_dirs(policy: Policy) -> list[Path]:
    """The local directories of the policy's directory (fs) tiers, in tier order."""
    dirs = []
    for tier in policy.l2:
        path = getattr(tier, "base_path", None)
        if path and getattr(tier, "type", None) == "fs":
            dirs.append(Path(path))
    return dirs


def store_root(policy: Policy) -> Path | None:
    """Where manifests and the document registry live: the first directory tier (as the connector's)."""
    for tier in policy.l2:
        path = getattr(tier, "base_path", None)
        if path:
            return Path(path)
    return None


class ChunkHasher:
    """LMCache's token hasher at the server's chunk size and hash algorithm (the keys the server computes)."""

    def __init__(self, chunk_size: int, hash_algorithm: str = "blake3") -> None:
        self.chunk_size = chunk_size
        self.hash_algorithm = hash_algorithm
        self._hasher: Any = None

    def _get(self) -> Any:
        if self._hasher is None:
            import logging

            from lmcache.v1.multiprocess.token_hasher import TokenHasher

            # LMCache logs its hasher's set-up at INFO on every construction; keep that off our output
            lm_log = logging.getLogger("lmcache.v1.multiprocess.token_hasher")
            level = lm_log.level
            lm_log.setLevel(logging.WARNING)
            try:
                self._hasher = TokenHasher(chunk_size=self.chunk_size, hash_algorithm=self.hash_algorithm)
            finally:
                lm_log.setLevel(level)
        return self._hasher

    def hashes(self, token_ids: list[int]) -> list[str]:
        """Hex chunk hashes of every full chunk of ``token_ids``, in order."""
        if len(token_ids) < self.chunk_size:
            return []
        return [h.hex() for h in self._get().compute_chunk_hashes(list(token_ids))]


def blake3_chunk_hashes(token_ids: list[int], chunk_size: int) -> list[str]:
    """LMCache 0.5.6's blake3 rolling hash, re-implemented (used only by tests to pin LMCache's scheme)."""
    import struct

    def h(prefix: bytes | int, tokens: list[int]) -> bytes:
        hasher = blake3.blake3()
        hasher.update(prefix.to_bytes(8, "big", signed=True) if isinstance(prefix, int) else prefix)
        hasher.update(struct.pack(f">{len(tokens)}I", *tokens))
        return hasher.digest()

    prefix: bytes | int = h(0, [0])
    out = []
    for i in range(0, len(token_ids) - len(token_ids) % chunk_size, chunk_size):
        prefix = h(prefix, token_ids[i: i + chunk_size])
        out.append(prefix.hex())
    return out


@dataclass
class NamespaceIndex:
    """Chunk files of one namespace in the directory tiers: hash -> objects (kv_rank, group) per salt.

    A scan reads directory entries only (names, no ``stat`` per file): it is what warm polls while the server
    writes; sizes are read on demand, for the files :meth:`bytes_of` is asked about."""

    namespace: str
    objects: dict[tuple[str, str], set[tuple[int, int]]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    #: the directory each file was seen in (the first tier holding it)
    dirs: dict[str, Path] = field(default_factory=dict)
    _expected: set[tuple[int, int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def scan(cls, dirs: Iterable[Path], namespace: str) -> NamespaceIndex:
        index = cls(namespace)
        prefix = namespace.replace("/", _PATH_SLASH) + SEP
        for directory in dirs:
            for entry in _scandir(directory):
                if not entry.name.startswith(prefix):
                    continue
                parsed = parse_chunk_file(entry.name)
                if parsed is None or parsed.namespace != namespace:
                    continue
                index.objects.setdefault((parsed.chunk_hash, parsed.salt), set()).add(parsed.object)
                index.world_size = max(index.world_size, parsed.world_size)
                index.dirs.setdefault(entry.name, directory)
        return index

    def size(self, name: str) -> int:
        """Bytes of one file of the index (0 when it is gone or unreadable); read once."""
        if name not in self.sizes:
            directory = self.dirs.get(name)
            try:
                self.sizes[name] = (directory / name).stat().st_size if directory is not None else 0
            except OSError:
                self.sizes[name] = 0
        return self.sizes[name]

    def expected_objects(self) -> set[tuple[int, int]]:
        """Objects every chunk of this namespace has (all ranks x all groups seen); computed once per scan."""
        if self._expected is None:
            seen: set[tuple[int, int]] = set()
            for objs in self.objects.values():
                seen |= objs
            self._expected = seen
        return set(self._expected)

    def missing(self, hashes: list[str], salt: str, expected: set[tuple[int, int]] | None = None) -> list[str]:
        """Hashes of ``hashes`` not fully present (some expected object missing)."""
        expected = self.expected_objects() if expected is None else expected
        out = []
        for h in hashes:
            objs = self.objects.get((h, salt))
            if not objs or not expected <= objs:
                out.append(h)
                continue
            ranks = {(rank >> 16) & 0xFF for rank, _ in objs}
            if len(ranks) < self.world_size:
                out.append(h)
        return out

    def files_of(self, hashes: list[str], salt: str) -> list[str]:
        names = []
        for h in hashes:
            for rank, group in sorted(self.objects.get((h, salt), ())):
                names.append(chunk_file_name(self.namespace, rank, group, h, salt))
        return names

    def bytes_of(self, hashes: list[str], salt: str) -> int:
        return sum(self.size(name) for name in self.files_of(hashes, salt))


def _scandir(directory: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            yield from (e for e in it if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return
