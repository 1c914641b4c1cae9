"""The network lab's partition between node B and an sshfs-mounted store (``python tests/lab/sshfs_faults.py``;
root, about 4 minutes; writes docs/benchmarks/lab-sshfs-faults.json).

A cut under FUSE is unlike a cut in front of Redis: no health probe sees it (the ``fs`` tier's probe is a local
directory check, answered from the mount's attribute cache), so the replica learns it only as a lookup abandoned
at the cost model's deadline. Node A computes four documents into the store node's directory (mounted over
sshfs on both nodes, the ``fs`` tier on it); node B loads two of them over the healthy link, then B's link is cut
for ``CUT_S`` seconds while B asks (mode auto), then healed while B keeps asking until a request loads again.

Reported, every answer compared with A's cold one: each request's time against a recompute and
``load.timeout_s``, and how long after the heal (and after how many requests) the loads resumed.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lab.engines import EngineLab  # noqa: E402
from lab.lab import commit  # noqa: E402

TOKENS = 1024
TIMEOUT_S = 5.0
CUT_S = 20.0  # longer than the SSH keepalive's 15 s: the connection dies, and sshfs must reconnect
HEAL_BOUND_S = 90.0


def _row(phase: str, out: dict[str, Any], at: float) -> dict[str, Any]:
    return {"phase": phase, "at_s": round(at, 2), "seconds": round(out["seconds"], 3),
            "loaded_tokens": out["num_cached_tokens"], "same_as_cold": out["same_as_cold"],
            "fallbacks": out["fallbacks_added"], "decisions": out["decisions_added"]}


def run(work: Path) -> dict[str, Any]:
    from prefixshare.model import create_model

    model = create_model(work / "model", shape="bench", seed=0)
    rows: list[dict[str, Any]] = []
    with EngineLab(work, model, max_tokens=TOKENS + 1, timeout_s=TIMEOUT_S, log=print) as el:
        export = el.start_sshfs()
        seeds = [9901, 9902, 9903, 9904]
        el.seed(seeds, TOKENS, session="a-sshfs",
                stored=lambda: sum(1 for p in export.path.rglob("*") if p.is_file()))
        t0 = time.monotonic()
        for s in seeds[:2]:
            rows.append(_row("healthy", el.b(s, f"healthy:{s}", session="b-sshfs"), time.monotonic() - t0))
        recomputes = [el.b(s, f"recompute:{s}", load="never", session="b-sshfs")["seconds"] for s in seeds[2:]]
        recompute_s = statistics.median(recomputes)
        el.lab.cut("b")
        cut_at = time.monotonic()
        i = 0
        while time.monotonic() - cut_at < CUT_S:
            out = el.b(seeds[i % 4], f"cut:{i}", session="b-sshfs")
            rows.append(_row("cut", out, time.monotonic() - t0))
            i += 1
        el.lab.cut("b", False)
        healed = time.monotonic()
        resumed = None
        while time.monotonic() - healed < HEAL_BOUND_S:
            out = el.b(seeds[i % 4], f"heal:{i}", session="b-sshfs")
            rows.append(_row("healed", out, time.monotonic() - t0))
            i += 1
            if out["num_cached_tokens"] > 0:
                resumed = {"after_s": round(time.monotonic() - healed, 2),
                           "requests": sum(1 for r in rows if r["phase"] == "healed")}
                break
    during = [r for r in rows if r["phase"] == "cut"]
    return {"recompute_s": recompute_s, "timeout_s": TIMEOUT_S, "cut_s": CUT_S, "rows": rows, "resumed": resumed,
            "all_same_as_cold": all(r["same_as_cold"] for r in rows),
            "worst_added_during_cut_s": round(max(r["seconds"] for r in during) - recompute_s, 3) if during else None}


def main() -> None:
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    work = Path("/var/tmp") / f"prefixshare-lab-sshfs-{run_id}"
    out = HERE.parents[1] / "docs" / "benchmarks" / "lab-sshfs-faults.json"
    started = time.monotonic()
    try:
        result = run(work)
    finally:
        shutil.rmtree(work / "model", ignore_errors=True)
    result.update(run_id=run_id, commit=commit(), seconds=round(time.monotonic() - started, 1))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    for r in result["rows"]:
        print(r)


if __name__ == "__main__":
    main()
