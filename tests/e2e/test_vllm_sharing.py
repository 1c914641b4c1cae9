"""Cross-replica prefix sharing with real vLLM engines and real LMCache MP servers (CPU).

Every replica is a fresh process (tests/helpers/vllm_replica.py); replicas share nothing but the store.
Outputs are compared with a cold engine without prefixshare: greedy token ids exactly, logprobs within
1e-4 (a load changes the order of a few float reductions, nothing else). Negative controls: corrupted
chunk bytes change the output; incompatible replicas (tokenizer, weights, KV dtype) load nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from e2e.common import (
    CHUNK,
    LOGPROB_TOL,
    corrupt_copy,
    document_ids,
    hf_greedy,
    http_server,
    policy_for,
    post_json,
    run_replica,
    same_output,
    write_policy_file,
)
from prefixshare.server import LMCacheServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

DOC_TOKENS = 1100


# --- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> dict[str, list[int]]:
    sizes = {"doc": (3, DOC_TOKENS), "short": (4, 200), "pinned": (5, 200), "tenant": (6, 600), "doc2": (7, 700),
             "doc3": (8, 700)}
    return {name: document_ids(models["main"], seed, n) for name, (seed, n) in sizes.items()}


@pytest.fixture(scope="module")
def store(work: Path) -> Path:
    return work / "store"


@pytest.fixture(scope="module")
def server1(store: Path) -> Iterator[LMCacheServer]:
    with LMCacheServer(policy_for(store)) as server:
        yield server


def req(ids: list[int], **params: Any) -> dict[str, Any]:
    return {"prompt_token_ids": ids, "max_tokens": 12, "params": params or None}


@pytest.fixture(scope="module")
def cold(work: Path, models: dict[str, Path], prompts: dict[str, list[int]]) -> dict[str, Any]:
    names = ["doc", "short", "pinned", "tenant", "doc3"]
    result = run_replica(work, "cold", models["main"], None, [req(prompts[n]) for n in names])
    return dict(zip(names, result["results"], strict=True))


@pytest.fixture(scope="module")
def replica_a(work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server1: LMCacheServer) -> dict[str, Any]:
    requests = [
        req(prompts["doc"]),
        req(prompts["short"]),  # 200 tokens < min_tokens 256, not pinned: not stored
        req(prompts["pinned"], **{"prefixshare.document_id": "manual-7"}),  # short but pinned: stored
        req(prompts["tenant"], **{"prefixshare.tenant": "acme"}),
    ]
    return run_replica(work, "replica-a", models["main"], server1.policy, requests)


@pytest.fixture(scope="module")
def replica_b(work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server1: LMCacheServer,
              replica_a: dict[str, Any]) -> dict[str, Any]:
    requests = [
        req(prompts["doc"]),
        req(prompts["short"]),
        req(prompts["pinned"], **{"prefixshare.document_id": "manual-7"}),
        req(prompts["tenant"], **{"prefixshare.tenant": "globex"}),  # another tenant: must not hit acme's KV
        req(prompts["tenant"], **{"prefixshare.tenant": "acme"}),
    ]
    return run_replica(work, "replica-b", models["main"], server1.policy, requests, engine_args=True)  # EngineArgs form


# --- tests ------------------------------------------------------------------------------------------------


def test_fresh_replica_loads_the_document_and_answers_like_a_cold_engine(
    replica_a: dict[str, Any], replica_b: dict[str, Any], cold: dict[str, Any]
) -> None:
    a, b = replica_a["results"][0], replica_b["results"][0]
    assert a["num_cached_tokens"] == 0  # the first replica prefills
    assert b["num_cached_tokens"] >= 0.9 * DOC_TOKENS, b["num_cached_tokens"]  # on its FIRST request
    assert same_output(a, cold["doc"]) and same_output(b, cold["doc"])
    stats = replica_b["stats"]
    assert stats["tokens_loaded"] >= b["num_cached_tokens"] and stats["hits"] >= 1
    assert stats["bytes_loaded"] == stats["tokens_loaded"] * stats["kv_bytes_per_token"]
    assert stats["lookup_ms"]["count"] >= 1 and stats["load_ms"]["count"] >= 1
    # A's stores were copied into the server after its steps (policy store.defer, the default), yet B loaded
    # exactly what a cold engine computes
    deferring = [e for e in replica_a["events"] if e.get("event") == "store.deferring"]
    assert deferring and deferring[0]["context"] == "EngineDrivenTransferContext", deferring
    # ...by prefixshare's one-pass copy into the server's buffers (vLLM's CPU layout), not LMCache's gather
    copies = [e for e in replica_a["events"] if e.get("event") == "store.copy"]
    assert [e["by"] for e in copies] == ["prefixshare"], copies


def test_admission_stores_only_what_the_policy_admits(
    replica_a: dict[str, Any], replica_b: dict[str, Any], cold: dict[str, Any], store: Path
) -> None:
    short, pinned = replica_b["results"][1], replica_b["results"][2]
    assert short["num_cached_tokens"] == 0 and same_output(short, cold["short"])
    assert pinned["num_cached_tokens"] == 192 and same_output(pinned, cold["pinned"])
    assert replica_a["stats"]["refused"] == {"min_tokens": 1}, replica_a["stats"]  # first reason of the refusal
    # exact object count written by replica A: doc 17 chunks + pinned 3 + tenant acme 9 (a salted namespace)
    namespace = replica_a["stats"]["namespace"]
    files = [f.name for f in store.glob(f"{namespace}@*.data")]
    acme = [f for f in files if f.endswith("@t-acme.data")]
    assert len(acme) == 600 // CHUNK
    assert len([f for f in files if f.count("@") == 3]) == DOC_TOKENS // CHUNK + 200 // CHUNK


def test_tenants_never_hit_each_other(replica_b: dict[str, Any], cold: dict[str, Any]) -> None:
    other, same = replica_b["results"][3], replica_b["results"][4]
    assert other["num_cached_tokens"] == 0 and same_output(other, cold["tenant"])
    assert same["num_cached_tokens"] >= 576 and same_output(same, cold["tenant"])


def test_two_nodes_on_one_shared_directory(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], store: Path, replica_a: dict[str, Any],
    cold: dict[str, Any],
) -> None:
    with LMCacheServer(policy_for(store)) as server2:  # node 2: its own server, empty L1, same directory
        result = run_replica(work, "node2", models["main"], server2.policy, [req(prompts["doc"])])["results"][0]
    assert result["num_cached_tokens"] >= 0.9 * DOC_TOKENS and same_output(result, cold["doc"])


def test_corrupted_chunks_change_the_output_unless_checked(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], store: Path, replica_a: dict[str, Any],
    cold: dict[str, Any],
) -> None:
    """Negative control: the loaded KV is really used (noise in the stored bytes changes the answer) — on a tier
    without integrity checks. With them (the default) the same damage is refused: nothing loaded, cold answer."""
    bad = corrupt_copy(store, work / "corrupt-store")
    unchecked = policy_for(bad, l2=[{"type": "fs", "base_path": str(bad), "integrity": "none"}])
    with LMCacheServer(unchecked) as server:
        result = run_replica(work, "corrupt", models["main"], server.policy, [req(prompts["doc"])])["results"][0]
    assert result["num_cached_tokens"] >= 0.9 * DOC_TOKENS  # same hits...
    assert not same_output(result, cold["doc"])  # ...different answer
    with LMCacheServer(policy_for(bad)) as server:
        checked = run_replica(work, "corrupt-checked", models["main"], server.policy, [req(prompts["doc"])])
    assert checked["results"][0]["num_cached_tokens"] == 0 and same_output(checked["results"][0], cold["doc"])


@pytest.mark.parametrize(
    ("variant", "engine", "field"),
    [("other_tok", {}, "tokenizer"), ("other_weights", {}, "weights"), ("main", {"dtype": "bfloat16"}, "kv_dtype")],
)
def test_incompatible_replicas_load_nothing_and_say_why(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server1: LMCacheServer,
    replica_a: dict[str, Any], cold: dict[str, Any], variant: str, engine: dict[str, Any], field: str,
) -> None:
    out = run_replica(work, f"incompatible-{field}", models[variant], server1.policy, [req(prompts["doc"])],
                      engine=engine)
    result = out["results"][0]
    assert result["num_cached_tokens"] == 0  # same token ids, same store: nothing loaded
    assert out["stats"]["tokens_loaded"] == 0
    warnings = [e for e in out["events"] if e.get("event") == "store.incompatible"]
    assert len(warnings) == 1, out["events"]
    assert any(field in d for d in warnings[0]["differences"]), warnings[0]
    if variant == "other_tok":
        assert same_output(result, cold["doc"])  # the same weights on the same ids: the cold answer
    if variant == "other_weights":
        assert result["token_ids"] == hf_greedy(models[variant], [prompts["doc"]], 12)[0]  # its own cold answer


def test_store_down_means_recompute_within_the_timeout(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], cold: dict[str, Any]
) -> None:
    server = LMCacheServer(policy_for(work / "down-store")).start()
    try:
        assert server.pid is not None
        out = run_replica(work, "store-down", models["main"], server.policy,
                          [req(prompts["doc2"]), req(prompts["doc3"])], kill_before={"1": server.pid})
    finally:
        server.stop()
    after = out["results"][1]
    assert same_output(after, cold["doc3"]) and after["num_cached_tokens"] == 0
    budget = server.policy.load.timeout_s
    assert after["seconds"] <= cold["doc3"]["seconds"] + budget + 1.0, (after["seconds"], cold["doc3"]["seconds"])


def test_http_server_replica_is_covered_too(
    work: Path, models: dict[str, Path], prompts: dict[str, list[int]], server1: LMCacheServer,
    replica_a: dict[str, Any], cold: dict[str, Any],
) -> None:
    """A replica behind vLLM's OpenAI server, started with the flags `prefixshare vllm-args` prints."""
    from prefixshare.adapters.vllm import serve_args

    policy_file = write_policy_file(work / "serve-policy.yaml", server1.policy)
    argv, env = serve_args(server1.policy, str(models["main"]), policy_file=str(policy_file), instance="http")
    if argv[0] == "python":
        argv[0] = sys.executable
    else:
        argv[:2] = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"][: 2] + argv[1:2]
    port = free_port()
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
             "--block-size", "32", "--max-model-len", "4096"]
    server_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with http_server(argv, server_env, work / "http-server.log", port) as url:
        answer = post_json(f"{url}/v1/completions", {
            "model": str(models["main"]), "prompt": prompts["doc"], "max_tokens": 12, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
            "kv_transfer_params": {"cached_token_stats": True, "prefixshare.document_id": "manual-http"}})
    choice = answer["choices"][0]
    stats = (answer.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}).get("cached_token_stats", {})
    assert stats.get("num_lmcache_cached_tokens", 0) >= 0.9 * DOC_TOKENS, answer
    assert choice["token_ids"] == cold["doc"]["token_ids"]
    got = choice["logprobs"]["token_logprobs"]
    assert all(abs(x - y) <= LOGPROB_TOL for x, y in zip(got, cold["doc"]["logprobs"], strict=True))
