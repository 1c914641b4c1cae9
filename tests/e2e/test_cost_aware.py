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


def test_a_slow_store_flips_the_decision_to_recompute(
    work: Path, model: Path, docs: dict[str, list[int]], store: Path, replica_a: dict[str, Any]
) -> None:
    slow_policy = _policy(store, "always", slow=True)
    with LMCacheServer(slow_policy) as slow:
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
