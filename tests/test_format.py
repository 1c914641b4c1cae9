"""The engine KV-layout label (prefixshare.adapters._format) against LMCache's own copy routine, on CPU.

Synthetic KV in each engine's format (tests/gpu/formats.py) is copied into stored objects by LMCache: two formats
give byte-identical objects exactly when their labels are equal, and every object scatters back bit for bit.
The same check runs on CUDA in tests/gpu/ where a GPU is available.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixshare.adapters import _format
from prefixshare.errors import FingerprintError

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from gpu.formats import _formats, check  # noqa: E402


@pytest.fixture(scope="module")
def report() -> dict:
    return check("cpu", "bfloat16", reps=1)


def test_equal_labels_iff_equal_bytes_on_cpu(report: dict) -> None:
    assert report["labels_tell_the_truth"], report["pairs"]
    pairs = {(p["a"], p["b"]): p for p in report["pairs"]}
    # both outcomes occur, so the check can fail either way
    assert pairs[("vllm-fused-nhd", "vllm-fused-hnd")]["identical_bytes"] is True  # the backend layout is normalised
    assert pairs[("vllm-split-5d", "sglang-split")]["identical_bytes"] is True  # split K/V: one byte order
    assert pairs[("vllm-fused-nhd", "sglang-split")]["identical_bytes"] is False  # fused vs split: never


def test_every_format_round_trips_bit_for_bit(report: dict) -> None:
    assert {n: f["round_trip_bit_exact"] for n, f in report["formats"].items()} == dict.fromkeys(report["formats"], True)


def test_orders_and_lmcache_formats(report: dict) -> None:
    got = {n: (f["lmcache_format"], f["order"]) for n, f in report["formats"].items()}
    assert got == {
        "vllm-fused-nhd": ("NL_X_NB_BS_NH_CS", _format.FUSED),
        "vllm-fused-hnd": ("NL_X_NB_NH_BS_CS", _format.FUSED),
        "vllm-split-5d": ("NL_X_TWO_NB_BS_NH_HS", _format.SPLIT),
        "sglang-split": ("NL_X_NB_BS_NH_HS", _format.SPLIT),
    }
    fused = report["formats"]["vllm-fused-nhd"]
    assert fused["object_bytes"] == 4 * 64 * 8 * 2 * 128 * 2  # layers x tokens x heads x (K, V) x dim x bf16


def test_labels() -> None:
    label = _format.layout_label("cuda", _format.FUSED)
    assert label.startswith("lmcache-0.") and label.endswith("/cuda/L,T,H,KV,D")
    assert _format.label_order(label) == _format.FUSED and _format.label_order("unknown") is None
    assert _format.expected_order(mla=True, fused=True) == _format.LATENT
    assert _format.expected_order(mla=False, fused=False) == _format.SPLIT
    with pytest.raises(ValueError, match="unknown stored-object order"):
        _format.layout_label("cpu", "T,L")


def test_a_label_that_does_not_describe_the_registered_kv_stops_the_engine() -> None:
    kv, hints, engine = _formats(torch, "cpu", torch.float32)["sglang-split"]
    wrong = _format.layout_label("cpu", _format.FUSED)
    with pytest.raises(FingerprintError, match=r"NL_X_NB_BS_NH_HS \(stored objects ordered KV,L,T,H,D\).*"
                                               r"derived for L,T,H,KV,D"):
        _format.check_registered(wrong, kv, hints, engine)
    assert _format.check_registered(_format.layout_label("cpu", _format.SPLIT), kv, hints, engine) == _format.SPLIT
    assert _format.check_registered("my/own-label", kv, hints, engine) == _format.SPLIT  # not ours: not checked


def test_the_gpu_check_script_runs_here_and_reports_the_cpu_rows(tmp_path: Path) -> None:
    """scripts/gpu-check on a CPU machine: the CUDA tests skip, the CPU report is written and tells the truth."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([str(root / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = json.loads((tmp_path / "gpu-formats.json").read_text())["reports"]
    assert [r["device"] for r in reports] == ["cpu"] and reports[0]["labels_tell_the_truth"]
    assert "skipped" in (tmp_path / "junit.xml").read_text()
