"""Metrics hooks: free when off, Prometheus counters/histograms when on, an exporter behind an env var."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import free_port
from prefixshare import _metrics


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_metrics.PORT_ENV, raising=False)
    monkeypatch.delenv(_metrics.ENABLE_ENV, raising=False)
    _metrics._reset_for_tests()
    yield
    _metrics._reset_for_tests()


def _all_hooks() -> None:
    _metrics.lookup("vllm", 0.004, 512)
    _metrics.load("vllm", 0.02, 512, 512 * 4096)
    _metrics.admission("vllm", True, "pinned")
    _metrics.admission("vllm", False, "min_tokens")
    _metrics.fallback("vllm", "lookup_timeout")
    _metrics.stored("vllm", 256, 256 * 4096)
    _metrics.warm_progress(1, 300, 1000, run="r1", engine="vllm", total_tokens=600)
    _metrics.warm_progress(2, 600, 2000, run="r1", engine="vllm", total_tokens=600, finished=True)


def test_off_by_default_and_cheap(fresh: None) -> None:
    _all_hooks()
    assert not _metrics.enabled() and _metrics.exporter_port is None
    started = time.perf_counter()
    for _ in range(100_000):
        _metrics.lookup("vllm", 0.001, 0)
    assert (time.perf_counter() - started) / 100_000 < 5e-6  # a global check per call, no allocation


def test_hooks_record_prometheus_metrics(fresh: None) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    _metrics.enable(registry)
    _all_hooks()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "vllm", **labels})

    assert value("prefixshare_lookups_total") == 1 and value("prefixshare_hit_tokens_total") == 512
    assert value("prefixshare_lookup_seconds_count") == 1
    assert value("prefixshare_load_seconds_sum") == pytest.approx(0.02)
    assert value("prefixshare_loaded_bytes_total") == 512 * 4096 and value("prefixshare_stored_tokens_total") == 256
    assert value("prefixshare_fallbacks_total", reason="lookup_timeout") == 1
    assert value("prefixshare_admission_decisions_total", decision="admitted", reason="pinned") == 1
    assert value("prefixshare_admission_decisions_total", decision="refused", reason="min_tokens") == 1
    # warm progress is cumulative per run; counters take the increments
    assert value("prefixshare_warm_documents_total") == 2 and value("prefixshare_warm_tokens_total") == 600
    assert value("prefixshare_warm_bytes_total") == 2000 and value("prefixshare_warm_progress_ratio") == 1.0


_EXPORTER = """
import json, os, urllib.request
from prefixshare import _metrics
_metrics.lookup("vllm", 0.01, 64)
port = _metrics.exporter_port
body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
print(json.dumps({"port": port, "ok": 'prefixshare_lookups_total{engine="vllm"} 1.0' in body}))
"""


def test_exporter_starts_on_first_hook_and_moves_off_a_taken_port() -> None:
    port = free_port()
    env = {**os.environ, _metrics.PORT_ENV: str(port)}
    run = subprocess.run([sys.executable, "-c", _EXPORTER], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"port": port, "ok": True}
    with socket.socket() as busy:  # another engine process holds the port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env[_metrics.PORT_ENV] = str(port)
        run = subprocess.run([sys.executable, "-c", _EXPORTER], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"] and port < result["port"] < port + 16
