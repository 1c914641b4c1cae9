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

    assert results["run_id"] and results["commit"] and results["recorded_at"]
    assert results["interleaved_a_r"]  # P7's and P6's replicas up side by side, their requests alternating

    rows = results["per_length"]
    settings = results["settings"]
    assert sorted(map(int, rows)) == settings["lengths"]
    for n, row in rows.items():
        n = int(n)
        for key in ("raw_cold_ttft_s", "cold_ttft_s", "warm_ttft_s", "one_token_ttft_s"):
            _sane(row[key], runs)
            assert len(row[key]["values"]) == runs  # every run's value, not only the summary
        # prompts are n + 1 tokens: the warm replica loaded exactly the n-token prefix from the store, and its
        # one-token request found exactly that prefix in its own KV cache: both computed one token
        assert row["warm_loaded_tokens"] == [n] * runs, row["warm_loaded_tokens"]
        assert row["one_token_cached_tokens"] == [n] * runs, row["one_token_cached_tokens"]
        floor = row["floor_s"]
        assert floor["total_s"] > floor["one_token_s"] == row["one_token_ttft_s"]["median"]
        assert all(floor[k] > 0 for k in ("read_s", "copy_s", "read_gbps", "copy_gbps", "hash_gbps"))
        assert floor["hash_s"] > 0 if results["integrity_hashing"] else floor["hash_s"] == 0
        for src in ("raw", "fs_l2", "fs_l2_plain"):
            for key in ("write_gbps", "read_warm_gbps", "read_evicted_gbps"):
                assert row["io"][src][key]["median"] > 0
        miss = row["miss_overhead"]
        assert math.isfinite(miss["ratio"]) and miss["lookup_s"] is not None and miss["lookup_s"] > 0
        # the bypassed prompts of P7's in-process pairs were left alone: nothing looked up, loaded or stored
        _sane(row["bypassed_cold_ttft_s"], runs)
        assert len(miss["added_values_s"]) == runs and math.isfinite(miss["in_process_ratio"])
        assert miss["bypassed_did"] == {"lookups": 0, "tokens_stored": 0, "tokens_loaded": 0}, miss
        # a second raw engine computed the same prompts: the difference of two raw processes, P7's resolution
        _sane(row["raw_twin_cold_ttft_s"], runs)
        assert miss["raw_twin_ratio"] == row["raw_twin_cold_ttft_s"]["median"] / row["raw_cold_ttft_s"]["median"]
        assert results["goals"]["P7"]["raw_twin"][str(n)] == miss["raw_twin_ratio"]
        # every miss was stored after its first token: its chunks reached the store's medium before the next request
        assert len(miss["landed_values_s"]) == runs and all(x is not None for x in miss["landed_values_s"]), miss
        assert 0 < row["overhead_us"]["calls_us"]["median"] < row["overhead_us"]["total_us"]
        assert math.isfinite(row["overhead_pct_of_warm_ttft"])
    for n in settings["slow_lengths"]:
        row = rows[str(n)]
        for key in ("prewarm_s", "raw_prefill_s"):
            _sane(row[key], runs)
        assert row["prewarm_tokens"] > 0

    # the probe of what idle memory costs on this machine (shown beside P3 and P6 when they miss)
    idle = results["idle_memory"]
    assert idle["idle_s"] == [0.0, 1.0] and idle["rounds"] == 1
    assert all(v > 0 for row in idle["gbps"].values() for v in row.values()), idle["gbps"]

    # item 1: the floor is a lower bound (the run itself fails when it is beaten; checked here too)
    assert results["goals"]["P2"]["floor_check"]["ok"], results["goals"]["P2"]["floor_check"]
    # item 2: the sweep yields a regret per point, from forced loads that loaded and forced recomputes that did not
    sweep = results["sweep"]["per_length"]
    assert sorted(map(int, sweep)) == settings["sweep_lengths"]
    for n, d in sweep.items():
        assert [p["factor"] for p in d["points"]] == settings["sweep_factors"]
        for p in d["points"]:
            assert p["load_loaded_tokens"] == [int(n)] * settings["sweep_runs"], p
            assert p["recompute_loaded_tokens"] == [0] * settings["sweep_runs"], p
            assert len(p["auto_choices"]) == settings["sweep_runs"]
            assert math.isfinite(p["regret"]) and p["regret"] > 0 and p["better"] in ("load", "recompute")
    assert set(results["goals"]["P4"]["per_point"]) == {f"{n}@{p['factor']}" for n, d in sweep.items()
                                                         for p in d["points"]}

    # item 3: the same warm requests through prefixshare's connector and LMCache's, interleaved: every pair
    # loaded the prompt from the server in both replicas (their own prefix caches emptied first)
    pairs = settings["p5_pairs"]
    for n, row in rows.items():
        c = row["connectors"]
        assert c["pairs"] == pairs and c["pairs_not_loaded"] == 0, c
        for key in ("ours_ttft_s", "lmcache_ttft_s"):
            _sane(c[key], pairs)
        lo, hi = c["added_ci95_s"]
        assert lo <= c["added_s"] <= hi and len(c["added_values_s"]) == pairs
        hooks = c["hooks_us_per_request"]
        # prefixshare's hooks ran in O (a lookup per request, a transfer gated in the worker)...
        assert hooks["SchedulerSide.before_lookup"]["calls_median"] >= 1, hooks
        assert hooks["WorkerSide.gate"]["calls_median"] >= 1, hooks
        assert 0 < c["hooks_us_total"] < c["ours_ttft_s"]["median"] * 1e6
    replicas = results["connectors"]["replicas"]
    assert replicas["O"]["stats"]["tokens_loaded"] > 0 and replicas["O"]["stats"]["lookups"] > 0
    assert replicas["L"]["stats"] == {}  # ...and none of prefixshare ran in L: it has no prefixshare stats

    goals = results["goals"]
    assert set(goals) == {"P1", "P2", "P3", "P4", "P5", "P5_calls", "P6", "P7", "KV"}
    assert goals["P5"]["value_pct"] is not None and isinstance(goals["P5"]["resolved"], bool)
    assert all(isinstance(g["pass"], bool) for g in goals.values())
    # the KV bytes the store holds per token are what `prefixshare plan` predicts (not a timing)
    assert goals["KV"]["pass"], results["kv_bytes_per_token"]

    assert len(results["plots"]) == 3
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
    assert "prefixshare bench --quick" in page and m["cpu"] in page and "| P4 |" in page and "| P7 |" in page
    assert results["run_id"] in page
    for plot in results["plots"]:
        assert os.path.relpath(plot, docs.parent) in page
