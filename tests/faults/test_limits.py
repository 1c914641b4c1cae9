"""Resource limits: the policy's byte budget runs out, the server's L1 is far smaller than the documents, and
the fs tier's filesystem fills up, while one vLLM engine keeps serving (tests/faults/_replica.py).

Phase A: a server whose L1 holds about three documents, with an fs L2; the policy's byte budget
(per tenant) admits three documents of tenant t1 and refuses the rest with a reason. Phase B: the server is
replaced (same port, same engine) by one whose L2 directory is a 4 MiB tmpfs mounted in its own mount
namespace (``unshare --mount``): writes hit ENOSPC. Every answer equals the cold engine's.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import policy_for
from faults._common import (SLACK_S, WARMUP, added_latency, counters, delta, gen, identical, log_since, pause,
                            row_counters, run_steps)
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC = 640
KV_PER_TOKEN = 4096  # the tiny model, float32 (checked against the engine's stats below)
DOC_BYTES = DOC * KV_PER_TOKEN
BUDGET_DOCS = 3
L1_GB = 0.008  # 32 chunk buffers: ~3 documents (LMCache evicts above 80 % use, once a second)
TMPFS = "4m"  # ~1.5 documents
T1 = {"prefixshare.tenant": "t1"}
T2 = {"prefixshare.tenant": "t2"}


def _l1_objects(status: dict[str, Any] | None) -> int | None:
    """Objects in the server's L1 (its /status: one entry per L1 tag under storage_manager.l1_managers)."""
    managers = ((status or {}).get("storage_manager") or {}).get("l1_managers")
    return sum(int(m.get("total_object_count", 0)) for m in managers.values()) if managers else None


def _tmpfs_launcher(directory: Path) -> list[str] | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    launcher = [unshare, "--mount", "--propagation", "private", "sh", "-c",
                f'mount -t tmpfs -o size={TMPFS},mode=0750 tmpfs "{directory}" && exec "$@"', "sh"]
    probe = subprocess.run([*launcher, "true"], capture_output=True)
    return launcher if probe.returncode == 0 else None


class Servers:
    def __init__(self, root: Path) -> None:
        self.dir = root / "store"
        self.policy = policy_for(self.dir, l1={"size_gb": L1_GB}, admission={"all": [
            {"min_tokens": 256}, {"byte_budget": {"max": BUDGET_DOCS * DOC_BYTES + DOC_BYTES // 2, "per": "tenant"}}]})
        self.server = LMCacheServer(self.policy)
        self.log_offset = self.server.log_path.stat().st_size if self.server.log_path.exists() else 0
        self.server.start()
        self.launcher = _tmpfs_launcher(self.dir)

    def status(self) -> dict[str, Any]:
        """What the current server logged since it started (counted), and its /status."""
        log = log_since(self.server.log_path, self.log_offset)
        out: dict[str, Any] = {"alloc_failures": log.count("Failed to batched allocate"),
                               "evictions": log.count("triggering eviction"), "tracebacks": log.count("Traceback"),
                               "enospc": sum(1 for ln in log.splitlines() if "No space left on device" in ln
                                             or "Errno 28" in ln or "ENOSPC" in ln),
                               "failed_stores": log.count("store.write_failed") + log.count("failed to store")}
        try:
            out.update(healthy=self.server.healthy(), status=self.server.status())
        except Exception as exc:  # noqa: BLE001
            out.update(healthy=False, error=str(exc))
        out["l1_objects"] = _l1_objects(out.get("status"))
        return out

    def to_tmpfs(self) -> dict[str, Any]:
        before = self.status()
        self.server.stop()
        if self.launcher is None:
            return {"skipped": True, "phase_a": before}
        self.log_offset = self.server.log_path.stat().st_size
        self.server = LMCacheServer(self.policy, launcher=self.launcher).start()
        import time

        time.sleep(3.0)  # LMCache's heartbeat and our probe notice the new server
        return {"skipped": False, "phase_a": before}

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def servers(work: Path) -> Iterator[Servers]:
    s = Servers(work)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def run(work: Path, model: Path, docs: dict[str, list[int]], servers: Servers, cold: dict[str, Any]) -> dict[str, Any]:
    a_docs, b_docs = ["a", "b", "c", "d", "e"], ["f", "g", "h", "i"]
    steps: list[dict[str, Any]] = [gen(WARMUP, docs[WARMUP], reset=False)]
    steps += [gen(f"a1-{d}", docs[d], params=T1) for d in a_docs]
    steps += [gen(f"a2-{d}", docs[d], params=T1) for d in a_docs]  # again: what was stored is loaded
    steps += [pause("status-a"), pause("tmpfs")]
    steps += [gen(f"b1-{d}", docs[d], params=T2) for d in b_docs]
    steps += [gen(f"b2-{d}", docs[d], params=T2) for d in b_docs]
    steps += [pause("status-b")]
    return run_steps(work, "limits", model, servers.policy, steps,
                     {"status-a": servers.status, "tmpfs": servers.to_tmpfs, "status-b": servers.status})


def _all_identical(run: dict[str, Any], cold: dict[str, Any], prefix: str) -> tuple[bool, float]:
    """Every request whose name starts with ``prefix`` compared with the cold answer; (all identical, worst
    added latency)."""
    names = [n for n in run["by_name"] if n.startswith(prefix) and run["by_name"][n]["op"] == "generate"]
    same = {n: identical(run["by_name"][n], cold[n.split("-")[-1]]) for n in names}
    assert all(same.values()), same
    worst = max(added_latency(run["by_name"][n], cold[n.split("-")[-1]], cold) for n in names)
    return all(same.values()), worst


def test_byte_budget_stops_admission_with_a_reason_and_serving_continues(
    run: dict[str, Any], cold: dict[str, Any], servers: Servers
) -> None:
    by = run["by_name"]
    assert by["a1-e"]["stats"]["kv_bytes_per_token"] == KV_PER_TOKEN
    refused = delta(by[WARMUP]["stats"], by["a1-e"]["stats"], "refused", "byte_budget")
    assert refused == 2, by["a1-e"]["stats"]["refused"]  # d and e: over t1's budget of three documents
    reasons = [e.get("reason", "") for e in run["events"] if e.get("event") == "request.finished"
               and not e.get("admitted")]
    assert any(r.startswith("byte_budget: tenant 't1'") for r in reasons), reasons
    same, worst = _all_identical(run, cold, "a")
    assert [by[f"a2-{d}"]["num_cached_tokens"] > 0 for d in "de"] == [False, False]  # refused: never stored
    c = counters(run, "a1-a", "a2-e")
    assert c["requests"] == 10, c
    record(Row("resource limits", "the policy's byte budget runs out (per tenant: 3 documents of 5)",
               "documents past the budget are refused with the reason (byte_budget: tenant 't1' used+need > max) "
               "and recomputed on every request; admitted ones keep loading; outputs identical to cold",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst,
               budget_s=servers.policy.load.timeout_s,
               extra={"refused": refused, "admitted": c["admitted"],
                      "reason_example": next(r for r in reasons if r.startswith("byte_budget"))}))


def test_l1_pressure_evicts_without_errors(run: dict[str, Any], cold: dict[str, Any], servers: Servers) -> None:
    by = run["by_name"]
    status = run["actions"]["status-a"]
    assert status["healthy"], status
    # every request completes with the cold answer; the server stays up; what reached L2 loads again
    same, worst = _all_identical(run, cold, "a")
    assert by["a2-a"]["num_cached_tokens"] >= 0.9 * DOC  # the first document always fits
    l2_chunks = len(list(servers.dir.glob("*@t-t1.data")))
    stored = l2_chunks // (DOC // 64)
    # the fault happened: L1 ran over LMCache's watermark and its eviction loop evicted (it logs each round)
    assert status["evictions"] > 0, {k: v for k, v in status.items() if k != "status"}
    c = counters(run, "a1-a", "a2-e")
    record(Row("resource limits", f"L1 smaller than the working set (l1.size_gb {L1_GB}: ~3 of the 5 documents, "
               "stored and loaded back to back)",
               ("the server evicts (LRU, above 80 % use) and serves evicted documents from L2; no errors; "
                "outputs identical" if not status["alloc_failures"] else
                "no request fails and every answer is identical; but the server evicts only above 80 % use and only "
                "chunks its L2 tier has written, so a store that did not fit in the free L1 at that moment was dropped "
                "(\"Failed to batched allocate\" in the server log) and that document is recomputed next time"),
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst,
               budget_s=servers.policy.load.timeout_s,
               extra={"requests_admitted": c["admitted"], "documents_in_l2": stored, "l2_chunks": l2_chunks,
                      "l1_objects": status["l1_objects"], "evictions_logged": status["evictions"],
                      "l1_alloc_failures": status["alloc_failures"], "server_tracebacks": status["tracebacks"]}))


def test_full_filesystem_stops_writes_and_serving_continues(
    run: dict[str, Any], cold: dict[str, Any], servers: Servers
) -> None:
    if run["actions"]["tmpfs"].get("skipped"):
        pytest.skip("unshare --mount is not permitted here: no private tmpfs for the server")
    status = run["actions"]["status-b"]
    assert status["healthy"], status
    # the fault happened: the server's L2 writes failed with ENOSPC (its log since the tmpfs server started)
    assert status["enospc"] > 0, {k: v for k, v in status.items() if k != "status"}
    same, worst = _all_identical(run, cold, "b")
    by = run["by_name"]
    stored_back = [by[f"b2-{d}"]["num_cached_tokens"] > 0 for d in "fghi"]
    assert not all(stored_back), stored_back  # 4 documents (10 MiB) cannot fit in 4 MiB
    budget = servers.policy.load.timeout_s
    assert worst <= budget + SLACK_S
    c = counters(run, "b1-f", "b2-i")
    record(Row("resource limits", f"fs tier's filesystem full (a {TMPFS} tmpfs under the L2 directory)",
               "L2 writes fail with ENOSPC inside the server, which keeps serving; what is still in its L1 (or did "
               "fit in L2) keeps loading; everything else recomputes; outputs identical to cold",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst,
               budget_s=budget, extra={"enospc_logged": status["enospc"], "loaded_on_second_ask": stored_back,
                                       "server": {k: v for k, v in status.items() if k != "status"}}))
