"""The fault matrix and its page, without engines: rows carry their run, commit and time; the renderer takes one
run only (the newest, or the one asked for), refuses a fault recorded twice in it, marks rows over their
budget and says which rows ran a real engine; and no fault test records a literal where a measurement belongs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from faults import _matrix, render
from faults._matrix import RUN_ENV, Row, load_raw, record

HERE = Path(__file__).resolve().parent
#: Row arguments that must be measured (or computed from what was measured), never written as a constant
MEASURED = ("requests", "hits", "fallbacks", "tokens_loaded", "identical_to_cold", "max_added_latency_s",
            "budget_s", "corrupt_detected")


def _row(fault: str, **kw: Any) -> dict[str, Any]:
    base = {"area": "store down", "fault": fault, "behaviour": "b", "engine": "vllm", "tier": "fs", "requests": 2,
            "hits": 1, "fallbacks": 1, "tokens_loaded": 64, "identical_to_cold": True, "max_added_latency_s": 0.5,
            "budget_s": 2.0, "corrupt_detected": 0, "extra": {}, "run_id": "r1", "commit": "abc",
            "recorded_at": "2026-01-01T00:00:00Z"}
    return {**base, **kw}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_record_stamps_run_commit_and_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXSHARE_FAULT_RESULTS", str(tmp_path / "r.jsonl"))
    record(Row("bad input", "x", "y", engine="none"))
    record(Row("store down", "z", "w", requests=1, hits=0, fallbacks=1))
    rows = load_raw(tmp_path / "r.jsonl")
    assert {r["run_id"] for r in rows} == {os.environ[RUN_ENV]}  # this session's, set by the suite's conftest
    head = subprocess.run(["git", "-C", str(_matrix.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    want = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert all(r["commit"].startswith(want) and r["recorded_at"].endswith("Z") for r in rows), rows


def test_the_run_id_is_created_once_per_session_and_inherited(tmp_path: Path) -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from faults._matrix import Row, record; "
            "record(Row('bad input', sys.argv[2], 'b', engine='none'))")
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, _matrix.COMMIT_ENV)}
    env["PREFIXSHARE_FAULT_RESULTS"] = str(tmp_path / "r.jsonl")
    for fault in ("one", "two"):  # two sessions without a run id: two runs
        subprocess.run([sys.executable, "-c", code, str(HERE.parent), fault], env=env, check=True, timeout=120)
    subprocess.run([sys.executable, "-c", code, str(HERE.parent), "three"], env={**env, RUN_ENV: "given"},
                   check=True, timeout=120)
    ids = [r["run_id"] for r in load_raw(tmp_path / "r.jsonl")]
    assert ids[0] != ids[1] and ids[2] == "given" and all(ids), ids


def test_commit_is_unknown_outside_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_matrix, "ROOT", tmp_path)
    assert _matrix._git_commit() == "unknown"


def test_record_refuses_engine_rows_without_counters_and_counters_without_an_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXSHARE_FAULT_RESULTS", str(tmp_path / "r.jsonl"))
    with pytest.raises(ValueError, match="measured"):
        record(Row("store down", "f", "b"))
    with pytest.raises(ValueError, match="no engine"):
        record(Row("bad input", "f", "b", engine="none", requests=3))
    with pytest.raises(ValueError, match="engine"):
        record(Row("bad input", "f", "b", engine="tgi", requests=1, hits=0, fallbacks=0))
    assert not (tmp_path / "r.jsonl").exists()


def test_the_newest_run_is_selected_and_other_runs_ignored(tmp_path: Path) -> None:
    raw = [_row("old only", run_id="r0", recorded_at="2026-01-01T00:00:00Z"),
           _row("a", run_id="r1", recorded_at="2026-01-02T00:00:00Z"),
           _row("b", run_id="r1", recorded_at="2026-01-02T00:10:00Z"),
           _row("a", run_id="r0", recorded_at="2026-01-01T00:01:00Z"),
           {k: v for k, v in _row("no run id").items() if k not in ("run_id", "commit", "recorded_at")}]
    run, rows = render.select(raw)
    assert run == "r1" and [r["fault"] for r in rows] == ["a", "b"]
    run, rows = render.select(raw, "r0")
    assert run == "r0" and [r["fault"] for r in rows] == ["old only", "a"]
    with pytest.raises(render.RenderError, match="no rows of run"):
        render.select(raw, "r9")
    with pytest.raises(render.RenderError, match="more than once"):
        render.select([*raw, _row("b", run_id="r1", recorded_at="2026-01-02T00:11:00Z")])
    with pytest.raises(render.RenderError, match="runs"):  # render() itself never mixes runs
        render.render([Row.from_dict(r) for r in raw[:2]])


def test_the_page_names_its_run_marks_rows_over_budget_and_says_which_ran_an_engine() -> None:
    rows = [Row.from_dict(r) for r in (
        _row("within", max_added_latency_s=1.9),
        _row("over but within the tolerance", max_added_latency_s=2.4, commit="abc-dirty",
             recorded_at="2026-01-01T00:07:00Z"),
        _row("no engine", engine="none", requests=None, hits=None, fallbacks=None, tokens_loaded=None,
             max_added_latency_s=None, budget_s=None, area="bad input"))]
    page = render.render(rows)
    flat = " ".join(page.split())
    assert "**Run `r1`**" in page and "`abc`, `abc-dirty`" in page
    assert "2026-01-01T00:00:00Z to 2026-01-01T00:07:00Z" in flat and "(UTC, 7 min)" in flat
    assert "3 rows, 2 with a real inference engine, 1 over budget" in flat
    assert "2 of the 3 rows ran a real inference engine (vLLM: 2 rows)" in flat
    lines = {ln.split(" | ")[0][2:]: ln for ln in page.splitlines() if ln.startswith("| ") and " | " in ln}
    assert "**over budget**" in lines["over but within the tolerance"] and "+2.40 s / 2 s" in lines[
        "over but within the tolerance"]
    assert "over budget" not in lines["within"]
    assert " | yes | vllm / fs | 2 | 1 | 1 | 64 | " in lines["within"]
    assert " | no | none / fs | – | – | – | – | " in lines["no engine"]
    assert "tolerate 1 s of machine noise on top" in flat


def test_write_renders_one_run_and_copies_its_raw_rows(tmp_path: Path) -> None:
    results = _write(tmp_path / "results.jsonl", [
        _row("a", run_id="r0", recorded_at="2026-01-01T00:00:00Z"),
        _row("a", run_id="r1", recorded_at="2026-01-02T00:00:00Z"),
        _row("b", run_id="r1", recorded_at="2026-01-02T00:01:00Z")])
    docs = tmp_path / "docs"
    script = HERE / "render.py"
    out = subprocess.run([sys.executable, str(script), str(results), "--write", "--docs", str(docs)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "run r1" in out.stderr and "1 rows of other runs ignored" in out.stderr
    copied = load_raw(docs / "reliability.jsonl")
    assert [(r["run_id"], r["fault"]) for r in copied] == [("r1", "a"), ("r1", "b")]
    assert "**Run `r1`**" in (docs / "reliability.md").read_text()
    again = subprocess.run([sys.executable, str(script), str(results), "--run", "r0"], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "**Run `r0`**" in again.stdout, again.stderr
    _write(results, [*load_raw(results), _row("b", run_id="r1", recorded_at="2026-01-02T00:02:00Z")])
    dup = subprocess.run([sys.executable, str(script), str(results)], capture_output=True, text=True, timeout=120)
    assert dup.returncode == 2 and "more than once" in dup.stderr, dup.stderr


def _recorded_rows(path: Path) -> list[ast.Call]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "record" and node.args
                and isinstance(node.args[0], ast.Call) and getattr(node.args[0].func, "id", None) == "Row"):
            calls.append(node.args[0])
    return calls


def test_fault_rows_record_measurements_not_literals() -> None:
    """Every record(Row(...)) of the fault suite: counters, comparisons, latencies, budgets and corruption
    counts are expressions over what the test observed, never constants (None aside)."""
    found, literal = 0, []
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        for call in _recorded_rows(path):
            found += 1
            assert len(call.args) <= 3, f"{path.name}:{call.lineno}: pass measured fields by name"
            for kw in call.keywords:
                if kw.arg in MEASURED and isinstance(kw.value, ast.Constant) and kw.value.value is not None:
                    literal.append(f"{path.name}:{call.lineno} {kw.arg}={kw.value.value!r}")
    assert found >= 25, found
    assert not literal, literal


def test_rows_with_details_keep_the_sections_that_follow_them() -> None:
    # a row's details once replaced the fleet section (a loop variable shadowed render()'s parameter)
    row = Row.from_dict({**_row("a fault with details"), "extra": {"cli_exit": 3}})
    text = render.render([row], "## Fleet section\n")
    assert "## Fleet section" in text and text.count("cli_exit=3") == 1
