"""Integrity data we write beside every chunk of an fs tier, and the checks that read it.

A chunk file written by prefixshare's fs adapter (:mod:`prefixshare.server.plugins.fs`, run inside LMCache's
MP server) is the raw KV bytes LMCache's own fs adapter writes, followed by a fixed 48-byte trailer::

    payload (n bytes) | b"PSKV" | version u8 | algorithm u8 | reserved u16 | n u64 | digest (32 bytes)

``digest = blake3(file name stem || 0x00 || payload)``. Binding the name means a chunk copied in under
another name — another model's, another tenant's, another position's — fails the check exactly like a flipped
bit or a truncated file. A reader accepts a chunk only if the file is ``n + 48`` bytes long, the trailer
parses and the digest matches; anything else is *damaged* and never loaded.

LMCache's own fs adapter still reads these files (it reads exactly the payload length and ignores what
follows), so a store stays readable by a plain LMCache deployment; the reverse is refused: a file without a
trailer is *unverified* and prefixshare does not load it.

This module imports nothing heavy: the store tools (``doctor``, ``gc``) use it to scan a store.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3

from prefixshare.keys import DATA_SUFFIX

MAGIC = b"PSKV"
VERSION = 1
ALGORITHM_BLAKE3 = 1
_HEAD = struct.Struct("<4sBBHQ")  # magic, version, algorithm, reserved, payload length
DIGEST_BYTES = 32
TRAILER_BYTES = _HEAD.size + DIGEST_BYTES  # 48
#: suffix given to a chunk file found damaged on load: lookups stop finding it; ``gc --damaged`` removes it
QUARANTINE_SUFFIX = ".corrupt"

Verdict = Literal["ok", "truncated", "unverified", "bad-trailer", "digest-mismatch", "missing", "unreadable"]


def _name_bytes(name: str) -> bytes:
    stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
    return stem.encode("utf-8") + b"\x00"


def digest(name: str, payload: bytes | bytearray | memoryview) -> bytes:
    """The digest of ``payload`` stored under file name ``name`` (the ``.data`` suffix is ignored)."""
    h = blake3.blake3(_name_bytes(name))
    h.update(payload)
    return h.digest()


def trailer(name: str, payload: bytes | bytearray | memoryview) -> bytes:
    """The 48 bytes written after ``payload`` in the file ``name``."""
    n = memoryview(payload).nbytes
    return _HEAD.pack(MAGIC, VERSION, ALGORITHM_BLAKE3, 0, n) + digest(name, payload)


def _trailer_state(head: bytes, payload_bytes: int) -> Literal["ok", "absent", "bad"]:
    """What the trailer header at a file's end says for a payload of ``payload_bytes``: ours and consistent
    (``ok``), not a trailer at all (``absent``: no magic), or ours but unusable (``bad``: another version or
    algorithm, or a length that does not match the file)."""
    if len(head) < _HEAD.size:
        return "absent"
    magic, version, algorithm, _reserved, length = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC:
        return "absent"
    if version != VERSION or algorithm != ALGORITHM_BLAKE3 or length != payload_bytes:
        return "bad"
    return "ok"


def check(name: str, payload: bytes | bytearray | memoryview, tail: bytes, file_size: int) -> Verdict:
    """Verdict on a chunk whose first ``len(payload)`` bytes were read into ``payload`` and whose last
    ``TRAILER_BYTES`` are ``tail`` (``file_size`` is the file's size on disk)."""
    n = memoryview(payload).nbytes
    if file_size == n:
        return "unverified"  # exactly the payload: written without integrity data (a plain LMCache fs tier)
    if file_size < n + TRAILER_BYTES or len(tail) != TRAILER_BYTES:
        return "truncated"
    if file_size != n + TRAILER_BYTES or _trailer_state(tail, n) != "ok":
        return "bad-trailer"
    return "ok" if digest(name, payload) == tail[_HEAD.size :] else "digest-mismatch"


@dataclass(frozen=True)
class FileVerdict:
    path: Path
    verdict: Verdict
    payload_bytes: int | None  #: the payload length the trailer states (None when there is no valid trailer)


def verify_file(path: Path) -> FileVerdict:
    """Read one chunk file and check it (the store tools' scan; the adapter checks while loading)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < TRAILER_BYTES:
                return FileVerdict(path, "truncated", None)
            f.seek(size - TRAILER_BYTES)
            tail = f.read(TRAILER_BYTES)
            length = size - TRAILER_BYTES
            state = _trailer_state(tail, length)
            if state == "absent":
                # no trailer: either a plain LMCache chunk or one whose end was cut off
                return FileVerdict(path, "unverified", None)
            if state == "bad":
                return FileVerdict(path, "bad-trailer", None)
            f.seek(0)
            payload = f.read(length)
    except FileNotFoundError:
        return FileVerdict(path, "missing", None)
    except OSError:
        return FileVerdict(path, "unreadable", None)
    verdict: Verdict = "ok" if digest(path.name, payload) == tail[_HEAD.size :] else "digest-mismatch"
    return FileVerdict(path, verdict, length)


def payload_size(path: Path, file_size: int | None = None) -> int:
    """The KV bytes in a chunk file: its size minus the trailer when it has one (no digest check)."""
    size = path.stat().st_size if file_size is None else file_size
    if size < TRAILER_BYTES:
        return size
    try:
        with open(path, "rb") as f:
            f.seek(size - TRAILER_BYTES)
            head = f.read(_HEAD.size)
    except OSError:
        return size
    return size - TRAILER_BYTES if _trailer_state(head, size - TRAILER_BYTES) == "ok" else size
