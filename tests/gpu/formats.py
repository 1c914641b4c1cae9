"""Test-only: the stored-format check on synthetic KV, on any torch device (CPU in CI, CUDA on a GPU host).

Each engine KV format is built from the same K and V values -- vLLM >= 0.32's K|V fused per head (NHD, as on
CUDA, and HND, as vLLM's CPU backend keeps it), vLLM's older split 5-D layout, SGLang's K buffers followed
by its V buffers -- and copied into LMCache chunk objects by LMCache's own routine
(``gather_paged_kv_to_cpu``: the compiled CUDA kernel for CUDA tensors, the engine-driven copy for CPU ones).
What it proves, per device: two formats give byte-identical objects exactly when
:mod:`prefixshare.adapters._format` gives them the same order (so equal layout labels go with equal bytes,
and only then); every object scatters back into the engine's paged KV bit for bit; and it times the copy.

Needs torch and LMCache only (no engine, no pytest): ``python -m gpu.formats`` from ``tests/`` prints a JSON
report; ``tests/test_format.py`` (CPU) and ``tests/gpu/test_formats_cuda.py`` (CUDA) assert on it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

L, NB, BS, H, D = 4, 16, 16, 8, 128  # Qwen3-8B's head geometry: 8 KV heads x 128
BLOCKS = [3, 11, 0, 7, 5, 14, 9, 2]  # two 64-token chunks of 16-token blocks, out of order
BLOCKS_PER_CHUNK = 4


def _formats(torch: Any, device: str, dtype: Any) -> dict[str, tuple[dict[str, Any], dict[str, str], str]]:
    """name -> (KV tensors, layout hints, engine), every format holding the same K and V values."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(L, NB, BS, H, D, generator=gen).to(dtype)
    v = torch.randn(L, NB, BS, H, D, generator=gen).to(dtype)

    def put(t: Any) -> Any:
        return t.contiguous().to(device)

    return {
        "vllm-fused-nhd": ({f"layer.{i}": put(torch.cat([k[i], v[i]], dim=-1)) for i in range(L)},
                           {"kv_layout": "NHD"}, "vllm"),
        "vllm-fused-hnd": ({f"layer.{i}": put(torch.cat([k[i], v[i]], dim=-1).permute(0, 2, 1, 3)) for i in range(L)},
                           {"kv_layout": "HND"}, "vllm"),
        "vllm-split-5d": ({f"layer.{i}": put(torch.stack([k[i], v[i]])) for i in range(L)},
                          {"kv_layout": "NHD"}, "vllm"),
        "sglang-split": ({**{f"kv_{i}": put(k[i]) for i in range(L)}, **{f"kv_{L + i}": put(v[i]) for i in range(L)}},
                         {"kv_list_layout": "unified"}, "sglang"),
    }


def _engine_type(engine: str) -> Any:
    from lmcache.utils import EngineType

    return EngineType.SGLANG if engine == "sglang" else EngineType.VLLM


def _gather(torch: Any, kv: dict[str, Any], hints: dict[str, str], engine: str) -> list[Any]:
    from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu

    out = gather_paged_kv_to_cpu(kv, BLOCKS, BLOCKS_PER_CHUNK, hints, engine_type=_engine_type(engine))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [o.contiguous().cpu() for o in out]


def _round_trip(torch: Any, kv: dict[str, Any], hints: dict[str, str], engine: str, chunks: list[Any]) -> bool:
    """Scatter the objects into zeroed paged KV of the same format: the copied blocks come back bit for bit."""
    from lmcache.v1.multiprocess.transfer_context.base import scatter_cpu_to_paged_kv

    empty = {name: torch.zeros_like(t) for name, t in kv.items()}
    scatter_cpu_to_paged_kv(empty, BLOCKS, chunks, BLOCKS_PER_CHUNK, layout_hints=hints,
                            engine_type=_engine_type(engine))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for name, t in kv.items():
        index = (slice(None), BLOCKS) if t.dim() == 5 else BLOCKS  # blocks: dim 1 of [2, NB, ...], else dim 0
        if not torch.equal(empty[name][index].cpu().view(torch.uint8), t[index].cpu().view(torch.uint8)):
            return False
    return True


def _time_gather(torch: Any, kv: dict[str, Any], hints: dict[str, str], engine: str, reps: int) -> float:
    """Median seconds of one gather of the two chunks."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        _gather(torch, kv, hints, engine)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def check(device: str, dtype_name: str = "bfloat16", reps: int = 5) -> dict[str, Any]:
    """The report for one device: per format its LMCache format, order and label, round trip, copy time; per
    pair of formats whether their objects are byte-identical and whether their orders are equal."""
    import torch

    from prefixshare.adapters._format import layout_label, registered_order

    dtype = getattr(torch, dtype_name)
    formats = _formats(torch, device, dtype)
    report: dict[str, Any] = {"device": device, "dtype": dtype_name, "torch": torch.__version__,
                              "geometry": {"layers": L, "kv_heads": H, "head_dim": D, "block": BS,
                                           "chunk_tokens": BS * BLOCKS_PER_CHUNK},
                              "formats": {}, "pairs": []}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    objects: dict[str, bytes] = {}
    for name, (kv, hints, engine) in formats.items():
        order, fmt = registered_order(kv, hints, engine)
        chunks = _gather(torch, kv, hints, engine)
        objects[name] = b"".join(c.view(torch.uint8).numpy().tobytes() for c in chunks)
        seconds = _time_gather(torch, kv, hints, engine, reps)
        report["formats"][name] = {
            "engine": engine, "lmcache_format": fmt, "order": order, "label": layout_label(device, order),
            "object_shape": list(chunks[0].shape), "object_bytes": len(objects[name]) // len(chunks),
            "round_trip_bit_exact": _round_trip(torch, kv, hints, engine, chunks),
            "gather_s": seconds, "gather_gb_s": len(objects[name]) / seconds / 1e9 if seconds > 0 else None,
        }
    for a, b in itertools.combinations(formats, 2):
        fa, fb = report["formats"][a], report["formats"][b]
        report["pairs"].append({"a": a, "b": b, "identical_bytes": objects[a] == objects[b],
                                "same_label": fa["label"] == fb["label"]})
    report["labels_tell_the_truth"] = all(p["identical_bytes"] == p["same_label"] for p in report["pairs"])
    return report


def main() -> int:
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    reports = [check(d) for d in devices]
    sys.stdout.write(json.dumps({"reports": reports}, indent=1) + "\n")
    ok = all(r["labels_tell_the_truth"] and all(f["round_trip_bit_exact"] for f in r["formats"].values())
             for r in reports)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
