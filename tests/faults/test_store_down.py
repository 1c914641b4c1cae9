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
from faults._common import SLACK_S, WARMUP, added_latency, delta, gen, identical, pause, run_steps
from faults._matrix import Row, record
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC = 640
RECOVERY_WAIT_S = 3.0  # LMCache's heartbeat (1 s) and our probe (1 s) both notice a returned server within this


class Store:
    """The current server over one directory; actions replace it, kill it, move the directory."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "store"
        self.policy = policy_for(self.dir)
        self.server = LMCacheServer(self.policy).start()
        self.notes: dict[str, Any] = {}

    def kill(self) -> dict[str, Any]:
        self.server.kill()
        return {"alive": self.server.healthy(timeout=0.5)}

    def restart(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.server = LMCacheServer(self.policy).start()
        started = time.monotonic() - t0
        time.sleep(RECOVERY_WAIT_S)
        return {"server_start_s": round(started, 2)}

    def hang(self) -> dict[str, Any]:
        assert self.server.process is not None
        os.killpg(self.server.process.pid, signal.SIGSTOP)
        return {}

    def unhang(self) -> dict[str, Any]:
        assert self.server.process is not None
        os.killpg(self.server.process.pid, signal.SIGCONT)
        time.sleep(RECOVERY_WAIT_S)
        return {"healthy": self.server.healthy()}

    def move_away(self) -> dict[str, Any]:
        self.dir.rename(self.dir.with_name("store.away"))
        return {}

    def replace_with_file(self) -> dict[str, Any]:
        self.dir.rename(self.dir.with_name("store.away"))
        self.dir.write_text("not a directory\n")
        return {}

    def restore(self) -> dict[str, Any]:
        recreated = self.dir.exists()
        if self.dir.is_dir():
            shutil.rmtree(self.dir)
        elif self.dir.exists():
            self.dir.unlink()
        self.dir.with_name("store.away").rename(self.dir)
        return {"server_alive_during_fault": self.server.healthy(), "recreated_by_server": recreated}

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
               "move-away": store.move_away, "restore-1": store.restore, "file": store.replace_with_file,
               "restore-2": store.restore}
    return run_steps(work, "store-down", model, store.policy, steps, actions)


def _check(run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], names: list[str],
           budget: float) -> tuple[int, int, float]:
    """Every named request: the cold answer, within budget. Returns (requests, hits, max added latency)."""
    by = run["by_name"]
    worst = 0.0
    hits = 0
    for name in names:
        got = by[name]
        doc = name.split("-")[-1]
        assert identical(got, cold[doc]), (name, got["token_ids"], cold[doc]["token_ids"])
        worst = max(worst, added_latency(got, cold[doc], cold))
        hits += got["num_cached_tokens"] >= 0.9 * DOC
    assert worst <= budget + SLACK_S, (names, [(n, by[n]["seconds"], cold[n.split('-')[-1]]["seconds"]) for n in names])
    return len(names), hits, worst


def _stats_between(run: dict[str, Any], first: str, last: str, key: str, sub: str | None = None) -> int:
    names = [r["name"] for r in run["results"]]
    before = run["results"][names.index(first) - 1]
    while before.get("stats") is None:
        before = run["results"][run["results"].index(before) - 1]
    return delta(before["stats"], run["by_name"][last]["stats"], key, sub)


def test_the_store_serves_before_any_fault(run: dict[str, Any], cold: dict[str, Any]) -> None:
    by = run["by_name"]
    assert by["store-a"]["num_cached_tokens"] == 0
    assert by["hit-a"]["num_cached_tokens"] >= 0.9 * DOC and identical(by["hit-a"], cold["a"])


def test_server_killed_every_request_recomputes_within_the_timeout(
    run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], store: Store
) -> None:
    budget = store.policy.load.timeout_s
    names = ["down-b", "down-a", "down-g"]
    n, hits, worst = _check(run, cold, docs, names, budget)
    assert hits == 0 and all(run["by_name"][x]["num_cached_tokens"] == 0 for x in names)
    fallbacks = _stats_between(run, "down-b", "down-g", "fallbacks", "store_down")
    assert fallbacks == n  # each one skipped the dead store at once (no lookup, no store RPC)
    assert run["actions"]["kill"]["alive"] is False
    record(Row("store down", "LMCache MP server killed (SIGKILL) between requests",
               "each request skips the store at once (port refuses) and recomputes; output identical to cold",
               requests=n, hits=hits, fallbacks=fallbacks, identical_to_cold=True, max_added_latency_s=worst,
               budget_s=budget))


def test_server_restarted_hits_resume_without_restarting_the_engine(
    run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], store: Store
) -> None:
    back = run["by_name"]["back-a"]
    assert back["num_cached_tokens"] >= 0.9 * DOC, back["num_cached_tokens"]  # from L2: the new server's L1 is empty
    assert identical(back, cold["a"])
    assert _stats_between(run, "back-a", "back-a", "hits") == 1
    record(Row("store down", "MP server restarted on the same port and directory (engine kept running)",
               f"the same engine loads from the store again within {RECOVERY_WAIT_S:g} s (LMCache's heartbeat "
               "re-registers the KV caches; our probe lifts the skip); output identical to cold",
               requests=1, hits=1, fallbacks=0, identical_to_cold=True,
               max_added_latency_s=added_latency(back, cold["a"], cold), budget_s=store.policy.load.timeout_s,
               extra={"server_start_s": run["actions"]["restart"]["server_start_s"]}))


def test_server_hung_costs_at_most_one_timeout_then_resumes(
    run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], store: Store
) -> None:
    budget = store.policy.load.timeout_s
    n, hits, worst = _check(run, cold, docs, ["hung-h", "hung-i"], budget)
    assert hits == 0
    timeouts = _stats_between(run, "hung-h", "hung-i", "fallbacks", "lookup_timeout")
    skipped = _stats_between(run, "hung-h", "hung-i", "fallbacks", "store_down")
    # the first waits for the lookup (our timeout, or LMCache's heartbeat losing the server, whichever first);
    # the second skips the store at once
    assert timeouts + skipped == 2, run["by_name"]["hung-i"]["stats"]["fallbacks"]
    after = run["by_name"]["unhung-a"]
    assert after["num_cached_tokens"] >= 0.9 * DOC and identical(after, cold["a"])
    record(Row("store down", "MP server hung (SIGSTOP: port open, no answers), then continued (SIGCONT)",
               "the first request waits for its lookup (at most the load timeout; LMCache's 1 s heartbeat often "
               "gives up first) and recomputes without storing; later ones skip the store until its health "
               "check answers; hits resume after SIGCONT",
               requests=n + 1, hits=1, fallbacks=timeouts + skipped, identical_to_cold=True,
               max_added_latency_s=worst, budget_s=budget,
               extra={"lookup_timeout": timeouts, "store_down": skipped}))


def test_l2_directory_moved_away_then_restored(
    run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], store: Store
) -> None:
    budget = store.policy.load.timeout_s
    n, hits, worst = _check(run, cold, docs, ["away-c", "away-d"], budget)
    assert hits == 0
    assert run["actions"]["restore-1"]["server_alive_during_fault"] is True
    back = run["by_name"]["restored-c"]
    assert back["num_cached_tokens"] >= 0.9 * DOC and identical(back, cold["c"])
    record(Row("store down", "fs L2 directory gone (moved away, as an unmounted share) while the server runs",
               "lookups miss and the engine recomputes; writes fail inside the server, which keeps serving; "
               "hits resume when the directory is back",
               requests=n + 1, hits=1, fallbacks=0, identical_to_cold=True, max_added_latency_s=worst, budget_s=budget,
               extra={"recreated_by_server": run["actions"]["restore-1"]["recreated_by_server"]}))


def test_l2_path_replaced_by_a_file_then_restored(
    run: dict[str, Any], cold: dict[str, Any], docs: dict[str, list[int]], store: Store
) -> None:
    budget = store.policy.load.timeout_s
    n, hits, worst = _check(run, cold, docs, ["file-f", "file-e"], budget)
    assert hits == 0
    assert run["actions"]["restore-2"]["server_alive_during_fault"] is True
    back = run["by_name"]["restored-f"]
    assert back["num_cached_tokens"] >= 0.9 * DOC and identical(back, cold["f"])
    record(Row("store down", "fs L2 path unreadable (the directory replaced by a file; root ignores chmod 000)",
               "lookups miss and the engine recomputes; the server keeps serving; hits resume when restored",
               requests=n + 1, hits=1, fallbacks=0, identical_to_cold=True, max_added_latency_s=worst,
               budget_s=budget))
