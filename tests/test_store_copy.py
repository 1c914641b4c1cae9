"""prefixshare's copy of a store out of vLLM's CPU KV blocks (:mod:`prefixshare.adapters.vllm._store_copy`) puts
the same bytes in the same places as LMCache's own fallback for that layout, and refuses any other layout without
writing. The engine-level proof (a replica whose stores it copied serves another replica the same greedy tokens
and logprobs as a cold run) is in tests/e2e/test_vllm_sharing.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from prefixshare.adapters.vllm._store_copy import _runs, copy_blocks  # noqa: E402

LAYERS, HEADS, BLOCK, WIDTH, PER_CHUNK = 3, 4, 16, 32, 2  # WIDTH: K and V of one head, fused


class _HeadMajor:
    """What LMCache's fallback reads of its format spec for vLLM's CPU layout (head-major blocks)."""

    is_hnd = True


def _kv(dtype: Any, blocks: int = 40) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(blocks, HEADS, BLOCK, WIDTH, generator=g).to(dtype)
            for i in range(LAYERS)}


def _buffers(n: int, dtype: Any) -> list[Any]:
    return [torch.full((LAYERS, PER_CHUNK * BLOCK, HEADS * WIDTH), -1.0, dtype=dtype) for _ in range(n)]


def _lmcache(kv: dict[str, Any], block_ids: list[int], dtype: Any) -> list[Any]:
    """Every chunk as LMCache's Python fallback copies it (the kernel its gather calls for this layout)."""
    from lmcache.v1.platform.torch_ops.mp_mem_kernels import _transfer_per_layer_fused

    out = _buffers(len(block_ids) // PER_CHUNK, dtype)
    _transfer_per_layer_fused(list(kv.values()), out, torch.tensor(block_ids), len(block_ids), PER_CHUNK, BLOCK,
                              _HeadMajor, True, 0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_copy_matches_lmcaches_byte_for_byte(dtype: Any) -> None:
    kv = _kv(dtype)
    # runs of consecutive blocks and scattered ones, as a cache that has been reused hands them out
    block_ids = [3, 4, 9, 10, 11, 12, 30, 2, 25, 26, 0, 39]
    expected = _lmcache(kv, block_ids, dtype)
    everything = _buffers(6, dtype)
    assert copy_blocks(kv, block_ids, PER_CHUNK, everything, list(range(6)))
    for got, want in zip(everything, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # only the chunks the server reserved (the others are stored already), into the first buffers, in order
    some = _buffers(3, dtype)
    assert copy_blocks(kv, block_ids, PER_CHUNK, some, [1, 4])
    assert torch.equal(some[0], expected[1]) and torch.equal(some[1], expected[4])
    assert bool((some[2] == -1).all())  # an extra buffer is left alone


def test_runs_split_block_ids_where_they_stop_being_consecutive() -> None:
    assert list(_runs([5, 6, 7, 2, 9, 10])) == [(0, 5, 3), (3, 2, 1), (4, 9, 2)]
    assert list(_runs([])) == []


@pytest.mark.parametrize("case", ["other layout", "buffer shape", "buffer dtype", "block out of range",
                                  "short chunk", "too few buffers", "no layers"])
def test_any_other_layout_is_refused_without_writing(case: str) -> None:
    kv, block_ids, buffers, indices = _kv(torch.float32), [0, 1, 2, 3], _buffers(2, torch.float32), [0, 1]
    if case == "other layout":  # K and V in planes of their own: [2, blocks, heads, block, head]
        kv = {k: torch.zeros(2, 40, HEADS, BLOCK, WIDTH // 2) for k in kv}
    elif case == "buffer shape":
        buffers = [torch.zeros(LAYERS, PER_CHUNK * BLOCK, HEADS * WIDTH + 1) for _ in range(2)]
    elif case == "buffer dtype":
        buffers = [b.to(torch.float16) for b in buffers]
    elif case == "block out of range":
        block_ids = [0, 1, 2, 40]
    elif case == "short chunk":
        block_ids = [0, 1, 2]
    elif case == "too few buffers":
        buffers = buffers[:1]
    else:
        kv = {}
    before = [b.clone() for b in buffers]
    assert not copy_blocks(kv, block_ids, PER_CHUNK, buffers, indices)
    assert all(torch.equal(b, a) for b, a in zip(buffers, before, strict=True))


class _Server:
    """Stands in for LMCache's engine-driven server context: reserves ``reserve`` chunk buffers for the chunks at
    ``indices`` and keeps what each commit hands it."""

    def __init__(self, indices: list[int], dtype: Any) -> None:
        self.indices, self.dtype = indices, dtype
        self.commits: list[list[Any]] = []

    def prepare_store(self, key: Any, instance: int) -> tuple[list[Any], list[int]]:
        return _buffers(len(self.indices), self.dtype), list(self.indices)

    def commit_store(self, key: Any, instance: int, chunks: list[Any]) -> bool:
        self.commits.append([c.clone() for c in chunks])
        return True


def _context(server: _Server, layout: str) -> Any:
    """LMCache's synchronous engine-driven context, registered (as its register() leaves it) on ``server``."""
    from lmcache.lmcache_native import EngineKVFormat
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext

    context = EngineDrivenTransferContext(7, None)  # type: ignore[arg-type]
    context._engine_driven_context = server
    context._engine_kv_format = getattr(EngineKVFormat, layout)
    return context


@pytest.mark.parametrize("layout", ["NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS"])
def test_a_store_is_filled_here_only_for_the_layout_lmcache_detected_as_vllms_cpu_one(
        layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixshare.adapters.vllm import _compat
    from prefixshare.adapters.vllm._store_copy import submit_store

    kv, block_ids = _kv(torch.float32), [3, 4, 9, 10, 11, 12]
    gathered: list[Any] = []
    monkeypatch.setattr(_compat, "lmcache_gather", lambda ctx, kv, ids, n, out, idx: gathered.append(idx) or out)
    server = _Server([0, 2], torch.float32)
    future, here = submit_store(_context(server, layout), "r", "key", kv, [block_ids], None, PER_CHUNK)
    assert future.result() is True and len(server.commits) == 1
    if layout == "NL_X_NB_NH_BS_CS":  # vLLM's CPU layout: prefixshare's copy, the bytes LMCache's would be
        expected = _lmcache(kv, block_ids, torch.float32)
        assert here and gathered == []
        assert torch.equal(server.commits[0][0], expected[0]) and torch.equal(server.commits[0][1], expected[2])
    else:  # the token-major layout has tensors of the same rank: LMCache's gather, not a guess from shapes
        assert not here and gathered == [[0, 2]]


def test_a_store_already_held_commits_nothing_and_other_contexts_are_left_to_themselves() -> None:
    from prefixshare.adapters.vllm._store_copy import submit_store

    server = _Server([], torch.float32)
    future, here = submit_store(_context(server, "NL_X_NB_NH_BS_CS"), "r", "key", _kv(torch.float32), [[0, 1]],
                                None, PER_CHUNK)
    assert future.result() is True and not here and server.commits == []

    class Other:
        def submit_store(self, *args: Any) -> str:
            return "its own"

    assert submit_store(Other(), "r", "key", _kv(torch.float32), [[0, 1]], None, PER_CHUNK) == ("its own", False)
