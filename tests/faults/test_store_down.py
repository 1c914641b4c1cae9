"""Store down: the LMCache MP server killed, hung and restarted, and its fs L2 directory taken away and given
back, while ONE vLLM engine keeps serving (tests/faults/_replica.py, one process for every step).

Every request completes with the cold engine's answer (greedy ids, logprobs within 1e-4); a request served
while the store is broken takes at most the policy's load timeout longer than the cold engine (plus
``SLACK_S`` of machine noise); when the store comes back, the same engine loads from it again. Before each
timed request the engine's own prefix cache is cleared, so a hit can only come from the store.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.common import policy_for
from faults._common import (SLACK_S, WARMUP, added_latency, counters, gen, identical, log_since, pause, process_state,
                            row_counters, run_steps, wait_state)
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC = 640
RECOVERY_WAIT_S = 3.0  # the heartbeat (every 1 s: a refused port degrades at once) and our probe (1 s) notice a
# returned server within this


class Store:
    """The current server over one directory; actions replace it, kill it, move the directory."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "store"
        self.policy = policy_for(self.dir)
        self.server = LMCacheServer(self.policy).start()
        self.notes: dict[str, Any] = {}

    def _log_size(self) -> int:
        return self.server.log_path.stat().st_size if self.server.log_path.exists() else 0

    def kill(self) -> dict[str, Any]:
        """SIGKILL; what shows the server is really dead: its exit status, no /proc entry, no health answer."""
        assert self.server.process is not None
        pid = self.server.process.pid
        self.server.kill()
        return {"pid": pid, "returncode": self.server.process.returncode, "proc_state": process_state(pid),
                "alive": self.server.healthy(timeout=0.5)}

    def restart(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.server = LMCacheServer(self.policy).start()
        started = time.monotonic() - t0
        time.sleep(RECOVERY_WAIT_S)
        assert self.server.process is not None
        return {"server_start_s": round(started, 2), "pid": self.server.process.pid, "healthy": self.server.healthy()}

    def hang(self) -> dict[str, Any]:
        """SIGSTOP; what shows the server is really stopped: its kernel state 'T', and its port still open."""
        assert self.server.process is not None
        pid = self.server.process.pid
        os.killpg(pid, signal.SIGSTOP)
        return {"pid": pid, "proc_state": wait_state(pid, "T", 2.0), "healthy": self.server.healthy(timeout=0.3)}

    def unhang(self) -> dict[str, Any]:
        assert self.server.process is not None
        pid = self.server.process.pid
        state_during = process_state(pid)  # still stopped when the hung requests have been served
        os.killpg(pid, signal.SIGCONT)
        time.sleep(RECOVERY_WAIT_S)
        return {"proc_state_before_sigcont": state_during, "proc_state": process_state(pid),
                "healthy": self.server.healthy()}

    def move_away(self) -> dict[str, Any]:
        self.dir.rename(self.dir.with_name("store.away"))
        return {"dir_exists": self.dir.exists(), "log_offset": self._log_size()}

    def replace_with_file(self) -> dict[str, Any]:
        self.dir.rename(self.dir.with_name("store.away"))
        self.dir.write_text("not a directory\n")
        return {"is_file": self.dir.is_file(), "log_offset": self._log_size()}

    def restore(self, fault: str) -> dict[str, Any]:
        """Put the directory back; what the server logged while it was gone (its failed L2 writes) comes back."""
        log = log_since(self.server.log_path, self.notes.pop(fault)["log_offset"])
        recreated = self.dir.is_dir()
        if self.dir.is_dir():
            shutil.rmtree(self.dir)
        elif self.dir.exists():
            self.dir.unlink()
        self.dir.with_name("store.away").rename(self.dir)
        return {"server_alive_during_fault": self.server.healthy(), "recreated_by_server": recreated,
                "failed_stores_logged": log.count("store.write_failed") + log.count("failed to store"), "server_tracebacks": log.count("Traceback")}

    def noting(self, fault: str, action: Any) -> Any:
        def run() -> dict[str, Any]:
            self.notes[fault] = out = action()
            return out
        return run

    def stop(self) -> None:
        if self.server.process is not None and self.server.process.poll() is None:
            try:
                os.killpg(self.server.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.server.stop()


@pytest.fixture(scope="module")
def store(work: Path) -> Iterator[Store]:
    s = Store(work)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def run(work: Path, model: Path, docs: dict[str, list[int]], store: Store, cold: dict[str, Any]) -> dict[str, Any]:
    steps = [
        gen(WARMUP, docs[WARMUP], reset=False),
        gen("store-a", docs["a"]), gen("store-c", docs["c"]), gen("store-f", docs["f"]),
        gen("hit-a", docs["a"]),  # sanity: the store serves
        pause("kill"),
        gen("down-b", docs["b"]), gen("down-a", docs["a"]), gen("down-g", docs["g"]),
        pause("restart"),
        gen("back-a", docs["a"]),  # a new server (empty L1) over the same directory: from L2
        pause("hang"),
        gen("hung-h", docs["h"]), gen("hung-i", docs["i"]),
        pause("unhang"),
        gen("unhung-a", docs["a"], reset=True),
        pause("move-away"),
        gen("away-c", docs["c"]), gen("away-d", docs["d"]),
        pause("restore-1"),
        gen("restored-c", docs["c"]),
        pause("file"),
        gen("file-f", docs["f"]), gen("file-e", docs["e"]),
        pause("restore-2"),
        gen("restored-f", docs["f"]),
    ]
    actions = {"kill": store.kill, "restart": store.restart, "hang": store.hang, "unhang": store.unhang,
               "move-away": store.noting("away", store.move_away), "restore-1": lambda: store.restore("away"),
               "file": store.noting("file", store.replace_with_file), "restore-2": lambda: store.restore("file")}
    return run_steps(work, "store-down", model, store.policy, steps, actions)


def _check(run: dict[str, Any], cold: dict[str, Any], names: list[str], budget: float) -> tuple[bool, float]:
    """Every named request: compared with the cold answer, its added latency within budget (+ machine noise).
    Returns (all identical, max added latency)."""
    by = run["by_name"]
    same = [identical(by[name], cold[name.split("-")[-1]]) for name in names]
    assert all(same), [(n, by[n]["token_ids"], cold[n.split("-")[-1]]["token_ids"]) for n, ok in zip(names, same) if not ok]
    worst = max(added_latency(by[name], cold[name.split("-")[-1]], cold) for name in names)
    assert worst <= budget + SLACK_S, (names, [(n, by[n]["seconds"], cold[n.split('-')[-1]]["seconds"]) for n in names])
    return all(same), worst


def test_the_store_serves_before_any_fault(run: dict[str, Any], cold: dict[str, Any]) -> None:
    by = run["by_name"]
    assert by["store-a"]["num_cached_tokens"] == 0
    assert by["hit-a"]["num_cached_tokens"] >= 0.9 * DOC and identical(by["hit-a"], cold["a"])


def test_server_killed_every_request_recomputes_within_the_timeout(
    run: dict[str, Any], cold: dict[str, Any], store: Store
) -> None:
    killed = run["actions"]["kill"]
    # the fault happened: the process is gone (SIGKILL exit status, no /proc entry) and nothing answers
    assert killed["returncode"] == -signal.SIGKILL and killed["proc_state"] is None and killed["alive"] is False, killed
    budget = store.policy.load.timeout_s
    names = ["down-b", "down-a", "down-g"]
    same, worst = _check(run, cold, names, budget)
    c = counters(run, "down-b", "down-g")
    assert all(run["by_name"][x]["num_cached_tokens"] == 0 for x in names)
    assert c["requests"] == len(names) and c["hits"] == 0, c
    # each one skipped the dead store at once (no lookup, no store RPC)
    assert c["fallback_reasons"].get("store_down") == c["fallbacks"] == len(names), c
    record(Row("store down", "LMCache MP server killed (SIGKILL) between requests",
               "each request skips the store at once (port refuses) and recomputes; output identical to cold",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst, budget_s=budget,
               extra={"fallback_reasons": c["fallback_reasons"], "server_returncode": killed["returncode"],
                      "server_in_proc": killed["proc_state"] is not None}))


def test_server_restarted_hits_resume_without_restarting_the_engine(
    run: dict[str, Any], cold: dict[str, Any], store: Store
) -> None:
    restarted, killed = run["actions"]["restart"], run["actions"]["kill"]
    assert restarted["healthy"] and restarted["pid"] != killed["pid"], (restarted, killed)  # a new server process
    back = run["by_name"]["back-a"]
    assert back["num_cached_tokens"] >= 0.9 * DOC, back["num_cached_tokens"]  # from L2: the new server's L1 is empty
    c = counters(run, "back-a")
    assert c["requests"] == 1 and c["hits"] == 1, c
    same = identical(back, cold["a"])
    assert same
    record(Row("store down", "MP server restarted on the same port and directory (engine kept running)",
               f"the same engine loads from the store again within {RECOVERY_WAIT_S:g} s (LMCache's heartbeat "
               "re-registers the KV caches; our probe lifts the skip); output identical to cold",
               **row_counters(c), identical_to_cold=same,
               max_added_latency_s=added_latency(back, cold["a"], cold), budget_s=store.policy.load.timeout_s,
               extra={"server_start_s": restarted["server_start_s"], "new_pid": restarted["pid"] != killed["pid"]}))


def test_server_hung_costs_at_most_one_timeout_then_resumes(
    run: dict[str, Any], cold: dict[str, Any], store: Store
) -> None:
    hung, unhung = run["actions"]["hang"], run["actions"]["unhang"]
    # the fault happened: the server was stopped (kernel state T) through the hung requests, then ran again
    assert hung["proc_state"] == "T" and unhung["proc_state_before_sigcont"] == "T", (hung, unhung)
    assert unhung["proc_state"] not in ("T", None) and unhung["healthy"], unhung
    budget = store.policy.load.timeout_s
    names = ["hung-h", "hung-i"]
    same, worst = _check(run, cold, names, budget)
    during = counters(run, "hung-h", "hung-i")
    assert during["requests"] == len(names) and during["hits"] == 0, during
    timeouts = during["fallback_reasons"].get("lookup_timeout", 0)
    skipped = during["fallback_reasons"].get("store_down", 0)
    # the first waits for the lookup (our timeout, or LMCache's lookup RPC timing out, whichever first); the second
    # skips the store at once, or, before the server's health flag is cleared, waits out its own lookup
    assert timeouts + skipped == during["fallbacks"] == 2, during
    after = run["by_name"]["unhung-a"]
    assert after["num_cached_tokens"] >= 0.9 * DOC
    same = same and identical(after, cold["a"])
    assert same
    c = counters(run, "hung-h", "unhung-a")
    assert c["hits"] == 1, c
    record(Row("store down", "MP server hung (SIGSTOP: port open, no answers), then continued (SIGCONT)",
               "the first request waits for its lookup (at most the load timeout) and recomputes without "
               "storing; later ones skip the store once a timed-out RPC has marked it down, until its health "
               "check answers; hits resume after SIGCONT",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst, budget_s=budget,
               extra={"fallback_reasons": c["fallback_reasons"], "server_state_during": hung["proc_state"],
                      "server_state_after_sigcont": unhung["proc_state"]}))


def _dir_fault(run: dict[str, Any], cold: dict[str, Any], store: Store, names: list[str], back: str,
               restore: str) -> tuple[dict[str, Any], bool, float, dict[str, Any]]:
    budget = store.policy.load.timeout_s
    same, worst = _check(run, cold, names, budget)
    during = counters(run, names[0], names[-1])
    assert during["requests"] == len(names) and during["hits"] == 0, during
    restored = run["actions"][restore]
    assert restored["server_alive_during_fault"] is True
    got = run["by_name"][back]
    assert got["num_cached_tokens"] >= 0.9 * DOC
    same = same and identical(got, cold[back.split("-")[-1]])
    assert same
    c = counters(run, names[0], back)
    assert c["requests"] == len(names) + 1 and c["hits"] == 1, c
    return c, same, worst, restored


def test_l2_directory_moved_away_then_restored(run: dict[str, Any], cold: dict[str, Any], store: Store) -> None:
    moved = run["actions"]["move-away"]
    assert moved["dir_exists"] is False, moved  # the fault happened: nothing at the tier's path
    c, same, worst, restored = _dir_fault(run, cold, store, ["away-c", "away-d"], "restored-c", "restore-1")
    assert restored["failed_stores_logged"] > 0, restored  # ...and the server's L2 writes failed meanwhile
    record(Row("store down", "fs L2 directory gone (moved away, as an unmounted share) while the server runs",
               "lookups miss and the engine recomputes; writes fail inside the server, which keeps serving; "
               "hits resume when the directory is back",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst, budget_s=store.policy.load.timeout_s,
               extra={"dir_exists_during_fault": moved["dir_exists"], "recreated_by_server": restored["recreated_by_server"],
                      "failed_stores_logged": restored["failed_stores_logged"],
                      "fallback_reasons": c["fallback_reasons"]}))


def test_l2_path_replaced_by_a_file_then_restored(run: dict[str, Any], cold: dict[str, Any], store: Store) -> None:
    replaced = run["actions"]["file"]
    assert replaced["is_file"] is True, replaced  # the fault happened: a plain file at the tier's path
    c, same, worst, restored = _dir_fault(run, cold, store, ["file-f", "file-e"], "restored-f", "restore-2")
    assert restored["failed_stores_logged"] > 0, restored  # ...and the server's L2 writes failed meanwhile
    record(Row("store down", "fs L2 path unreadable (the directory replaced by a file; root ignores chmod 000)",
               "lookups miss and the engine recomputes; the server keeps serving; hits resume when restored",
               **row_counters(c), identical_to_cold=same, max_added_latency_s=worst, budget_s=store.policy.load.timeout_s,
               extra={"path_is_file_during_fault": replaced["is_file"],
                      "failed_stores_logged": restored["failed_stores_logged"],
                      "fallback_reasons": c["fallback_reasons"]}))
