"""Fresh-process replicas and LMCache MP servers for the benchmarks (and the cost-aware loading tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefixshare.errors import PrefixShareError


#: LMCache's MP server loads the throttled fs adapter from here (its "plugin" L2 adapter type)
THROTTLE_MODULE, THROTTLE_CLASS = "prefixshare.bench._throttle", "ThrottledFSL2Adapter"


def throttled_store_spec(base_path: str, *, chunk_delay_s: float = 0.0, read_gbps: float | None = None,
                         control_path: str | None = None) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object of a deliberately slow fs store on ``base_path`` (see
    :mod:`prefixshare.bench._throttle`; building the spec imports nothing of LMCache). ``control_path``: a JSON
    file the adapter reads its delay from at every load (a replica's ``throttle`` step writes it)."""
    params: dict[str, Any] = {"base_path": base_path, "chunk_delay_s": chunk_delay_s}
    if read_gbps:
        params["read_gbps"] = read_gbps
    if control_path:
        params["control_path"] = control_path
    return {"type": "plugin", "module_path": THROTTLE_MODULE, "class_name": THROTTLE_CLASS, "adapter_params": params}


def set_throttle(path: str, *, chunk_delay_s: float = 0.0, read_gbps: float | None = None) -> None:
    """Write a throttled store's control file (atomically: a load never reads half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"chunk_delay_s": chunk_delay_s, "read_gbps": read_gbps}, f)
    os.replace(tmp, path)


class ReplicaError(PrefixShareError):
    """A replica process failed; the message ends with the tail of its stderr."""


def run_replica(workdir: Path, name: str, spec: dict[str, Any], *, timeout_s: float = 1800,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run :mod:`prefixshare.bench._replica` on ``spec`` in a fresh process; returns its result with the
    structured log events it emitted (``events``) and its wall time including start-up (``wall_s``)."""
    import time

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(spec))
    full_env = {**os.environ, **(env or {})}
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "prefixshare.bench._replica", str(path)], capture_output=True,
                              text=True, timeout=timeout_s, env=full_env)
    except subprocess.TimeoutExpired as exc:
        raise ReplicaError(f"replica {name} did not finish within {timeout_s:.0f} s") from exc
    wall = time.perf_counter() - started
    (workdir / f"{name}.stderr").write_text(proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise ReplicaError(f"replica {name} failed (exit code {proc.returncode}); stderr ends:\n{proc.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result["events"] = parse_events(proc.stderr)
    result["wall_s"] = wall
    return result


def parse_events(text: str) -> list[dict[str, Any]]:
    """The structured (JSON) log lines in a process's output, in order; other lines are skipped."""
    events = []
    for ln in text.splitlines():
        start = ln.find("{")
        if start >= 0 and '"event"' in ln:
            try:
                events.append(json.loads(ln[start:]))
            except ValueError:
                pass
    return events
