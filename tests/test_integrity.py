"""The integrity data of fs-tier chunks: what a reader accepts and what it refuses (no server needed; the
server-side adapter that writes and checks it is exercised end to end in tests/faults/test_corruption.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixshare.server.plugins.integrity import (
    TRAILER_BYTES,
    Keyring,
    StoreKeyError,
    TrailerHasher,
    check,
    key_id,
    payload_size,
    tier_keyring,
    trailer,
    verify_file,
)

NAME = "prefixshare-0123456789abcdef0123@0x01000100@0@" + "ab" * 32 + ".data"
OTHER = "prefixshare-0123456789abcdef0123@0x01000100@0@" + "cd" * 32 + ".data"


def write_chunk(directory: Path, name: str, payload: bytes, algorithm: str = "xxh3") -> Path:
    path = directory / name
    path.write_bytes(payload + trailer(name, payload, algorithm=algorithm))
    return path


def test_a_chunk_verifies_and_its_payload_size_excludes_the_trailer(tmp_path: Path) -> None:
    payload = os.urandom(4096)
    path = write_chunk(tmp_path, NAME, payload)
    assert path.stat().st_size == 4096 + TRAILER_BYTES == 4096 + 48
    v = verify_file(path)
    assert v.verdict == "ok" and v.payload_bytes == 4096
    assert payload_size(path) == 4096
    assert check(NAME, payload, path.read_bytes()[-TRAILER_BYTES:], path.stat().st_size) == "ok"


@pytest.mark.parametrize("algorithm", ["xxh3", "blake3"])
@pytest.mark.parametrize(("damage", "verdict"), [
    ("flip", "digest-mismatch"), ("flip-digest", "digest-mismatch"), ("truncate", "unverified"),
    ("strip", "unverified"), ("rename", "digest-mismatch"), ("append", "unverified"), ("empty", "truncated"),
])
def test_every_damage_is_refused(tmp_path: Path, damage: str, verdict: str, algorithm: str) -> None:
    payload = os.urandom(4096)
    path = write_chunk(tmp_path, NAME, payload, algorithm)
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


# --- keyed mode: only a key holder can write chunks others load -------------------------------------------------
KEY, OLD, WRONG = bytes(range(32)), bytes(range(1, 33)), bytes(range(2, 34))


def _ring(write: bytes, *accepted: bytes) -> Keyring:
    return Keyring(write, (write, *accepted))


def test_a_keyed_chunk_loads_only_under_a_key_the_reader_holds(tmp_path: Path) -> None:
    payload = os.urandom(4096)
    path = tmp_path / NAME
    path.write_bytes(payload + trailer(NAME, payload, _ring(KEY)))
    assert verify_file(path, _ring(KEY)).verdict == "ok"
    raw = path.read_bytes()
    assert check(NAME, raw[:4096], raw[4096:], len(raw), _ring(KEY)) == "ok"
    assert verify_file(path, _ring(WRONG)).verdict == "other-key"  # a reader with another key
    assert verify_file(path).verdict == "keyed"  # a reader with no key cannot check it (nor load it)
    # a rotation: a reader that writes under a new key still accepts the old one it was told to accept
    assert verify_file(path, _ring(OLD, KEY)).verdict == "ok"
    # the keyed digest binds the name like the unkeyed one
    other = tmp_path / OTHER
    other.write_bytes(raw)
    assert verify_file(other, _ring(KEY)).verdict == "digest-mismatch"


def test_forgeries_are_refused_by_a_keyed_reader(tmp_path: Path) -> None:
    """What a writer without the key can produce: an unkeyed digest it recomputed itself, a digest under its own
    key, a keyed chunk's trailer copied onto other bytes (with the right key id), and a made-up digest."""
    good = os.urandom(4096)
    evil = os.urandom(4096)
    keyed_tail = trailer(NAME, good, _ring(KEY))
    forged = {
        "unkeyed": evil + trailer(NAME, evil, algorithm="xxh3"),
        "other-key": evil + trailer(NAME, evil, _ring(WRONG)),
        "digest-mismatch": evil + keyed_tail,
    }
    unkeyed_blake3 = evil + trailer(NAME, evil, algorithm="blake3")
    for verdict, data in [*forged.items(), ("unkeyed", unkeyed_blake3)]:
        path = tmp_path / NAME
        path.write_bytes(data)
        assert verify_file(path, _ring(KEY)).verdict == verdict
        assert check(NAME, data[:4096], data[4096:], len(data), _ring(KEY)) == verdict


def test_store_keys_come_from_named_variables_with_a_fix_when_missing() -> None:
    env = {"K": KEY.hex(), "K_OLD": OLD.hex(), "SHORT": "abcd", "NOTHEX": "zz" * 32}
    ring = Keyring.from_env("K", ["K_OLD"], environ=env)
    assert ring.write == KEY and ring.accepted == (KEY, OLD)
    assert ring.by_id(key_id(OLD)) == OLD and ring.by_id(key_id(WRONG)) is None
    with pytest.raises(StoreKeyError, match=r"MISSING is not set; fix: export MISSING=\$\(python"):
        Keyring.from_env("MISSING", environ=env)
    for bad in ("SHORT", "NOTHEX"):
        with pytest.raises(StoreKeyError, match=f"{bad} must hold 32 bytes as 64 hex digits"):
            Keyring.from_env("K", [bad], environ=env)


def test_a_keyed_fs_tier_names_its_variables_not_its_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixshare.errors import PolicyError
    from prefixshare.policies import Policy

    def build(**tier: object) -> Policy:
        return Policy.build(l2=[{"type": "fs", "base_path": str(tmp_path), **tier}])

    policy = build(key_env="PS_KEY", accept_key_envs=["PS_KEY_OLD"])
    cfg = policy.l2[0].server_config()
    assert cfg["adapter_params"]["key_env"] == "PS_KEY" and cfg["adapter_params"]["accept_key_envs"] == ["PS_KEY_OLD"]
    assert KEY.hex() not in str(policy.to_dict())
    for tier, words in (({"key_env": "not a name"}, "key_env"), ({"key_env": "K", "integrity": "none"}, "key_env needs"),
                        ({"accept_key_envs": ["K_OLD"]}, "accept_key_envs without key_env")):
        with pytest.raises(PolicyError, match=words):
            build(**tier)
    monkeypatch.delenv("PS_KEY", raising=False)
    with pytest.raises(StoreKeyError, match="PS_KEY is not set"):
        tier_keyring(policy.l2[0])  # what the server's start checks: it does not start without its key
    monkeypatch.setenv("PS_KEY", KEY.hex())
    monkeypatch.setenv("PS_KEY_OLD", OLD.hex())
    assert tier_keyring(policy.l2[0]) == Keyring(KEY, (KEY, OLD))
    assert tier_keyring(build()) is None  # an unkeyed tier


def test_a_payload_hashed_in_pieces_gets_the_same_trailer_and_check(tmp_path: Path) -> None:
    """The fs writer feeds the digest a slice at a time; the trailer must be the whole payload's, keyed or not,
    and the check that reads it must accept it (and refuse one bit flipped)."""
    payload = os.urandom(3 * 65_536 + 123)
    keyring = Keyring.from_env("PS_PIECES_KEY", (), environ={"PS_PIECES_KEY": "ab" * 32})
    for ring, algorithm in ((None, "xxh3"), (None, "blake3"), (keyring, "xxh3")):
        hasher = TrailerHasher("ns@chunk.data", ring, algorithm)
        for start in range(0, len(payload), 65_536):
            hasher.update(memoryview(payload)[start:start + 65_536])
        tail = hasher.trailer(len(payload))
        assert tail == trailer("ns@chunk.data", payload, ring, algorithm)
        size = len(payload) + TRAILER_BYTES
        assert check("ns@chunk.data", payload, tail, size, ring) == "ok"
        flipped = bytes([payload[0] ^ 1]) + payload[1:]
        assert check("ns@chunk.data", flipped, tail, size, ring) == "digest-mismatch"


def test_a_store_written_under_both_digests_loads_both_and_names_what_it_does_not_know(tmp_path: Path) -> None:
    """Servers of one store may write xxh3 and blake3 trailers (a store changing its digest): every reader
    checks each chunk under the digest its trailer names. Each digest is its own: a blake3 trailer relabelled
    xxh3 fails, and an algorithm this version does not know is a bad trailer, not a pass."""
    payload = os.urandom(8192)
    fast = write_chunk(tmp_path, NAME, payload, "xxh3")
    slow = write_chunk(tmp_path, OTHER, payload, "blake3")
    assert verify_file(fast).verdict == verify_file(slow).verdict == "ok"
    xxh3_tail, blake3_tail = fast.read_bytes()[-TRAILER_BYTES:], slow.read_bytes()[-TRAILER_BYTES:]
    assert xxh3_tail[5] == 3 and blake3_tail[5] == 1 and xxh3_tail[-16:] == bytes(16)
    relabelled = bytearray(slow.read_bytes())
    relabelled[-TRAILER_BYTES + 5] = 3
    slow.write_bytes(relabelled)
    assert verify_file(slow).verdict == "digest-mismatch"
    relabelled[-TRAILER_BYTES + 5] = 9
    slow.write_bytes(relabelled)
    assert verify_file(slow).verdict == "bad-trailer"
    with pytest.raises(ValueError, match="xxh3"):
        trailer(NAME, payload, algorithm="crc32")
