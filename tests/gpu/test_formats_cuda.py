"""The stored-format check on CUDA: LMCache's CUDA copy kernel on synthetic KV in each engine's GPU format.

Equal layout labels if and only if byte-identical stored objects, on the device our users serve from; every
object scatters back bit for bit. Runs where ``torch.cuda.is_available()`` (``scripts/gpu-check``); CI machines
are CPU-only, where it skips with that reason (``tests/test_format.py`` runs the same check on CPU).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (scripts/gpu-check runs this on a GPU host); CI machines are CPU-only",
                allow_module_level=True)

from gpu.formats import check  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_labels_tell_the_truth_bit_for_bit(dtype: str) -> None:
    report = check("cuda", dtype)
    assert report["labels_tell_the_truth"], report["pairs"]
    assert all(f["round_trip_bit_exact"] for f in report["formats"].values()), report["formats"]
    # the rows this check is for: vLLM 0.32 (fused) and SGLang (split) really differ; a split vLLM layout and
    # SGLang really are the same bytes
    pairs = {(p["a"], p["b"]): p["identical_bytes"] for p in report["pairs"]}
    assert pairs[("vllm-fused-nhd", "sglang-split")] is False
    assert pairs[("vllm-split-5d", "sglang-split")] is True


def test_cuda_objects_equal_cpu_objects() -> None:
    """Whether an object copied on CUDA is the one copied on CPU (what would let the label drop the device)."""
    cuda, cpu = check("cuda"), check("cpu")
    for name, f in cuda["formats"].items():
        assert f["order"] == cpu["formats"][name]["order"]
        assert f["object_bytes"] == cpu["formats"][name]["object_bytes"]
