"""What every script in benchmarks/ records about its run: an id, the commit and whether the tree was dirty, the
time, and the command that reproduces it.

    from _meta import run_header  # benchmarks/ is sys.path[0] when a script runs as python benchmarks/<name>.py

    result = {**run_header("miss_path.py"), "rows": rows}
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """``git <args>`` in the repository's root; its standard output, as it came (a trailing newline included)."""
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def run_header(script: str, argv: list[str] | None = None) -> dict[str, Any]:
    """A run's id (UTC time and 6 random hex digits), ``HEAD``'s commit, whether tracked files differ from it, when
    (UTC) and ``python benchmarks/<script> <argv>`` (``argv``: ``sys.argv[1:]`` when None)."""
    now = time.gmtime()
    return {"run_id": time.strftime("%Y%m%dT%H%M%SZ", now) + "-" + uuid.uuid4().hex[:6],
            "commit": git("rev-parse", "HEAD").strip(),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
            "command": " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])}
