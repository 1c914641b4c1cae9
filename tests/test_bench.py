"""`prefixshare bench --quick` end to end (real engines, real MP servers): results, plots and the generated page
are produced and sane. No timing thresholds: a shared CI machine's times say nothing about the code."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.server]


def _sane(summary: dict, runs: int) -> None:
    assert summary["n"] == runs
    assert 0 < summary["min"] <= summary["median"] <= summary["max"] < 600


def test_quick_bench_produces_sane_results(tmp_path: Path) -> None:
    out, docs = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-c", "from prefixshare.cli import main; main()", "bench", "--quick", "--out", str(out),
         "--docs", str(docs), "--json"],
        capture_output=True, text=True, timeout=900, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert json.loads((out / "results.json").read_text())["goals"].keys() == results["goals"].keys()
    runs = results["settings"]["runs"]
    assert runs >= 5 and results["command"].startswith("prefixshare bench --quick")
    m = results["machine"]
    assert m["cores"] >= 1 and m["memory_gb"] > 0 and m["versions"]["prefixshare"] and m["cpu"]

    rows = results["per_length"]
    assert sorted(map(int, rows)) == results["settings"]["lengths"]
    for n, row in rows.items():
        for key in ("cold_ttft_s", "warm_ttft_s", "local_ttft_s"):
            _sane(row[key], runs)
        # the cross-replica replica really loaded (all but the last partial chunk / token)
        assert row["warm_loaded_tokens"]["min"] >= int(n) - results["settings"]["chunk_size"]
        assert row["limit_page_cache_warm_s"] > row["local_ttft_s"]["median"]
        for src in ("raw", "fs_l2"):
            for key in ("write_gbps", "read_warm_gbps", "read_evicted_gbps"):
                assert row["io"][src][key]["median"] > 0
        assert 0 < row["overhead_us"]["calls_us"]["median"] < row["overhead_us"]["total_us"]
        assert math.isfinite(row["overhead_pct_of_warm_ttft"])
    for n in results["settings"]["slow_lengths"]:
        row = rows[str(n)]
        for key in ("throttled_auto_ttft_s", "throttled_cold_ttft_s", "prewarm_s", "raw_prefill_s",
                    "local_raw_engine_ttft_s"):
            _sane(row[key], runs)
        assert row["prewarm_tokens"] > 0

    # cost-aware loading: the calibrated replica chose to recompute rather than read the throttled store,
    # and every recorded decision carries a prediction and its observed time
    measured = results["cost_aware"]["measured_replica"]
    assert measured["decisions"].get("before_lookup:recompute", 0) >= runs
    for n in results["settings"]["slow_lengths"]:
        assert rows[str(n)]["throttled_loaded_tokens"] == [0] * runs
    # (a decision taken on a deadline, or one whose request had not finished when the stats were read,
    # carries no load prediction or no observation yet: only complete before-lookup records are checked)
    recent = [d for d in measured["recent"] if d["decision"] == "recompute" and d["phase"] == "before_lookup"
              and d["observed_s"] is not None]
    assert recent and all(d["predicted_load_s"] > d["predicted_recompute_s"] > 0 and d["observed_s"] > 0
                          for d in recent), measured["recent"]
    assert results["cost_aware"]["learning_replica"]["decisions"]

    goals = results["goals"]
    assert set(goals) == {"P1", "P2", "P3", "P4", "P5", "P6", "KV"}
    assert all(isinstance(g["pass"], bool) for g in goals.values())
    # the KV bytes the store holds per token are what `prefixshare plan` predicts (not a timing)
    assert goals["KV"]["pass"], results["kv_bytes_per_token"]

    for plot in results["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the page can be rendered again from the results alone (nothing measured)
    again = docs.parent / "again.md"
    proc = subprocess.run(
        [sys.executable, "-c", "from prefixshare.cli import main; main()", "bench", "--render", str(out / "results.json"),
         "--docs", str(again)], capture_output=True, text=True, timeout=300, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert again.read_text().split("## Goals")[1] == docs.read_text().split("## Goals")[1]
    page = docs.read_text()
    assert "prefixshare bench --quick" in page and m["cpu"] in page and "| P4 |" in page
    for plot in results["plots"]:
        assert os.path.relpath(plot, docs.parent) in page
