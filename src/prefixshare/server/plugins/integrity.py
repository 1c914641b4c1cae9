"""Integrity data we write beside every chunk of an fs tier, and the checks that read it.

A chunk file written by prefixshare's fs adapter (:mod:`prefixshare.server.plugins.fs`, run inside LMCache's
MP server) is the raw KV bytes LMCache's own fs adapter writes, followed by a fixed 48-byte trailer::

    payload (n bytes) | b"PSKV" | version u8 | algorithm u8 | key id u16 | n u64 | digest (32 bytes)

``digest = H(file name stem || 0x00 || payload)``. Binding the name means a chunk copied in under another
name — another model's, another tenant's, another position's — fails the check exactly like a flipped bit or
a truncated file. A reader accepts a chunk only if the file is ``n + 48`` bytes long, the trailer parses and
the digest matches; anything else is *damaged* and never loaded.

**Unkeyed digests** (the fs tier's ``integrity``) detect damage, not forgery: anyone who can write to the
directory can compute either of them. ``xxh3`` (algorithm 3, the default: XXH3-128, 16 bytes then 16 zero
bytes; about 25 GB/s a core, a quarter of a memory copy's cost) or ``blake3`` (algorithm 1; about 6 GB/s a
core, as costly as the copy it checks). A reader accepts either, whatever it writes, so a store can change
algorithm without losing a chunk.

**Keyed mode** (algorithm 2; the fs tier's ``key_env``): the digest is blake3's keyed hash under a 32-byte key
that only the store's servers hold, and the key id field names which key (a 16-bit id derived from the key,
not the key). Without it anyone who can write to the directory can plant KV with a valid digest; with it a
chunk is accepted only under a key the reader holds (its own, or one it accepts during a rotation). A keyed
reader refuses unkeyed chunks (``unkeyed``: a forger could compute that digest) and chunks under a key it does
not hold (``other-key``); a reader without a key cannot check keyed chunks (``keyed``: not loaded, and left in
place — a replica missing its key must not destroy the store's good chunks).

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
from typing import Any, Literal

import blake3
import xxhash

from prefixshare.errors import PrefixShareError
from prefixshare.keys import DATA_SUFFIX

MAGIC = b"PSKV"
VERSION = 1
ALGORITHM_BLAKE3 = 1
ALGORITHM_BLAKE3_KEYED = 2
ALGORITHM_XXH3 = 3
#: the unkeyed digests a writer can be told to use (the fs tier's ``integrity``), by name
UNKEYED_ALGORITHMS: dict[str, int] = {"xxh3": ALGORITHM_XXH3, "blake3": ALGORITHM_BLAKE3}
#: what a writer uses when it is not told (the fs tier's default)
DEFAULT_ALGORITHM = "xxh3"
_KNOWN_ALGORITHMS = frozenset({ALGORITHM_BLAKE3, ALGORITHM_BLAKE3_KEYED, ALGORITHM_XXH3})
_HEAD = struct.Struct("<4sBBHQ")  # magic, version, algorithm, key id (keyed) or 0, payload length
DIGEST_BYTES = 32
TRAILER_BYTES = _HEAD.size + DIGEST_BYTES  # 48
#: suffix given to a chunk file found damaged on load: lookups stop finding it; ``gc --damaged`` removes it
QUARANTINE_SUFFIX = ".corrupt"

Verdict = Literal["ok", "truncated", "unverified", "bad-trailer", "digest-mismatch", "missing", "unreadable",
                  "unkeyed", "other-key", "keyed"]
#: verdicts that say nothing against the chunk, only that this reader cannot check it: not loaded, not quarantined
UNCHECKABLE: frozenset[str] = frozenset({"keyed"})
#: bytes of a store key (blake3's keyed mode)
KEY_BYTES = 32


class StoreKeyError(PrefixShareError, ValueError):
    """A store key that is missing or malformed; the message names the variable and the fix."""


def key_id(key: bytes) -> int:
    """The 16-bit id written beside a keyed digest (derived from the key; it does not reveal it)."""
    return int.from_bytes(blake3.blake3(b"prefixshare store key id\x00" + key).digest()[:2], "little")


@dataclass(frozen=True)
class Keyring:
    """The keys a store's servers hold: ``write`` signs new chunks; chunks under any of ``accepted`` (``write``
    first) are loaded."""

    write: bytes
    accepted: tuple[bytes, ...]

    def by_id(self, kid: int) -> bytes | None:
        return next((k for k in self.accepted if key_id(k) == kid), None)

    @classmethod
    def from_env(cls, key_env: str, accept_key_envs: list[str] | tuple[str, ...] = (),
                 environ: Any = None) -> Keyring:
        """The keyring named by environment variables (64 hex digits each); :class:`StoreKeyError` when one is
        missing or malformed."""
        env = os.environ if environ is None else environ
        write = parse_key(key_env, env.get(key_env))
        accepted = [write] + [parse_key(name, env.get(name)) for name in accept_key_envs]
        return cls(write, tuple(dict.fromkeys(accepted)))


def tier_keyring(tier: Any) -> Keyring | None:
    """A tier's store keys from this process's environment (None: an unkeyed tier); :class:`StoreKeyError`
    names the variable that is missing or malformed."""
    key_env = getattr(tier, "key_env", None)
    if key_env is None:
        return None
    return Keyring.from_env(key_env, getattr(tier, "accept_key_envs", ()))


def parse_key(name: str, value: str | None) -> bytes:
    fix = (f"export {name}=$(python -c 'import secrets; print(secrets.token_hex(32))') on every node of the "
           "store (the same value), before its server starts")
    if not value:
        raise StoreKeyError(f"the store key variable {name} is not set; fix: {fix}")
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise StoreKeyError(f"{name} must hold {KEY_BYTES} bytes as {2 * KEY_BYTES} hex digits; fix: {fix}")
    return key


def _name_bytes(name: str) -> bytes:
    stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
    return stem.encode("utf-8") + b"\x00"


class _Xxh3:
    """XXH3-128 in the digest field's 32 bytes (16 bytes of digest, then zeros)."""

    def __init__(self, first: bytes) -> None:
        self._h = xxhash.xxh3_128(first)

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._h.update(piece)

    def digest(self) -> bytes:
        return self._h.digest() + bytes(DIGEST_BYTES - 16)


def _hasher(name: str, key: bytes | None, algorithm: int) -> Any:
    """The digest over the file name's stem and a NUL, ready for the payload: blake3's keyed hash when ``key`` is
    given, else the unkeyed ``algorithm``."""
    if key is not None:
        return blake3.blake3(_name_bytes(name), key=key)
    if algorithm == ALGORITHM_XXH3:
        return _Xxh3(_name_bytes(name))
    return blake3.blake3(_name_bytes(name))


def algorithm_id(name: str) -> int:
    """The trailer's id of an unkeyed digest named as the fs tier names it (``xxh3``, ``blake3``)."""
    try:
        return UNKEYED_ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown integrity digest {name!r}; use one of {sorted(UNKEYED_ALGORITHMS)}") from None


def digest(name: str, payload: bytes | bytearray | memoryview, key: bytes | None = None, *,
           algorithm: int) -> bytes:
    """The digest of ``payload`` stored under file name ``name`` (the ``.data`` suffix is ignored); keyed
    (blake3's keyed hash) when ``key`` is given, else the unkeyed ``algorithm`` (a trailer's id)."""
    h = _hasher(name, key, algorithm)
    h.update(payload)
    return h.digest()


def trailer(name: str, payload: bytes | bytearray | memoryview, keyring: Keyring | None = None,
            algorithm: str = DEFAULT_ALGORITHM) -> bytes:
    """The 48 bytes written after ``payload`` in the file ``name`` (keyed under ``keyring.write`` if given, else
    the unkeyed ``algorithm``)."""
    hasher = TrailerHasher(name, keyring, algorithm)
    hasher.update(payload)
    return hasher.trailer(memoryview(payload).nbytes)


class TrailerHasher:
    """The trailer of a payload fed in pieces: a writer hashes each slice right before it writes it, while the
    slice is still in the CPU's cache, instead of reading the whole chunk from memory twice (once to hash it,
    once to copy it into the page cache). Same digest as :func:`trailer` over the whole payload."""

    def __init__(self, name: str, keyring: Keyring | None = None, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self._key = keyring.write if keyring is not None else None
        self._algorithm = algorithm_id(algorithm)
        self._hash = _hasher(name, self._key, self._algorithm)

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._hash.update(piece)

    def trailer(self, payload_bytes: int) -> bytes:
        if self._key is None:
            return _HEAD.pack(MAGIC, VERSION, self._algorithm, 0, payload_bytes) + self._hash.digest()
        return (_HEAD.pack(MAGIC, VERSION, ALGORITHM_BLAKE3_KEYED, key_id(self._key), payload_bytes)
                + self._hash.digest())


def _trailer_state(head: bytes, payload_bytes: int) -> Literal["ok", "absent", "bad"]:
    """What the trailer header at a file's end says for a payload of ``payload_bytes``: ours and consistent
    (``ok``), not a trailer at all (``absent``: no magic), or ours but unusable (``bad``: another version or
    algorithm, or a length that does not match the file)."""
    if len(head) < _HEAD.size:
        return "absent"
    magic, version, algorithm, _reserved, length = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC:
        return "absent"
    if version != VERSION or algorithm not in _KNOWN_ALGORITHMS or length != payload_bytes:
        return "bad"
    return "ok"


def _check_digest(name: str, payload: bytes | bytearray | memoryview, tail: bytes,
                  keyring: Keyring | None) -> Verdict:
    """The digest of a chunk whose trailer parsed, under the key its trailer names (see the module's docstring
    for the keyed verdicts)."""
    _magic, _version, algorithm, kid, _length = _HEAD.unpack(tail[: _HEAD.size])
    key = None
    if algorithm == ALGORITHM_BLAKE3_KEYED:
        if keyring is None:
            return "keyed"
        key = keyring.by_id(kid)
        if key is None:
            return "other-key"
    elif keyring is not None:
        return "unkeyed"
    return "ok" if digest(name, payload, key, algorithm=algorithm) == tail[_HEAD.size :] else "digest-mismatch"


def check(name: str, payload: bytes | bytearray | memoryview, tail: bytes, file_size: int,
          keyring: Keyring | None = None) -> Verdict:
    """Verdict on a chunk whose first ``len(payload)`` bytes were read into ``payload`` and whose last
    ``TRAILER_BYTES`` are ``tail`` (``file_size`` is the file's size on disk); ``keyring``: the reader's keys
    (None: an unkeyed store)."""
    n = memoryview(payload).nbytes
    if file_size == n:
        return "unverified"  # exactly the payload: written without integrity data (a plain LMCache fs tier)
    if file_size < n + TRAILER_BYTES or len(tail) != TRAILER_BYTES:
        return "truncated"
    if file_size != n + TRAILER_BYTES or _trailer_state(tail, n) != "ok":
        return "bad-trailer"
    return _check_digest(name, payload, tail, keyring)


@dataclass(frozen=True)
class FileVerdict:
    path: Path
    verdict: Verdict
    payload_bytes: int | None  #: the payload length the trailer states (None when there is no valid trailer)


def verify_file(path: Path, keyring: Keyring | None = None) -> FileVerdict:
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
    return FileVerdict(path, _check_digest(path.name, payload, tail, keyring), length)


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
