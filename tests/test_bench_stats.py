"""The benchmark's statistics and its interactive replica driver, without an engine."""

from __future__ import annotations

import math
import random
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefixshare.bench._connectors import connector_rows, median_ci
from prefixshare.bench._procs import ReplicaError, ReplicaSession


def test_median_interval_is_the_order_statistics_of_the_binomial_tail() -> None:
    assert median_ci([float(i) for i in range(20)]) == (5.0, 14.0)  # P(Bin(20, 1/2) <= 5) = 2.1 %
    assert median_ci([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)  # too few pairs: min and max
    assert median_ci([2.0]) == (2.0, 2.0)
    assert all(math.isnan(v) for v in median_ci([]))
    # it covers the true median about 95 % of the time
    rng = random.Random(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (median_ci([rng.gauss(0, 1) for _ in range(20)]) for _ in range(2000)))
    assert 0.93 <= hits / 2000 <= 0.99


def _pair(n: int, ours: float, plain: float, loaded: int, hooks_us: float = 40.0) -> dict:
    hooks = {"SchedulerSide.before_lookup": {"us": hooks_us, "calls": 1}}
    return {f"O:{n}": {"seconds": ours, "num_cached_tokens": loaded, "reset": True, "hooks": hooks},
            f"L:{n}": {"seconds": plain, "num_cached_tokens": loaded, "reset": True}}


def test_connector_rows_pair_the_requests_and_leave_out_those_that_did_not_load() -> None:
    steps = {}
    for k, (ours, plain) in enumerate([(0.102, 0.100), (0.101, 0.100), (0.099, 0.100), (0.110, 0.100)]):
        for key, value in _pair(512, ours, plain, 512).items():
            steps[f"{key}:{k}"] = value
    for key, value in _pair(512, 0.5, 0.1, 0).items():  # a recompute in one replica: not a warm pair
        steps[f"{key}:4"] = value
    row = connector_rows({"steps": steps}, [512], 5, 64)["512"]
    assert row["pairs"] == 4 and row["pairs_not_loaded"] == 1
    assert row["added_s"] == pytest.approx(0.0015) and row["added_pct_of_warm_ttft"] == pytest.approx(1.5)
    assert row["added_ci95_s"] == [pytest.approx(-0.001), pytest.approx(0.010)]
    assert row["hooks_us_total"] == 40.0


def test_a_replica_session_interleaves_steps_and_reports_a_silent_or_dead_child(tmp_path: Path) -> None:
    """The driver's protocol against a stand-in child (the real replica needs an engine: tests/test_bench.py)."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import json, sys, time
        print("engine noise"); print("READY", flush=True)
        for line in sys.stdin:
            m = json.loads(line)
            if m.get("exit"):
                break
            if m["steps"][0].get("hang"):
                time.sleep(30)
            sys.stdout.write("noise\\nSTEPS " + json.dumps([s["tag"] for s in m["steps"]]) + "\\n")
            sys.stdout.flush()
        print("RESULT " + json.dumps({"steps": []}), flush=True)
    """))
    import prefixshare.bench._procs as procs

    orig = procs.sys.executable
    argv = [sys.executable, str(child)]

    class Popen(procs.subprocess.Popen):  # type: ignore[misc]
        def __init__(self, _args: list[str], **kwargs: object) -> None:
            super().__init__(argv, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(procs.subprocess, "Popen", Popen)
    try:
        with ReplicaSession(tmp_path, "x", {}, timeout_s=5) as a, ReplicaSession(tmp_path, "y", {}, timeout_s=5) as b:
            assert a.run([{"tag": "a1"}]) == ["a1"] and b.run([{"tag": "b1"}]) == ["b1"]
            assert a.run([{"tag": "a2"}, {"tag": "a3"}]) == ["a2", "a3"]
        assert a.result is not None and a.result["steps"] == [] and a.result["wall_s"] > 0
        with pytest.raises(ReplicaError, match="said nothing for 1 s"):
            with ReplicaSession(tmp_path, "z", {}, timeout_s=1) as c:
                c.run([{"tag": "h", "hang": True}])
        assert c.proc.poll() is not None  # killed, not left behind
    finally:
        mp.undo()
    assert procs.sys.executable == orig


def test_the_idle_memory_probe_times_every_kind_and_leaves_nothing_behind(tmp_path: Path) -> None:
    import os

    from prefixshare.bench._memory import KINDS, idle_memory
    from prefixshare.bench._report import _idle_memory

    shm_before = {p for p in os.listdir("/dev/shm") if p.startswith("prefixshare-idle-")}
    t0 = time.perf_counter()
    result = idle_memory([0.6, 0.2, 0.0], 2 << 20, 2, work=tmp_path)
    # a short spell (0.2 s) is waited out per kind, after a touch of its own; the long one (0.6 s) once per round,
    # after the short ones
    assert time.perf_counter() - t0 >= 2 * (len(KINDS) * 0.2 + 0.6)
    assert result["idle_s"] == [0.0, 0.2, 0.6] and result["bytes"] == 2 << 20 and len(result["runs"]) == 2
    assert set(result["gbps"]) == set(KINDS)
    for kind in KINDS:
        assert set(result["gbps"][kind]) == {"0", "0.2", "0.6"} and all(v > 0 for v in result["gbps"][kind].values())
        assert result["ratio_to_first"][kind]["0"] == 1.0
    # its regions are gone: no file in its work directory, no shared-memory file
    assert list(tmp_path.iterdir()) == []
    assert {p for p in os.listdir("/dev/shm") if p.startswith("prefixshare-idle-")} == shm_before

    page = "\n".join(_idle_memory(result))
    assert "| shared memory (as the server's chunk buffers) |" in page and "idle 0.2 s" in page
    assert f"{result['gbps']['anon_4k']['0.2']:.2f} GB/s ({result['ratio_to_first']['anon_4k']['0.2']:.2f}×)" in page
    assert _idle_memory(None) == []  # results from before the probe existed render without it
