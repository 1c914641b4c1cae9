"""The fs tier's store path at two revisions, in one run: raw sequential I/O, LMCache's plain fs adapter, and
prefixshare's checked adapter as it is in this tree and as it was at ``--before`` (loaded from git), each
storing and loading one request's chunks (page cache warm, then evicted), raw I/O included, interleaved per
repetition.

    python benchmarks/store_io.py --before a8c5140^ [--reps 7] [--out docs/benchmarks/store-io.json]

The same measure as the bench's P3 (``prefixshare.bench._micro.store_io``), with a "before" column so a change
to the adapter is judged against the code it replaced on the same machine at the same time. Bench model's KV
(24,576 bytes per token), 256-token chunks, 1k-8k tokens. Ratios are medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _meta import git, run_header

ROOT = Path(__file__).resolve().parents[1]
KV_BYTES_PER_TOKEN, CHUNK_TOKENS = 24576, 256
LENGTHS = (1024, 2048, 4096, 8192)
MEASURES = ("write", "read_warm", "read_evicted")


def _module_at(rev: str, scratch: Path, name: str) -> Any:
    """``src/prefixshare/server/plugins/<name>.py`` as it was at ``rev``, loaded under another name."""
    path = scratch / f"{name}_before.py"
    path.write_text(git("show", f"{rev}:src/prefixshare/server/plugins/{name}.py"))
    spec = importlib.util.spec_from_file_location(f"prefixshare_{name}_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _adapter_at(rev: str, scratch: Path) -> Any:
    """prefixshare's checked fs adapter class as it was at ``rev``, with the integrity module of ``rev`` (its
    digest and trailer), not this tree's."""
    module = _module_at(rev, scratch, "fs")
    module.integrity = _module_at(rev, scratch, "integrity")
    return module.CheckedFSL2Adapter


def measure(work: Path, before: str, reps: int) -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

    from prefixshare.bench._micro import RawIO, fs_l2_round
    from prefixshare.server.plugins.fs import CheckedFSL2Adapter

    old = _adapter_at(before, work)
    makers = {
        "lmcache_plain": lambda d: FSL2Adapter(FSL2AdapterConfig(base_path=str(d))),
        "checked_before": lambda d: old(FSL2AdapterConfig(base_path=str(d))),
        "checked_after": lambda d: CheckedFSL2Adapter({"base_path": str(d)}),
    }
    out: dict[str, Any] = {**run_header("store_io.py"), "before": git("rev-parse", before).strip(),
                           "cpus": os.cpu_count(), "reps": reps, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                           "chunk_tokens": CHUNK_TOKENS, "per_length": {}}
    for n in LENGTHS:
        size, chunk_bytes = n * KV_BYTES_PER_TOKEN, CHUNK_TOKENS * KV_BYTES_PER_TOKEN
        payload = os.urandom(chunk_bytes)
        raw = RawIO(work / "raw", size)
        raw_rounds: list[tuple[float, ...]] = []
        dirs = {k: work / k for k in makers}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        adapters = {k: make(dirs[k]) for k, make in makers.items()}
        times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in adapters}
        try:
            names = ["raw", *adapters]
            for rep in range(reps):  # the order rotates each repetition: none is always first or after another
                for k in names[rep % len(names):] + names[:rep % len(names)]:
                    if k == "raw":
                        raw_rounds.append(raw.round())
                    else:
                        times[k].append(fs_l2_round(adapters[k], dirs[k], chunk_bytes, n // CHUNK_TOKENS, payload))
        finally:
            raw.close()
            for a in adapters.values():
                a.close()
        raw_gbps = raw.summary(raw_rounds)
        row: dict[str, Any] = {"raw_gbps": {m: round(raw_gbps[f"{m}_gbps"]["median"], 3) for m in MEASURES}}
        for k, ts in times.items():
            row[k] = {m: round(size / statistics.median(t[i] for t in ts) / 1e9, 3) for i, m in enumerate(MEASURES)}
            row[f"{k}_vs_raw"] = {m: round(row[k][m] / row["raw_gbps"][m], 3) for m in MEASURES}
        out["per_length"][str(n)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision of the adapter to compare with")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory on the store's medium")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "store-io.json")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="prefixshare-store-io-", dir="/var/tmp"))
    try:
        result = measure(work, args.before, args.reps)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for n, row in result["per_length"].items():
        cells = ", ".join(f"{m} {row['checked_before_vs_raw'][m]:.2f}->{row['checked_after_vs_raw'][m]:.2f}"
                          for m in MEASURES)
        sys.stdout.write(f"{n} tokens, checked adapter / raw, before->after: {cells}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
