"""Where the fs tier's write time goes: the store path taken apart, stage by stage, against raw sequential I/O.

    python benchmarks/store_stages.py [--reps 7] [--out docs/benchmarks/store-stages.json]

One request's chunks (bench model: 24,576 B/token, 256-token chunks, 4k tokens = 16 chunks of 6.3 MB) written
into the page cache (no fsync, as the server writes), each variant timed ``--reps`` times, interleaved:

* ``raw``: one file, one sequential ``write`` of the whole request (P3's reference);
* ``files``: one file per chunk (create exclusive, ``writev``, close, rename): the file layout alone;
* ``blake3``: the keyed digest over every chunk, nothing written (what integrity costs, one thread);
* ``files+blake3``: both, chunk after chunk, one thread;
* ``pool N``: both, N threads (the checked adapter's structure: each chunk hashed in the thread that writes it);
* ``adapter``: prefixshare's checked adapter through LMCache's L2 interface (what P3 measures);
* ``fs_native``: LMCache's native adapter (C++ threads, no digest) through the same interface.

Each row is GB/s (median) and its ratio to ``raw``; a stage's cost is what it adds to the row above it. Machines
are shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from _meta import run_header

ROOT = Path(__file__).resolve().parents[1]
KV_BYTES_PER_TOKEN, CHUNK_TOKENS, TOKENS = 24576, 256, 4096


def _write_file(path: Path, parts: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.writev(fd, parts)
    finally:
        os.close(fd)


def _chunk_file(directory: Path, i: int, payload: memoryview, key: bytes | None) -> None:
    tail: list[memoryview] = []
    if key is not None:
        import blake3

        tail = [memoryview(blake3.blake3(payload, key=key).digest())]
    tmp = directory / f"c{i}.{uuid.uuid4().hex[:8]}.tmp"
    _write_file(tmp, [payload, *tail])
    os.replace(tmp, directory / f"c{i}.data")


def variants(chunks: list[memoryview], key: bytes) -> dict[str, Callable[[Path], None]]:
    import blake3

    def raw(d: Path) -> None:
        _write_file(d / "raw.data", list(chunks))

    def files(d: Path) -> None:
        for i, c in enumerate(chunks):
            _chunk_file(d, i, c, None)

    def digest(d: Path) -> None:
        for c in chunks:
            blake3.blake3(c, key=key).digest()

    def files_blake3(d: Path) -> None:
        for i, c in enumerate(chunks):
            _chunk_file(d, i, c, key)

    def pool(n: int) -> Callable[[Path], None]:
        def run(d: Path) -> None:
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda ic: _chunk_file(d, ic[0], ic[1], key), enumerate(chunks)))
        return run

    return {"raw": raw, "files": files, "blake3": digest, "files+blake3": files_blake3, "pool 2": pool(2),
            "pool 4": pool(4)}


def _adapter_round(kind: str, directory: Path, chunk_bytes: int, n: int, payload: bytes) -> float:
    from prefixshare.bench._micro import fs_adapter, fs_l2_round

    adapter = fs_adapter(kind, directory)
    try:
        write, _, _ = fs_l2_round(adapter, directory, chunk_bytes, n, payload)
    finally:
        adapter.close()
    return write


def measure(work: Path, reps: int) -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    chunk_bytes, n = KV_BYTES_PER_TOKEN * CHUNK_TOKENS, TOKENS // CHUNK_TOKENS
    total = chunk_bytes * n
    base = os.urandom(chunk_bytes)
    chunks = [memoryview(bytearray(base)) for _ in range(n)]
    key = os.urandom(32)
    runs = variants(chunks, key)
    times: dict[str, list[float]] = {name: [] for name in [*runs, "adapter", "fs_native"]}
    for _ in range(reps):
        for name, fn in runs.items():
            d = work / uuid.uuid4().hex[:8]
            d.mkdir()
            t0 = time.perf_counter()
            fn(d)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(d)
        for name, kind in (("adapter", "checked"), ("fs_native", "native")):
            d = work / uuid.uuid4().hex[:8]
            d.mkdir()
            times[name].append(_adapter_round(kind, d, chunk_bytes, n, base))
            shutil.rmtree(d)
    raw = statistics.median(times["raw"])
    rows = {name: {"gbps": total / statistics.median(t) / 1e9, "over_raw": raw / statistics.median(t),
                   "seconds": t} for name, t in times.items()}
    return {"bytes": total, "chunks": n, "chunk_bytes": chunk_bytes, "reps": reps, "rows": rows,
            "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "store-stages.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-stages-", dir="/var/tmp"))
    try:
        result = measure(work, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(run_header("store_stages.py"))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["rows"].items():
        sys.stdout.write(f"{name:14s} {row['gbps']:6.2f} GB/s  {row['over_raw']:.2f}x raw\n")


if __name__ == "__main__":
    main()
