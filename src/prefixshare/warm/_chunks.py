"""Whether a directory tier holds a prefix's chunk objects: an index of one namespace's files.

Chunk file names and LMCache's chunk hashes are :mod:`prefixshare.keys`' (one place for every key fact).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prefixshare.keys import chunk_file_name, file_prefix, parse_chunk_file


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
        prefix = file_prefix(namespace)
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
