"""The engine side of a store on a CPU engine: LMCache's copy of a request's KV out of vLLM's paged blocks into
the server's chunk objects, against a copy of the same bytes that reads and writes each once.

    python benchmarks/store_copy.py [--reps 9] [--threads 1] [--out docs/benchmarks/store-copy.json]

A minimal reproduction of what benchmarks/miss_path.py's Q measures as the engine's CPU per stored miss. On a
CPU engine LMCache has no native kernel for this copy; its Python fallback
(``lmcache.v1.platform.torch_ops.mp_mem_kernels._transfer_per_layer_fused``, called for vLLM's CPU layout:
one K/V-fused plane per layer, head-major blocks) does, per chunk: allocate a staging tensor; per layer,
``index_select`` the chunk's blocks (a second allocation and a gather), copy them, permuted to token-major, into
the staging tensor; then copy the staging tensor into the chunk object. Each byte is written three times.

The comparison copies each block, permuted, straight into the object (``copy_`` of a strided view: one read,
one write per byte), prefixshare's copy that the connector makes instead of LMCache's on this layout
(``prefixshare.adapters.vllm._store_copy.copy_blocks``: numpy, one strided copy per chunk, layer and run of
consecutive blocks, no OpenMP) and a plain ``memcpy`` of the same number of bytes (a reference, not a bound:
one contiguous copy between two buffers of its own; the strided copies can match it at 1k tokens). Bench model's
shape (12 layers, 4 KV heads of 64, fp32: 24,576 bytes per token), 128-token blocks, 256-token chunks, 1k and 4k
tokens; torch limited to ``--threads`` (the store runs on one thread of the engine's process beside its prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _meta import run_header

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD, BLOCK, CHUNK = 12, 4, 64, 128, 256
LENGTHS = (1024, 4096)


class _HeadMajor:
    """What the fallback reads of its format spec here: vLLM's CPU blocks are head-major."""

    is_hnd = True


def _setup(tokens: int) -> tuple[list[Any], list[Any], Any]:
    import torch

    blocks = tokens // BLOCK
    pool = 4 * blocks  # the request's blocks are scattered in a larger cache
    layers = [torch.randn(pool, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    objects = [torch.empty(LAYERS, CHUNK, HEADS * 2 * HEAD) for _ in range(tokens // CHUNK)]
    block_ids = torch.randperm(pool)[:blocks].sort().values
    return layers, objects, block_ids


def _lmcache(layers: list[Any], objects: list[Any], block_ids: Any) -> None:
    from lmcache.v1.platform.torch_ops.mp_mem_kernels import _transfer_per_layer_fused

    _transfer_per_layer_fused(layers, objects, block_ids, len(block_ids), CHUNK // BLOCK, BLOCK, _HeadMajor,
                              True, 0)


def _one_pass(layers: list[Any], objects: list[Any], block_ids: Any) -> None:
    per = CHUNK // BLOCK
    ids = block_ids.tolist()
    for o, obj in enumerate(objects):
        view = obj.view(LAYERS, per, BLOCK, HEADS, 2 * HEAD)
        for j, b in enumerate(ids[o * per:(o + 1) * per]):
            for layer_idx, layer in enumerate(layers):
                view[layer_idx, j].copy_(layer[b].transpose(0, 1))


def _prefixshare(layers: list[Any], objects: list[Any], block_ids: Any) -> None:
    from prefixshare.adapters.vllm._store_copy import copy_blocks

    kv = {str(i): layer for i, layer in enumerate(layers)}
    if not copy_blocks(kv, block_ids.tolist(), CHUNK // BLOCK, objects, list(range(len(objects)))):
        raise SystemExit("prefixshare's copy refused the bench's layout")


def _check(layers: list[Any], block_ids: Any, tokens: int) -> None:
    """Every copy puts the same bytes in the same places."""
    import torch

    a = [torch.empty(LAYERS, CHUNK, HEADS * 2 * HEAD) for _ in range(tokens // CHUNK)]
    _lmcache(layers, a, block_ids)
    for name, copy in (("one-pass", _one_pass), ("prefixshare", _prefixshare)):
        b = [torch.empty(LAYERS, CHUNK, HEADS * 2 * HEAD) for _ in range(tokens // CHUNK)]
        copy(layers, b, block_ids)
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            raise SystemExit(f"the {name} copy does not match LMCache's: the comparison would mean nothing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "store-copy.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows: dict[str, Any] = {}
    for tokens in LENGTHS:
        layers, objects, block_ids = _setup(tokens)
        _check(layers, block_ids, tokens)
        nbytes = sum(o.numel() * o.element_size() for o in objects)
        src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        runs: dict[str, list[float]] = {"lmcache": [], "one_pass": [], "prefixshare": [], "memcpy": []}
        for _ in range(args.reps):  # interleaved
            for name in runs:
                t0 = time.perf_counter()
                if name == "lmcache":
                    _lmcache(layers, objects, block_ids)
                elif name == "one_pass":
                    _one_pass(layers, objects, block_ids)
                elif name == "prefixshare":
                    _prefixshare(layers, objects, block_ids)
                else:
                    dst.copy_(src)
                runs[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows[str(tokens)] = {"bytes": nbytes, "seconds": runs,
                             "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
                             "ms": {k: v * 1e3 for k, v in med.items()},
                             "lmcache_over_one_pass": med["lmcache"] / med["one_pass"],
                             "lmcache_over_prefixshare": med["lmcache"] / med["prefixshare"]}
        print(f"{tokens} tokens ({nbytes / 1e6:.0f} MB): " + ", ".join(
            f"{k} {med[k] * 1e3:.1f} ms ({nbytes / med[k] / 1e9:.2f} GB/s)" for k in runs))
    out = {**run_header("store_copy.py"), "threads": args.threads, "reps": args.reps, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
