"""Cost-aware loading with real vLLM engines and real LMCache MP servers: a fast store is loaded from, a
deliberately slowed one is not (the prefix is recomputed), and every decision carries its prediction and the
observed time.

Replicas are fresh processes (prefixshare.bench._replica) sharing one run dir, where the estimates persist:
replica A computes the documents (calibrating the prefill rate) and loads one back (calibrating the store);
fresh replica B, through a second server on the same directory, is calibrated from its first request and
loads. The slow store is the same directory behind a server whose fs adapter sleeps per chunk read
(prefixshare.bench._throttle, LMCache's "plugin" L2 adapter type): replica C1 is forced to load from it
(mode always: what it observes calibrates the slow store), fresh replica C2 (mode auto) recomputes and
answers like a cold engine. No timing thresholds: only the decisions and the sanity of what was recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from e2e.common import CHUNK, document_ids, same_output
from prefixshare.bench._procs import run_replica, throttled_store_spec
from prefixshare.policies import Policy
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC_TOKENS = 1600
#: seconds the slow store sleeps per chunk it reads (25 chunks of 64 tokens: ~10 s against a ~0.3 s prefill)
CHUNK_DELAY_S = 0.4


def _policy(store: Path, mode: str, *, slow: bool = False) -> Policy:
    fields: dict[str, Any] = {
        "chunk_size": CHUNK,
        "l1": {"size_gb": 0.2},
        "server": {"port": free_port(), "http_port": free_port(), "start_timeout_s": 120},
        "load": {"timeout_s": 60.0, "mode": mode},
    }
    if slow:
        import json

        spec = throttled_store_spec(str(store), chunk_delay_s=CHUNK_DELAY_S)
        fields["server"]["extra_args"] = ["--l2-adapter", json.dumps(spec)]
    else:
        fields["l2"] = [{"type": "fs", "base_path": str(store), "create": True}]
    return Policy.build(**fields)


def _with_mode(policy: Policy, mode: str) -> Policy:
    data = policy.to_dict()
    data["load"]["mode"] = mode
    return Policy.build(**data)


def _gen(ids: list[int], tag: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "ids": ids, "max_tokens": 8, "tag": tag, **extra}


def _replica(work: Path, name: str, model: Path, policy: Policy | None, steps: list[dict[str, Any]]) -> dict[str, Any]:
    spec = {"model": str(model), "policy": policy.to_dict() if policy else None, "instance": f"{name}-cost",
            "steps": steps, "log_level": "INFO", "engine": {"max_model_len": 2048}}
    # one run dir for every replica of this module: the estimates persist there
    return run_replica(work, name, spec, timeout_s=600, env={"PREFIXSHARE_CACHE_DIR": str(work / "cache")})


def _decisions(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result["stats"]["cost"]["recent"]


def _step(result: dict[str, Any], tag: str) -> dict[str, Any]:
    return next(s for s in result["steps"] if s["tag"] == tag)


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    from prefixshare.model import create_model

    return create_model(work / "main", shape="demo", seed=0)


@pytest.fixture(scope="module")
def docs(model: Path) -> dict[str, list[int]]:
    return {f"d{i}": document_ids(model, 20 + i, DOC_TOKENS) for i in range(4)}


@pytest.fixture(scope="module")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="module")
def fast(store: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(_policy(store, "auto")) as server:
        yield server


@pytest.fixture(scope="module")
def replica_a(work: Path, model: Path, docs: dict[str, list[int]], fast: LMCacheServer) -> dict[str, Any]:
    steps = [_gen(ids, name) for name, ids in docs.items()]
    steps.append(_gen(docs["d0"], "reload", reset_local=True))  # from the server: calibrates the store
    return _replica(work, "a", model, fast.policy, steps)


def test_a_fast_store_is_loaded_by_a_fresh_calibrated_replica(
    work: Path, model: Path, docs: dict[str, list[int]], store: Path, replica_a: dict[str, Any]
) -> None:
    est = replica_a["stats"]["cost"]["estimates"]
    assert est["prefill_observations"] >= 3 and est["transfer_observations"] >= 1, est  # (not the first: one-off costs)
    with LMCacheServer(_policy(store, "auto")) as fast2:  # a second "node" on the same directory
        b = _replica(work, "b", model, fast2.policy, [_gen(docs["d1"], "d1")])
    step = _step(b, "d1")
    assert step["num_cached_tokens"] >= DOC_TOKENS - CHUNK
    assert same_output(step, _step(replica_a, "d1"))
    [before, after] = [d for d in b["events"] if d.get("event") == "load.decision"]
    assert before["phase"] == "before_lookup" and before["decision"] == "load"
    assert before["reason"] == "load predicted faster", before
    assert 0 < before["predicted_load_s"] < before["predicted_recompute_s"]
    assert after["phase"] == "after_lookup" and after["decision"] == "load"
    [outcome] = [d for d in b["events"] if d.get("event") == "load.outcome"]
    assert outcome["decision"] == "load" and outcome["observed_s"] > 0 and outcome["predicted_s"] > 0
    assert outcome["loaded_tokens"] >= DOC_TOKENS - CHUNK
    recorded = _decisions(b)[-1]
    assert recorded["observed_s"] == pytest.approx(outcome["observed_s"], abs=1e-4) and recorded["error"] is not None


@pytest.fixture(scope="module")
def slow(store: Path, replica_a: dict[str, Any]) -> Iterator[LMCacheServer]:
    """The same directory behind a server whose reads sleep CHUNK_DELAY_S per chunk (once A has filled it)."""
    with LMCacheServer(_policy(store, "always", slow=True)) as server:
        yield server


def test_a_slow_store_flips_the_decision_to_recompute(
    work: Path, model: Path, docs: dict[str, list[int]], slow: LMCacheServer, replica_a: dict[str, Any]
) -> None:
    # C1 is forced to load: the slow read it observes calibrates this store for the next replica
    c1 = _replica(work, "c1", model, slow.policy, [_gen(docs["d2"], "d2")])
    c2 = _replica(work, "c2", model, _with_mode(slow.policy, "auto"), [_gen(docs["d3"], "d3")])
    loaded = _step(c1, "d2")
    assert loaded["num_cached_tokens"] >= DOC_TOKENS - CHUNK and same_output(loaded, _step(replica_a, "d2"))
    est = c1["stats"]["cost"]["estimates"]
    assert est["lookup_observations"] >= 1 and est["lookup_gbps"] is not None

    step = _step(c2, "d3")
    assert step["num_cached_tokens"] == 0  # recomputed, not loaded
    assert same_output(step, _step(replica_a, "d3"))
    [decision] = [d for d in c2["events"] if d.get("event") == "load.decision"]
    assert decision["phase"] == "before_lookup" and decision["decision"] == "recompute", decision
    assert decision["predicted_load_s"] > decision["predicted_recompute_s"] > 0
    [outcome] = [d for d in c2["events"] if d.get("event") == "load.outcome"]
    assert outcome["decision"] == "recompute" and outcome["observed_s"] > 0 and outcome["loaded_tokens"] == 0
    stats = c2["stats"]
    assert stats["fallbacks"].get("cost") == 1 and stats["lookups"] == 0  # nothing was looked up or locked
    assert stats["cost"]["decisions"] == {"before_lookup:recompute": 1}


def _fresh(work: Path, name: str, model: Path, policy: Policy, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A replica with a run dir of its own: no estimates persisted by the others (a fresh host)."""
    spec = {"model": str(model), "policy": policy.to_dict(), "instance": f"{name}-cost", "steps": steps,
            "log_level": "INFO", "engine": {"max_model_len": 2048}}
    return run_replica(work, name, spec, timeout_s=600, env={"PREFIXSHARE_CACHE_DIR": str(work / f"cache-{name}")})


def _events(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in result["events"] if e.get("event") == name]


def test_a_first_load_on_an_unmeasured_slow_store_is_cut_at_the_plans_bound(
    work: Path, model: Path, docs: dict[str, list[int]], slow: LMCacheServer, replica_a: dict[str, Any]
) -> None:
    """No estimates at all (a fresh host) and a store ~10 s slow for this prompt, load.timeout_s 60 s: the first
    load is abandoned at the plan's bound (KV bytes at FIRST_LOAD_GBPS + the measured lookup latency, at least
    FIRST_LOAD_MIN_S), not after the timeout, and the answer is the cold one."""
    from prefixshare.runtime._cost import FIRST_LOAD_MIN_S

    policy = _with_mode(slow.policy, "auto")
    miss = document_ids(model, 90, 512)  # not in the store: a miss measures the lookup latency
    d = _fresh(work, "first", model, policy, [_gen(miss, "miss"), _gen(docs["d0"], "d0")])
    step = _step(d, "d0")
    assert step["num_cached_tokens"] == 0 and same_output(step, _step(replica_a, "d0"))
    [deadline] = [e for e in _events(d, "load.decision") if e["phase"] == "deadline"]
    assert deadline["decision"] == "recompute" and "first-load bound" in deadline["reason"], deadline
    [outcome] = [e for e in _events(d, "load.outcome") if e["phase"] == "deadline"]
    waited = outcome["observed_lookup_s"]
    # abandoned at the bound (the poll runs once per engine step), far before the throttled read would end
    assert FIRST_LOAD_MIN_S <= waited < 3.0, outcome
    assert step["seconds"] < 0.5 * CHUNK_DELAY_S * (DOC_TOKENS // CHUNK), step["seconds"]
    assert d["stats"]["fallbacks"] == {"cost": 1}  # a cost decision, not a timeout: the store is not marked down


def test_a_timed_out_lookup_is_learnt_and_not_waited_for_again(
    work: Path, model: Path, docs: dict[str, list[int]], slow: LMCacheServer, replica_a: dict[str, Any]
) -> None:
    """load.timeout_s (0.3 s) under every other bound: the lookup times out, the store is skipped for a
    moment, and once its health check passes the next long prompt is recomputed by decision, without a
    lookup (the timed-out lookup was learnt as at least DEADLINE_FACTOR x the recompute)."""
    data = slow.policy.to_dict()
    data["load"] = {"mode": "auto", "timeout_s": 0.3}
    policy = Policy.build(**data)
    steps = [_gen(document_ids(model, 91, 512), "miss1"), _gen(document_ids(model, 92, 1024), "miss2"),
             _gen(docs["d1"], "d1"), {"op": "sleep", "seconds": 1.5}, _gen(docs["d2"], "d2")]
    t = _fresh(work, "timeout", model, policy, steps)
    for tag in ("d1", "d2"):
        step = _step(t, tag)
        assert step["num_cached_tokens"] == 0 and same_output(step, _step(replica_a, tag)), tag
    assert _step(t, "d1")["stats"]["fallbacks"].get("lookup_timeout") == 1
    timeouts = _events(t, "cost.lookup_timeout_observed")
    decisions = [(e["phase"], e["decision"], e["prompt_tokens"], e["reason"]) for e in _events(t, "load.decision")]
    assert len(timeouts) == 1, (timeouts, decisions)  # the misses answered in time; d2 did not wait again
    [timeout] = timeouts
    assert timeout["lookup_tokens"] == len(docs["d1"]) // CHUNK * CHUNK, (timeout, decisions)
    assert timeout["waited_s"] >= 0.3 and timeout["learnt_s"] >= timeout["waited_s"], timeout
    last = [e for e in _events(t, "load.decision") if e["phase"] == "before_lookup"][-1]
    assert last["decision"] == "recompute" and last["predicted_load_s"] > last["predicted_recompute_s"], last
    assert "outlived load.timeout_s" in last["reason"], last
    stats = t["stats"]
    assert stats["fallbacks"] == {"lookup_timeout": 1, "cost": 1}, stats["fallbacks"]
    assert stats["cost"]["decisions"].get("timeout:recompute") == 1
