"""The integrity data of fs-tier chunks: what a reader accepts and what it refuses (no server needed; the
server-side adapter that writes and checks it is exercised end to end in tests/faults/test_corruption.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixshare.server.plugins.integrity import TRAILER_BYTES, check, payload_size, trailer, verify_file

NAME = "prefixshare-0123456789abcdef0123@0x01000100@0@" + "ab" * 32 + ".data"
OTHER = "prefixshare-0123456789abcdef0123@0x01000100@0@" + "cd" * 32 + ".data"


def write_chunk(directory: Path, name: str, payload: bytes) -> Path:
    path = directory / name
    path.write_bytes(payload + trailer(name, payload))
    return path


def test_a_chunk_verifies_and_its_payload_size_excludes_the_trailer(tmp_path: Path) -> None:
    payload = os.urandom(4096)
    path = write_chunk(tmp_path, NAME, payload)
    assert path.stat().st_size == 4096 + TRAILER_BYTES == 4096 + 48
    v = verify_file(path)
    assert v.verdict == "ok" and v.payload_bytes == 4096
    assert payload_size(path) == 4096
    assert check(NAME, payload, path.read_bytes()[-TRAILER_BYTES:], path.stat().st_size) == "ok"


@pytest.mark.parametrize(("damage", "verdict"), [
    ("flip", "digest-mismatch"), ("flip-digest", "digest-mismatch"), ("truncate", "unverified"),
    ("strip", "unverified"), ("rename", "digest-mismatch"), ("append", "unverified"), ("empty", "truncated"),
])
def test_every_damage_is_refused(tmp_path: Path, damage: str, verdict: str) -> None:
    payload = os.urandom(4096)
    path = write_chunk(tmp_path, NAME, payload)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[100] ^= 1
    elif damage == "flip-digest":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[:3000]
    elif damage == "strip":  # the payload alone: a plain LMCache fs tier's file
        data = data[:-TRAILER_BYTES]
    elif damage == "append":
        data += b"x"
    elif damage == "empty":
        data = bytearray()
    if damage == "rename":  # a good chunk copied in under another chunk's name
        target = tmp_path / OTHER
        target.write_bytes(bytes(data))
        path = target
    else:
        path.write_bytes(bytes(data))
    assert verify_file(path).verdict == verdict
    # the load-time check (payload read into a buffer of the expected size) agrees
    size = path.stat().st_size
    raw = path.read_bytes()
    if size >= 4096:
        assert check(path.name, raw[:4096], raw[4096:4096 + TRAILER_BYTES], size) != "ok"


def test_missing_file(tmp_path: Path) -> None:
    assert verify_file(tmp_path / NAME).verdict == "missing"
