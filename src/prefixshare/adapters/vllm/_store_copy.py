"""The engine side of a store on a CPU engine: a request's KV copied out of vLLM's paged blocks straight into the
chunk buffers the server reserved for it, each byte read once and written once, on the store's own thread.

LMCache's engine-driven transfer context (CPU engines) reserves the chunk buffers in the server's shared memory
(``prepare_store``), fills them (``gather_paged_kv_to_cpu``) and commits them (``commit_store``). A CPU engine
has no native kernel for the fill; LMCache's Python fallback, per chunk and layer, gathers the chunk's blocks
into a new tensor, copies them permuted to token-major into a new staging tensor, then copies that into the
chunk buffer: every byte written three times, two of them into fresh allocations, in OpenMP parallel regions
that start a thread team on the store's thread beside the engine's own (``benchmarks/store_copy.py``: 1.4-1.9
GB/s, against 4.1 GB/s for one pass and 5.7 GB/s for a plain memory copy on the same machine).

:func:`copy_blocks` makes the same copy with numpy: one strided copy per chunk, layer and run of consecutive
blocks, straight into the reserved buffer. numpy copies on the calling thread, releases the GIL while it does
(the engine's own thread goes on), and starts no OpenMP team. It handles vLLM's CPU layout: per layer
``[num_blocks, kv_heads, block_size, 2 * head_size]`` (K and V fused per head, head-major within a block), a chunk
buffer ``[layers, chunk_tokens, kv_heads * 2 * head_size]`` (token-major), any element type (it copies bytes).
:func:`submit_store` uses it only when LMCache's own detection named that layout (the token-major layout has
tensors of the same rank), and :func:`copy_blocks` checks every shape against it and copies nothing (False) on
any mismatch; LMCache's gather then makes the copy as before.
``tests/test_store_copy.py`` compares its bytes with LMCache's fallback's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prefixshare.adapters.vllm import _compat


def _runs(block_ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in the chunk, first block id, count) for each run of consecutive block ids."""
    start = 0
    while start < len(block_ids):
        end = start + 1
        while end < len(block_ids) and block_ids[end] == block_ids[end - 1] + 1:
            end += 1
        yield start, block_ids[start], end - start
        start = end


def _as_bytes(tensor: Any) -> Any:
    """A numpy view of ``tensor``'s bytes (its last dimension in bytes), sharing its memory."""
    import torch

    return tensor.detach().view(torch.uint8).numpy()


def copy_blocks(kv_caches: dict[str, Any], block_ids: list[int], blocks_per_chunk: int, out: list[Any],
                chunk_indices: list[int]) -> bool:
    """Copy the chunks at ``chunk_indices`` (positions in ``block_ids``, ``blocks_per_chunk`` blocks each) into
    ``out[0..]``, in order; False (nothing written) when the tensors are not vLLM's CPU layout."""
    layers = list(kv_caches.values())
    if not layers or len(out) < len(chunk_indices):
        return False
    first = layers[0]
    if first.device.type != "cpu" or first.dim() != 4:
        return False
    num_blocks, heads, block, _ = first.shape
    for t in layers:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
            return False
    want = (len(layers), blocks_per_chunk * block, heads * first.shape[3])
    buffers = out[: len(chunk_indices)]
    for b in buffers:
        if tuple(b.shape) != want or b.dtype != first.dtype or b.device.type != "cpu" or not b.is_contiguous():
            return False
    chunks = [block_ids[i * blocks_per_chunk:(i + 1) * blocks_per_chunk] for i in chunk_indices]
    if any(len(ids) != blocks_per_chunk or min(ids) < 0 or max(ids) >= num_blocks for ids in chunks):
        return False
    import numpy as np

    sources = [_as_bytes(t) for t in layers]  # [num_blocks, heads, block, row bytes]
    for buffer, ids in zip(buffers, chunks, strict=True):
        dst = _as_bytes(buffer).reshape(len(layers), blocks_per_chunk, block, heads, -1)
        for at, first_block, count in _runs(ids):
            for layer, src in enumerate(sources):
                np.copyto(dst[layer, at:at + count], src[first_block:first_block + count].transpose(0, 2, 1, 3))
    return True


def submit_store(context: Any, request_id: str, key: Any, kv_caches: dict[str, Any], block_ids: Any, event: Any,
                 blocks_in_chunk: int) -> tuple[Any, bool]:
    """LMCache's synchronous store (``EngineDrivenTransferContext.submit_store``: reserve, fill, commit) with the
    fill made by :func:`copy_blocks` where it can: (a resolved future of the commit's result, whether
    :func:`copy_blocks` made the fill). Any context or tensors it does not know are handed to
    ``context.submit_store`` unchanged."""
    parts = _compat.engine_driven_store(context)
    if parts is None or any(t.device.type != "cpu" for t in kv_caches.values()):
        return context.submit_store(request_id, key, kv_caches, block_ids, event, blocks_in_chunk), False
    from lmcache.v1.multiprocess.futures import MessagingFuture

    driven, instance, head_major = parts
    done: Any = MessagingFuture()
    reserved = driven.prepare_store(key, instance)
    out, indices = reserved if reserved is not None else (None, None)
    if indices is not None and len(indices) == 0:  # every chunk is already stored
        done.set_result(True)
        return done, False
    ids = _compat.single_group_block_ids(block_ids)
    here = (head_major and out is not None and indices is not None
            and copy_blocks(kv_caches, ids, blocks_in_chunk, out, list(indices)))
    chunks = out[: len(indices)] if here else _compat.lmcache_gather(context, kv_caches, ids, blocks_in_chunk, out,
                                                                      indices)
    done.set_result(driven.commit_store(key, instance, chunks))
    return done, here
