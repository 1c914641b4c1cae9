"""`prefixshare demo --quick` end to end: three processes, one server; replica B loads the manual."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.server]


def test_demo_quick_runs_end_to_end_and_loads_the_manual(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "prefixshare"
    proc = subprocess.run([str(exe), "demo", "--quick", "--out", str(tmp_path), "--json"], capture_output=True,
                          text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["quick"] is True and len(result["rows"]) == 3
    for row in result["rows"]:
        assert row["tokens_loaded"] > 0 and row["bytes_loaded"] > 0, row  # every question loaded the manual
        assert row["tokens_loaded"] >= 0.9 * row["prefix_tokens"] and row["same_first_token"], row
        assert row["cold_ttft_s"] > 0 and row["warm_ttft_s"] > 0
        assert row["cold_cached_tokens"] == 0  # the cold replica computed every prompt in full
    assert result["warm"]["status"] == "warmed" and result["warm"]["verified"] is True
    assert Path(result["plot"]).stat().st_size > 0 and (tmp_path / "demo.json").is_file()
    for name in ("replica-a", "replica-cold", "replica-b"):
        assert (tmp_path / f"{name}.log").is_file()
    for port in result["server"].values():  # the demo stopped its server
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_demo_table_as_printed(tmp_path: Path) -> None:
    """The human output: the table with loaded tokens, and the plot path."""
    from rich.console import Console

    from prefixshare.demo import DemoResult, render_table

    rows = [{"question": "Q?", "prompt_tokens": 1469, "prefix_tokens": 1445, "cold_ttft_s": 0.9, "warm_ttft_s": 0.1,
             "tokens_loaded": 1408, "bytes_loaded": 5767168, "speedup": 9.0, "same_first_token": True}]
    console = Console(record=True, width=120)
    render_table(DemoResult(rows, {}, {}, "m", "s", None), console)
    text = console.export_text()
    assert "1,408" in text and "5.5" in text and "MiB" in text and "9.0x" in text and "Q1: Q?" in text
