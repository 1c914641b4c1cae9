"""An engine that leaves with a store reserved but never written or committed (its store RPC timed out, it was
killed mid-copy, its shutdown drain gave up) must not leave that chunk behind as a hit.

LMCache's server, as shipped, admits such a reservation when the engine unregisters: the key becomes a hit with
whatever bytes the buffer held, the fs tier persists it with a valid integrity trailer (the digest covers the
bytes as written), and every replica on the store loads it. The control below shows that with LMCache's own
entry point (tests/helpers/unguarded_server.sh); the server prefixshare starts
(prefixshare.server.plugins.guards) discards the reservation instead, so the next request misses and computes.

The raw MP client (tests/helpers/mp_client.py) plays the engine: ``abandon`` reserves a request's 4 chunks
(PREPARE_STORE) and unregisters; ``fetch`` looks them up in a fresh process, loads what hits and compares the
bytes with what ``store`` writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TESTS, free_port, run_mp_client
from faults._matrix import Row, record
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.server]

CHUNKS = 4  # the raw client's request: 128 tokens in chunks of 32


def _policy(store: Path) -> Policy:
    return Policy.build(chunk_size=32, l1={"size_gb": 0.1},
                        l2=[{"type": "fs", "base_path": str(store), "create": True}],
                        server={"port": free_port(), "http_port": free_port(), "start_timeout_s": 90})


def _client(mode: str, url: str) -> str:
    proc = run_mp_client(mode, url)
    assert mode == "fetch" or proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def _chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.data"))


def test_an_abandoned_store_is_discarded_not_admitted(tmp_path: Path) -> None:
    # control: LMCache's server as shipped admits the never-written buffers, and they are loaded as the prefix's KV
    bare_store = tmp_path / "unguarded"
    launcher = [str(TESTS / "helpers" / "unguarded_server.sh")]
    with LMCacheServer(_policy(bare_store), launcher=launcher) as bare:
        assert f"RESERVED slots = {CHUNKS}" in _client("abandon", bare.url)  # the fault: reserved, then left
        admitted = _client("fetch", bare.url)
    assert f"hit_chunks={CHUNKS}/{CHUNKS}" in admitted and "bytes_equal = False" in admitted, admitted
    persisted = _chunk_files(bare_store)
    assert len(persisted) == CHUNKS  # and written to the shared store, for every replica to load

    store = tmp_path / "guarded"
    with LMCacheServer(_policy(store)) as server:
        assert f"RESERVED slots = {CHUNKS}" in _client("abandon", server.url)
        missed = _client("fetch", server.url)
        assert f"hit_chunks=0/{CHUNKS}" in missed, missed  # a miss: the next request computes
        assert _chunk_files(store) == []
        logged = server.log_path.read_text()
        assert "server.store_abandoned" in logged and f"chunks={CHUNKS}" in logged, logged[-3000:]
        # the guard costs nothing to a store that completes: written, committed, loaded bit for bit
        assert "STORE ok = True" in _client("store", server.url)
        fetched = _client("fetch", server.url)
        assert f"hit_chunks={CHUNKS}/{CHUNKS}" in fetched and "bytes_equal = True" in fetched, fetched

    record(Row(area="corruption", fault="an engine leaves with a store reserved but never written (unregistered "
               "between PREPARE_STORE and COMMIT_STORE)", engine="none",
               behaviour="the reservation is discarded (one log line): the next lookup misses and computes; "
               "LMCache's server as shipped admits it and every replica loads its unwritten bytes (control)",
               corrupt_detected=CHUNKS,
               extra={"control_hit_chunks": CHUNKS, "control_bytes_equal": False,
                      "control_chunks_persisted": len(persisted), "guarded_hit_chunks": 0,
                      "guarded_chunks_persisted": 0}))
